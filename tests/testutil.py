"""Small helpers shared by test modules (importable by name; conftest.py is not, since
tests/gpu has a conftest of its own)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def in_ci():
    """True under CI (env CI = true/1/yes/on): tests of native code fail there instead of skipping."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def assert_close(name, got, ref, rtol_max):
    """max |got - ref| <= rtol_max * max |ref| (per tensor), got finite; on failure the
    message gives max and mean error and the worst element."""
    import numpy as np
    import pytest

    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert np.isfinite(got).all(), f"{name}: non-finite values at {np.argwhere(~np.isfinite(got))[:5].tolist()}"
    if ref.size == 0:
        return
    err = np.abs(got - ref)
    ref_max = float(np.abs(ref).max())
    tol = rtol_max * max(ref_max, 1e-30)
    if err.max() > tol:
        where = np.unravel_index(int(err.argmax()), err.shape)
        pytest.fail(
            f"{name}: max abs err {err.max():.3e} > tol {tol:.3e} (max |ref| {ref_max:.3e}); "
            f"mean abs err {err.mean():.3e}; worst at {tuple(int(i) for i in where)}: "
            f"got {got[where]:.7g}, ref {ref[where]:.7g}"
        )


def empty_refused_here(fn, *args, **kwargs):
    """On a Paddle that cannot compute on empty tensors (2.6), ``fn(*args)`` with an empty
    batch must raise the plugin's error naming it; returns True then (the caller stops)."""
    import pytest
    from paddle_unpad._runtime import paddle_compat as _paddle_compat

    if _paddle_compat.EMPTY_TENSORS_SUPPORTED:
        return False
    with pytest.raises(ValueError, match="cannot compute on empty tensors"):
        fn(*args, **kwargs)
    return True


def require_native(ops_available, names, what):
    """Skip locally / fail under CI unless the native CPU kernels of every op in names are loaded."""
    import pytest

    ok = all(ops_available.get(op, {}).get("cpu", False) for op in names)
    if not ok:
        msg = (
            f"native {what} CPU op(s) not loaded (ops_available() = {ops_available}); "
            "build them with `pip install --no-build-isolation -e .` (or `make setup`)"
        )
        if in_ci():
            pytest.fail("CI=true: " + msg)
        pytest.skip(msg)
    return ops_available


def cpu_flags():
    """This CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


def run_python(*args, cwd=None, env=None, timeout=300):
    """``python *args`` (each one str()-ed) in a fresh process, with one math thread unless ``env`` (the
    whole environment) is given; returns the finished process, its output captured as text."""
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1") if env is None else env
    cmd = [sys.executable, *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def example_module(name):
    """examples/<name>.py imported as a module (examples/ is not a package)."""
    import importlib
    import sys

    sys.path.insert(0, EXAMPLES)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(EXAMPLES)


def run_benchmark(script, *args, timeout, **env):
    """Runs benchmarks/<script> with args from the repository root (the tree first on PYTHONPATH, env's
    variables set on top), asserts it exits 0 (the output's tail as message) and returns the finished process."""
    run_env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    r = run_python(os.path.join(ROOT, "benchmarks", script), *args, cwd=ROOT, env=run_env, timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r

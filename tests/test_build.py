"""The package installs and finds its compiled operators in every supported way.

Each case runs in a fresh interpreter, outside the source tree where that matters, so
that the in-tree package cannot mask a broken install.
"""

import json
import os
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.build, pytest.mark.paddle_gpu_stage]

PROBE = (
    "import json, warnings, paddle_unpad as pu\n"
    "with warnings.catch_warnings(record=True) as w:\n"
    "    warnings.simplefilter('always')\n"
    "    avail = pu.ops_available()\n"
    "print(json.dumps({'file': pu.__file__, 'avail': avail, 'info': pu._runtime.native.info(),\n"
    "                  'warnings': [str(x.message) for x in w]}))\n"
)


def _probe(env_extra, cwd, pythonpath=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_non_editable_install_finds_its_library(tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-build-isolation",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            ROOT,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, PADDLE_UNPAD_SKIP_CUDA="1"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = _probe({}, cwd=str(tmp_path), pythonpath=str(target))
    assert out["file"].startswith(str(target)), out["file"]
    assert out["avail"]["fmha"]["cpu"] is True, out
    assert out["info"]["path"].startswith(str(target)), out["info"]


def test_jit_fallback_builds_into_cache_when_library_missing(tmp_path):
    cache = tmp_path / "cache"
    # Under a CUDA build of Paddle the fallback compiles the CUDA sources too: one SM version
    # checks the build and the cache as well as two (set-up builds every supported one).
    env = {"PADDLE_UNPAD_FORCE_JIT": "1", "PADDLE_UNPAD_CACHE": str(cache), "PADDLE_UNPAD_CUDA_ARCHS": "80"}
    out = _probe(env, cwd=ROOT)
    assert out["avail"]["fmha"]["cpu"] is True, out
    assert out["info"]["path"].startswith(str(cache)), out["info"]
    # Second start: same sources, same flags -> the cached library, no rebuild.
    before = {p: os.path.getmtime(p) for p in map(str, cache.rglob("*.so"))}
    again = _probe(env, cwd=ROOT)
    assert again["info"]["path"] == out["info"]["path"]
    assert {p: os.path.getmtime(p) for p in map(str, cache.rglob("*.so"))} == before


def test_import_without_native_code_falls_back_with_one_warning():
    out = _probe({"PADDLE_UNPAD_DISABLE_NATIVE": "1"}, cwd=ROOT)
    assert "fmha" in out["avail"]
    assert all(dev is False for op in out["avail"].values() for dev in op.values()), out["avail"]
    assert out["info"]["error"] == "PADDLE_UNPAD_DISABLE_NATIVE is set"


def test_missing_library_warns_once_and_reference_still_computes(tmp_path):
    code = (
        "import warnings, numpy as np, paddle\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import paddle_unpad as pu  # registers the operators (or warns) at import\n"
        "    q = paddle.to_tensor(np.random.default_rng(0).standard_normal((5, 2, 8)).astype('float32'))\n"
        "    cu = pu.cu_seqlens_from_lengths([2, 3])[0]\n"
        "    a = pu.fmha(q, q, q, cu, 3); b = pu.fmha(q, q, q, cu, 3)\n"
        "    ref = pu.ops.fmha_reference(q, q, q, cu, 3)\n"
        "n = sum('native operators unavailable' in str(x.message) for x in w)\n"
        "assert n == 1, [str(x.message) for x in w]\n"
        "assert pu.ops_available()['fmha']['cpu'] is False\n"
        "np.testing.assert_array_equal(a.numpy(), ref.numpy())\n"
        "print('ok')\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PADDLE_UNPAD_FORCE_JIT="1", PADDLE_UNPAD_JIT="0")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr

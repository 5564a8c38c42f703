"""Shared pytest fixtures.

* Thread count: ``OMP_NUM_THREADS`` defaults to 2 (these machines have 2 cores); set it
  before running pytest to override. It must be set before paddle is imported.
* ``report``: ``benchmarks/report.py`` reading its result files from the test's ``tmp_path``.
* ``native_ops``: for tests of compiled code. When the native FMHA op is not loaded, the
  test is skipped locally (with the reason) but FAILS under CI (env ``CI`` = true/1/yes),
  so a broken build can never pass as a row of skips.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import sys  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402,F401  (before paddle: paddle-gpu 2.6's libpaddle clashes with a zlib loaded after it)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:  # in-tree runs without an install (``pytest tests`` from the repository root)
    import paddle_unpad  # noqa: F401
except ImportError:
    sys.path.insert(0, _ROOT)


from testutil import require_native  # noqa: E402


@pytest.fixture(scope="session")
def native_ops():
    """ops_available() when the native CPU fmha op is loaded; skip locally / fail in CI otherwise."""
    import paddle_unpad

    return require_native(paddle_unpad.ops_available(), ("fmha",), "fmha")


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture
def report(tmp_path):
    """``benchmarks/report.py`` reading its result files from ``tmp_path``."""
    sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
    try:
        import report as mod
    finally:
        sys.path.pop(0)
    old = mod.RESULTS
    mod.RESULTS = str(tmp_path)
    yield mod
    mod.RESULTS = old


@pytest.fixture(scope="session")
def cuda_kernel_build(tmp_path_factory):
    """Every unit of custom_ops/kernels/cuda compiled once for sm_80, sm_90 and the archs of the
    build setting (objects, each SM's cubin, ptxas's report): the CUDA compile check reads its
    warnings, the machine-code limits its cubins. ``None`` without nvcc."""
    sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
    import kernel_static
    from paddle_unpad._runtime import build_config

    nvcc = build_config.find_nvcc()
    if nvcc is None:
        return None
    sms = sorted({80, 90} | set(int(a) for a in build_config.cuda_archs()))
    jobs = int(os.environ.get("PADDLE_UNPAD_BUILD_JOBS", "0")) or (os.cpu_count() or 1)
    t0 = time.time()
    built = kernel_static.build_all(nvcc, sms, str(tmp_path_factory.mktemp("cuda_kernels")), jobs)
    print(f"\nCUDA kernels built once for sm {sms}: {len(built)} units, {jobs} jobs, {time.time() - t0:.1f} s wall")
    return {"sms": sms, "built": built}

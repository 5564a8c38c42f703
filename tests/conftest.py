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

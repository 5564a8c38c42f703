"""What every benchmark shares: the machine a result came from, threads, timing, result files.

Importing this module loads neither Paddle nor the package (benchmark parents that only
launch workers stay light); :func:`run_info` adds the Paddle side once Paddle is loaded.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


def _load_by_path(name):
    """A stdlib-only module of the package, without importing the package (and Paddle)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_pu_{name}", os.path.join(ROOT, "paddle_unpad", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_host = _load_by_path("_host")
config = _load_by_path("config")


def load_average():
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def machine_info():
    """CPU model and vendor (Intel and AMD hosts differ several-fold in Paddle's GEMM speed),
    cores, notable ISA flags, Python, the date and the load average now."""
    return dict(_host.describe(), python=platform.python_version(), date=utc_now(), loadavg=load_average())


def run_info():
    """machine_info() plus, when Paddle is loaded, its version and what MKL runs (paddle_unpad.cpu_gemm)."""
    out = machine_info()
    paddle = sys.modules.get("paddle")
    if paddle is not None:
        out["paddle"] = paddle.__version__
        pu = sys.modules.get("paddle_unpad")
        if pu is not None and hasattr(pu, "cpu_gemm"):
            info = pu.cpu_gemm.info()
            out["mkl_kernels"], out["mkl_dispatch"] = info.get("mkl_kernels"), info.get("action")
    return out


def thread_env(threads, env=None):
    """An environment that pins Paddle's, MKL's and OpenBLAS's thread pools and the plugin's
    kernels to ``threads`` (set before Paddle loads: the pools read it once)."""
    env = dict(os.environ if env is None else env)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                 config.variable("NUM_THREADS").env):
        env[name] = str(int(threads))
    return env


def set_threads(threads):
    """Pin this process's pools to ``threads`` (call before ``import paddle``; Paddle's own
    setter is called too when Paddle is already loaded)."""
    os.environ.update(thread_env(threads, {}))
    if "paddle" in sys.modules:
        sys.path.insert(0, ROOT)
        from paddle_unpad._paddle_compat import set_num_threads

        set_num_threads(threads)


def time_calls(fn, repeats, warmup=1, sync=None):
    """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (``sync`` before
    and after each timed call: a device synchronise)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        out.append(time.perf_counter() - t0)
    return out


def write_result(path, result):
    """Write a benchmark's JSON, with the machine it ran on (``result["machine"]``, unless set)."""
    result.setdefault("machine", run_info())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def result_path(name):
    return os.path.join(RESULTS, name)

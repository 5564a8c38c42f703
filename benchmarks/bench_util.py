"""What every benchmark shares: the machine a result came from, threads, timing, result files,
the encoder shapes, the launcher's command line.

Importing this module loads neither Paddle nor the package (benchmark parents that only
launch workers stay light); :func:`run_info` adds the Paddle side once Paddle is loaded.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


def encoder_shape(vocab, hidden, layers, heads, ffn, positions):
    """The size fields of a BERT config (two token types)."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=positions,
        type_vocab_size=2,
    )


# Operators that only move, gather or reshape data: the profiles' layout kind (substrings of operator names).
LAYOUT_OPS = (
    "gather",
    "scatter",
    "index_",
    "concat",
    "split",
    "slice",
    "reshape",
    "transpose",
    "squeeze",
    "stack",
    "flatten",
    "expand",
)

# The encoder shapes the benchmarks time: MiniLM's (the real model) and a tiny one for smoke runs.
MINILM = encoder_shape(30522, 384, 6, 12, 1536, 512)
TINY = encoder_shape(1000, 64, 2, 4, 256, 64)


def _load_by_path(name):
    """A stdlib-only module of the package, without importing the package (and Paddle)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"_pu_{name}", os.path.join(ROOT, "paddle_unpad", *name.split("/")) + ".py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_host = _load_by_path("_runtime/host")
config = _load_by_path("config")


def launch_util():
    """tests/launch_util.py, the launcher helpers the tests use too: the command line of a
    ``paddle.distributed.launch`` job, bounded runs, free ports."""
    tests = os.path.join(ROOT, "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import launch_util

    return launch_util


def load_average():
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def load_note(*loads):
    """A warning line when the 1-min load averages seen during a run exceed the cores (other
    processes shared the machine), else None."""
    seen = [x for x in loads if x is not None]
    if seen and max(seen) > (os.cpu_count() or 1) - 0.5:
        return (
            f"note: 1-min load average up to {max(seen):.1f} on {os.cpu_count()} CPUs: other processes shared "
            "the machine; absolute times are noisy (the sides were interleaved)"
        )
    return None


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def machine_info():
    """CPU model and vendor (Intel and AMD hosts differ several-fold in Paddle's GEMM speed),
    cores, notable ISA flags, Python, the date and the load average now."""
    return dict(_host.describe(), python=platform.python_version(), date=utc_now(), loadavg=load_average())


def run_info():
    """machine_info() plus, when Paddle is loaded, its version and what MKL runs (paddle_unpad._runtime.cpu_gemm)."""
    out = machine_info()
    paddle = sys.modules.get("paddle")
    if paddle is not None:
        out["paddle"] = paddle.__version__
        pu = sys.modules.get("paddle_unpad")
        if pu is not None and hasattr(pu, "_runtime"):
            from paddle_unpad._runtime import cpu_gemm, host_malloc

            info = cpu_gemm.info()
            out["mkl_kernels"], out["mkl_dispatch"] = info.get("mkl_kernels"), info.get("action")
            out["host_malloc"] = host_malloc.info()["action"]
    return out


def thread_env(threads, env=None):
    """An environment that pins Paddle's, MKL's and OpenBLAS's thread pools and the plugin's
    kernels to ``threads`` (set before Paddle loads: the pools read it once)."""
    env = dict(os.environ if env is None else env)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", config.variable("NUM_THREADS").env):
        env[name] = str(int(threads))
    return env


def set_threads(threads):
    """Pin this process's pools to ``threads`` (call before ``import paddle``; Paddle's own
    setter is called too when Paddle is already loaded)."""
    os.environ.update(thread_env(threads, {}))
    if "paddle" in sys.modules:
        sys.path.insert(0, ROOT)
        from paddle_unpad._runtime.paddle_compat import set_num_threads

        set_num_threads(threads)


def print_head(header):
    """Print a table's header line and a rule as wide."""
    print(header)
    print("-" * len(header))


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


def interleaved_times(fns, warmup, repeats, call=None):
    """Per callable of ``fns`` (name -> fn), its times over ``repeats`` rounds in which every
    callable runs once, in turn -- load changes on a shared machine hit every side alike --
    after ``warmup`` untimed calls each. ``call(name, fn)`` makes one timed call (default
    ``fn()``), e.g. to record a memory peak around it."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            call(name, fn) if call else fn()
            times[name].append(time.perf_counter() - t0)
    return times


def options_of(args, names):
    """The values of the command-line options ``names`` (attribute names), for a result's config."""
    return {name: getattr(args, name) for name in names}


def make_step(model, opt, batch):
    """One training step of a PaddleNLP-style model (first output = loss): forward, backward,
    optimizer step; returns the loss."""

    def step():
        loss = model(**batch)[0]
        loss.backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)
        return loss

    return step


def attention_cases(lengths, H, D, rng):
    """Packed [T, H, D] and padded [B, S, H, D] tensors holding the same tokens: q, k, v and the
    output gradient drawn from ``rng``, the additive key mask and the [B, S] token mask."""
    import numpy as np
    import paddle

    import paddle_unpad

    B, S = len(lengths), max(lengths)
    cu, max_seqlen = paddle_unpad.cu_seqlens_from_lengths(lengths)
    T = int(sum(lengths))
    data = [rng.standard_normal((T, H, D)).astype(np.float32) for _ in range(4)]  # q, k, v, dout
    keep = np.arange(S)[None, :] < np.asarray(lengths)[:, None]  # [B, S]
    padded = []
    for a in data:
        p = np.zeros((B, S, H, D), np.float32)
        p[keep] = a
        padded.append(p)
    return dict(
        packed=[paddle.to_tensor(a, stop_gradient=False) for a in data[:3]],
        dout_packed=paddle.to_tensor(data[3]),
        cu=cu,
        max_seqlen=max_seqlen,
        padded=[paddle.to_tensor(a, stop_gradient=False) for a in padded[:3]],
        dout_padded=paddle.to_tensor(padded[3]),
        mask=paddle.to_tensor(np.where(keep, 0.0, -1e4).astype(np.float32)[:, None, None, :]),  # [B, 1, 1, S]
        keep=keep,
    )


def write_result(path, result):
    """Write a benchmark's JSON, with the machine it ran on (``result["machine"]``, unless set)."""
    result.setdefault("machine", run_info())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def result_path(name):
    return os.path.join(RESULTS, name)


def kind_of_vendor(vendor):
    """``intel`` / ``amd`` / the lower-cased CPU vendor string."""
    vendor = vendor or platform.machine()
    return {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(vendor, re.sub(r"[^a-z0-9]+", "_", vendor.lower()))


def host_kind():
    """This host's kind (:func:`kind_of_vendor`): the kinds differ several-fold in Paddle's GEMM and in
    what the plugin's kernels reach, so results that measure a target are kept per kind."""
    return kind_of_vendor(_host.cpu_identity()[0])


def kind_result_path(stem):
    """``benchmarks/results/<stem>_<kind>.json``: a run on one host kind keeps the other kind's file."""
    return result_path(f"{stem}_{host_kind()}.json")

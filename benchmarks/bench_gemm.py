"""fp32 GEMM speed on this host: Paddle's CPU matmul against the BLAS libraries on the same cores,
and which setting makes Paddle's matmul fast where it is slow.

Shapes (T = ``--tokens`` packed tokens, default 2048; weights [in, out] as PaddleNLP stores them):

* ``qkv``        [T, 384] x [384, 1152]   the fused Q/K/V projection
* ``ffn1``       [T, 384] x [384, 1536]
* ``ffn2``       [T, 1536] x [1536, 384]
* ``ffn1_wgrad`` [384, T]^T-stored x [T, 1536] (X^T dY: the weight gradient, K = T, transposed A)
* ``sq1024``     1024 x 1024 x 1024

Sides measured in one process (the ``default`` configuration):

* ``paddle_matmul``  ``paddle.matmul`` (transpose_x for the weight gradient)
* ``paddle_linear``  ``paddle.nn.functional.linear`` (what the encoder layers call; no transposed shape)
* ``numpy``          ``numpy @`` (numpy's own OpenBLAS; its threads capped with threadpoolctl)
* ``mkl_cblas``      ``cblas_sgemm`` of the MKL library Paddle has loaded, called through ctypes on numpy
                     arrays: the library without Paddle's dispatch in front of it
* ``dnnl_sgemm``     ``dnnl_sgemm`` of the oneDNN library Paddle has loaded (ctypes): a GEMM the plugin's
                     C++ ops could call without a new dependency
* ``encoder_step``   one training step (forward, loss, backward, AdamW) of the MiniLM-shape
                     ``BertForSequenceClassification`` (6 x 384, random init) converted by ``paddle_unpad.convert``,
                     on one packed batch of 4 samples (256 + 150 + 75 + 31 = 512 tokens); in the ``default``
                     and the two ``MKL_DEBUG_CPU_TYPE`` configurations. Its eval-mode loss is compared across them.

Configurations whose environment must be set before Paddle loads MKL (``--variants``; ``default``
always runs) each get their own worker process: MKL's CPU dispatch (``MKL_DEBUG_CPU_TYPE``,
``MKL_ENABLE_INSTRUCTIONS``, ``MKL_CBWR``), Paddle's oneDNN flags, and thread settings. Every worker is
started once and kept; the parent then drives all of them in lock-step -- round after round, shape
after shape, one (worker, side) at a time with a pause between -- so load changes on this shared
machine hit every configuration alike. A worker's OpenMP threads keep spinning for a while after a
call (``KMP_BLOCKTIME``, 200 ms by default), which is what the pause (``--pause``) waits out.

Every (configuration, side, shape) is checked against numpy's fp64 product of the same inputs:
relative Frobenius error below ``10 * sqrt(K) * eps_fp32`` is "correct" (bf16 or TF32 shortcuts would
be ~100x above it).

Probes (``--no-probes`` skips them): ``perf record`` on a worker while it runs one shape (which
kernel symbols are hot: MKL's ``def`` (SSE), ``avx2`` or ``avx512`` sgemm kernels); a run with
``MKL_VERBOSE=1 ONEDNN_VERBOSE=1`` to see which library serves Paddle's matmul; and whether
``FLAGS_use_onednn=1`` under ``paddle.jit.to_static`` runs (it reaches oneDNN's matmul there).

Threads: ``--threads`` (default ``OMP_NUM_THREADS``, else 2) for every side: ``OMP_NUM_THREADS``,
``MKL_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS`` in each worker's environment, Paddle's
``set_num_threads`` and threadpoolctl's limit for numpy -- except in the variants that test the
thread settings themselves. ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE`` and any MKL/KMP/oneDNN
setting of the calling shell are cleared in every worker (recorded in the JSON), so ``default``
means Paddle's default.

Writes ``benchmarks/results/gemm_<kind>.json``, one file per host kind (``intel``, ``amd``, else the
CPU vendor string), so that a run on one kind keeps the other kind's figures in docs/performance.md.

Usage::

    OMP_NUM_THREADS=2 python benchmarks/bench_gemm.py     # everything, ~2-3 min on 2 cores
    python benchmarks/bench_gemm.py --variants default,mkl_cpu_avx2
    python benchmarks/bench_gemm.py --quick                # smoke run: tiny shapes, few variants
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import bench_args
import bench_util  # loads neither Paddle nor the package: the parent stays light

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MKL_DISPATCH_ENV = bench_util.config.variable("MKL_DISPATCH").env
EPS32 = 2.0**-23

SIDES = ("paddle_matmul", "paddle_linear", "numpy", "mkl_cblas", "dnnl_sgemm")
PADDLE_SIDES = ("paddle_matmul", "paddle_linear")

# name -> (environment added, description, sides, sets threads itself).
# Every worker clears the MKL/KMP/oneDNN/OpenBLAS settings of the shell first (see _worker_env).
VARIANTS = {
    "default": ({}, "Paddle as installed", SIDES + ("encoder_step",), True),
    "paddle_unpad": (
        {},
        "what `import paddle_unpad` sets up (paddle_unpad._runtime.cpu_gemm: MKL_DEBUG_CPU_TYPE on non-Intel CPUs)",
        ("paddle_matmul", "paddle_linear", "encoder_step"),
        True,
    ),
    "mkl_cpu_avx2": (
        {"MKL_DEBUG_CPU_TYPE": "5"},
        "MKL_DEBUG_CPU_TYPE=5 (MKL <= 2020.0: AVX2 kernels on any CPU)",
        ("paddle_matmul", "paddle_linear", "encoder_step"),
        True,
    ),
    "mkl_cpu_avx512": (
        {"MKL_DEBUG_CPU_TYPE": "7"},
        "MKL_DEBUG_CPU_TYPE=7 (AVX-512 kernels; needs avx512f)",
        ("paddle_matmul", "paddle_linear", "encoder_step"),
        True,
    ),
    "mkl_enable_avx2": ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, "MKL_ENABLE_INSTRUCTIONS=AVX2", ("paddle_matmul",), True),
    "mkl_enable_avx512": (
        {"MKL_ENABLE_INSTRUCTIONS": "AVX512"},
        "MKL_ENABLE_INSTRUCTIONS=AVX512",
        ("paddle_matmul",),
        True,
    ),
    "mkl_cbwr_avx2": (
        {"MKL_CBWR": "AVX2"},
        "MKL_CBWR=AVX2 (conditional numerical reproducibility)",
        ("paddle_matmul",),
        True,
    ),
    "onednn_flag": ({"FLAGS_use_onednn": "1"}, "FLAGS_use_onednn=1", ("paddle_matmul",), True),
    "mkldnn_flag": ({"FLAGS_use_mkldnn": "1"}, "FLAGS_use_mkldnn=1", ("paddle_matmul",), True),
    "threads_1": (
        {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        "OMP_NUM_THREADS=1 (1 thread)",
        ("paddle_matmul",),
        False,
    ),
    "threads_unset": ({}, "no OMP_NUM_THREADS, no set_num_threads (Paddle's own default)", ("paddle_matmul",), False),
    "mkl_threads_only": (
        {"MKL_NUM_THREADS": "{T}"},
        "MKL_NUM_THREADS=T only, no set_num_threads",
        ("paddle_matmul",),
        False,
    ),
    "kmp_affinity": (
        {"KMP_AFFINITY": "granularity=fine,compact,1,0"},
        "KMP_AFFINITY=granularity=fine,compact,1,0",
        ("paddle_matmul",),
        True,
    ),
    "omp_proc_bind": (
        {"OMP_PROC_BIND": "true", "OMP_PLACES": "cores"},
        "OMP_PROC_BIND=true OMP_PLACES=cores",
        ("paddle_matmul",),
        True,
    ),
}
QUICK_VARIANTS = ("default", "paddle_unpad", "mkl_cpu_avx2", "threads_1")
# Every worker imports paddle_unpad (its thread helper, the encoder step); all but the
# "paddle_unpad" configuration opt out of its MKL set-up, so that they measure Paddle as it is.
PLUGIN_CONFIGURED = ("paddle_unpad",)
# The encoder step: the converted MiniLM-shape model (random init), one packed batch of these lengths.
MINILM, TINY = bench_util.MINILM, bench_util.TINY
STEP_LENGTHS = (256, 150, 75, 31)
QUICK_STEP_LENGTHS = (64, 30, 10)
# Variants whose hot kernels are worth a perf probe: (variant, side).
PERF_PROBES = (
    ("default", "paddle_matmul"),
    ("default", "mkl_cblas"),
    ("default", "numpy"),
    ("default", "dnnl_sgemm"),
    ("mkl_cpu_avx2", "paddle_matmul"),
    ("mkl_cpu_avx512", "paddle_matmul"),
    ("mkl_enable_avx512", "paddle_matmul"),
    ("mkl_cbwr_avx2", "paddle_matmul"),
    ("onednn_flag", "paddle_matmul"),
)
CLEARED_PREFIXES = (
    "MKL_",
    "KMP_",
    "DNNL_",
    "ONEDNN_",
    "OPENBLAS_",
    "GOMP_",
    "FLAGS_use_onednn",
    "FLAGS_use_mkldnn",
    "FLAGS_tracer_onednn",
)
CLEARED_NAMES = ("OMP_PROC_BIND", "OMP_PLACES", "OMP_WAIT_POLICY", "OMP_DYNAMIC", "OMP_NUM_THREADS")


def shapes_for(tokens, quick=False):
    """[(name, M, N, K, trans_a, trans_b)]: C[M, N] = op(A) op(B)."""
    if quick:
        h, f = 64, 256
        return [
            ("qkv", tokens, 3 * h, h, False, False),
            ("ffn2", tokens, h, f, False, False),
            ("ffn1_wgrad", h, f, tokens, True, False),
            ("sq", 128, 128, 128, False, False),
        ]
    h, f = 384, 1536
    return [
        ("qkv", tokens, 3 * h, h, False, False),
        ("ffn1", tokens, f, h, False, False),
        ("ffn2", tokens, h, f, False, False),
        ("ffn1_wgrad", h, f, tokens, True, False),
        ("sq1024", 1024, 1024, 1024, False, False),
    ]


def gemm_flops(shape):
    _, m, n, k, _, _ = shape
    return 2.0 * m * n * k


def tolerance(k):
    return 10.0 * math.sqrt(k) * EPS32


def parse_args(argv=None):
    env_t = os.environ.get("OMP_NUM_THREADS", "")
    threads = int(env_t) if env_t.isdigit() and int(env_t) > 0 else 2
    options = [
        ("--threads", int, threads, "threads for every side (default: OMP_NUM_THREADS, else 2)"),
        ("--tokens", int, 2048, "packed tokens T of the encoder shapes (default 2048)"),
        ("--rounds", int, 3, "rounds over every configuration (default 3)"),
        ("--reps", int, 2, "timed calls per (side, shape) and round, after 1 warm-up"),
        ("--step-reps", int, 2, "timed encoder steps per configuration and round (default 2; 1 warm-up in the first)"),
        ("--pause", float, 0.1, "seconds between two measurements, for the previous one's spinning threads to sleep"),
        ("--variants", str, ",".join(VARIANTS), f"comma list of configurations (default all: {','.join(VARIANTS)})"),
        ("--no-probes", bool, False, "skip the perf / verbose / to_static probes"),
        ("--seed", int, 0, None),
        ("--out", str, None, "result file (default benchmarks/results/gemm_<kind>.json, kind from the CPU vendor)"),
        ("--quick", bool, False, "tiny shapes, 3 configurations, 2 rounds: a smoke run"),
        ("--_worker", bool, False, argparse.SUPPRESS),
        ("--_probe_static_onednn", bool, False, argparse.SUPPRESS),
    ]
    ap = bench_args.add_options(bench_args.parser(__doc__), options)
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = bench_util.kind_result_path("gemm")
    if args.quick:
        args.tokens, args.rounds, args.reps, args.step_reps, args.pause = 256, 2, 2, 1, 0.05
        if args.variants == ",".join(VARIANTS):
            args.variants = ",".join(QUICK_VARIANTS)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        ap.error(f"--variants: unknown {bad}; choose from {','.join(VARIANTS)}")
    if "default" not in names:
        names.insert(0, "default")
    args.variant_names = names
    if min(args.threads, args.tokens, args.rounds, args.reps, args.step_reps) < 1:
        ap.error("--threads, --tokens, --rounds and --reps must be >= 1")
    return args


# ----------------------------------------------------------------------------- host


def cpu_info():
    info = {
        "model": platform.processor() or platform.machine(),
        "vendor": None,
        "family": None,
        "model_id": None,
        "flags": [],
        "cores": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key, val = key.strip(), val.strip()
                if key == "model name":
                    info["model"] = val
                elif key == "vendor_id":
                    info["vendor"] = val
                elif key == "cpu family":
                    info["family"] = int(val)
                elif key == "model":
                    info["model_id"] = int(val)
                elif key == "flags":
                    flags = set(val.split())
                    info["flags"] = sorted(
                        flags & {"avx", "fma", "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}
                    )
                    break
    except OSError:
        pass
    return info


def loadavg():
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


# ----------------------------------------------------------------------------- worker


def _loaded_libs():
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if re.search(r"mkl|blas|dnnl|iomp|gomp", ln) and "/" in ln}
    except OSError:
        return []
    return sorted(paths)


class _Worker:
    def __init__(self, spec):
        import numpy as np

        self.np = np
        self.spec = spec
        self.threads = spec["threads"]
        import paddle

        if ROOT not in sys.path:
            sys.path.insert(0, ROOT)
        from paddle_unpad._runtime.paddle_compat import set_num_threads

        self.paddle = paddle
        paddle.set_device("cpu")
        if spec["set_threads"]:
            set_num_threads(self.threads)
        self.info = {"errors": {}}
        self._limit_blas(spec)
        # Paddle loads MKL on the first GEMM; the ctypes sides must bind to that same copy.
        a = paddle.ones([8, 8])
        paddle.matmul(a, a)
        self.libs = _loaded_libs()
        self._bind_gemms()
        self.info.update(self._library_info())
        self._make_data(spec)
        self.fns = {}
        if "encoder_step" in spec["sides"]:
            self._build_step(spec)
        for side in spec["sides"]:
            if side == "encoder_step":
                continue
            for name in self.data:
                fn = self._make(side, name)
                if fn is None:
                    continue
                self.fns[(side, name)] = fn
                self.info["errors"][f"{side}/{name}"] = self._error(fn(), name)
        self.info["libs_after"] = _loaded_libs()

    def _limit_blas(self, spec):
        """numpy's BLAS at the worker's thread count (when it sets threads), and what it is."""
        self._blas_limit = None
        try:
            import threadpoolctl

            if spec["set_threads"]:
                self._blas_limit = threadpoolctl.threadpool_limits(limits=self.threads, user_api="blas")
            self.info["numpy_blas"] = [
                {k: d.get(k) for k in ("internal_api", "version", "architecture", "num_threads", "threading_layer")}
                | {"library": os.path.basename(d.get("filepath", ""))}
                for d in threadpoolctl.threadpool_info()
                if d.get("user_api") == "blas"
            ]
        except ImportError:
            self.info["numpy_blas"] = "threadpoolctl not installed"

    def _bind_gemms(self):
        self.mkl = self._bind(
            r"libmklml|libmkl_rt",
            "cblas_sgemm",
            [ctypes.c_int] * 6
            + [
                ctypes.c_float,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_float,
                ctypes.c_void_p,
                ctypes.c_int,
            ],
        )
        i64 = ctypes.c_int64
        self.dnnl = self._bind(
            r"libdnnl|libmkldnn",
            "dnnl_sgemm",
            [
                ctypes.c_char,
                ctypes.c_char,
                i64,
                i64,
                i64,
                ctypes.c_float,
                ctypes.c_void_p,
                i64,
                ctypes.c_void_p,
                i64,
                ctypes.c_float,
                ctypes.c_void_p,
                i64,
            ],
        )

    def _make_data(self, spec):
        """Per shape: the fp32 operands (numpy and Paddle), the fp64 reference and an output buffer."""
        np, paddle = self.np, self.paddle
        self.data = {}
        rng = np.random.default_rng(spec["seed"])
        for shp in spec["shapes"]:
            name, m, n, k, ta, tb = shp
            a_np = rng.uniform(-1, 1, (k, m) if ta else (m, k)).astype(np.float32)
            b_np = rng.uniform(-1, 1, (n, k) if tb else (k, n)).astype(np.float32)
            a64, b64 = a_np.astype(np.float64), b_np.astype(np.float64)
            ref = (a64.T if ta else a64) @ (b64.T if tb else b64)
            self.data[name] = dict(
                shape=shp,
                a=a_np,
                b=b_np,
                ref=ref,
                c=np.empty((m, n), np.float32),
                pa=paddle.to_tensor(a_np),
                pb=paddle.to_tensor(b_np),
            )

    def _build_step(self, spec):
        import paddle
        from paddlenlp.transformers import BertConfig, BertForSequenceClassification

        import paddle_unpad as pu
        from paddle_unpad.data import PackingCollator

        np = self.np
        cfg = TINY if spec["quick"] else MINILM
        lengths = QUICK_STEP_LENGTHS if spec["quick"] else STEP_LENGTHS
        paddle.seed(spec["seed"])
        model = BertForSequenceClassification(BertConfig(num_labels=2, **cfg))
        pu.convert(model)
        rng = np.random.default_rng(spec["seed"])
        samples = [
            {"input_ids": rng.integers(5, cfg["vocab_size"], n).astype(np.int64), "labels": np.int64(i % 2)}
            for i, n in enumerate(lengths)
        ]
        batch = PackingCollator(max_seqlen=cfg["max_position_embeddings"])(samples)
        model.eval()
        with paddle.no_grad():
            self.info["encoder_step"] = {
                "eval_loss": float(model(**batch)[0]),
                "tokens": int(sum(lengths)),
                "lengths": list(lengths),
                "model": cfg,
            }
        model.train()
        opt = paddle.optimizer.AdamW(learning_rate=1e-5, parameters=model.parameters())
        self.fns[("encoder_step", "step")] = bench_util.make_step(model, opt, batch)

    def _bind(self, pattern, symbol, argtypes):
        for path in self.libs:
            if re.search(pattern, os.path.basename(path)):
                try:
                    fn = getattr(ctypes.CDLL(path), symbol)
                except (OSError, AttributeError):
                    continue
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int if symbol.startswith("dnnl") else None
                return fn
        return None

    def _library_info(self):
        out = {"libs": self.libs}
        for path in self.libs:
            base = os.path.basename(path)
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            if re.search(r"libmklml|libmkl_rt", base):
                buf = ctypes.create_string_buffer(256)
                lib.MKL_Get_Version_String(buf, 256)
                out["mkl"] = {"library": base, "version": buf.value.decode(errors="replace")}
                for sym in ("mkl_serv_cpu_detect", "mkl_serv_intel_cpu_true", "MKL_Get_Max_Threads"):
                    if hasattr(lib, sym):
                        out["mkl"][sym] = int(getattr(lib, sym)())
            elif re.search(r"libdnnl|libmkldnn", base) and hasattr(lib, "dnnl_version"):

                class _Ver(ctypes.Structure):
                    _fields_ = [
                        ("major", ctypes.c_int),
                        ("minor", ctypes.c_int),
                        ("patch", ctypes.c_int),
                        ("hash", ctypes.c_char_p),
                    ]

                lib.dnnl_version.restype = ctypes.POINTER(_Ver)
                v = lib.dnnl_version().contents
                out["onednn"] = {
                    "library": base,
                    "version": f"{v.major}.{v.minor}.{v.patch}",
                    "effective_cpu_isa": hex(lib.dnnl_get_effective_cpu_isa()),
                }
        try:
            out["paddle_flags"] = {
                k: v for k, v in self.paddle.get_flags(["FLAGS_use_onednn", "FLAGS_use_mkldnn"]).items()
            }
        except Exception as e:  # the flag set differs between Paddle versions
            out["paddle_flags"] = repr(e)
        out["paddle"] = self.paddle.__version__
        return out

    def _make(self, side, name):
        d = self.data[name]
        _, m, n, k, ta, tb = d["shape"]
        paddle, np = self.paddle, self.np
        if side == "paddle_matmul":
            pa, pb = d["pa"], d["pb"]
            return lambda: paddle.matmul(pa, pb, transpose_x=ta, transpose_y=tb)
        if side == "paddle_linear":
            if ta or tb:
                return None
            pa, pb = d["pa"], d["pb"]
            return lambda: paddle.nn.functional.linear(pa, pb)
        if side == "numpy":
            a = d["a"].T if ta else d["a"]
            b = d["b"].T if tb else d["b"]
            c = d["c"]
            return lambda: np.matmul(a, b, out=c)
        a, b, c = d["a"], d["b"], d["c"]
        lda, ldb = a.shape[1], b.shape[1]
        if side == "mkl_cblas":
            if self.mkl is None:
                return None
            f, ca, cb = self.mkl, 112 if ta else 111, 112 if tb else 111
            return lambda: (
                f(101, ca, cb, m, n, k, 1.0, a.ctypes.data, lda, b.ctypes.data, ldb, 0.0, c.ctypes.data, n),
                c,
            )[1]
        if side == "dnnl_sgemm":
            if self.dnnl is None:
                return None
            f, ca, cb = self.dnnl, b"T" if ta else b"N", b"T" if tb else b"N"

            def call():
                rc = f(ca, cb, m, n, k, 1.0, a.ctypes.data, lda, b.ctypes.data, ldb, 0.0, c.ctypes.data, n)
                if rc != 0:
                    raise RuntimeError(f"dnnl_sgemm returned {rc}")
                return c

            return call
        raise ValueError(side)

    def _error(self, out, name):
        np = self.np
        d = self.data[name]
        got = out.numpy() if hasattr(out, "numpy") else out
        ref = d["ref"]
        diff = got.astype(np.float64) - ref
        rel = float(np.linalg.norm(diff) / np.linalg.norm(ref))
        k = d["shape"][3]
        return {
            "rel_fro": rel,
            "max_abs_rel": float(np.abs(diff).max() / np.abs(ref).max()),
            "tol": tolerance(k),
            "ok": bool(rel <= tolerance(k)),
        }

    def time(self, side, name, reps, warmup=1):
        return bench_util.time_calls(self.fns[(side, name)], reps, warmup)

    def spin(self, side, name, seconds):
        fn = self.fns[(side, name)]
        end = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < end:
            fn()
            n += 1
        return n


def worker_main():
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # MKL_VERBOSE and Paddle's banners print to fd 1; keep them out of the protocol

    def send(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    spec = json.loads(sys.stdin.readline())
    try:
        w = _Worker(spec)
    except Exception as e:
        send({"error": f"{type(e).__name__}: {e}"})
        return 1
    send({"info": w.info, "available": sorted(f"{s}/{n}" for s, n in w.fns), "pid": os.getpid()})
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        if cmd == "quit":
            break
        if cmd == "time":
            send({"times": w.time(msg["side"], msg["shape"], msg["reps"], msg.get("warmup", 1))})
        elif cmd == "spin":
            send({"calls": w.spin(msg["side"], msg["shape"], msg["seconds"])})
    return 0


def static_onednn_probe():
    """paddle.jit.to_static matmul with FLAGS_use_onednn=1 (set by the caller's environment)."""
    import numpy as np
    import paddle

    paddle.set_device("cpu")

    def mm(x, y):
        return paddle.matmul(x, y)

    f = paddle.jit.to_static(mm, full_graph=True)
    a = np.random.default_rng(0).uniform(-1, 1, (64, 64)).astype(np.float32)
    out = f(paddle.to_tensor(a), paddle.to_tensor(a)).numpy()
    err = float(np.abs(out - a.astype(np.float64) @ a).max())
    print(json.dumps({"ran": True, "max_abs_err": err}), flush=True)
    return 0


# ----------------------------------------------------------------------------- parent


def _worker_env(base_extra, threads, set_threads, extra):
    env = {k: v for k, v in os.environ.items() if not (k.startswith(CLEARED_PREFIXES) or k in CLEARED_NAMES)}
    if set_threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(base_extra)
    env.update({k: v.replace("{T}", str(threads)) for k, v in extra.items()})
    return env


def cleared_env():
    return {k: v for k, v in os.environ.items() if k.startswith(CLEARED_PREFIXES) or k in CLEARED_NAMES}


class Proc:
    """One worker process: a configuration's environment, driven line by line over pipes."""

    def __init__(self, name, env, spec, logdir):
        self.name = name
        self.log_path = os.path.join(logdir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--_worker"],
            env=env,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.send(spec)
        self.ready = None

    def send(self, obj):
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def recv(self):
        line = self.p.stdout.readline()
        if not line:
            self.p.wait()
            raise RuntimeError(f"worker {self.name} exited (rc {self.p.returncode}); log tail:\n{self.log_tail()}")
        return json.loads(line)

    def log_tail(self, n=3000):
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def close(self):
        try:
            self.send({"cmd": "quit"})
            self.p.stdin.close()
            self.p.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.p.kill()
        self.log.close()


def _perf_top(proc, side, shape, seconds, tmp):
    """Hot symbols (dso, symbol, percent) while the worker runs one (side, shape), or None."""
    perf = shutil.which("perf")
    if perf is None:
        return None
    data = os.path.join(tmp, f"perf_{proc.name}_{side}.data")
    rec = subprocess.Popen(
        [perf, "record", "-q", "-F", "499", "-o", data, "-p", str(proc.pid), "--", "sleep", str(seconds)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.3)
    proc.send({"cmd": "spin", "side": side, "shape": shape, "seconds": seconds})
    proc.recv()
    _, err = rec.communicate(timeout=60)
    if rec.returncode != 0 or not os.path.exists(data):
        return {"error": (err or "").strip()[-300:]}

    def report(sort):
        rep = subprocess.run(
            [perf, "report", "-i", data, "--stdio", "--no-children", "--sort", sort],
            capture_output=True,
            text=True,
            timeout=120,
        )
        return rep.stdout.splitlines()

    top, dsos = [], []
    for line in report("dso,sym"):
        m = re.match(r"\s+([\d.]+)%\s+(.+?)\s+\[\.\]\s+(\S+)", line)
        if m and float(m.group(1)) >= 2.0 and len(top) < 4:
            top.append({"pct": float(m.group(1)), "dso": m.group(2), "symbol": m.group(3)})
    # Runtime-generated kernels (oneDNN's JIT) spread over many addresses: only their dso total shows them.
    for line in report("dso"):
        m = re.match(r"\s+([\d.]+)%\s+(.+?)\s*$", line)
        if m and float(m.group(1)) >= 2.0 and len(dsos) < 4:
            dsos.append({"pct": float(m.group(1)), "dso": m.group(2)})
    return {"top": top, "dsos": dsos, "kernel": kernel_family(top, dsos)}


def kernel_family(top, dsos):
    """MKL's per-ISA kernel families by their symbol prefix; OpenBLAS by its kernel; JIT code by its dso."""
    for t in top:
        m = re.match(r"mkl_blas_(avx512_mic|avx512|avx2|avx|mc3|mc|cnr_def|def)_", t["symbol"])
        if m:
            return {
                "def": "MKL def (generic SSE2 kernels)",
                "avx2": "MKL avx2",
                "avx512": "MKL avx512",
                "avx512_mic": "MKL avx512_mic",
                "avx": "MKL avx",
                "mc3": "MKL mc3 (SSE4.2)",
                "mc": "MKL mc (SSSE3)",
                "cnr_def": "MKL cnr_def",
            }[m.group(1)]
        if "openblas" in t["dso"]:
            return f"OpenBLAS {t['symbol']}"
    if dsos and dsos[0]["dso"].startswith("[JIT]"):
        return f"JIT-generated code ({dsos[0]['pct']:.0f}% of samples)"
    return None


def verbose_probe(args, shapes, tmp):
    """Which library serves Paddle's matmul: a worker run with MKL_VERBOSE / ONEDNN_VERBOSE, per flag setting."""
    out = {}
    for name, extra in (("default", {}), ("FLAGS_use_onednn=1", {"FLAGS_use_onednn": "1"})):
        env = _worker_env(
            {"MKL_VERBOSE": "1", "ONEDNN_VERBOSE": "1", MKL_DISPATCH_ENV: "off"}, args.threads, True, extra
        )
        spec = dict(
            threads=args.threads,
            set_threads=True,
            seed=args.seed,
            shapes=shapes[:1],
            sides=list(PADDLE_SIDES),
            quick=args.quick,
        )
        p = Proc(f"verbose_{len(out)}", env, spec, tmp)
        try:
            p.recv()
        finally:
            p.close()
        with open(p.log_path, errors="replace") as f:
            log = f.read()
        out[name] = {
            "mkl_sgemm_calls": len(re.findall(r"^MKL_VERBOSE SGEMM", log, re.M)),
            "onednn_exec_lines": len(re.findall(r"^onednn_verbose,.*,exec,", log, re.M)),
            "mkl_banner": next(iter(re.findall(r"^MKL_VERBOSE (Intel\(R\) MKL.*)$", log, re.M)), None),
            "sgemm_calls": sorted(
                {re.sub(r"0x[0-9a-f]+", "*", c) for c in re.findall(r"^MKL_VERBOSE (SGEMM\([^)]*\))", log, re.M)}
            ),
        }
    return out


def static_probe(args):
    env = _worker_env({"FLAGS_use_onednn": "1", "ONEDNN_VERBOSE": "1"}, args.threads, True, {})
    # After its segfault Paddle's crash handler sometimes never returns: a hang is a result too.
    try:
        r = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--_probe_static_onednn"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        rc, text, hung = r.returncode, r.stdout + r.stderr, False
    except subprocess.TimeoutExpired as e:
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        rc, hung = None, True
    ran = [json.loads(ln) for ln in text.splitlines() if ln.startswith('{"ran"')]
    return {
        "returncode": rc,
        "hung": hung,
        "completed": bool(ran),
        "onednn_matmul_exec": len(re.findall(r"onednn_verbose,.*,exec,cpu,matmul", text)),
        "onednn_impl": next(iter(re.findall(r"exec,cpu,matmul,([^,]+),", text)), None),
        "signal": next(iter(re.findall(r"FatalError: `([^`]+)`", text)), None),
    }


def summarize(results, shapes, default_key="default/paddle_matmul"):
    """GFLOP/s per (config, side, shape) from the recorded times: best over all calls and median of the
    per-round best; the geometric-mean speedup over Paddle's default matmul on the shapes both ran."""
    flops = {s[0]: gemm_flops(s) for s in shapes}
    for key, r in results.items():
        for name, rounds in r["times_s"].items():
            per_round = [min(t) for t in rounds]
            r["gflops_best"][name] = flops[name] / min(per_round) / 1e9
            r["gflops_median"][name] = flops[name] / statistics.median(per_round) / 1e9
    base = results.get(default_key)
    for r in results.values():
        common = [n for n in r["gflops_best"] if base and n in base["gflops_best"]]
        r["speedup_vs_default_matmul"] = (
            math.exp(statistics.fmean(math.log(r["gflops_best"][n] / base["gflops_best"][n]) for n in common))
            if common
            else None
        )


def summarize_steps(steps, worker_info):
    """Median of the per-round best step time per configuration, tokens/s, speedup over ``default``, and the
    eval-mode loss difference against ``default`` (the same weights and batch in every worker)."""
    out = {}
    for name, st in steps.items():
        info = worker_info[name].get("encoder_step", {})
        per_round = [min(t) for t in st["times_s"]]
        out[name] = {
            "times_s": st["times_s"],
            "ms_best": 1e3 * min(per_round),
            "ms_median": 1e3 * statistics.median(per_round),
            "tokens": info.get("tokens"),
            "eval_loss": info.get("eval_loss"),
        }
        out[name]["tokens_per_s"] = info.get("tokens", 0) / (out[name]["ms_best"] / 1e3)
    base = out.get("default")
    for r in out.values():
        if base:
            r["speedup_vs_default"] = base["ms_best"] / r["ms_best"]
            r["loss_rel_diff_vs_default"] = abs(r["eval_loss"] - base["eval_loss"]) / abs(base["eval_loss"])
    return out


def print_table(res):
    c = res["config"]
    print(
        f"CPU: {c['cpu']['model']} ({c['cpu']['vendor']}, family {c['cpu']['family']} model "
        f"{c['cpu']['model_id']}; {', '.join(c['cpu']['flags'])}), {c['cpu']['cores']} cores; threads "
        f"{c['threads']}; load {c['loadavg_start']} -> {c['loadavg_end']}"
    )
    names = [s[0] for s in c["shapes"]]
    head = f"{'configuration / side':44s}" + "".join(f"{n:>11s}" for n in names) + f"{'vs default':>11s}  ok  kernel"
    print(head)
    for key, r in res["results"].items():
        cells = "".join(f"{r['gflops_best'][n]:11.1f}" if n in r["gflops_best"] else f"{'-':>11s}" for n in names)
        sp = r["speedup_vs_default_matmul"]
        print(
            f"{key:44s}{cells}{(f'{sp:10.2f}x' if sp else '-'):>11s}  {'yes' if r['correct'] else 'NO':3s} "
            f"{r.get('kernel') or ''}"
        )
    for name, st in res["encoder_step"].items():
        print(
            f"encoder step {name:31s} {st['ms_best']:8.0f} ms best, {st['ms_median']:.0f} median, "
            f"{st['tokens_per_s']:.0f} tokens/s, {st.get('speedup_vs_default', 1):.2f}x default, "
            f"eval loss diff {st.get('loss_rel_diff_vs_default', 0):.1e}"
        )


def _start_workers(args, shapes, tmp, procs):
    """One worker process per variant (into ``procs``); returns each one's hello message."""
    for name in args.variant_names:
        extra, _, sides, set_threads = VARIANTS[name]
        if name not in PLUGIN_CONFIGURED:
            extra = dict(extra, **{MKL_DISPATCH_ENV: "off"})
        env = _worker_env({}, args.threads, set_threads, extra)
        spec = dict(
            threads=args.threads,
            set_threads=set_threads,
            seed=args.seed,
            shapes=shapes,
            sides=list(sides),
            quick=args.quick,
        )
        procs[name] = Proc(name, env, spec, tmp)
    infos = {}
    for name, p in procs.items():
        msg = p.recv()
        if "error" in msg:
            raise RuntimeError(f"worker {name}: {msg['error']}\n{p.log_tail()}")
        p.pid = msg["pid"]
        infos[name] = msg
    return infos


def _result_slots(procs, infos, shapes):
    """Empty per-side GEMM results and per-variant encoder-step timings, for what each worker has."""
    plan = [(name, side) for name in procs for side in VARIANTS[name][2] if side != "encoder_step"]
    steps = {name: {"config": name, "times_s": []} for name in procs if "encoder_step/step" in infos[name]["available"]}
    results = {}
    for name, side in plan:
        avail = [s[0] for s in shapes if f"{side}/{s[0]}" in infos[name]["available"]]
        if not avail:
            continue
        errs = {n: infos[name]["info"]["errors"][f"{side}/{n}"] for n in avail}
        results[f"{name}/{side}"] = {
            "config": name,
            "side": side,
            "env": VARIANTS[name][0],
            "description": VARIANTS[name][1],
            "errors": errs,
            "correct": all(e["ok"] for e in errs.values()),
            "times_s": {n: [] for n in avail},
            "gflops_best": {},
            "gflops_median": {},
        }
    return results, steps


def _time_rounds(args, shapes, procs, results, steps):
    """Every side and shape timed once per round, in lock-step; returns the seconds it took."""
    t_rounds = time.time()
    for rnd in range(args.rounds):
        for shp in shapes:
            for key, r in results.items():
                if shp[0] not in r["times_s"]:
                    continue
                p = procs[r["config"]]
                time.sleep(args.pause)
                p.send({"cmd": "time", "side": r["side"], "shape": shp[0], "reps": args.reps})
                r["times_s"][shp[0]].append(p.recv()["times"])
        for name, st in steps.items():
            time.sleep(args.pause)
            procs[name].send(
                {
                    "cmd": "time",
                    "side": "encoder_step",
                    "shape": "step",
                    "reps": args.step_reps,
                    "warmup": 1 if rnd == 0 else 0,
                }
            )
            st["times_s"].append(procs[name].recv()["times"])
    return time.time() - t_rounds


def _perf_probes(args, shapes, procs, results, tmp):
    """The hottest code under `perf record` for the probed sides, on the ffn1 shape."""
    probe_shape = "ffn1" if any(s[0] == "ffn1" for s in shapes) else shapes[0][0]
    for name, side in PERF_PROBES:
        key = f"{name}/{side}"
        if key in results and probe_shape in results[key]["times_s"]:
            time.sleep(args.pause)
            top = _perf_top(procs[name], side, probe_shape, 0.8 if not args.quick else 0.5, tmp)
            if top is not None:
                results[key]["perf"] = top
                results[key]["kernel"] = top.get("kernel")
    return {"perf_shape": probe_shape}


def _run_config(args, shapes, cpu, load_start, t_start, t_rounds):
    return {
        "cpu": cpu,
        "threads": args.threads,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "reps": args.reps,
        "pause_s": args.pause,
        "quick": args.quick,
        "seed": args.seed,
        "shapes": [list(s) for s in shapes],
        "flops": {s[0]: gemm_flops(s) for s in shapes},
        "variants": {
            n: {"env": VARIANTS[n][0], "description": VARIANTS[n][1], "sets_threads": VARIANTS[n][3]}
            for n in args.variant_names
        },
        "cleared_from_shell": cleared_env(),
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "wall_s": {"rounds": t_rounds, "total": time.time() - t_start},
        "command": "OMP_NUM_THREADS=2 python benchmarks/bench_gemm.py" + (" --quick" if args.quick else ""),
    }


def main(argv=None):
    args = parse_args(argv)
    if args._worker:
        return worker_main()
    if args._probe_static_onednn:
        return static_onednn_probe()
    t_start = time.time()
    shapes = shapes_for(args.tokens, args.quick)
    cpu = cpu_info()
    load_start = loadavg()
    tmp = tempfile.mkdtemp(prefix="bench_gemm_")
    procs = {}
    try:
        infos = _start_workers(args, shapes, tmp, procs)
        results, steps = _result_slots(procs, infos, shapes)
        t_rounds = _time_rounds(args, shapes, procs, results, steps)
        probes = {} if args.no_probes else _perf_probes(args, shapes, procs, results, tmp)
    finally:
        for p in procs.values():
            p.close()
    if not args.no_probes:
        probes["verbose"] = verbose_probe(args, shapes, tmp)
        probes["static_onednn"] = static_probe(args)
    summarize(results, shapes)
    worker_info = {name: m["info"] for name, m in infos.items()}
    encoder_step = summarize_steps(steps, worker_info)
    for info in worker_info.values():
        info.pop("errors", None)
    res = {
        "config": _run_config(args, shapes, cpu, load_start, t_start, t_rounds),
        "workers": worker_info,
        "results": results,
        "encoder_step": encoder_step,
        "probes": probes,
    }
    res["summary"] = summary(res)
    print_table(res)
    for line in res["summary"]["lines"]:
        print(line)
    bench_util.write_result(args.out, res)
    print(f"wrote {args.out}", file=sys.stderr)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def summary(res):
    """The fastest correct Paddle configuration and what the library calls show, as data and sentences."""
    r = res["results"]
    base = r.get("default/paddle_matmul")
    paddle_rows = {
        k: v
        for k, v in r.items()
        if v["side"] in PADDLE_SIDES
        and v["correct"]
        and v["speedup_vs_default_matmul"] is not None
        and res["config"]["variants"][v["config"]]["sets_threads"]
    }
    best = max(paddle_rows, key=lambda k: paddle_rows[k]["speedup_vs_default_matmul"]) if paddle_rows else None
    lines = []
    out = {"best_paddle": best, "lines": lines}
    if base and best:
        out["best_paddle_speedup"] = paddle_rows[best]["speedup_vs_default_matmul"]
        lines.append(
            f"fastest correct Paddle configuration: {best} "
            f"({paddle_rows[best]['speedup_vs_default_matmul']:.2f}x the default paddle.matmul, "
            f"geometric mean over the shapes)"
        )
    for side in ("numpy", "mkl_cblas", "dnnl_sgemm"):
        k = f"default/{side}"
        if k in r and r[k]["speedup_vs_default_matmul"]:
            out[f"{side}_vs_default_matmul"] = r[k]["speedup_vs_default_matmul"]
            lines.append(
                f"{side} in the same process: {r[k]['speedup_vs_default_matmul']:.2f}x the default "
                f"paddle.matmul{'' if r[k]['correct'] else ' (NOT within tolerance)'}"
            )
    return out


if __name__ == "__main__":
    sys.exit(main())

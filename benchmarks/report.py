"""Regenerate docs/performance.md from benchmarks/results/*.json (no hand-edited numbers).

    python benchmarks/report.py            # after the benchmark scripts (make bench runs all)

Each section names the command that produced its JSON, the machine and the date (the
JSON's own record when it has one, else the file's modification time), and the load
average seen by the benchmark where it recorded it: these 2-core machines are shared,
and only ratios measured side by side in one run are meaningful.
"""

import datetime
import functools
import json
import os
import platform
import sys

import bench_util

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
OUT = os.path.join(os.path.dirname(HERE), "docs", "performance.md")
IMG = os.path.join(os.path.dirname(HERE), "docs", "img")


def _plot(name, title, xlabel, ylabel, series, ideal=None, xticks=None):
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
        if xticks is None:
            ax.plot(xs, ys, marker="o", label=label)
        else:  # categorical x axis: bars
            ax.bar(xs, ys, label=label)
    if xticks is not None:
        ax.set_xticks(range(len(xticks)))
        ax.set_xticklabels(xticks, fontsize=8)
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


def _kind_files(stem):
    """{kind: (data, when)} of ``<stem>_<kind>.json``: a benchmark's result per host kind (intel, amd), each
    from its last run on that kind."""
    if not os.path.isdir(RESULTS):
        return {}
    out = {}
    for n in sorted(os.listdir(RESULTS)):
        if n.startswith(stem + "_") and n.endswith(".json"):
            out[n[len(stem) + 1 : -5]] = _load(n)
    return out


def _date(d, when):
    m = (d or {}).get("machine")
    return m["date"] if isinstance(m, dict) and m.get("date") else when


def _newest(stem):
    """(data, when) of the most recent ``<stem>_<kind>.json`` (the full section shows it; the targets
    table shows every kind)."""
    files = _kind_files(stem)
    if not files:
        return None, None
    return max(files.values(), key=lambda dw: _date(*dw))


def _section(results):
    """A report section drawn from one results file: ``results`` names it (``encoder.json``) or, without
    ``.json``, the stem of a file per host kind (the newest is shown). Without the file, no section."""

    def wrap(body):
        @functools.wraps(body)
        def section():
            d, when = _load(results) if results.endswith(".json") else _newest(results)
            return [] if d is None else body(d, when)

        return section

    return wrap


def _cpu():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine(d):
    """The machine a result came from, as recorded in it (older files: the machine running this report)."""
    m = (d or {}).get("machine")
    if not isinstance(m, dict):
        return f"{os.cpu_count()} cores, {_cpu()} (not recorded in the results file: this report's machine)"
    text = f"{m['cores']} cores, {m['cpu_model']} ({m.get('cpu_vendor') or 'vendor unknown'})"
    if m.get("mkl_kernels"):
        text += f", MKL {m['mkl_kernels']} GEMM kernels"
    if m.get("paddle"):
        text += f", Paddle {m['paddle']}"
    if m.get("host_malloc"):
        text += f", freed host memory {'kept (paddle_unpad._runtime.host_malloc)' if m['host_malloc'] == 'retain' else 'returned (glibc defaults)'}"
    if m.get("loadavg"):
        text += f", load average {'/'.join(f'{x:.1f}' for x in m['loadavg'])} at the end"
    return text


def _header(title, command, d, when, extra=""):
    when = _date(d, when)
    return [
        f"## {title}",
        "",
        f"Command: `{command}`  ",
        f"Machine: {_machine(d)}; results written {when}.{(' ' + extra) if extra else ''}",
        "",
    ]


def _table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out + [""]


# e2e MFU targets per host kind; the other targets are the same on every kind
_MFU_TARGET = {"intel": 0.60, "amd": 0.50}
_PLAN_TARGET_MS = 10.0
_KIND_NAME = {"intel": "Intel host", "amd": "AMD host"}


def _verdict(ok):
    return "met" if ok else "**NOT met**"


def _target_mfu(e2e, k):
    if k not in e2e:
        return "-"
    acc = e2e[k][0]["acceptance"]
    v, t = acc["mfu_balanced"], _MFU_TARGET.get(k)
    text = f"{100 * v:.1f}%" + ("" if t is None else f" (>= {100 * t:.0f}%: {_verdict(v >= t)})")
    if "mfu_balanced_after" in acc:
        text += f"; all-reduce after the backward: {100 * acc['mfu_balanced_after']:.1f}%"
    return text


def _target_vs_stock(e2e, k):
    if k not in e2e:
        return "-"
    a = e2e[k][0]["acceptance"]
    sp, ideal = a["balanced_speedup_vs_batch_max"], a["ideal_vs_batch_max"]
    return f"{sp:.2f}x, ideal {ideal:.2f}x ({_verdict(sp >= ideal)})"


def _target_comm(e2e, k):
    if k not in e2e:
        return "-"
    acc = e2e[k][0]["acceptance"]
    return f"{100 * acc['exposed_comm_share_balanced']:.1f}% ({_verdict(acc['exposed_comm_at_most_5pct'])})"


def _target_fmha(att, k, hd, p):
    r = [r for r in (att[k][0].get("head_sizes") or []) if (r["head_dim"], r["dropout"]) == (hd, p)] if k in att else []
    if not r:
        return "-"
    f, fb = r[0]["fwd"]["of_matmul"], r[0]["fwd_bwd"]["of_matmul"]
    return f"{100 * f:.0f}% / {100 * fb:.0f}% ({_verdict(r[0]['meets_target'])})"


def _target_plan(bal, k):
    pm = bal[k][0].get("planner_ms", {}) if k in bal else {}
    keys = [x for x in pm if x.startswith("1024x64 native numpy")]
    if not keys:
        return "-"
    worst = max(pm[x] for x in keys)
    return " / ".join(f"{pm[x]:.2f}" for x in keys) + f" ms ({_verdict(worst < _PLAN_TARGET_MS)})"


def _target_gemm_rate(gem, k):
    if k not in gem:
        return "-"
    res = gem[k][0]["results"]
    a, b = res.get("default/paddle_matmul"), res.get("paddle_unpad/paddle_matmul")
    if not (a and b):
        return "-"
    return (
        f"{a['gflops_best'].get('ffn1', 0):.0f} -> {b['gflops_best'].get('ffn1', 0):.0f} GFLOP/s "
        f"(all shapes {b.get('speedup_vs_default_matmul', 1):.2f}x)"
    )


def _target_enc_step(gem, k):
    st = gem[k][0].get("encoder_step") or {} if k in gem else {}
    if "default" not in st or "paddle_unpad" not in st:
        return "-"
    return f"{st['default']['ms_best']:.0f} -> {st['paddle_unpad']['ms_best']:.0f} ms"


def _target_demo(demo, k):
    if k != bench_util.kind_of_vendor((demo.get("machine") or {}).get("cpu_vendor")):
        return "-"
    pad, unp = demo["padded"], demo["unpadded"]
    return (
        f"dev accuracy {pad['dev_accuracy']:.4f} stock, {unp['dev_accuracy']:.4f} paddle_unpad; "
        f"{unp['tokens_per_s'] / pad['tokens_per_s']:.2f}x tokens/s"
    )


def _target_host(by_stem, k):
    e2e, gem = by_stem["e2e"], by_stem["gemm"]
    files = [f[k] for f in by_stem.values() if f.get(k)]
    dates = sorted(_date(d, w) for d, w in files)
    m = files[0][0].get("machine") or {}
    if not m and k in gem:
        m = {"cpu_model": gem[k][0]["config"]["cpu"]["model"]}
    load = (e2e[k][0].get("machine") or {}).get("loadavg") if k in e2e else None
    cpu = gem[k][0]["config"]["cpu"] if k in gem else {}
    ident = f" (family {cpu['family']} model {cpu['model_id']})" if cpu.get("family") is not None else ""
    text = f"{m.get('cpu_model', '?')}{ident}; {dates[0]}" + (f" to {dates[-1]}" if dates[-1] != dates[0] else "")
    if load:
        text += f"; load {'/'.join(f'{x:.1f}' for x in load)} at the end of the end-to-end job"
    return text


def _target_rows(by_stem, demo, row):
    e2e, att, bal, gem = (by_stem[s] for s in ("e2e", "attention", "balance", "gemm"))
    row("end-to-end MFU, unpadded + balanced (useful FLOPs over the job's fp32 matmul)", lambda k: _target_mfu(e2e, k))
    row(
        "unpadded + balanced vs stock padded to the batch max (>= the ideal FLOP ratio)",
        lambda k: _target_vs_stock(e2e, k),
    )
    row("exposed gradient communication, share of the step (<= 5%)", lambda k: _target_comm(e2e, k))
    combos = sorted(
        {(r["head_dim"], r["dropout"]) for d, _ in att.values() for r in d.get("head_sizes") or []},
        key=lambda x: (x[0], -x[1]),
    )
    for hd, p in combos:
        row(
            f"`fmha` head size {hd}, dropout {p}: forward / forward+backward, share of the fastest fp32 GEMM (>= 55%)",
            lambda k, hd=hd, p=p: _target_fmha(att, k, hd, p),
        )
    row(
        f"planner, 1024 ranks x 64 samples, numpy in and out: default cost / Python callable cost "
        f"(< {_PLAN_TARGET_MS:.0f} ms)",
        lambda k: _target_plan(bal, k),
    )
    row(
        "Paddle fp32 matmul (ffn1 shape), Paddle as installed -> with `import paddle_unpad`",
        lambda k: _target_gemm_rate(gem, k),
    )
    row(
        "converted encoder training step, Paddle as installed -> with `import paddle_unpad`",
        lambda k: _target_enc_step(gem, k),
    )
    if demo:
        row("`make demo` (accuracy: see the seed scatter below)", lambda k: _target_demo(demo, k))
    row("machine, results written, load", lambda k: _target_host(by_stem, k))


def targets():
    """Every efficiency target on every host kind measured, from the per-kind result files."""
    by_stem = {s: _kind_files(s) for s in ("e2e", "attention", "balance", "gemm")}
    kinds = sorted(set().union(*by_stem.values()))
    if not kinds:
        return []
    rows = []
    demo, _ = _load("demo.json")
    _target_rows(by_stem, demo, lambda label, fn: rows.append([label] + [fn(k) for k in kinds]))
    lines = [
        "## Targets on each host kind",
        "",
        "The efficiency targets, each from the last `make bench` on that kind of host (result files "
        "`benchmarks/results/<benchmark>_<kind>.json`; the sections below show the newest run in full). "
        "Shares are against fp32 GEMM rates measured in the same run; hosts of one kind differ, so compare "
        "across columns only the shares and ratios, not times.",
        "",
    ]
    lines += _table(["target"] + [f"{_KIND_NAME.get(k, k)}" for k in kinds], rows)
    return lines


@_section("attention")
def attention(d, when):
    c = d["config"]
    load = c.get("loadavg_1min")
    lines = _header(
        "Attention: `fmha` (packed) vs Paddle's padded attention",
        "OMP_NUM_THREADS=2 python benchmarks/bench_attention.py",
        d,
        when,
        f"Threads {c['threads']} on every side; load average during the run {load}." if load else "",
    )
    lines += [
        f"B={c['batch']}, H={c['heads']}, D={c['head_dim']}, max length {c['max_len']}; lengths: "
        f"{c['length_distribution']}. `sdpa` = `F.scaled_dot_product_attention` with a mask, `mha` = "
        "the matmul-softmax-matmul path of PaddleNLP's attention, both padded to the batch maximum. "
        "Ideal = B*S_max^2 / sum(s_i^2); useful GFLOP/s counts real tokens only. "
        f"Paddle fp32 matmul 1024^3: {d['matmul_gflops']:.1f} GFLOP/s at the start of the run, "
        "timed again between the calls of every row (column `matmul GFLOP/s`, median). `% of matmul`: "
        "the packed path's best round over the fastest fp32 GEMM rate the run observed, "
        f"**{d['gemm_ceiling_gflops']:.1f} GFLOP/s**. On this shared machine the GEMM rate drifts by up "
        "to 2x within a minute, and the GEMM loses more than `fmha` in a disturbed phase, so a share "
        "against a GEMM of the same moment would flatter `fmha`; against the fastest GEMM seen a share "
        "can only err low.",
        "",
    ]
    rows = []
    for s in d["scenarios"]:
        for mode in ("fwd", "fwd_bwd"):
            m = s[mode]
            rows.append(
                [
                    s["name"],
                    mode.replace("_", "+"),
                    f"{100 * s['padding_ratio']:.0f}%",
                    f"{s['ideal_ratio']:.2f}",
                    f"{m['packed']['ms']:.1f}",
                    f"{m['sdpa']['ms']:.1f}",
                    f"{m['mha']['ms']:.1f}",
                    f"{m['speedup_vs_sdpa']:.2f}x",
                    f"{m['speedup_vs_sdpa_over_ideal']:.2f}",
                    f"{m['packed']['useful_gflops']:.1f}",
                    f"{m['matmul_gflops']:.1f}",
                    f"{100 * m['packed_fraction_of_matmul_peak']:.0f}%",
                ]
            )
    lines += _table(
        [
            "scenario",
            "pass",
            "padding",
            "ideal",
            "fmha ms",
            "sdpa ms",
            "mha ms",
            "speedup vs sdpa",
            "speedup / ideal",
            "fmha useful GFLOP/s",
            "matmul GFLOP/s",
            "% of matmul",
        ],
        rows,
    )
    sweep = [x for x in d["scenarios"] if x["name"].startswith("pad_")]
    xs = [100 * x["padding_ratio"] for x in sweep]
    lines += _plot(
        "attention_speedup.png",
        "fmha speedup over padded SDPA vs padding (fwd+bwd)",
        "padding (%)",
        "speedup (x)",
        [
            ("fwd+bwd", xs, [x["fwd_bwd"]["speedup_vs_sdpa"] for x in sweep]),
            ("fwd", xs, [x["fwd"]["speedup_vs_sdpa"] for x in sweep]),
        ],
        ideal=(xs, [x["ideal_ratio"] for x in sweep]),
    )
    lines += [
        "The padded paths are far below the ideal ratio's prediction because Paddle's CPU "
        "softmax and masking run at a few GFLOP/s; `fmha` fuses them into the tiles.",
        "",
    ]
    hs = d.get("head_sizes")
    if hs:
        m, k, n = d["gemm_ceiling_shape"]
        lines += [
            f"`fmha` alone per head size on the real batch ({c['heads']} heads), dropout off and on (training "
            "uses 0.1), every row's calls and a Paddle matmul "
            f"{m}x{k}x{n} run in turn in each of {len(hs[0]['round_ms']['gemm'])} rounds (best GEMM rate "
            f"there {hs[0]['gemm_best_gflops']:.1f} GFLOP/s): best-round times, useful GFLOP/s and the share of "
            f"the run's fastest fp32 GEMM rate ({d['gemm_ceiling_gflops']:.1f} GFLOP/s, as above; median "
            "times in the JSON). Target: forward and forward+backward >= 55%.",
            "",
        ]
        lines += _table(
            [
                "head size",
                "dropout",
                "fwd ms (best)",
                "fwd GFLOP/s",
                "fwd % of GEMM",
                "fwd+bwd ms (best)",
                "fwd+bwd GFLOP/s",
                "fwd+bwd % of GEMM",
                "target",
            ],
            [
                [
                    r["head_dim"],
                    r["dropout"],
                    f"{r['fwd']['ms']:.1f}",
                    f"{r['fwd']['useful_gflops']:.1f}",
                    f"{100 * r['fwd']['of_matmul']:.0f}%",
                    f"{r['fwd_bwd']['ms']:.1f}",
                    f"{r['fwd_bwd']['useful_gflops']:.1f}",
                    f"{100 * r['fwd_bwd']['of_matmul']:.0f}%",
                    "met" if r["meets_target"] else "NOT met",
                ]
                for r in hs
            ],
        )
    return lines


@_section("fused_ops.json")
def fused(d, when):
    c = d["config"]
    lines = _header(
        "Fused encoder ops vs the unfused Paddle sequence",
        "OMP_NUM_THREADS=2 python benchmarks/bench_fused_ops.py",
        d,
        when,
        f"Threads {c['threads']} on both sides, ISA {c.get('isa')}.",
    )
    rows = [
        [
            r["op"],
            "x".join(map(str, r["shape"])),
            "-" if r["dropout"] is None else r["dropout"],
            r["mode"].replace("_", "+"),
            f"{r['fused_ms']:.2f}",
            f"{r['unfused_ms']:.2f}",
            f"{r['speedup']:.2f}x",
            f"{r['fused_gbs']:.1f}",
        ]
        for r in d["rows"]
    ]
    return lines + _table(["op", "shape", "dropout", "pass", "fused ms", "unfused ms", "speedup", "fused GB/s"], rows)


@_section("fp32_attention")
def fp32_attention(d, when):
    lines = _header(
        "float32 attention without a kernel (GPU float32: bucketed plain-Paddle attention)",
        "OMP_NUM_THREADS=2 python benchmarks/bench_fp32_attention.py",
        d,
        when,
        f"Threads {d['threads']} on every side.",
    )
    lines += [
        "Where no kernel takes the tensors (float32 on a GPU, see [gpu.md](gpu.md#training-modes)), `fmha` "
        "runs `paddle_unpad.ops.bucketed_attention`: length buckets, each padded to its own longest sequence. "
        "Work per batch relative to the real tokens' (`sum s^2`; the stock model pads to the batch "
        "maximum), attention's share of one encoder layer's FLOPs, and float32 forward+backward on this "
        "CPU with Paddle's ops (12 heads of 32, one batch):",
        "",
    ]
    rows = []
    for name, e in d["distributions"].items():
        t, base = e["cpu_fp32_fwd_bwd"], e["share_of_layer_flops"]["bert-base (h=768)"]
        rows.append(
            [
                name,
                f"{e['bucketed_over_useful']:.2f}x",
                f"{e['batch_max_over_useful']:.2f}x",
                f"{base['packed']:.1%} / {base['bucketed']:.1%} / {base['stock']:.1%}",
                f"{t['ms']['packed_kernel']:.0f}",
                f"{t['ms']['bucketed']:.0f}",
                f"{t['ms']['stock_batch_max']:.0f}",
                f"{t['bucketed_vs_stock']:.2f}x",
            ]
        )
    lines += _table(
        [
            "lengths",
            "bucketed work",
            "stock work",
            "share of a BERT-base layer: packed / bucketed / stock",
            "CPU kernel ms",
            "bucketed ms",
            "stock ms",
            "stock / bucketed",
        ],
        rows,
    )
    return lines + [
        "On a CPU, Paddle's element-wise passes over the score tensors (scale, mask, softmax) dominate "
        "both padded paths; the CPU kernel, which never materialises them, is what runs there.",
        "",
    ]


@_section("exchange_scale")
def exchange_scale(d, when):
    lines = _header(
        "The sample exchange at 2 to 16 ranks",
        "OMP_NUM_THREADS=1 python benchmarks/bench_exchange_scale.py",
        d,
        when,
        f"{d['steps']} steps of {d['samples_per_rank']} samples per rank (BERT pre-training "
        f"lengths up to {d['max_len']}), one fleetrun job per row.",
    )
    lines += [
        "`allgather` is the exchange as it ships (one gloo group per loader; the samples that move travel in "
        "one all-gather of each rank's outgoing bytes); `pairs` an alternative with a 2-rank group per pair "
        "of ranks (`isend`/`irecv`); `roundrobin` point-to-point on one group in N-1 rounds; "
        "`allgather:nagle` the shipped design with Paddle's store connections as Paddle opens them "
        f"(`{bench_util.config.variable('STORE_NODELAY').env}=0`; every other row has them set `TCP_NODELAY`). *1st batch*: "
        "from `fleet.init` returning to the first balanced batch, slowest rank (*after all*: from the last "
        "rank leaving `fleet.init`); *ms/step*: median per balanced batch, *pack-only*: the same loader with "
        "`balance=False`. Ranks beyond the cores share them: times grow with oversubscription too, group "
        "counts and bytes do not.",
        "",
    ]
    rows, errors = [], any("error" in r for r in d["runs"])
    for r in d["runs"]:
        if "error" in r:
            rows.append([r["design"], r["world"], r["nnodes"]] + ["-"] * 8 + [r["error"]])
            continue
        rows.append(
            [
                r["design"],
                r["world"],
                r["nnodes"],
                r["groups_per_rank"],
                r["group_creations_per_rank"],
                f"{r['fleet_init_s']:.1f}",
                f"{r['first_batch_s']:.2f}",
                f"{r['first_batch_after_all_s']:.2f}",
                f"{r['step_ms']:.1f}",
                f"{r['local_step_ms']:.1f}",
                f"{r['moved_bytes_per_step'] / 1e3:.0f} / {r['received_bytes_per_step'] / 1e3:.0f}",
            ]
            + ([""] if errors else [])
        )
    lines += _table(
        [
            "design",
            "ranks",
            "nodes",
            "groups / rank",
            "group creations / rank",
            "fleet.init s",
            "1st batch s",
            "after all s",
            "ms/step",
            "pack-only ms",
            "KB moved / received per rank",
        ]
        + (["error"] if errors else []),
        rows,
    )
    m = d.get("at_scale")
    if m:
        i = m["inputs"]
        lines += [
            "At cluster sizes, modelled from this run (`at_scale` in the benchmark; its inputs measured on "
            f"this host in the same run: a store request {1e3 * i['store_request_s']:.2f} ms "
            f"({1e3 * i['store_request_nagle_s']:.0f} ms with the connection as Paddle opens it), the store "
            f"server's time per request under load {1e3 * i['store_server_s']:.3f} ms, a TCP connect "
            f"{1e3 * i['connect_s']:.2f} ms, a hop {1e3 * i['hop_s']:.3f} ms, {i['bytes_per_s'] / 1e9:.1f} GB/s; "
            f"moved bytes per sample slot {m['moved_bytes_per_sample_slot'] / 1e3:.2f} KB; all-gather padding "
            f"received / moved = {m['padding_fit'][0]:.2f} + {m['padding_fit'][1]:.2f} ln N). Per rank:",
            "",
        ]
        lines += _table(
            [
                "ranks",
                "samples / rank",
                "groups / rank",
                "messages / step",
                "headers + lengths MB / step",
                "samples received MB / step",
                "planner ms",
                "exchange step ms",
                "one gloo group s",
                "same, store as Paddle opens it s",
                "first balanced batch s",
            ],
            [
                [
                    r["ranks"],
                    r["samples_per_rank"],
                    r["groups_per_rank"],
                    r["messages_per_rank"],
                    f"{(r['header_bytes'] + r['length_bytes']) / 1e6:.2f}",
                    f"{r['received_bytes'] / 1e6:.1f}",
                    f"{1e3 * r['planner_s']:.1f}",
                    f"{1e3 * r['step_s']:.0f}",
                    f"{r['group_s']:.1f}",
                    f"{r['group_nagle_s']:.0f}",
                    f"{r['startup_s']:.1f}",
                ]
                for r in m["rows"]
            ],
        )
    return lines


@_section("balance")
def balance(d, when):
    lines = _header(
        "Load balance",
        "OMP_NUM_THREADS=1 python benchmarks/bench_balance.py",
        d,
        when,
        f"Length distribution: `{d['distribution']}`; C++ planner: {d['native']}.",
    )
    lines += [
        "Imbalance = max rank cost / mean rank cost - 1, over 200 global batches of 56 samples "
        "per rank (mean / p95 / max, %); moved = share of samples that change rank.",
        "",
    ]
    rows = []
    for s in d["simulation"]:
        rows.append(
            [
                s["ranks"],
                s["cost"],
                s["method"],
                f"{s['mean_pct']:.3f}",
                f"{s['p95_pct']:.3f}",
                f"{s['max_pct']:.3f}",
                f"{100 * s['moved_frac']:.1f}%",
                "-" if s["plan_ms"] is None else f"{s['plan_ms']:.2f}",
            ]
        )
    lines += _table(["ranks", "cost", "method", "mean %", "p95 %", "max %", "moved", "plan ms"], rows)
    lines += [
        "Planner time for one call (best of several, ms): `lists` = `balance.plan` on Python lists (lists "
        "of (rank, index) out), `numpy` = `balance.plan_dest` on a [ranks, samples] array (a numpy "
        "destination array out, what the exchange calls); `callable cost` = a Python function "
        "length -> cost equal to the default model (the same plan). Target: 1024 x 64 under 10 ms.",
        "",
    ]
    lines += _table(["problem", "ms"], [[k, f"{v:.2f}"] for k, v in d["planner_ms"].items()])
    r = d.get("real_2rank")
    if r:
        sm = r["summary"]
        lines += [
            f"Real 2-rank CPU run ({r['steps']} steps, {r['samples_per_rank']} samples per rank, the "
            "three modes interleaved):",
            "",
        ]
        lines += _table(
            ["", "no balancing", "exchange (async)", "pre-balanced batches"],
            [
                ["step time (ms)"] + [f"{sm['step_ms'][k]:.0f}" for k in ("none", "exchange", "prebalanced")],
                ["wait at the all-reduce (ms)"]
                + [f"{sm['wait_ms'][k]:.0f}" for k in ("none", "exchange", "prebalanced")],
                ["slowest rank compute (ms)"]
                + [f"{sm['slowest_compute_ms'][k]:.0f}" for k in ("none", "exchange", "prebalanced")],
            ],
        )
        lines += [
            f"Exchange overhead against pre-balanced feeding: {100 * sm['exchange_overhead']:+.1f}% "
            "(wall clock, target <= 2%; this shared machine adds about +-10% noise between runs).",
            "",
        ]
    return lines


def _gemm_intro(d, when):
    c = d["config"]
    cpu = c["cpu"]
    ld = lambda x: "/".join(f"{v:.1f}" for v in x[:3]) if x else "not recorded"  # noqa: E731
    lines = [
        f"### {cpu['model']} ({cpu['vendor']}, family {cpu['family']} model {cpu['model_id']})",
        "",
        f"Command: `{c['command']}`  ",
        f"Machine: {cpu['cores']} cores, {cpu['model']}, flags {', '.join(cpu['flags'])}; results written "
        f"{c.get('date', when)}. Threads {c['threads']} on every side (except the thread variants); load "
        f"average (1/5/15 min) at start {ld(c['loadavg_start'])}, at end {ld(c['loadavg_end'])}; "
        f"{c['rounds']} interleaved rounds of {c['reps']} timed calls after 1 warm-up.",
        "",
    ]
    shape_txt = ", ".join(
        f"`{s[0]}` {'[%d,%d]^T' % (s[3], s[1]) if s[4] else '[%d,%d]' % (s[1], s[3])} x [{s[3]},{s[2]}]"
        for s in c["shapes"]
    )
    lines += [
        f"fp32 GFLOP/s (best of the rounds) of C = op(A) op(B): {shape_txt}. Every configuration is its own "
        "process with the environment shown, all driven in lock-step; `vs default` = geometric mean over the "
        "shapes of the speedup over the default `paddle.matmul`; correct = every shape within "
        "10 sqrt(K) eps32 (relative Frobenius error) of numpy's fp64 product; kernel = the hottest code "
        "under `perf record` on the ffn1 shape.",
        "",
    ]
    return lines


def _gemm_results(d):
    names = [s[0] for s in d["config"]["shapes"]]
    rows = []
    for key, r in d["results"].items():
        env = " ".join(f"{k}={v}" for k, v in r["env"].items()) or "-"
        worst = max(e["rel_fro"] for e in r["errors"].values())
        sp = r.get("speedup_vs_default_matmul")
        rows.append(
            [r["config"], f"`{env}`", r["side"]]
            + [f"{r['gflops_best'][n]:.1f}" if n in r["gflops_best"] else "-" for n in names]
            + [
                "-" if sp is None else f"{sp:.2f}x",
                f"{'yes' if r['correct'] else 'NO'} ({worst:.1e})",
                r.get("kernel") or "",
            ]
        )
    lines = _table(
        ["configuration", "environment", "side"] + names + ["vs default", "correct (max rel err)", "kernel"], rows
    )
    st = d.get("encoder_step") or {}
    if st:
        any_info = next(iter(d["workers"].values())).get("encoder_step", {})
        lines += [
            f"Encoder training step (converted MiniLM-shape model, random init, forward + loss + backward + "
            f"AdamW) on one packed batch of lengths {any_info.get('lengths')}, interleaved with the GEMMs:",
            "",
        ]
        lines += _table(
            [
                "configuration",
                "step ms (best)",
                "step ms (median)",
                "tokens/s",
                "vs default",
                "eval loss rel. diff vs default",
            ],
            [
                [
                    k,
                    f"{v['ms_best']:.0f}",
                    f"{v['ms_median']:.0f}",
                    f"{v['tokens_per_s']:.0f}",
                    f"{v.get('speedup_vs_default', 1):.2f}x",
                    f"{v.get('loss_rel_diff_vs_default', 0):.1e}",
                ]
                for k, v in st.items()
            ],
        )
    return lines


def _gemm_mkl_facts(d):
    mkl = d["workers"].get("default", {}).get("mkl")
    facts = []
    if mkl:
        detect = {
            k: d["workers"][k]["mkl"].get("mkl_serv_cpu_detect")
            for k in d["workers"]
            if isinstance(d["workers"][k].get("mkl"), dict) and k.startswith("mkl_cpu")
        }
        facts.append(
            f"Paddle's matmul calls `cblas_sgemm` of `{mkl['library']}` ({mkl['version']}): MKL's own "
            f"CPU check on this host gives `mkl_serv_intel_cpu_true` = {mkl.get('mkl_serv_intel_cpu_true')} "
            f"and `mkl_serv_cpu_detect` = {mkl.get('mkl_serv_cpu_detect')} by default"
            + (", " + ", ".join(f"{v} under {k}" for k, v in detect.items()) if detect else "")
            + "."
        )
    vb = d.get("probes", {}).get("verbose", {})
    for name, v in vb.items():
        facts.append(
            f"With `MKL_VERBOSE=1 ONEDNN_VERBOSE=1`{'' if name == 'default' else ' and `' + name + '`'}: "
            f"{v['mkl_sgemm_calls']} MKL SGEMM calls and {v['onednn_exec_lines']} oneDNN primitive runs "
            f"for {len(v.get('sgemm_calls', []))} distinct dygraph GEMM calls."
        )
    so = d.get("probes", {}).get("static_onednn")
    if so:
        fate = (
            "completed"
            if so["completed"]
            else "hung after the first op and was stopped"
            if so["hung"]
            else f"died ({so.get('signal') or 'return code ' + str(so['returncode'])})"
        )
        facts.append(
            f"`FLAGS_use_onednn=1` under `paddle.jit.to_static`: {so['onednn_matmul_exec']} oneDNN matmul "
            f"run(s) ({so.get('onednn_impl')}), then the program {fate}."
        )
    return facts


def _gemm_library_facts(d):
    w = d["workers"].get("default", {})
    dnnl, nb = w.get("onednn"), w.get("numpy_blas")
    facts = []
    if dnnl:
        facts.append(
            f"`{dnnl['library']}` (oneDNN {dnnl['version']}, already loaded by Paddle) picks its kernels "
            f"by CPU features (effective ISA {dnnl['effective_cpu_isa']}), not by vendor."
        )
    if isinstance(nb, list) and nb:
        facts.append(
            "numpy's BLAS (threadpoolctl): "
            + "; ".join(
                f"{b['internal_api']} {b['version']} {b['architecture']} kernel, {b['num_threads']} threads" for b in nb
            )
            + "."
        )
    cleared = d["config"].get("cleared_from_shell") or {}
    if cleared:
        facts.append(
            "Cleared from the shell's environment in every worker: "
            + ", ".join(f"`{k}={v}`" for k, v in cleared.items())
            + "."
        )
    return facts


def _gemm_host(d, when):
    lines = _gemm_intro(d, when) + _gemm_results(d)
    return lines + [f"- {f}" for f in _gemm_mkl_facts(d) + _gemm_library_facts(d)] + [""]


def gemm():
    files = _kind_files("gemm")
    if not files:
        return []
    lines = [
        "## GEMM speed on AMD and Intel hosts",
        "",
        "Paddle 3.x CPU wheels run `paddle.matmul` / `F.linear` (dygraph) through `cblas_sgemm` of the MKL "
        "they ship (`libmklml_intel.so`, MKL 2019.0.5). That MKL picks its kernels by CPU *vendor*: on a "
        "non-Intel CPU it runs its generic `def` kernels (SSE2 `mulps`/`addps`, no FMA) whatever the ISA. "
        "MKL up to 2020.0 honours `MKL_DEBUG_CPU_TYPE` (5 = AVX2 kernels, 7 = AVX-512 kernels), read when MKL "
        "runs its first GEMM: set it before the first matmul of the process (before `import paddle` is "
        "safest), and only on AMD hosts -- on Intel MKL already picks the best kernels, and a forced AVX2 "
        "path would slow an AVX-512 host (7 needs `avx512f` in the CPU flags, else it faults). "
        "`MKL_ENABLE_INSTRUCTIONS` only caps the ISA on Intel CPUs; `MKL_CBWR` selects the reproducible "
        "`cnr_def` kernels; `FLAGS_use_onednn` does not move dygraph matmul to oneDNN. "
        "`import paddle_unpad` therefore sets `MKL_DEBUG_CPU_TYPE` on non-Intel x86 CPUs when it is unset "
        "(`paddle_unpad._runtime.cpu_gemm`; the `paddle_unpad` configuration below; opt out with "
        f"`{bench_util.config.variable('MKL_DISPATCH').env}=off`); every other configuration opts out, so `default` is Paddle as "
        "installed.",
        "",
    ]
    for d, when in files.values():
        lines += _gemm_host(d, when)
    return lines


def _enc_pts(d, sweep):
    """The points of one sweep of encoder.json, sorted by their x value (empty if the sweep was not run)."""
    s = d.get("sweeps", {}).get(sweep)
    return sorted(s["points"], key=lambda p: p["x"]) if s else []


def _enc_mib(p, side):
    b = p["paddle_alloc_step_peak_bytes"][side]
    return None if b is None else b / 2**20


def _enc_sweep_table(pts, first_col):
    rows = []
    for p in pts:
        u, o = p["sides"]["unpadded"], p["sides"]["batch_max"]
        mu, mo = _enc_mib(p, "unpadded"), _enc_mib(p, "batch_max")
        rows.append(
            [
                first_col(p),
                p["batch"],
                p["max_seqlen"],
                f"{100 * p['padding_ratio']:.0f}%",
                p["tokens"],
                f"{u['tokens_per_s']:.0f}",
                f"{o['tokens_per_s']:.0f}",
                f"{p['speedup_vs_batch_max']:.2f}x",
                f"{p['ideal_vs_batch_max']:.2f}",
                f"{p['speedup_over_ideal_vs_batch_max']:.2f}",
                f"{u['useful_gflops']:.1f} / {o['useful_gflops']:.1f}",
                "-" if mu is None else f"{mu:.0f} / {mo:.0f}",
            ]
        )
    return _table(
        [
            "",
            "B",
            "S max",
            "padding",
            "real tokens",
            "tokens/s converted",
            "tokens/s original",
            "speedup",
            "ideal",
            "speedup / ideal",
            "useful GFLOP/s (conv / orig)",
            "alloc peak MiB (conv / orig)",
        ],
        rows,
    )


def _enc_sentence(text):
    return text[:1].upper() + text[1:] + "."


def _enc_change(a, b):
    """'x1.23' for the change from a to b."""
    return f"x{b / a:.2f}" if a else "-"


def _enc_tok(pts, side):
    return [p["sides"][side]["tokens_per_s"] for p in pts]


def _enc_tokens_plot(pts, png, title, xlabel):
    """Tokens/s of both sides over a sweep's x."""
    xs = [p["x"] for p in pts]
    return _plot(
        png,
        title,
        xlabel,
        "real tokens/s",
        [
            ("converted (unpadded)", xs, _enc_tok(pts, "unpadded")),
            ("original, padded to batch max", xs, _enc_tok(pts, "batch_max")),
        ],
    )


def _enc_speedup_plot(pts, png, title, xlabel):
    """The measured speedup over a sweep's x, and the ideal."""
    xs = [p["x"] for p in pts]
    measured = [("measured", xs, [p["speedup_vs_batch_max"] for p in pts])]
    return _plot(png, title, xlabel, "speedup (x)", measured, ideal=(xs, [p["ideal_vs_batch_max"] for p in pts]))


def _enc_sweep(d, sweep, title, first_col, body):
    """One sweep's subsection: its description and table, then ``body(d, pts)`` (plots and findings)."""
    pts = _enc_pts(d, sweep)
    if not pts:
        return []
    lines = [f"#### {title}", "", _enc_sentence(d["sweeps"][sweep]["description"]), ""]
    return lines + _enc_sweep_table(pts, first_col) + body(d, pts)


def _enc_padding(d, pts):
    lines = _enc_tokens_plot(
        pts, "encoder_padding_tokens.png", "Training step tokens/s vs padding ratio", "padding (%)"
    )
    lines += _enc_speedup_plot(
        pts, "encoder_speedup.png", "Training step speedup, converted vs original, vs padding", "padding (%)"
    )
    a, b = pts[0], pts[-1]
    txt = (
        f"From {a['x']:.0f}% to {b['x']:.0f}% padding the original's tokens/s changes "
        f"{_enc_change(a['sides']['batch_max']['tokens_per_s'], b['sides']['batch_max']['tokens_per_s'])} "
        f"(it computes the padded shape) and the converted model's "
        f"{_enc_change(a['sides']['unpadded']['tokens_per_s'], b['sides']['unpadded']['tokens_per_s'])}; "
        f"the speedup goes from {a['speedup_vs_batch_max']:.2f}x to {b['speedup_vs_batch_max']:.2f}x against an "
        f"ideal of {a['ideal_vs_batch_max']:.2f} to {b['ideal_vs_batch_max']:.2f}."
    )
    part = d.get("summary", {}).get("acceptance", {}).get("padding_part_over_ideal")
    if part and a["name"] == "pad_0":
        vals = [v for k, v in part.items() if k != a["name"]]
        if vals:
            rng = f"{min(vals):.2f}" if min(vals) == max(vals) else f"{min(vals):.2f}-{max(vals):.2f}"
            txt += (
                f" The {a['speedup_vs_batch_max']:.2f}x at no padding is the layers' efficiency alone; divided "
                f"out, the part of the speedup that comes from removing padding is {rng} of the ideal."
            )
    return lines + [txt, ""]


def _enc_max_len(d, pts):
    xs = [p["x"] for p in pts]
    lines = _enc_tokens_plot(
        pts, "encoder_maxlen_tokens.png", "Training step tokens/s vs max sequence length", "max length L"
    )
    if all(_enc_mib(p, "unpadded") is not None for p in pts):
        lines += _plot(
            "encoder_maxlen_memory.png",
            "Paddle allocator peak per training step vs max length",
            "max length L",
            "MiB",
            [
                ("converted (unpadded)", xs, [_enc_mib(p, "unpadded") for p in pts]),
                ("original, padded to batch max", xs, [_enc_mib(p, "batch_max") for p in pts]),
            ],
        )
    a, b = pts[0], pts[-1]
    to, tu = _enc_tok(pts, "batch_max"), _enc_tok(pts, "unpadded")
    txt = (
        f"From L={a['x']} to L={b['x']} the original's tokens/s changes {_enc_change(to[0], to[-1])} and the "
        f"converted model's {_enc_change(tu[0], tu[-1])}; "
        f"the speedup goes from {a['speedup_vs_batch_max']:.2f}x to {b['speedup_vs_batch_max']:.2f}x (ideal "
        f"{a['ideal_vs_batch_max']:.2f} to {b['ideal_vs_batch_max']:.2f})."
    )
    if _enc_mib(a, "unpadded") is not None:
        txt += (
            f" Allocator peak per step: original {_enc_mib(a, 'batch_max'):.0f} -> {_enc_mib(b, 'batch_max'):.0f} "
            f"MiB, converted {_enc_mib(a, 'unpadded'):.0f} -> {_enc_mib(b, 'unpadded'):.0f} MiB."
        )
    return lines + [txt, ""]


def _enc_hidden(d, pts):
    lines = _enc_speedup_plot(pts, "encoder_hidden_speedup.png", "Training step speedup vs hidden size", "hidden size")
    a, b = pts[0], pts[-1]
    so = [p["speedup_over_ideal_vs_batch_max"] for p in pts]
    lines += [
        f"From h={a['x']} to h={b['x']} on the same lengths (ideal {a['ideal_vs_batch_max']:.2f} to "
        f"{b['ideal_vs_batch_max']:.2f}) the speedup goes from {a['speedup_vs_batch_max']:.2f}x to "
        f"{b['speedup_vs_batch_max']:.2f}x ({min(so):.2f}-{max(so):.2f} of the ideal); useful GFLOP/s: converted "
        f"{a['sides']['unpadded']['useful_gflops']:.1f} -> {b['sides']['unpadded']['useful_gflops']:.1f}, "
        f"original {a['sides']['batch_max']['useful_gflops']:.1f} -> "
        f"{b['sides']['batch_max']['useful_gflops']:.1f}.",
        "",
    ]
    return lines


# the encoder's scaling sweeps: (sweep, subsection title, first column of its table, what follows the table)
_ENC_SWEEPS = (
    ("padding", "Padding ratio", lambda p: f"{p['x']:.0f}%", _enc_padding),
    ("max_len", "Max sequence length", lambda p: f"L={p['x']}", _enc_max_len),
    ("hidden", "Hidden size", lambda p: f"h={p['x']} ({p['heads']} heads)", _enc_hidden),
)


def _enc_fit(d):
    f = d.get("fits")
    if not f:
        return []
    lines = ["#### Does the cost follow the real work?", ""]
    if "unpadded" not in f:
        return lines + [f"No fit: {f.get('skipped')}.", ""]
    r2s = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    groups = [
        g
        for g in f["unpadded"]["real_work"].get("r2_within_sweep", {})  # sweeps with >= 2 points
        if any(
            f[sd][k]["r2_within_sweep"][g] is not None
            for sd in ("unpadded", "batch_max")
            for k in ("real_work", "padded_shape")
        )
    ]
    rows = []
    for side, label in (("unpadded", "converted (unpadded)"), ("batch_max", "original (batch max)")):
        for key, feats in (("real_work", "T, sum(s_i^2)"), ("padded_shape", "B*S, B*S^2")):
            e = f[side][key]
            rows.append(
                [
                    label,
                    feats,
                    f"{e['a_ms_per_token']:.4f}",
                    f"{e['b_ms_per_sq_token']:.3g}",
                    f"{e['c_ms']:.0f}",
                    r2s(e["r2"]),
                ]
                + [r2s(e["r2_within_sweep"][g]) for g in groups]
                + [f"{e['max_abs_residual_pct']:.0f}%"]
            )
    lines += [
        f"Least squares of the step time, ms = a*x1 + b*x2 + c, over the {f['n']} sweep points of the "
        f"{f['model']} (padding, max-length and hidden-size points of that size): on the real work "
        "(T real tokens, sum of squared lengths) and on the padded shape (B*S, B*S^2, S = batch max).",
        "",
    ]
    lines += _table(
        ["side", "x1, x2", "a (ms / token)", "b (ms / token^2)", "c (ms)", "R^2"]
        + [f"R^2 within {g} sweep" for g in groups]
        + ["largest residual"],
        rows,
    )
    u, o = f["unpadded"], f["batch_max"]
    ru, rus = u["real_work"]["r2"], u["padded_shape"]["r2"]
    ro, ros = o["real_work"]["r2"], o["padded_shape"]["r2"]
    if ru is not None and rus is not None:
        if ru >= 0.9 and ru - rus >= 0.05:
            verdict = "follows the real tokens and squared lengths, not the padded shape"
        elif ru > rus:
            verdict = "fits the real work only slightly better than the padded shape in this run"
        else:
            verdict = "is not explained better by the real work than by the padded shape in this run"
        txt = (
            f"The converted model's step time {verdict}: R^2 {ru:.3f} on the real work vs {rus:.3f} on the padded shape"
        )
        if ro is not None and ros is not None:
            txt += f"; the original's: {ros:.3f} on its padded shape vs {ro:.3f} on the real work"
        txt += "."
        wu = u["real_work"].get("r2_within_sweep", {}).get("padding")
        ws = u["padded_shape"].get("r2_within_sweep", {}).get("padding")
        pad = _enc_pts(d, "padding")
        if wu is not None and ws is not None and pad:
            ts = [p["tokens"] for p in pad]
            txt += (
                f" Within the padding sweep (one padded shape, {min(ts)}-{max(ts)} real tokens) the real-work fit "
                f"explains R^2 {wu:.3f} of the converted model's variation, the padded-shape fit {ws:.3f} (it "
                "predicts one time for every padding ratio)."
            )
        lines += [txt, ""]
    return lines


@_section("encoder.json")
def encoder(d, when):
    c = d["config"]
    sw = c.get("sweep")
    wall = c.get("wall_s", {})
    load = c.get("loadavg_1min")
    load = "/".join("-" if x is None else f"{x:.1f}" for x in load) if load else "not recorded"
    lines = _header(
        "Encoder training step: converted vs original PaddleNLP model",
        "OMP_NUM_THREADS=2 python benchmarks/bench_encoder.py",
        d,
        when,
        f"Threads {c['threads']} on both sides; 1-min load average at start/end {load}"
        + (f"; whole run {wall['total']:.0f} s." if "total" in wall else "."),
    )
    lines += [
        f"One training step (forward, backward, AdamW; {c['head']}, dropout {c['dropout']}), the converted "
        "model on the packed batch vs the original PaddleNLP model padded to the batch maximum, sides "
        "interleaved, same weights. Ideal = the FLOP ratio padded / real (per layer "
        "24*T*h^2 + 4*h*sum(s_i^2)); useful GFLOP/s = 3x the real-token encoder forward FLOPs per second. "
        "Memory: Paddle's allocator peak during one step, and the RSS peak of one step (each side alone in "
        "a fresh process).",
        "",
    ]
    if d["summary"]["rows"]:
        lines += [
            f"Main model: {c['model']} ({c['weights']}), batch {c['batch']}, max length {c['max_len']}, "
            f"median of {c['repeats']} steps; lengths: {c['length_distribution']}.",
            "",
        ]
        rows = []
        for r in d["summary"]["rows"]:
            rss = r.get("rss_step_peak_mib")
            rows.append(
                [
                    r["scenario"],
                    f"{r['padding_pct']:.0f}%",
                    r["tok_s_unpadded"],
                    r["tok_s_batch_max"],
                    f"{r['speedup_vs_batch_max']:.2f}x",
                    f"{r['ideal_vs_batch_max']:.2f}",
                    f"{r['speedup_over_ideal_vs_batch_max']:.2f}",
                    f"{r['alloc_peak_mib']['unpadded']} / {r['alloc_peak_mib']['batch_max']}",
                    f"{rss['unpadded']} / {rss['batch_max']}" if rss else "-",
                ]
            )
        lines += _table(
            [
                "scenario",
                "padding",
                "tokens/s converted",
                "tokens/s original",
                "speedup",
                "ideal",
                "speedup / ideal",
                "alloc peak MiB (conv / orig)",
                "RSS step peak MiB (conv / orig)",
            ],
            rows,
        )
    if sw and d.get("sweeps"):
        lines += [
            "### Scaling sweeps",
            "",
            f"Sweep model: {sw['model']}, median of {sw['repeats']} steps after "
            f"{sw['warmup']} warm-up per point; lengths from the same distribution. Every sweep batch holds a "
            "sample of the maximum length, so padding to max_len is padding to the batch maximum.",
            "",
        ]
        for sweep, title, first_col, body in _ENC_SWEEPS:
            lines += _enc_sweep(d, sweep, title, first_col, body)
        lines += _enc_fit(d)
    return lines


def _e2e_ways(d, when):
    c, ways = d["config"], d["ways"]
    lines = _header(
        "End-to-end fleetrun training, five ways side by side",
        "python benchmarks/bench_e2e.py",
        d,
        c.get("date", when),
        f"{c['world']} ranks x {c['threads_per_rank']} thread(s) on {c['device']}.",
    )
    lines += [
        f"{c['model']}, {c['weights']}; {c['batch_per_rank']} samples per rank and step, {c['steps']} timed "
        f"steps per way after {c['warmup']} warm-up, the ways interleaved step by step in one job. Lengths: "
        f"{c['length_distribution']}. Wait = time a rank waits at the gradient all-reduce for the slowest rank; "
        f"comm = the gradient all-reduce the step still waits for after that (gloo on CPU; "
        f"{_GRAD_SYNC.get(c.get('grad_sync'), 'one flat all-reduce of every gradient after the backward')}); "
        f"MFU = useful (real-token) training FLOPs per second per "
        f"rank over the {c['mfu_against']} ({', '.join(f'{x:.0f}' for x in c['matmul_gflops_per_rank'])} "
        f"GFLOP/s); alloc peak = peak of live Paddle tensors during a step (the ways share a process, so "
        f"RSS per way is in the encoder section, measured in separate processes); page faults = minor page "
        f"faults of a rank's training thread per step (host memory touched for the first time since the "
        f"kernel mapped it; see `paddle_unpad._runtime.host_malloc`).",
        "",
    ]
    rows = []
    sp = d["speedup"].get("padded_batch_max", {})
    for w, x in ways.items():
        comp = "/".join(f"{v:.0f}" for v in x["compute_ms_per_rank"])
        rows.append(
            [
                w,
                f"{x['samples_per_s']:.2f}",
                f"{x['tokens_per_s']:.0f}",
                f"{x['step_ms']:.0f}",
                comp,
                f"{x['wait_ms']:.0f}",
                f"{x['comm_ms']:.0f}",
                f"{x['padding_computed_pct']:.0f}%",
                f"{100 * x['mfu']:.1f}%",
                "-" if x["alloc_peak_mib"] is None else f"{x['alloc_peak_mib']:.0f}",
                "-" if x.get("page_faults_per_step") is None else f"{x['page_faults_per_step']:.0f}",
                f"{sp[w]:.2f}x" if w in sp else "-",
            ]
        )
    lines += _table(
        [
            "way",
            "samples/s",
            "tokens/s",
            "step ms",
            "compute ms per rank",
            "wait ms",
            "comm ms",
            "padding computed",
            "MFU",
            "alloc peak MiB",
            "page faults per step",
            "vs batch-max",
        ],
        rows,
    )
    return lines


def _e2e_acceptance(a, ways):
    lines = []
    if "ideal_vs_batch_max" in a:
        lines += [
            f"Unpadded + balanced vs stock padded to the batch max: **{a['balanced_speedup_vs_batch_max']:.2f}x** "
            f"tokens/s; the ideal FLOP ratio of these batches is {a['ideal_vs_batch_max']:.2f}, so the "
            f"measured speedup is {a['speedup_over_ideal']:.2f}x the ideal (target >= 0.85).",
            "",
        ]
    if "wait_ms_balanced" in a:
        lines += [
            f"Waiting at the all-reduce: {a['wait_ms_unbalanced']:.0f} ms per step and rank without balancing, "
            f"{a['wait_ms_balanced']:.0f} ms with it "
            f"({'lower' if a['wait_lower_with_balancing'] else 'NOT lower'} with balancing).",
            "",
        ]
    if "mfu_balanced" in a:
        ub = ways["unpadded_balanced"]
        lines += [
            f"Unpadded + balanced: MFU **{100 * a['mfu_balanced']:.1f}%** of the fp32 matmul measured in the "
            f"job; exposed gradient communication {ub['comm_ms']:.0f} ms = "
            f"**{100 * a['exposed_comm_share_balanced']:.1f}%** of the step (target <= 5%: "
            f"{'met' if a['exposed_comm_at_most_5pct'] else 'NOT met'})."
        ]
        if "mfu_balanced_after" in a:
            ua = ways["unpadded_balanced_after"]
            lines[-1] += (
                f" With the gradients reduced after the backward instead (`unpadded_balanced_after`): MFU "
                f"{100 * a['mfu_balanced_after']:.1f}%, exposed communication {ua['comm_ms']:.0f} ms = "
                f"{100 * a['exposed_comm_share_balanced_after']:.1f}% of its step (on CPU ranks that keep every "
                "core busy, what the overlap hides is paid partly in compute: its thread shares the cores)."
            )
        lines += [""]
    return lines


def _e2e_grad_sync_profiles(profs):
    if len(profs) != 2:
        return []
    cats = list(profs["overlap"]["shares"])
    cats += [k for k in profs["serial"]["shares"] if k not in cats]
    lines = [
        "### Gradient all-reduce: before and after",
        "",
        "The balanced way profiled twice in the same job: the gradients reduced by one flat all-reduce "
        "after the backward (before), and by `paddle_unpad.fleet.GradientAllReduce` (after: embedding "
        "tables by rows, large gradients in place, overlapped with the backward). ms per step, mean of "
        "ranks:",
        "",
    ]
    rows = [[k] + [f"{profs[m]['ms_per_step'].get(k, 0.0):.1f}" for m in ("serial", "overlap")] for k in cats]
    rows.append(["**step (timer)**"] + [f"**{profs[m]['timer_step_ms']:.0f}**" for m in ("serial", "overlap")])
    if all("useful_gflops_per_rank" in profs[m] for m in ("serial", "overlap")):
        rows.append(
            ["useful GFLOP/s per rank (the steps train different batches)"]
            + [f"{profs[m]['useful_gflops_per_rank']:.0f}" for m in ("serial", "overlap")]
        )
    rows.append(
        ["gradient bytes sent per step (MB)"]
        + [f"{profs[m]['grad_bytes_per_step'] / 1e6:.1f}" for m in ("serial", "overlap")]
    )
    lines += _table(["category", "before: flat all-reduce after the backward", "after: GradientAllReduce"], rows)
    return lines


def _e2e_profile(p):
    if not p:
        return []
    lines = [
        "### Where the time goes (unpadded + balanced)",
        "",
        f"Paddle's profiler over {p['steps_per_rank']} more steps on every rank (exclusive time per "
        f"operator, mean of ranks; {p['profiled_step_ms']:.0f} ms per profiled step, "
        f"{p['timer_step_ms']:.0f} ms by the step timer of the same steps; the profiler adds some "
        "overhead per op).",
        "",
    ]
    lines += _table(
        ["category", "ms per step", "share"],
        [[k, f"{p['ms_per_step'][k]:.1f}", f"{100 * v:.1f}%"] for k, v in p["shares"].items()],
    )
    lines += ["The three largest costs, and what would reduce them:", ""]
    ach = p.get("achieved", {})

    def rate(cat):
        a = ach.get(cat)
        return (
            f" It runs at {a['useful_gflops']:.0f} useful GFLOP/s, {100 * a['of_matmul']:.0f}% of the "
            "measured fp32 matmul."
            if a
            else ""
        )

    lines += [
        f"{i + 1}. **{t['category']}** ({100 * t['share']:.0f}%).{rate(t['category'])} To reduce it: {t['reduce_by']}."
        for i, t in enumerate(p["top3"])
    ] + [""]
    return lines


@_section("e2e")
def e2e(d, when):
    ways = d["ways"]
    lines = _e2e_ways(d, when) + _e2e_acceptance(d["acceptance"], ways)
    lines += (
        _plot(
            "e2e_throughput.png",
            "End-to-end tokens/s per way (real tokens)",
            "way",
            "tokens/s",
            [("tokens/s", list(range(len(ways))), [x["tokens_per_s"] for x in ways.values()])],
            xticks=list(ways),
        )
        if ways
        else []
    )
    return lines + _e2e_grad_sync_profiles(d.get("profiles") or {}) + _e2e_profile(d.get("profile"))


_GRAD_SYNC = {
    "overlap": "`paddle_unpad.fleet.GradientAllReduce`: overlapped with the backward, embedding tables by rows"
}


@_section("demo.json")
def demo(d, when):
    lines = _header(
        "The main job: fleetrun fine-tuning (make demo)",
        "python examples/run_demo.py --json-out benchmarks/results/demo.json",
        d,
        when,
    )
    pad, unp = d["padded"], d["unpadded"]
    lines += [
        f"MiniLM-L6 (pretrained) fine-tuned on {unp['train_samples']} Rotten Tomatoes snippets across "
        f"{unp['ranks']} fleetrun ranks, then evaluated on {unp['dev_samples']} dev snippets; stock = "
        f"PaddleNLP padded to the batch maximum; paddle_unpad = {unp['path']}. Both paths see the same "
        f"samples ({unp['train_tokens']} real tokens).",
        "",
    ]
    rows = []
    for label, key in (
        ("samples/s", "samples_per_s"),
        ("tokens/s", "tokens_per_s"),
        ("dev accuracy", "dev_accuracy"),
        ("peak RSS rank 0 (MB)", "peak_rss_mb_rank0"),
        ("train time (s)", "train_seconds"),
    ):
        rows.append([label, pad[key], unp[key], f"{unp[key] / pad[key]:.2f}" if pad[key] else "-"])
    lines += _table(["", "stock (padded)", "paddle_unpad", "ratio"], rows)
    return lines + demo_seeds()


@_section("demo_seeds.json")
def demo_seeds(d, when):
    """The demo's accuracy difference against the seed-to-seed scatter (bench_demo_seeds.py)."""
    c = d["config"]
    lines = [
        "### Is the accuracy difference noise?",
        "",
        f"Command: `{d['command']}` (not part of `make bench`: {d['seconds'] / 60:.0f} minutes here)  ",
        f"Machine: {_machine(d)}; results written {_date(d, when)}.",
        "",
        f"The demo's two jobs ({c['nproc']} ranks, batch {c['batch_size']} per rank, the same "
        f"{c['max_train']}-snippet slice, {c['steps']} steps each, {c['max_dev']} dev snippets) once per seed, "
        "with the demo's dropout 0.1 and with dropout 0. Both paths train the same samples in the same order "
        "with the same schedule; with dropout their random numbers differ (Paddle's generator vs the fused "
        "kernels' Philox), without it they compute the same function.",
        "",
    ]
    rows = [
        [p["seed"], p["dropout"], f"{p['stock']:.4f}", f"{p['unpadded']:.4f}", f"{p['diff']:+.4f}"] for p in d["pairs"]
    ]
    lines += _table(["seed", "dropout", "stock accuracy", "paddle_unpad accuracy", "difference"], rows)
    for key, s in sorted(d["summary"].items(), key=lambda kv: -float(kv[0])):
        text = (
            f"Dropout {key}: {s['pairs']} pairs, mean difference {s['mean_diff']:+.4f}, largest "
            f"{s['max_abs_diff']:.4f} ({s['max_abs_diff'] * s['dev_samples']:.0f} of {s['dev_samples']} dev "
            "snippets)"
        )
        if "sd_diff" in s:
            t = "" if s.get("t_of_mean_diff") is None else f" (t = {s['t_of_mean_diff']:+.2f})"
            text += (
                f"; sd of the differences {s['sd_diff']:.4f}{t}, stock accuracy sd over the seeds "
                f"{s['sd_stock_over_seeds']:.4f}"
            )
        lines += [text + ".", ""]
    return lines


def _serving_sweep(d):
    """The optimisation settings per thread count and swept batch size: median ms, or why Paddle refused."""
    c, sides = d["config"], ("unpadded", "padded")
    names = list(dict.fromkeys(cell["distribution"] for cell in d["runs"][0]["cells"]))
    rows = []
    for r in d["runs"]:
        for b in map(str, c["sweep_batches"]):
            for config, e in r["sweep"].items():
                chosen = " / ".join(s for s in sides if r["best"][b][s] == config) or "-"
                cols = (
                    ["refused: " + e["refused"]] + [""] * (2 * len(names) - 1)
                    if "refused" in e
                    else [f"{e['by_batch'][b][n][s]:.1f}" for n in names for s in sides]
                )
                rows.append([r["threads"], b, config] + cols + [chosen])
    head = ["threads", "batch", "ir_optim / oneDNN"] + [f"{n}: {s} ms" for n in names for s in sides]
    return [
        f"Paddle Inference's CPU optimisations (median of {c['sweep_repeats']} calls on different batches; "
        "`ir_optim` = `switch_ir_optim(True)`, `onednn` = `enable_mkldnn()`); each side then serves a batch "
        "with the setting that was fastest for it at the largest swept size not above it (last column):",
        "",
    ] + _table(head + ["serves"], rows)


def _same_batch(c):
    same = c.get("same_batch_p50_ms")
    return [f"{same['unpadded']:.1f} / {same['padded']:.1f}" if same else "-"]


def _serving_cells(d):
    """p50/p99 and sequences/s of both sides per thread count, distribution and batch; the ideal."""
    rows, far = [], []
    for r in d["runs"]:
        for c in r["cells"]:
            u, p = c["unpadded"], c["padded"]
            rows.append(
                [
                    r["threads"],
                    c["distribution"],
                    c["batch"],
                    c["calls"],
                    " / ".join(c["settings"][s] for s in ("unpadded", "padded")),
                    f"{u['p50_ms']:.1f} / {u['p99_ms']:.1f}",
                    f"{p['p50_ms']:.1f} / {p['p99_ms']:.1f}",
                    f"{u['seqs_per_s']:.1f}",
                    f"{p['seqs_per_s']:.1f}",
                    f"{c['real_over_padded']:.2f}",
                    f"{c['ideal_p50_ms']:.1f}",
                    f"{c['unpadded_over_ideal']:.2f}"
                    + (f" ({c['unpadded_over_ideal_paired']:.2f})" if "unpadded_over_ideal_paired" in c else ""),
                    f"**{c['speedup_p50']:.2f}x**",
                ]
                + _same_batch(c)
            )
            if c["batch"] >= 8 and c["unpadded_over_ideal"] > d["close_within"]:
                paired = c.get("unpadded_over_ideal_paired")
                far.append(
                    f"{c['distribution']} batch {c['batch']} at {r['threads']} thread(s) "
                    f"({c['unpadded_over_ideal']:.2f}x" + ("" if paired is None else f"; per batch {paired:.2f}x") + ")"
                )
    lines = [
        "Per thread count, distribution and batch size (settings: unpadded / padded). Ideal = padded p50 x real "
        "/ padded tokens; in brackets the median over batches of the same ratio taken call by call (the two "
        "calls on one batch ran back to back, so load from other processes disturbs it least). Same batch "
        "again: p50 of a few more calls on a batch whose shapes the predictor has seen (oneDNN builds kernels "
        "per input shape; the packed `[T]` is new with nearly every batch).",
        "",
    ]
    lines += _table(
        [
            "threads",
            "lengths",
            "batch",
            "calls",
            "settings",
            "unpadded p50 / p99 ms",
            "padded p50 / p99 ms",
            "unpadded seq/s",
            "padded seq/s",
            "real / padded tokens",
            "ideal p50 ms",
            "unpadded / ideal: p50 (median per batch)",
            "padded / unpadded p50",
            "same batch again: unpadded / padded ms",
        ],
        rows,
    )
    n = sum(1 for r in d["runs"] for c in r["cells"] if c["batch"] >= 8)
    verdict = (
        f"At batch 8 and more, {n - len(far)} of {n} cells serve unpadded within {d['close_within']:.2f}x of "
        "the ideal (padded p50 x real / padded tokens)"
    )
    speedups = [c["speedup_p50"] for r in d["runs"] for c in r["cells"] if c["batch"] >= 8]
    verdict += (f"; not: {', '.join(far)}" if far else "") + (
        f". Padded p50 / unpadded p50 at batch 8 and more: {min(speedups):.2f}x to {max(speedups):.2f}x."
        if speedups
        else "."
    )
    return lines + [verdict, ""]


def _serving_profile(d):
    """Exclusive ms per operator kind (dygraph, Paddle's profiler) and what does not shrink with the tokens."""
    prof = next((r["profile"] for r in d["runs"] if "profile" in r), None)
    if not prof:
        return []
    threads = next(r["threads"] for r in d["runs"] if "profile" in r)
    lines = [
        f"Where the time goes: the same two models in dygraph under Paddle's profiler, one batch per "
        f"distribution, {threads} thread(s); exclusive ms per operator kind, and what the unpadded side "
        "would take if every kind shrank with the tokens (padded x real / padded):",
        "",
    ]
    for name, e in prof.items():
        ratio, rows, excess = e["real_over_padded"], [], {}
        for k in sorted(set(e["padded"]) | set(e["unpadded"]), key=lambda k: -e["padded"].get(k, 0.0)):
            p, u = e["padded"].get(k, 0.0), e["unpadded"].get(k, 0.0)
            excess[k] = u - p * ratio
            rows.append([k, f"{p:.2f}", f"{u:.2f}", f"{p * ratio:.2f}"])
        t = e["total_ms"]
        rows.append(["total", f"{t['padded']:.2f}", f"{t['unpadded']:.2f}", f"{t['padded'] * ratio:.2f}"])
        ranked = sorted(excess.items(), key=lambda kv: -kv[1])
        above = [f"{k} (+{v:.1f} ms)" for k, v in ranked[:3] if v > 0]
        below = [f"{k} ({v:.1f} ms)" for k, v in ranked[::-1][:3] if v < 0]
        lines += [f"{name}, batch {e['batch']}, real / padded tokens {ratio:.2f}:", ""]
        lines += _table(["operator kind", "padded ms", "unpadded ms", "padded x real/padded"], rows)
        lines += [
            f"Unpadded above that: {', '.join(above) or 'nothing'}; below it: {', '.join(below) or 'nothing'}.",
            "",
        ]
    return lines + [
        "The profile runs the dygraph models, where the stock model's bias, residual, LayerNorm and GELU "
        "are separate passes; the padded predictor's graph passes (`ir_optim`) fuse some of them.",
        "",
    ]


@_section("serving")
def serving(d, when):
    m = d["model"]
    command = f"OMP_NUM_THREADS={d['omp_num_threads']} {d['command']}" if d.get("omp_num_threads") else d["command"]
    lines = _header(
        "Serving with Paddle Inference: unpadded export vs padded stock model",
        command.strip(),
        d,
        when,
        f"{d['seconds']:.0f} s in all.",
    )
    lines += [
        f"The demo's classifier ({m['model']}: {m['layers']} layers, hidden {m['hidden']}) exported twice "
        "with `paddle.jit.save` and served by `paddle.inference` CPU predictors: unpadded = "
        "`paddle_unpad.convert` + `PackedInputs` as `examples/serve.py` serves it (real tokens only); padded = "
        "the stock PaddleNLP model, each batch padded to its longest text. Batches drawn from the demo's short "
        "reviews and from BERT pre-training pairs (at most "
        f"{d['config']['long_max_len']} tokens); a call = inputs in, run, logits out; the sides alternate "
        "call by call over the same batches, each thread count in a process of its own.",
        "",
    ]
    lines += _serving_sweep(d) + _serving_cells(d) + _serving_profile(d)
    return lines + ([d["load_note"], ""] if d.get("load_note") else [])


_KIND_LABEL = {
    "fwd": "forward",
    "bwd_kv": "backward, one pass",
    "bwd_kv_det": "deterministic: dK, dV",
    "bwd_dq_det": "deterministic: dQ",
}


def _ks_rows(r):
    """One row per (kind, head size, tile, dropout) at sm_90; fp16 and bf16 side by side
    where they differ."""
    groups = {}
    for k in r["kernels"]:
        m = k["meta"]
        if m["kind"] not in _KIND_LABEL:
            continue
        tile = m.get("rows") or m.get("keys")
        groups.setdefault((list(_KIND_LABEL).index(m["kind"]), m["d"], tile, m["dropout"]), {})[m["dtype"]] = k
    rows = []
    for (kind_i, d, tile, drop), by_dt in sorted(groups.items()):

        def cell(f):
            vals = [f(by_dt[dt]) for dt in ("bf16", "fp16") if dt in by_dt]
            return vals[0] if len(set(vals)) == 1 else " / ".join(vals)

        k = by_dt.get("bf16") or by_dt.get("fp16")
        pe = k["analysis"]["per_element"]
        rows.append(
            [
                _KIND_LABEL[k["meta"]["kind"]],
                d,
                f"{tile} {'rows' if k['meta']['kind'] == 'fwd' else 'keys'}",
                "on" if drop else "off",
                cell(lambda x: str(x["registers"])),
                cell(lambda x: str(x["spill_stores"] + x["spill_loads"])),
                f"{(k['smem_dynamic'] + k.get('smem_static', 0)) / 1024:.1f}",
                cell(lambda x: str(x["blocks_per_sm"])),
                f"{k['occupancy']:.0%}",
                f"{k['analysis']['hmma_per_iteration']:.0f}",
                cell(lambda x: f"{x['analysis']['instructions_per_hmma']:.1f}"),
                f"{pe['tensor_flop']:.0f}",
                f"{pe['smem_bytes']:.1f}",
                f"{pe['philox_calls']:.3f}" if drop else "-",
                cell(lambda x: f"{x['dropout_added_thread_instructions_per_element']:.2f}") if drop else "-",
            ]
        )
    return rows


def gpu_kernels():
    d, when = _load("kernel_static.json")
    lines = ["## GPU", ""]
    if d is None:
        return lines + ["No record yet: `python benchmarks/kernel_static.py` writes it.", ""]
    a = d["roofline_assumptions"]
    r90 = d["sms"]["90"]
    lines += [
        "The CUDA kernels read without a GPU: every unit of `custom_ops/kernels/cuda` built for sm_80 and "
        "sm_90, registers and spills from `ptxas -v`, instructions from `cuobjdump -sass` (the main loop of "
        "each kernel: the loop with the most HMMA; a block only some warps run weighted by their share). "
        "The numbers predict the hardware: an integer-pipe model of such counts matched the H200's measured "
        "dropout cost of the earlier kernels within 1.3x. `benchmarks/gpu_check.sh` measures on a GPU when one "
        "is at hand.",
        "",
        f"Command: `{d['command']}`  ",
        f"Compiler: {d['nvcc']}, flags `{' '.join(d['flags'])}`; written {d['when']}; {d['seconds']:.0f} s on 2 cores.",
        "",
        "### Per kernel (sm_90; sm_80 in the JSON)",
        "",
        "Per main-loop iteration of one warp: HMMA (m16n8k16, 4096 FLOP each), instructions per HMMA; per "
        "attention element (one query x one key): tensor-core FLOP, shared-memory bytes, Philox calls and the "
        "thread-instructions dropout adds to the loop (the loop with dropout minus the loop without, outside "
        "the block only some warps run). "
        "Occupancy: blocks per SM on an H100 from registers and shared memory. fp16 / bf16 where they "
        "differ.",
        "",
    ]
    lines += _table(
        [
            "kernel",
            "d",
            "tile",
            "dropout",
            "registers",
            "spilled bytes",
            "shared KB",
            "blocks/SM",
            "occupancy",
            "HMMA/iter",
            "instr/HMMA",
            "FLOP/elem",
            "smem B/elem",
            "Philox calls/elem",
            "dropout instr/elem",
        ],
        _ks_rows(r90),
    )
    return lines + _gpu_checks(r90["checks"], d["sms"]["80"]["checks"]) + _gpu_roofline(r90["estimate"], a)


def _gpu_checks(c90, c80):
    lines = [
        "### What the kernels are held to",
        "",
        f"At d = {c90['head_dim']}, {c90['dtype']} (`tests/test_kernel_static.py`, from a fresh build in CI):",
        "",
    ]
    rows = []
    for label, f, limit in (
        (
            "Philox calls per element (every kernel that drops)",
            lambda c: max(v["philox_calls_per_element"] for v in c["kinds"].values()),
            "<= 0.125",
        ),
        (
            "dropout's thread-instructions per element (any main loop)",
            lambda c: max(v["dropout_added_thread_instructions_per_element"] for v in c["kinds"].values()),
            "<= 8",
        ),
        ("Philox constants in the kernels without dropout", lambda c: c["philox_constants_without_dropout"], "0"),
        ("spilled bytes, every kernel of every unit", lambda c: c["spill_bytes"], "0"),
        (
            "registers of the deterministic dQ kernel without dropout",
            lambda c: c["kinds"]["bwd_dq_det"]["registers_without_dropout"],
            "<= 168",
        ),
        (
            "tensor-core FLOP per element, one-pass backward",
            lambda c: c["backward_tensor_flop_per_element"],
            "<= 640 (5 matmuls)",
        ),
        (
            "tensor-core FLOP per element, deterministic backward",
            lambda c: c["deterministic_backward_tensor_flop_per_element"],
            "(7 matmuls)",
        ),
        ("RED/ATOM in the deterministic backward", lambda c: c["deterministic_red_atom_instructions"], "0"),
    ):
        v90, v80 = f(c90), f(c80)
        fmt = (
            (lambda v: f"{v:.3f}")
            if isinstance(v90, float) and v90 < 1
            else (lambda v: f"{v:.2f}" if isinstance(v, float) and v != int(v) else str(int(v)))
        )
        rows.append([label, fmt(v90), fmt(v80), limit])
    return lines + _table(["", "sm_90", "sm_80", "limit"], rows)


def _gpu_roofline(est, a):
    pb, h200 = a["problem"], a["measured_h200"]
    lines = [
        "### Roofline estimate at BERT-large "
        f"{pb['batch']} x {pb['seqlen']} "
        f"({pb['heads']} heads, d = {pb['head_dim']}, {pb['dtype']}) on an {a['gpu']}",
        "",
        "An estimate, not a measurement: per kernel, the time each pipe needs for the instructions counted "
        "above (per SM and clock: "
        f"tensor {a['tensor_flop_per_clk_sm']} FLOP, FMA {a['fma_lanes_per_clk_sm']} "
        f"lanes, ALU {a['alu_lanes_per_clk_sm']}, IMAD {a['imad_lanes_per_clk_sm']}, MUFU "
        f"{a['mufu_lanes_per_clk_sm']}, shuffle/movmatrix {a['shfl_lanes_per_clk_sm']}, "
        f"{a['issue_warp_instr_per_clk_sm']} warp instructions issued, shared memory {a['smem_bytes_per_clk_sm']} B; "
        f"{a['sms']} SMs at {a['clock_ghz']} GHz; DRAM {a['dram_bytes_per_s'] / 1e12:.2f} TB/s; L2 atomics "
        f"{a['l2_atomic_bytes_per_s'] / 1e12:.2f} TB/s), the kernel's time the largest of them. Assumptions: "
        f"{a['tensor_note']}; {a['l2_atomic_note']}. Each kernel's DRAM bytes are what it must read and "
        "write once; the one-pass backward's float32 dQ accumulator stays in L2.",
        "",
    ]
    rows = []
    for case in ("dropout_0", "dropout_0.1"):
        e = est[case]
        k = e["kernels"]
        rows.append(
            [
                case.replace("_", " "),
                f"{e['forward_us']:.0f} ({k['forward']['bound']})",
                f"{e['backward_us']:.0f} ({k['backward_one_pass']['bound']})",
                f"{e['backward_over_forward']:.2f}",
                f"{e['backward_deterministic_us']:.0f}",
                f"{e['deterministic_backward_over_forward']:.2f}",
                f"{e['fwd_bwd_tflops']:.0f}",
            ]
        )
    lines += _table(
        [
            "",
            "forward us (bound)",
            "backward us, one pass (bound)",
            "backward / forward",
            "backward us, deterministic",
            "deterministic / forward",
            "fwd+bwd TFLOP/s",
        ],
        rows,
    )
    m0, m1 = h200["bert_large_40x512_us"], h200["bert_large_40x512_dropout_0.1_us"]
    lines += [
        f"Forward + backward with dropout 0.1 over without: {est['fwd_bwd_dropout_over_none']:.3f} (estimate).",
        "",
        f"Measured on one H200 ({h200['when']}): forward {m0['forward']} us, backward {m0['backward_delta']} + "
        f"{m0['backward_dkdv']} + {m0['backward_dq']} us (delta, dK/dV, dQ), fwd+bwd {h200['fwd_bwd_ms']['dropout_0']} "
        f"ms; with dropout 0.1: forward {m1['forward']} us, dK/dV {m1['backward_dkdv']} us, dQ {m1['backward_dq']} us, "
        f"fwd+bwd {h200['fwd_bwd_ms']['dropout_0.1']} ms. No GPU was at hand for the kernels above; "
        "`benchmarks/gpu_check.sh` measures them.",
        "",
    ]
    return lines


def main():
    parts = [
        "# Performance",
        "",
        "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; do not edit by hand. "
        "`make bench` reruns every benchmark below in this size (about 30 minutes on 2 cores) and then "
        "this report. Each benchmark runs both sides of its comparison in one process (or one fleetrun "
        "job), interleaved, with the same thread count; absolute times on these shared 2-core machines "
        "are noise, ratios are the result.",
        "",
        "Sections: [targets on each host kind](#targets-on-each-host-kind), "
        "[the main job](#the-main-job-fleetrun-fine-tuning-make-demo), "
        "[end-to-end training five ways + profile](#end-to-end-fleetrun-training-five-ways-side-by-side), "
        "[serving with Paddle Inference](#serving-with-paddle-inference-unpadded-export-vs-padded-stock-model), "
        "[attention](#attention-fmha-packed-vs-paddles-padded-attention), "
        "[fused ops](#fused-encoder-ops-vs-the-unfused-paddle-sequence), "
        "[float32 attention without a kernel](#float32-attention-without-a-kernel-gpu-float32-bucketed-plain-paddle-attention), "
        "[encoder step and scaling](#encoder-training-step-converted-vs-original-paddlenlp-model), "
        "[load balance](#load-balance), "
        "[the sample exchange at 2 to 16 ranks](#the-sample-exchange-at-2-to-16-ranks), [GEMM speed on AMD and Intel hosts](#gemm-speed-on-amd-and-intel-hosts), "
        "[GPU](#gpu).",
        "",
    ]
    for section in (
        targets,
        demo,
        e2e,
        serving,
        attention,
        fused,
        fp32_attention,
        encoder,
        balance,
        exchange_scale,
        gemm,
    ):
        parts += section()
    parts += gpu_kernels()
    text = "\n".join(parts)
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT} ({len(text.splitlines())} lines)", file=sys.stderr)


if __name__ == "__main__":
    main()

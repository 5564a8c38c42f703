"""Is the demo's accuracy difference between stock PaddleNLP and paddle_unpad noise?

``make demo`` fine-tunes once per path with one seed, and the two dev accuracies differ by
a point or two. Both paths train the same samples in the same order with the same
schedule; what differs is the random numbers of dropout (Paddle's generator on the stock
side, Philox in the fused kernels on the unpadded side) and float rounding. This runs the
demo's two jobs (``examples/run_demo.py``'s runner: fleetrun, 2 ranks, the same slice)
for several seeds with a fixed number of steps, with dropout as in the demo and with
dropout 0, and prints the paired differences: with dropout they should scatter around 0
as much as the stock accuracy scatters from seed to seed; without dropout the two paths
compute the same function and should agree to a few dev samples.

Not part of ``make bench`` (about 15 minutes on a fast 2-core host, twice that on a slow
one). Writes ``benchmarks/results/demo_seeds.json``; ``benchmarks/report.py`` renders it.

Usage::

    python benchmarks/bench_demo_seeds.py                        # seeds 1-6, dropout-0 seeds 1-2
    python benchmarks/bench_demo_seeds.py --seeds 1,2 --no-dropout-seeds "" --steps 4   # a smoke run
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import bench_util

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import run_demo  # noqa: E402


def _t(s):
    return "" if s.get("t_of_mean_diff") is None else f", t {s['t_of_mean_diff']:+.2f}"


def ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3,4,5,6", help="seeds of the runs with the demo's dropout")
    ap.add_argument("--no-dropout-seeds", default="1,2", help="seeds of the runs with dropout 0")
    ap.add_argument(
        "--steps", type=int, default=24, help="training steps of every job (the demo's 60 s on a fast host)"
    )
    ap.add_argument("--max-train", type=int, default=3200)
    ap.add_argument("--max-dev", type=int, default=640)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads-per-rank", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "demo_seeds.json"))
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    plan = [(s, 0.1) for s in ints(args.seeds)] + [(s, 0.0) for s in ints(args.no_dropout_seeds)]
    if not plan:
        ap.error("--seeds and --no-dropout-seeds are both empty")
    pairs, t0 = [], time.time()
    for i, (seed, dropout) in enumerate(plan):
        job = argparse.Namespace(
            nproc=args.nproc,
            seed=seed,
            batch_size=args.batch_size,
            full=False,
            max_train=args.max_train,
            max_dev=args.max_dev,
            time_budget=0,
            threads_per_rank=args.threads_per_rank,
        )
        extra = ["--dropout", str(dropout), "--no-progress"]
        with tempfile.TemporaryDirectory(prefix="pu_seeds_") as wd:
            pad = run_demo.run("padded", job, wd, max_steps=args.steps, extra=extra)
            unp = run_demo.run("unpadded", job, wd, max_steps=args.steps, extra=extra)
        if (pad["steps"], pad["train_samples"]) != (unp["steps"], unp["train_samples"]):
            raise SystemExit(f"seed {seed}: the two jobs trained different slices")
        pair = {
            "seed": seed,
            "dropout": dropout,
            "steps": pad["steps"],
            "train_samples": pad["train_samples"],
            "dev_samples": pad["dev_samples"],
            "stock": pad["dev_accuracy"],
            "unpadded": unp["dev_accuracy"],
            "diff": unp["dev_accuracy"] - pad["dev_accuracy"],
        }
        pairs.append(pair)
        print(
            f"[{i + 1}/{len(plan)}, {time.time() - t0:.0f} s] seed {seed} dropout {dropout}: stock "
            f"{pair['stock']:.4f}, paddle_unpad {pair['unpadded']:.4f}, difference {pair['diff']:+.4f}",
            flush=True,
        )
    summary = {}
    for dropout in sorted({p["dropout"] for p in pairs}, reverse=True):
        ps = [p for p in pairs if p["dropout"] == dropout]
        d = [p["diff"] for p in ps]
        stock = [p["stock"] for p in ps]
        s = {
            "pairs": len(ps),
            "mean_diff": statistics.mean(d),
            "max_abs_diff": max(abs(x) for x in d),
            "dev_samples": ps[0]["dev_samples"],
        }
        if len(ps) > 1:
            s["sd_diff"] = statistics.stdev(d)
            s["sd_stock_over_seeds"] = statistics.stdev(stock)
            s["t_of_mean_diff"] = s["mean_diff"] / (s["sd_diff"] / len(ps) ** 0.5) if s["sd_diff"] > 0 else None
        summary[str(dropout)] = s
        print(
            f"dropout {dropout}: {len(ps)} pairs, mean difference {s['mean_diff']:+.4f}"
            + (
                f" (sd {s['sd_diff']:.4f}{_t(s)}; stock accuracy sd over seeds {s['sd_stock_over_seeds']:.4f})"
                if len(ps) > 1
                else ""
            )
            + f", largest |difference| {s['max_abs_diff']:.4f} ({s['max_abs_diff'] * s['dev_samples']:.0f} of "
            f"{s['dev_samples']} dev samples)"
        )
    res = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "pairs": pairs,
        "summary": summary,
        "command": "python benchmarks/bench_demo_seeds.py",
        "seconds": round(time.time() - t0, 1),
    }
    bench_util.write_result(args.out, res)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

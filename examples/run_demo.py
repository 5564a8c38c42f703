"""`make demo`: fine-tune MiniLM-L6 on Rotten Tomatoes across 2 ranks, stock vs unpadded.

Runs ``examples/finetune_classifier.py`` under fleetrun (``python -m
paddle.distributed.launch``) twice -- first stock PaddleNLP (dynamic padding to the batch
maximum), then paddle_unpad (converted model, packing collator, load balancing) -- and
prints one comparison table. ``--full`` trains a whole epoch.

The slice is sized by measured time, so that ``make demo`` takes two to three minutes on a
fast or a slow 2-core host (Paddle's CPU matmul speed differs several times between them):
the stock job trains until ``--time-budget`` seconds of training are spent (at most the
``--max-train`` slice), then the paddle_unpad job trains exactly the same steps -- the same
samples in the same order, the same learning-rate schedule. ``--time-budget 0`` trains the
whole slice.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from example_util import comparison_table

HERE = os.path.dirname(os.path.abspath(__file__))


def run(mode, args, workdir, max_steps=0, extra=()):
    out = os.path.join(workdir, f"{mode}.json")
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(args.nproc),
           "--log_dir", os.path.join(workdir, f"log_{mode}"), os.path.join(HERE, "finetune_classifier.py"),
           "--json-out", out, "--seed", str(args.seed), "--batch-size", str(args.batch_size)]
    if not args.full:
        cmd += ["--max-train", str(args.max_train)]
    if args.max_dev and not args.full:
        cmd += ["--max-dev", str(args.max_dev)]
    if mode == "padded":
        cmd.append("--no-unpad")
        if args.time_budget and not args.full:
            cmd += ["--time-budget", str(args.time_budget)]
    if max_steps:
        cmd += ["--max-steps", str(max_steps)]
    cmd += list(extra)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads_per_rank))
    print(f"\n=== {mode}: {' '.join(cmd[1:])}", flush=True)
    t = time.time()
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0 or not os.path.exists(out):
        for r in range(args.nproc):
            log = os.path.join(workdir, f"log_{mode}", f"workerlog.{r}")
            if os.path.exists(log):
                print(f"--- {log} (tail)\n" + "".join(open(log, errors="replace").readlines()[-30:]))
        raise SystemExit(f"{mode} run failed (exit {proc.returncode})")
    res = json.load(open(out))
    res["job_seconds"] = round(time.time() - t, 1)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true",
                   help="a whole epoch (about 11k snippets) and the whole dev set, no time budget")
    p.add_argument("--max-train", type=int, default=3200, help="training snippets of the slice (at most)")
    p.add_argument("--time-budget", type=float, default=60.0,
                   help="seconds of training for the stock job; paddle_unpad then trains the same steps "
                        "(0: the whole slice)")
    p.add_argument("--max-dev", type=int, default=640, help="evaluate on the first N dev snippets (0: all)")
    p.add_argument("--nproc", type=int, default=2)
    env_threads = os.environ.get("OMP_NUM_THREADS", "")
    p.add_argument("--threads-per-rank", type=int,
                   default=int(env_threads) if env_threads.isdigit() and int(env_threads) > 0 else 1,
                   help="OMP_NUM_THREADS of each rank, the same for both jobs (default: OMP_NUM_THREADS "
                        "when set, else 1)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--json-out", default="", help="also write both summaries here")
    args = p.parse_args(argv)
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="pu_demo_") as wd:
        pad = run("padded", args, wd)
        # exactly the stock job's steps: same samples, same order, same schedule
        unp = run("unpadded", args, wd, max_steps=pad["steps"])
    if unp["steps"] != pad["steps"] or unp["train_samples"] != pad["train_samples"]:
        raise SystemExit(f"the two jobs trained different slices: {pad['steps']} vs {unp['steps']} steps")
    sized = (f", stopped at {pad['steps']} of {pad['schedule_steps']} steps by the {args.time_budget:g} s budget"
             if pad.get("stopped_by_time_budget") else "")
    print(f"\nMiniLM-L6 fine-tuning on Rotten Tomatoes, {args.nproc} ranks x {args.threads_per_rank} thread(s), "
          f"batch {args.batch_size}/rank, {pad['train_samples']} training snippets "
          f"({'full epoch' if args.full else f'slice of {args.max_train}'}{sized}); "
          f"{pad['dev_samples']} dev snippets")
    m = unp["machine"]
    print(f"host: {m['cpu_model']} ({m['cpu_vendor']}), {m['cores']} cores, MKL {m['mkl_kernels']} GEMM kernels, "
          f"load average {os.getloadavg()[0]:.2f}")
    fields = [("samples/s", "samples_per_s", "{:.1f}"), ("tokens/s", "tokens_per_s", "{:.0f}"),
              ("dev accuracy", "dev_accuracy", "{:.4f}"), ("peak RSS rank 0 (MB)", "peak_rss_mb_rank0", "{:.0f}"),
              ("train time (s)", "train_seconds", "{:.1f}")]
    print("\n".join(comparison_table(fields, pad, unp)))
    print(f"paddle_unpad path: {unp['path']}; real tokens trained: {unp['train_tokens']} "
          f"(stock: {pad['train_tokens']}); both jobs took {time.time() - t_start:.0f} s "
          f"({pad['job_seconds']:.0f} + {unp['job_seconds']:.0f}, start-up and evaluation included)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"padded": pad, "unpadded": unp, "machine": dict(unp["machine"], date=time.strftime(
                "%Y-%m-%d %H:%M UTC", time.gmtime()), loadavg=[round(x, 2) for x in os.getloadavg()])}, f, indent=1)


if __name__ == "__main__":
    main()

"""`make demo`: fine-tune MiniLM-L6 on Rotten Tomatoes across 2 ranks, stock vs unpadded.

Runs ``examples/finetune_classifier.py`` under fleetrun (``python -m
paddle.distributed.launch``) twice on the same slice -- first stock PaddleNLP (dynamic
padding to the batch maximum), then paddle_unpad (converted model, packing collator,
load balancing) -- and prints one comparison table. ``--full`` trains a whole epoch.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run(mode, args, workdir):
    out = os.path.join(workdir, f"{mode}.json")
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(args.nproc),
           "--log_dir", os.path.join(workdir, f"log_{mode}"), os.path.join(HERE, "finetune_classifier.py"),
           "--json-out", out, "--seed", str(args.seed), "--batch-size", str(args.batch_size)]
    if not args.full:
        cmd += ["--max-train", str(args.max_train)]
    if args.max_dev:
        cmd += ["--max-dev", str(args.max_dev)]
    if mode == "padded":
        cmd.append("--no-unpad")
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
    p.add_argument("--full", action="store_true", help="a whole epoch (about 11k snippets) instead of a slice")
    p.add_argument("--max-train", type=int, default=3200, help="training snippets of the slice")
    p.add_argument("--max-dev", type=int, default=0, help="evaluate on the first N dev snippets (0: all)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--json-out", default="", help="also write both summaries here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pu_demo_") as wd:
        rows = [run("padded", args, wd), run("unpadded", args, wd)]
    pad, unp = rows
    print("\nMiniLM-L6 fine-tuning on Rotten Tomatoes, "
          f"{args.nproc} ranks x {args.threads_per_rank} thread(s), batch {args.batch_size}/rank, "
          f"{'full epoch' if args.full else f'{args.max_train} training snippets'}")
    fields = [("samples/s", "samples_per_s", "{:.1f}"), ("tokens/s", "tokens_per_s", "{:.0f}"),
              ("dev accuracy", "dev_accuracy", "{:.4f}"), ("peak RSS rank 0 (MB)", "peak_rss_mb_rank0", "{:.0f}"),
              ("train time (s)", "train_seconds", "{:.1f}")]
    print(f"{'':22s}{'stock (padded)':>16s}{'paddle_unpad':>16s}{'ratio':>8s}")
    for label, key, fmt in fields:
        a, b = pad[key], unp[key]
        print(f"{label:22s}{fmt.format(a):>16s}{fmt.format(b):>16s}{b / a if a else float('nan'):>8.2f}")
    print(f"paddle_unpad path: {unp['path']}; real tokens trained: {unp['train_tokens']} "
          f"(stock: {pad['train_tokens']})")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"padded": pad, "unpadded": unp}, f, indent=1)


if __name__ == "__main__":
    main()

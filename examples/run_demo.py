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

The terminal gets one line per job (rank 0's progress, its time left within the stock job's
budget, then what the job did) and the table, last. Everything else -- the launcher's output,
each worker's log, each job's JSON summary -- goes to files in ``--log-dir`` (default: a new
folder in the system's temporary folder, named on the first line).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from example_util import Progress, comparison_table

HERE = os.path.dirname(os.path.abspath(__file__))
LABELS = {"padded": "stock (padded)", "unpadded": "paddle_unpad"}


def job_command(mode, args, workdir, max_steps=0, extra=()):
    """The fleetrun command of one job: the launcher at WARNING, its logs under ``workdir``."""
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--log_level", "WARNING",
           "--nproc_per_node", str(args.nproc), "--log_dir", os.path.join(workdir, f"log_{mode}"),
           os.path.join(HERE, "finetune_classifier.py"), "--json-out", os.path.join(workdir, f"{mode}.json"),
           "--seed", str(args.seed), "--batch-size", str(args.batch_size)]
    if not args.full:
        cmd += ["--max-train", str(args.max_train)]
    if args.max_dev and not args.full:
        cmd += ["--max-dev", str(args.max_dev)]
    if mode == "padded":
        cmd.append("--no-unpad")
        if job_budget(mode, args):
            cmd += ["--time-budget", str(args.time_budget)]
    if max_steps:
        cmd += ["--max-steps", str(max_steps)]
    return cmd + list(extra)


def job_budget(mode, args):
    """Seconds of training the job may spend (0: no budget): the stock job's, when the slice is timed."""
    return args.time_budget if mode == "padded" and not args.full else 0.0


class JobLine:
    """One line per job on the terminal: rank 0's progress (the time left capped by the job's
    budget), rewritten in place on a terminal; elsewhere only the job's closing line."""

    def __init__(self, label, budget_s, stream=None):
        self.label, self.budget_s = label, budget_s
        self.stream = sys.stdout if stream is None else stream
        self.live = self.stream.isatty()

    def feed(self, line):
        """Show ``line`` when it is a progress line."""
        parsed = Progress.parse(line)
        if parsed is None or not self.live:
            return
        step, total, text, elapsed = parsed
        shown = Progress(total, clock=lambda: 0.0, budget_s=self.budget_s).line(step, text, now=elapsed)
        self._write(f"\r\033[K{self.label}: {shown}")

    def close(self, text):
        self._write(("\r\033[K" if self.live else "") + f"{self.label}: {text}\n")

    def _write(self, text):
        self.stream.write(text)
        self.stream.flush()


def run(mode, args, workdir, max_steps=0, extra=()):
    """One fleetrun job (``extra``: more options of finetune_classifier.py); its output goes to
    ``workdir/<mode>.out``, its progress to one line."""
    cmd = job_command(mode, args, workdir, max_steps, extra)
    shown = JobLine(LABELS[mode], job_budget(mode, args))
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads_per_rank))
    out = os.path.join(workdir, f"{mode}.json")
    if os.path.exists(out):  # a summary of an earlier run in the same --log-dir
        os.remove(out)
    t = time.time()
    with open(os.path.join(workdir, f"{mode}.out"), "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
        for line in proc.stdout:
            log.write(line)
            shown.feed(line)
        returncode = proc.wait()
    if returncode != 0 or not os.path.exists(out):
        shown.close(f"failed (exit {returncode})")
        fail(mode, args, workdir, returncode)
    res = json.load(open(out))
    res["job_seconds"] = round(time.time() - t, 1)
    shown.close(job_summary(res, job_budget(mode, args)))
    return res


def job_summary(res, budget_s):
    stop = (f", stopped by the {budget_s:g} s budget at step {res['steps']} of {res['schedule_steps']}"
            if res.get("stopped_by_time_budget") else "")
    steps = f"{res['steps']} step" + ("" if res["steps"] == 1 else "s")
    return (f"{steps}, {res['train_seconds']:.0f} s of training{stop}; "
            f"{res['job_seconds']:.0f} s with start-up and evaluation")


def fail(mode, args, workdir, returncode):
    """The tails of the job's output and of its workers' logs, then exit."""
    logs = [os.path.join(workdir, f"{mode}.out")]
    logs += [os.path.join(workdir, f"log_{mode}", f"workerlog.{r}") for r in range(args.nproc)]
    for log in logs:
        if os.path.exists(log):
            print(f"--- {log} (tail)\n" + "".join(open(log, errors="replace").readlines()[-30:]))
    raise SystemExit(f"{mode} run failed (exit {returncode}); its logs are in {workdir}")


def parse_args(argv=None):
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
    p.add_argument("--log-dir", default="",
                   help="write each job's output, worker logs and summary here (default: a new folder in "
                        "the system's temporary folder, kept)")
    return p.parse_args(argv)


def report(args, pad, unp, seconds):
    """The closing lines; the comparison table last."""
    sized = (f", stopped at {pad['steps']} of {pad['schedule_steps']} steps by the {args.time_budget:g} s budget"
             if pad.get("stopped_by_time_budget") else "")
    print(f"\nMiniLM-L6 fine-tuning on Rotten Tomatoes, {args.nproc} ranks x {args.threads_per_rank} thread(s), "
          f"batch {args.batch_size}/rank, {pad['train_samples']} training snippets "
          f"({'full epoch' if args.full else f'slice of {args.max_train}'}{sized}); "
          f"{pad['dev_samples']} dev snippets")
    m = unp["machine"]
    print(f"host: {m['cpu_model']} ({m['cpu_vendor']}), {m['cores']} cores, MKL {m['mkl_kernels']} GEMM kernels, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"paddle_unpad path: {unp['path']}; real tokens trained: {unp['train_tokens']} "
          f"(stock: {pad['train_tokens']}); both jobs took {seconds:.0f} s "
          f"({pad['job_seconds']:.0f} + {unp['job_seconds']:.0f}, start-up and evaluation included)\n")
    fields = [("samples/s", "samples_per_s", "{:.1f}"), ("tokens/s", "tokens_per_s", "{:.0f}"),
              ("dev accuracy", "dev_accuracy", "{:.4f}"), ("peak RSS rank 0 (MB)", "peak_rss_mb_rank0", "{:.0f}"),
              ("train time (s)", "train_seconds", "{:.1f}")]
    print("\n".join(comparison_table(fields, pad, unp)), flush=True)


def write_json(path, pad, unp):
    with open(path, "w") as f:
        json.dump({"padded": pad, "unpadded": unp, "machine": dict(unp["machine"], date=time.strftime(
            "%Y-%m-%d %H:%M UTC", time.gmtime()), loadavg=[round(x, 2) for x in os.getloadavg()])}, f, indent=1)


def main(argv=None):
    args = parse_args(argv)
    wd = args.log_dir or tempfile.mkdtemp(prefix="pu_demo_")
    os.makedirs(wd, exist_ok=True)
    print(f"Fine-tuning MiniLM-L6 twice on {args.nproc} CPU ranks, stock PaddleNLP then paddle_unpad "
          f"(logs and summaries in {wd})", flush=True)
    t_start = time.time()
    pad = run("padded", args, wd)
    # exactly the stock job's steps: same samples, same order, same schedule
    unp = run("unpadded", args, wd, max_steps=pad["steps"])
    if unp["steps"] != pad["steps"] or unp["train_samples"] != pad["train_samples"]:
        raise SystemExit(f"the two jobs trained different slices: {pad['steps']} vs {unp['steps']} steps")
    if args.json_out:
        write_json(args.json_out, pad, unp)
    report(args, pad, unp, time.time() - t_start)


if __name__ == "__main__":
    main()

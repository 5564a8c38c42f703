"""`make demo`: fine-tune MiniLM-L6 on Rotten Tomatoes across 2 ranks, stock vs unpadded.

Runs ``examples/finetune_classifier.py`` under fleetrun (``python -m
paddle.distributed.launch``) twice -- first stock PaddleNLP (dynamic padding to the batch
maximum), then paddle_unpad (converted model, packing collator, load balancing) -- and
prints one comparison table. ``--full`` trains a whole epoch.

The slice is sized by measured time, so that ``make demo`` takes two to three minutes on a
fast or a slow 2-core host (Paddle's CPU matmul speed differs several times between them).
Before either job runs, a short probe (the stock job itself, on the same ranks, for a few
steps) times a stock step; the number of steps the stock job can train in ``--time-budget``
seconds (at most the ``--max-train`` slice's) is then the number both jobs train, over a slice of exactly that
many batches -- the same samples in the same order, the same learning-rate schedule, run to
its end -- so that their accuracies are compared at equal work. ``--time-budget 0`` trains
the whole slice.

The terminal gets one line for the probe, one per job (rank 0's progress, then what the job
did) and the table, last. Everything else -- the launcher's output, each worker's log, each
job's JSON summary -- goes to files in ``--log-dir`` (default: a new folder in the system's
temporary folder, named on the first line).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

from example_util import Progress, add_options, compare_summaries, omp_num_threads

HERE = os.path.dirname(os.path.abspath(__file__))
LABELS = {"padded": "stock (padded)", "unpadded": "paddle_unpad"}


def job_command(mode, args, workdir, max_steps=0, extra=()):
    """The fleetrun command of one job: the launcher at WARNING, its logs under ``workdir``."""
    cmd = [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        "--log_level",
        "WARNING",
        "--nproc_per_node",
        str(args.nproc),
        "--log_dir",
        os.path.join(workdir, f"log_{mode}"),
        os.path.join(HERE, "finetune_classifier.py"),
        "--json-out",
        os.path.join(workdir, f"{mode}.json"),
        "--seed",
        str(args.seed),
        "--batch-size",
        str(args.batch_size),
    ]
    if not args.full:
        cmd += ["--max-train", str(args.max_train)]
    if args.max_dev and not args.full:
        cmd += ["--max-dev", str(args.max_dev)]
    if mode in ("padded", "probe"):
        cmd.append("--no-unpad")
    if max_steps:
        cmd += ["--max-steps", str(max_steps)]
    return cmd + list(extra)


PROBE_STEPS = 4  # the first is left out of the timing (one-time set-up inside Paddle)


def probe_step_seconds(args, workdir):
    """Seconds of one stock training step, timed before either job runs: the stock job itself (the same
    ranks, threads and batch size, so the same contention and gradient all-reduce) for a few steps,
    the median of rank 0's steps."""
    probe = argparse.Namespace(
        **dict(vars(args), full=False, max_train=PROBE_STEPS * args.batch_size * args.nproc, max_dev=1)
    )
    out = os.path.join(workdir, "probe.json")
    if os.path.exists(out):  # an earlier run's, in the same --log-dir
        os.remove(out)
    cmd = job_command("probe", probe, workdir) + ["--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads_per_rank))
    with open(os.path.join(workdir, "probe.out"), "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        returncode = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if returncode != 0 or not os.path.exists(out):
        fail("probe", args, workdir, returncode)
    return json.load(open(out))["median_step_seconds"]


def plan_steps(args, workdir):
    """``(steps, seconds of a stock step or None, slice size)``: the number of steps both jobs train and
    the training snippets that make exactly that many batches, decided before either job runs."""
    per_step = args.batch_size * args.nproc
    slice_steps = math.ceil(args.max_train / per_step)
    if args.full or not args.time_budget:
        return None, None, args.max_train
    step_s = probe_step_seconds(args, workdir)
    steps = max(1, min(slice_steps, int(args.time_budget / max(step_s, 1e-6))))
    return steps, step_s, min(args.max_train, steps * per_step)


class JobLine:
    """One line per job on the terminal: rank 0's progress, rewritten in place on a terminal;
    elsewhere only the job's closing line."""

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
    shown = JobLine(LABELS[mode], 0.0)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads_per_rank))
    out = os.path.join(workdir, f"{mode}.json")
    if os.path.exists(out):  # a summary of an earlier run in the same --log-dir
        os.remove(out)
    t = time.time()
    with open(os.path.join(workdir, f"{mode}.out"), "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        for line in proc.stdout:
            log.write(line)
            shown.feed(line)
        returncode = proc.wait()
    if returncode != 0 or not os.path.exists(out):
        shown.close(f"failed (exit {returncode})")
        fail(mode, args, workdir, returncode)
    res = json.load(open(out))
    res["job_seconds"] = round(time.time() - t, 1)
    shown.close(job_summary(res))
    return res


def job_summary(res):
    steps = f"{res['steps']} step" + ("" if res["steps"] == 1 else "s")
    return f"{steps}, {res['train_seconds']:.0f} s of training; {res['job_seconds']:.0f} s with start-up and evaluation"


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
    # (flag, default, help): see example_util.add_options
    options = [
        ("--full", False, "a whole epoch (about 11k snippets) and the whole dev set, no time budget"),
        ("--max-train", 3200, "training snippets of the slice (at most)"),
        (
            "--time-budget",
            60.0,
            "seconds of training the stock job may take, judged by a probe before either job runs: "
            "it sets the number of steps both jobs train (0: the whole slice)",
        ),
        ("--max-dev", 640, "evaluate on the first N dev snippets (0: all)"),
        ("--nproc", 2, None),
        (
            "--threads-per-rank",
            omp_num_threads(1),
            "OMP_NUM_THREADS of each rank, the same for both jobs (default: OMP_NUM_THREADS when set, else 1)",
        ),
        ("--batch-size", 32, None),
        ("--seed", 42, None),
        ("--json-out", "", "also write both summaries here"),
        (
            "--log-dir",
            "",
            "write each job's output, worker logs and summary here (default: a new folder in "
            "the system's temporary folder, kept)",
        ),
    ]
    return add_options(p, options).parse_args(argv)


def report(args, pad, unp, seconds, step_s=None):
    """The closing lines; the comparison table last."""
    sized = f"{pad['steps']} step{'' if pad['steps'] == 1 else 's'} each"
    if step_s is not None:
        sized += (
            f" (what the {args.time_budget:g} s budget holds at {step_s:.2f} s a stock step, timed before the jobs)"
        )
    print(
        f"\nMiniLM-L6 fine-tuning on Rotten Tomatoes, {args.nproc} ranks x {args.threads_per_rank} thread(s), "
        f"batch {args.batch_size}/rank, {pad['train_samples']} training snippets "
        f"({'full epoch' if args.full else f'at most {args.max_train}'}), {sized}; {pad['dev_samples']} dev snippets"
    )
    m = unp["machine"]
    print(
        f"host: {m['cpu_model']} ({m['cpu_vendor']}), {m['cores']} cores, MKL {m['mkl_kernels']} GEMM kernels, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"paddle_unpad path: {unp['path']}; real tokens trained: {unp['train_tokens']} "
        f"(stock: {pad['train_tokens']}); both jobs took {seconds:.0f} s "
        f"({pad['job_seconds']:.0f} + {unp['job_seconds']:.0f}, start-up and evaluation included)\n"
    )
    compared = ("samples_per_s", "tokens_per_s", "dev_accuracy", "peak_rss_mb_rank0", "train_seconds")
    print("\n".join(compare_summaries(compared, pad, unp)), flush=True)


def write_json(path, pad, unp, plan=None):
    machine = dict(
        unp["machine"],
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        loadavg=[round(x, 2) for x in os.getloadavg()],
    )
    with open(path, "w") as f:
        json.dump({"padded": pad, "unpadded": unp, "plan": plan or {}, "machine": machine}, f, indent=1)


def main(argv=None):
    args = parse_args(argv)
    wd = args.log_dir or tempfile.mkdtemp(prefix="pu_demo_")
    os.makedirs(wd, exist_ok=True)
    print(
        f"Fine-tuning MiniLM-L6 twice on {args.nproc} CPU ranks, stock PaddleNLP then paddle_unpad "
        f"(logs and summaries in {wd})",
        flush=True,
    )
    t_start = time.time()
    steps, step_s, slice_size = plan_steps(args, wd)
    if steps is not None:
        print(
            f"probe: {step_s:.2f} s a stock step, so {steps} step(s) of {args.nproc} x {args.batch_size} snippets "
            f"for each job in the {args.time_budget:g} s budget",
            flush=True,
        )
    # both jobs: the same slice of exactly `steps` batches, the same samples, order and schedule
    jobs = argparse.Namespace(**dict(vars(args), max_train=slice_size))
    pad = run("padded", jobs, wd)
    unp = run("unpadded", jobs, wd)
    if (
        unp["steps"] != pad["steps"]
        or unp["train_samples"] != pad["train_samples"]
        or (steps is not None and pad["steps"] != steps)
    ):
        raise SystemExit(
            f"the two jobs trained different slices: {pad['steps']} vs {unp['steps']} steps (planned: {steps})"
        )
    if args.json_out:
        write_json(
            args.json_out,
            pad,
            unp,
            {"steps": steps, "probe_step_seconds": step_s, "slice": slice_size, "time_budget": args.time_budget},
        )
    report(args, pad, unp, time.time() - t_start, step_s)


if __name__ == "__main__":
    main()

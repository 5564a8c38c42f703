"""What the example scripts share: argument parsing, quiet start-up, step history, loss plots, progress.

Imported as a sibling module (``from example_util import ...``): the examples run as scripts,
also under ``python -m paddle.distributed.launch``, so ``examples/`` is ``sys.path[0]``.
Nothing here imports paddle, so ``quiet_logs`` can run before it.
"""
import argparse
import json
import logging
import os
import sys
import time
import warnings


def make_parser(description):
    """An ArgumentParser whose ``--help`` shows each option's default (options need help text)."""
    return argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def add_run_args(parser):
    """The options every example has: where outputs go, how chatty the run is."""
    parser.add_argument("--output-dir", default="", help="write checkpoints, history and plots here (empty: none)")
    parser.add_argument("--verbose", action="store_true",
                        help="show Paddle's and PaddleNLP's start-up log lines")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines with the time left")
    return parser


# glog levels: 0 INFO, 1 WARNING, 2 ERROR. Paddle's C++ start-up chatter is INFO.
_QUIET_ENV = {"GLOG_minloglevel": "1", "GLOG_v": "0"}


def quiet_logs(verbose=False):
    """Keep Paddle's C++ (glog) info lines, Paddle's and PaddleNLP's logging at INFO and below, and
    import-time warnings out of the way, unless ``verbose``. Call before importing paddle: glog reads
    its environment once, when the C++ core loads; glog variables the user set are left alone. The
    launcher's own ``LAUNCH INFO`` lines belong to the launcher (its ``--log_level``)."""
    if verbose:
        return
    for k, v in _QUIET_ENV.items():
        os.environ.setdefault(k, v)
    for mod in ("paddle", "paddlenlp", "_distutils_hack", "setuptools", "pkg_resources"):
        warnings.filterwarnings("ignore", module=mod + r"(\.|$)")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    # Paddle's and PaddleNLP's loggers set their own levels (INFO, DEBUG) when imported, so
    # their levels cannot be lowered beforehand; the examples report through print()
    logging.disable(logging.INFO)


class StepHistory:
    """One row per training step (step, loss, tokens/s, learning rate, anything else), saved as JSON."""

    def __init__(self, rows=None):
        self.rows = list(rows or [])

    def add(self, step, loss, tokens_per_s=None, lr=None, **more):
        row = {"step": int(step), "loss": float(loss)}
        if tokens_per_s is not None:
            row["tokens_per_s"] = float(tokens_per_s)
        if lr is not None:
            row["lr"] = float(lr)
        row.update(more)
        self.rows.append(row)
        return row

    def save(self, path):
        with open(path, "w") as f:
            json.dump({"rows": self.rows}, f, indent=1)

    @classmethod
    def load(cls, path):
        with open(path) as f:
            d = json.load(f)
        return cls(d["rows"] if isinstance(d, dict) else d)

    def __len__(self):
        return len(self.rows)


def plot_loss_curves(png_path, curves, title):
    """Loss against step for every label of ``curves`` ({label: StepHistory or rows}) on one plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        for label, hist in curves.items():
            rows = hist.rows if isinstance(hist, StepHistory) else list(hist)
            ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=label, linewidth=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(png_path, dpi=100)
    finally:
        plt.close(fig)
    return png_path


def comparison_table(fields, left, right, headers=("stock (padded)", "paddle_unpad")):
    """Lines of a side-by-side table: ``fields`` are (label, key, format) rows read from the
    ``left`` and ``right`` summaries (dicts), with the ratio right/left."""
    lines = [f"{'':22s}{headers[0]:>16s}{headers[1]:>16s}{'ratio':>8s}"]
    for label, key, fmt in fields:
        a, b = left[key], right[key]
        lines.append(f"{label:22s}{fmt.format(a):>16s}{fmt.format(b):>16s}{b / a if a else float('nan'):>8.2f}")
    return lines


def format_duration(seconds):
    """1m02s, 3h05m, 45s."""
    s = int(round(max(0.0, seconds)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class Progress:
    """``step i/N <text> elapsed 1m02s, about 3m10s left``, at most every ``every_s`` seconds and at the
    last step. Steps count from 1; ``start`` is the number of steps done before (a resumed run). The
    time left assumes the remaining steps take as long as this run's ones did (``clock`` is
    replaceable for tests)."""

    def __init__(self, total_steps, enabled=True, every_s=10.0, clock=time.monotonic, stream=None, start=0):
        if total_steps < 1:
            raise ValueError(f"Progress: total_steps must be >= 1, got {total_steps}")
        self.total, self.enabled, self.every_s, self.clock = int(total_steps), enabled, float(every_s), clock
        self.start = int(start)
        self.stream = stream
        self.t0 = clock()
        self.last_print = None

    def remaining_s(self, step, now=None):
        elapsed = (self.clock() if now is None else now) - self.t0
        return elapsed / max(step - self.start, 1) * (self.total - step)

    def line(self, step, text="", now=None):
        now = self.clock() if now is None else now
        elapsed = now - self.t0
        body = f"step {step}/{self.total}" + (f" {text}" if text else "")
        if step >= self.total:
            return f"{body} elapsed {format_duration(elapsed)}, done"
        return f"{body} elapsed {format_duration(elapsed)}, about {format_duration(self.remaining_s(step, now))} left"

    def update(self, step, text=""):
        """Print the line if due; returns it (None when nothing was printed)."""
        if not self.enabled:
            return None
        now = self.clock()
        last = step >= self.total
        if not last and self.last_print is not None and now - self.last_print < self.every_s:
            return None
        self.last_print = now
        out = self.line(step, text, now)
        print(out, file=self.stream or sys.stdout, flush=True)
        return out

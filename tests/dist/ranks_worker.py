"""One rank of a fault scenario of the distributed layer on 2 or more CPU ranks
(tests/test_distributed_faults.py starts every rank directly: each one's own exit code is seen).

``ranks_worker.py SCENARIO`` prints ``RESULT {json}`` lines. A scenario that expects an error
lets it end the process, as a user's script would: the test checks the exit code and that
nothing aborted on the way out. Nothing here leaves through ``os._exit``.
"""

import os
import signal
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402

import paddle_unpad as pu  # noqa: E402
import paddle_unpad.fleet as pf  # noqa: E402
import worker_util  # noqa: E402  (tests/dist)
from worker_util import result  # noqa: E402


def init(**configs):
    return worker_util.init({"timeout": 20.0, "close_timeout": 5.0}, configs)


def reported(fn):
    """Run ``fn``; report its exception (type, message, seconds) and re-raise it."""
    t = time.monotonic()
    try:
        return fn()
    except BaseException as e:
        result(exc=type(e).__name__, msg=str(e), after=round(time.monotonic() - t, 3))
        raise


def smp(i, n):
    return {"input_ids": np.full(n, i % 40 + 1, np.int64), "sample_id": i}


def exchange_threads():
    return sum(1 for t in threading.enumerate() if t.name.startswith("paddle_unpad-exchange") and t.is_alive())


def all_ids(seen):
    every = []
    dist.all_gather_object(every, seen)
    return sorted(i for per_rank in every for i in per_rank)


# ------------------------------------------------------------------ peers that die, stall or run short


def scenario_peer_signal(signum):
    """The last rank signals itself from inside its exchange thread (its cost callable, run while
    planning) at step 1."""
    sentinel = 37  # only the last rank's step-1 batch has a sample of this length
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    last = int(os.environ["PADDLE_TRAINERS_NUM"]) - 1

    def cost(s):
        if rank == last and s == sentinel:
            os.kill(os.getpid(), signum)
            time.sleep(5)  # SIGKILL / SIGSTOP take effect at once
        return float(s)

    init(timeout=5.0, cost=cost)
    batches = [
        [
            smp(100 * s + 10 * rank + k, sentinel if (rank == last and s == 1 and k == 0) else 60 - 20 * rank + k)
            for k in range(3)
        ]
        for s in range(4)
    ]
    reported(lambda: list(pf.distributed_loader(batches)))


def scenario_counts(per_rank):
    """Ranks with ``per_rank[r]`` batches (0: none): every rank finishes, every sample once."""
    rank, world = init()
    batches = [[smp(1000 * rank + 10 * s + k, 5 + 9 * k + 11 * rank) for k in range(3)] for s in range(per_rank[rank])]
    seen = [int(i) for b in pf.distributed_loader(batches) for i in b["sample_ids"].tolist()]
    want = sorted(1000 * r + 10 * s + k for r in range(world) for s in range(per_rank[r]) for k in range(3))
    result(complete=all_ids(seen) == want, steps_seen=len({i // 10 % 100 for i in seen}))


# ------------------------------------------------------------------ the gradient all-reduce


def model_of(extra=False):
    paddle.seed(7)
    layers = [paddle.nn.Linear(6, 4), paddle.nn.Linear(4, 2)] + ([paddle.nn.Linear(2, 2)] if extra else [])
    return paddle.nn.Sequential(*layers)


def batch(rank, width=6):
    return paddle.to_tensor(np.random.default_rng(rank).standard_normal((5, width)).astype(np.float32))


def step(model, sync, rank, width=6):
    model(batch(rank, width)).square().mean().backward()
    sync.wait()


def scenario_models_differ():
    """The last rank's model has one more layer: every rank refuses when the all-reduce is built."""
    rank, world = init()
    reported(lambda: pf.GradientAllReduce(model_of(extra=rank == world - 1), timeout=20.0))


def scenario_allreduce_twice():
    """A second all-reduce on the same model is refused until the first is closed; after close()
    the new one gives the dense mean."""
    rank, world = init()
    model = model_of()
    first = pf.GradientAllReduce(model)
    step(model, first, rank)
    model.clear_gradients()
    try:
        pf.GradientAllReduce(model)
        result(second="accepted")
    except pf.GradientSyncError as e:
        result(second="refused", msg=str(e))
    first.close()
    first.close()  # idempotent
    again = pf.GradientAllReduce(model)
    step(model, again, rank)
    got = [p.grad.numpy() for p in model.parameters()]
    model.clear_gradients()
    again.close()
    x = batch(rank)
    model(x).square().mean().backward()
    ok = True
    for p, g in zip(model.parameters(), got):
        dense = p.grad.clone()
        dist.all_reduce(dense)
        ok = ok and np.allclose(dense.numpy() / world, g, rtol=1e-6, atol=1e-7)
    result(dense_mean=ok)


def scenario_allreduce_timeout():
    """A timeout far below what one all-reduce takes: wait() gives up while the communication
    thread is still inside the collective (on every rank); the script catches that and trains
    the next step, whose wait() refuses."""
    rank, world = init()
    model = paddle.nn.Sequential(*[paddle.nn.Linear(256, 256) for _ in range(4)])
    sync = pf.GradientAllReduce(model, timeout=1e-4)

    def train():
        try:
            step(model, sync, rank, width=256)
        except pf.GradientSyncError as e:
            result(first=str(e))
        model.clear_gradients()
        step(model, sync, rank, width=256)

    reported(train)


def scenario_allreduce_peer_stopped():
    """The last rank stops (SIGSTOP) before its backward; the others' wait() (no overlap: the
    reduction starts there) gives up after the timeout."""
    rank, world = init()
    model = model_of()
    sync = pf.GradientAllReduce(model, timeout=2.0, overlap=False)
    x = batch(rank)
    loss = model(x).square().mean()
    dist.barrier()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    loss.backward()
    reported(sync.wait)


def scenario_skipped_step():
    """Rank 1 skips the backward and wait() of step 1 (it takes the batch and goes on)."""
    rank, world = init()
    model = paddle.nn.Sequential(paddle.nn.Embedding(50, 4), paddle.nn.Linear(4, 2))
    sync = pf.GradientAllReduce(model, timeout=20.0)
    batches = [[smp(100 * s + 10 * rank + k, 4 + k) for k in range(3)] for s in range(4)]

    def train():
        for batch in pf.distributed_loader(batches):
            if rank == 1 and batch["step"] == 1:
                continue
            model(batch["input_ids"]).mean().backward()
            sync.wait(step=batch["step"])
            model.clear_gradients()

    reported(train)


class TiedTable(paddle.nn.Layer):
    """A 1 MiB table (reduced by rows) whose weight ``use`` takes through its layer
    (``plain``, ``keyword``), through ``F.embedding``, also in a tied output ``matmul``, or not
    at all (``unused``: no rank has a row to send)."""

    def __init__(self, use):
        super().__init__()
        self.use = use
        self.emb = paddle.nn.Embedding(2048, 128)
        self.mid = paddle.nn.Linear(128, 128)

    def forward(self, ids):
        if self.use == "functional":
            h = paddle.nn.functional.embedding(ids, self.emb.weight)
        elif self.use == "unused":
            h = paddle.ones([ids.shape[0], 128])
        else:
            h = self.emb(x=ids) if self.use == "keyword" else self.emb(ids)
        h = paddle.tanh(self.mid(h))
        if self.use == "matmul":
            h = paddle.matmul(h, self.emb.weight, transpose_y=True)
        return h.square().mean()


def global_reference(make, losses, world):
    """The gradients of the mean over the ranks of every rank's loss, in this one process:
    ``losses(model, r)`` is rank r's loss (all its micro-batches)."""
    ref = make()
    (sum(losses(ref, r) for r in range(world)) / world).backward()
    return [np.zeros(p.shape, np.float32) if p.grad is None else p.grad.numpy() for p in ref.parameters()]


def worst_error(model, ref):
    """The largest difference from the reference, relative to the gradient's largest value."""
    worst = 0.0
    for p, want in zip(model.parameters(), ref):
        got = p.grad.numpy()
        worst = max(worst, float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12)))
    return worst


def caught(fn):
    try:
        fn()
        return None
    except (pf.GradientSyncError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def scenario_allreduce_misuse():
    """Each rank: a tied table used in several ways (the averaged gradients against the global
    batch's, computed here); gradient accumulation with overlap (every rank, and rank 0 only);
    a parameter unfrozen or frozen after construction; a sparse embedding."""
    rank, world = init()

    def ids(r, s):
        return paddle.to_tensor(np.random.default_rng(100 * r + s).integers(0, 2048, 24))

    for use in ("plain", "keyword", "functional", "matmul", "unused"):

        def make():
            paddle.seed(3)
            return TiedTable(use)

        model, errs = make(), []
        sync = pf.GradientAllReduce(model)
        for s in range(2):
            model(ids(rank, s)).backward()
            sync.wait()
            errs.append(worst_error(model, global_reference(make, lambda m, r: m(ids(r, s)), world)))
            model.clear_gradients()
        result(
            case="tied",
            use=use,
            error=max(errs),
            unproven=sync.stats["tables_unproven"],
            by_rows=sync.stats["tables_by_rows"],
        )
        sync.close()
    accumulation(rank, world)
    trainable_changes(rank, world)
    sparse = paddle.nn.Embedding(50, 4, sparse=True)
    result(case="sparse layer", error=caught(lambda: pf.GradientAllReduce(paddle.nn.Sequential(sparse))))
    sync = pf.GradientAllReduce([sparse.weight])
    sparse(paddle.to_tensor([1, 2, 3])).sum().backward()
    result(case="sparse list", error=caught(sync.wait))
    sync.close()


def accumulation(rank, world):
    model = model_of()
    sync = pf.GradientAllReduce(model)
    for who, pause in (("every rank, bucket reduced first", 0.5), ("rank 0 only, at once", 0.0)):
        model(batch(rank)).square().mean().backward()
        time.sleep(pause)  # the communication thread reduces every bucket meanwhile
        if who.startswith("every") or rank == 0:
            model(batch(rank + 10)).square().mean().backward()
        result(case="accumulation", who=who, error=caught(sync.wait))
        model.clear_gradients()
    sync.close()
    sync = pf.GradientAllReduce(model, overlap=False)
    for x in (batch(rank), batch(rank + 10)):
        model(x).square().mean().backward()
    sync.wait()
    ref = global_reference(model_of, lambda m, r: m(batch(r)).square().mean() + m(batch(r + 10)).square().mean(), world)
    result(case="accumulation", who="overlap=False", error=worst_error(model, ref))
    sync.close()


def trainable_changes(rank, world):
    model = model_of()
    model[0].weight.stop_gradient = True
    sync = pf.GradientAllReduce(model)
    model[0].weight.stop_gradient = False
    result(case="unfrozen", error=caught(lambda: step(model, sync, rank)))
    sync.close()
    model.clear_gradients()
    sync = pf.GradientAllReduce(model)  # built again after the change: reduced
    step(model, sync, rank)
    result(
        case="rebuilt",
        error=worst_error(model, global_reference(model_of, lambda m, r: m(batch(r)).square().mean(), world)),
    )
    model.clear_gradients()
    model[1].bias.stop_gradient = True
    result(case="frozen", error=caught(lambda: step(model, sync, rank)))
    sync.close()


def scenario_allreduce_exception_before_wait():
    """Rank 1's loop raises between backward() and wait() while a layer got no gradient (its
    communication thread waits for that bucket); rank 2 calls close() there instead; rank 0
    reaches wait()."""
    rank, world = init()
    paddle.seed(7)
    used = paddle.nn.Sequential(paddle.nn.Linear(6, 4), paddle.nn.Linear(4, 2))
    model = paddle.nn.LayerList([used, paddle.nn.Linear(2, 2)])
    sync = pf.GradientAllReduce(model)
    used(batch(rank)).square().mean().backward()

    def fail():
        raise RuntimeError("the training loop failed on purpose")

    if rank == 2:
        t = time.monotonic()
        sync.close()
        result(closed_in=round(time.monotonic() - t, 3))
        return
    reported(fail if rank == 1 else sync.wait)


class Headed(paddle.nn.Layer):
    """An embedding, a body and a head; a sub-layer ``extra`` is used once one is added."""

    def __init__(self):
        super().__init__()
        self.emb = paddle.nn.Embedding(40, 6)
        self.body = paddle.nn.Linear(6, 4)
        self.head = paddle.nn.Linear(4, 2)

    def forward(self, ids):
        h = self.head(paddle.tanh(self.body(self.emb(ids))))
        extra = self._sub_layers.get("extra")
        return (extra(h) if extra is not None else h).square().mean()


def headed():
    paddle.seed(5)
    return Headed()


def ids_of(rank, s):
    return paddle.to_tensor(np.random.default_rng(10 * rank + s).integers(0, 40, 8))


MODEL_CHANGES = {  # what users do to a model after building its all-reduce
    "head replaced": lambda m: setattr(m, "head", paddle.nn.Linear(4, 2)),
    "head replaced on rank 0 only": lambda m: setattr(m, "head", paddle.nn.Linear(4, 2)),
    "sublayer added": lambda m: m.add_sublayer("extra", paddle.nn.Linear(2, 2)),
    "weight re-assigned": lambda m: setattr(m.body, "weight", m.body.create_parameter([6, 4])),
    "embedding resized": lambda m: setattr(m, "emb", paddle.nn.Embedding(48, 6)),
}


def scenario_allreduce_model_changes():
    """2 ranks. A parameter new to the model after its all-reduce was built (a replaced head, an
    added sub-layer, a re-assigned weight, a resized embedding; once on rank 0 only) is a named
    error on every rank at the next wait(); built again after the change, the all-reduce gives
    the global batch's gradients. An all-reduce over a group of rank 0 only, built on rank 1 too,
    is refused there by name. Then rank 0 leaves the job (its process ends, and the job's store
    with it); rank 1, building another all-reduce and a loader, is told that rank 0 has left."""
    rank, world = init()
    for case, change in MODEL_CHANGES.items():
        model = headed()
        sync = pf.GradientAllReduce(model, timeout=20.0)
        model(ids_of(rank, 0)).backward()
        sync.wait()
        model.clear_gradients()
        if rank == 0 or "rank 0 only" not in case:
            change(model)
        t = time.monotonic()
        error = caught(lambda: (model(ids_of(rank, 1)).backward(), sync.wait()))
        result(case=case, error=error, after=round(time.monotonic() - t, 3))
        sync.close()

    def changed():
        m = headed()
        paddle.seed(9)
        m.head = paddle.nn.Linear(4, 2)
        return m

    model = changed()
    sync = pf.GradientAllReduce(model)
    model(ids_of(rank, 2)).backward()
    sync.wait()
    result(
        case="rebuilt after the change",
        error=worst_error(model, global_reference(changed, lambda m, r: m(ids_of(r, 2)), world)),
    )
    sync.close()
    solo = dist.new_group([0], backend="gloo")  # every rank makes it (Paddle's rule); rank 1 is not in it
    attempt("all-reduce over a group without this rank", lambda: pf.GradientAllReduce(model, group=solo).close())
    if rank == 0:
        result(leaving=True)
        return  # the job's store, which this process serves, goes with it
    store = pu._runtime.paddle_compat.job_store()
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:  # rank 0 waits a few seconds for its peers to count out, then ends
        try:
            store.add("probe", 0)
            time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the store is gone: rank 0 has left
            break
    attempt("all-reduce after rank 0 left", lambda: pf.GradientAllReduce(headed()))
    attempt("loader after rank 0 left", lambda: pf.distributed_loader([[smp(rank, 4)]]))


class LateSizedSampler(paddle.io.BatchSampler):
    """Sizes itself when its own iteration starts (no set_epoch): epoch e has ``base + 2e``
    batches of 2 sample indices."""

    def __init__(self, base):  # nothing of BatchSampler's own state is used
        self.base, self.epochs, self.n = base, 0, base

    def __len__(self):
        return self.n

    def __iter__(self):
        self.n = self.base + 2 * self.epochs
        self.epochs += 1
        for b in range(self.n):
            yield [2 * b, 2 * b + 1]


class Numbered(paddle.io.Dataset):
    def __init__(self, rank):
        self.rank = rank

    def __len__(self):
        return 100

    def __getitem__(self, i):
        return {"input_ids": np.full(3 + i % 5, i % 40 + 1, np.int64), "sample_id": np.int64(1000 * self.rank + i)}


def scenario_late_sized_loader():
    """2 ranks. A DataLoader whose batch sampler sizes itself as its iteration starts (rank 0: 2,
    4, 6 batches per epoch, rank 1: 1, 3, 5): len() of the balanced loader, read after iter(),
    is the epoch's global step count, and every rank receives that many batches. counts of the
    wrong length are refused where given. Then rank 1 leaves the job (its process ends) and
    rank 0's next wait() names it."""
    rank, world = init()
    dl = paddle.io.DataLoader(
        Numbered(rank), batch_sampler=LateSizedSampler(2 - rank), collate_fn=pu.data.sample_list_collate
    )
    bl = pf.distributed_loader(dl)
    for epoch in range(3):
        it = iter(bl)
        told = len(bl)
        received = sum(1 for _ in it)
        result(what=f"epoch {epoch}", len=told, received=received)
    bl.close()
    attempt("counts of one rank", lambda: pf.distributed_loader([[smp(rank, 4)]], counts=[4]))
    model = model_of()
    sync = pf.GradientAllReduce(model, timeout=20.0)
    step(model, sync, rank)
    model.clear_gradients()
    if rank == 1:
        result(leaving=True)
        return
    reported(lambda: step(model, sync, rank))


# ------------------------------------------------------------------ the exchange's ends and settings


def scenario_loader_timeout():
    """The last rank's loader stalls 6 s at step 1; the loaders' timeout is 2 s."""
    rank, world = init(timeout=2.0)

    def batches():
        for s in range(4):
            if rank == world - 1 and s == 1:
                time.sleep(6.0)
            yield [smp(100 * s + 10 * rank + k, 5 + k) for k in range(2)]

    reported(lambda: list(pf.distributed_loader(batches())))


def scenario_break_and_del():
    """``break`` and ``del`` stop the exchange threads where they happen; two loaders left in the
    middle of an epoch at exit close without a stall."""
    rank, world = init(close_timeout=5.0)
    batches = [[smp(100 * s + 10 * rank + k, 5 + 7 * k + 3 * rank) for k in range(3)] for s in range(6)]
    a, b = pf.distributed_loader(batches), pf.distributed_loader(batches)
    for _ in a:
        break
    after_break = exchange_threads()
    it = iter(b)
    next(it)
    del it
    after_del_iterator = exchange_threads()
    it = iter(a)
    next(it)
    del a  # the iterator keeps its loader: the epoch goes on
    n_more = sum(1 for _ in it)
    after_epoch = exchange_threads()
    c = iter(pf.distributed_loader(batches))
    d = iter(b)
    next(c), next(d)  # two epochs in flight at exit: each rank closes both, none waits for another
    result(
        after_break=after_break,
        after_del_iterator=after_del_iterator,
        rest_of_epoch=n_more,
        after_epoch=after_epoch,
        in_flight_at_exit=exchange_threads(),
        exit_from=round(time.monotonic() - worker_util.T0, 3),
    )


def scenario_balance_on_one_rank_only():
    rank, world = init()
    reported(lambda: pf.distributed_loader([[smp(rank, 4)]], balance=rank != 1))


def scenario_missing_loader():
    """The last rank builds no balanced loader (it ends after 12 s); the others wait at most
    max(timeout, 10 s)."""
    rank, world = init(timeout=3.0)
    if rank == world - 1:
        time.sleep(12.0)
        result(built=False)
        return
    reported(lambda: pf.distributed_loader([[smp(rank, 4)]]))


def scenario_string_field():
    rank, world = init()
    batch = [dict(smp(10 * rank + k, 4 + k), **({"text": "a review"} if rank == 1 else {})) for k in range(2)]
    reported(lambda: list(pf.distributed_loader([batch])))


def scenario_bad_arguments():
    """Arguments that passed validation and failed later: each is refused where it is given, on
    every rank alike; then the same job balances and reduces normally."""
    rank, world = init()
    model = model_of()
    too_long = threading.TIMEOUT_MAX * 2
    attempts = {
        "all-reduce timeout": lambda: pf.GradientAllReduce(model, timeout=too_long),
        "parameter listed twice": lambda: pf.GradientAllReduce(list(model.parameters()) * 2),
        "loader timeout": lambda: pf.distributed_loader([[smp(rank, 4)]], timeout=too_long),
        "token_fields string": lambda: pf.distributed_loader([[smp(rank, 4)]], token_fields="input_ids"),
    }
    for what, attempt in attempts.items():
        try:
            attempt()
            result(what=what, refused=False)
        except (ValueError, TypeError) as e:
            result(what=what, refused=True, exc=type(e).__name__, msg=str(e))
    sync = pf.GradientAllReduce(model)
    step(model, sync, rank)
    seen = [
        int(i)
        for b in pf.distributed_loader([[smp(10 * rank + k, 3 + k) for k in range(2)]])
        for i in b["sample_ids"].tolist()
    ]
    sync.close()
    result(afterwards=all_ids(seen) == sorted(10 * r + k for r in range(world) for k in range(2)))


# ------------------------------------------------------------------ the balanced loader's contract


class ReusingLoader:
    """Batches whose samples are views of one buffer that the next batch overwrites (a fast
    pipeline's habit); ``sizes[epoch][rank]`` batches of 3 samples. Sample ``i`` holds the
    tokens ``i % 97 + 1``, ``3 + 7 * (i % 5)`` of them."""

    def __init__(self, rank, sizes):
        self.rank, self.sizes, self.epoch = rank, sizes, 0
        self.buf = np.zeros((3, 40), np.int64)

    def __len__(self):
        return self.sizes[self.epoch][self.rank]

    def __iter__(self):
        for s in range(len(self)):
            ids = [1000 * self.rank + 100 * self.epoch + 10 * s + k for k in range(3)]
            for k, i in enumerate(ids):
                self.buf[k] = i % 97 + 1
            yield [{"input_ids": self.buf[k, : 3 + 7 * (i % 5)], "sample_id": i} for k, i in enumerate(ids)]


def own_tokens(batch):
    """Whether every sample of a packed batch holds its own tokens."""
    cu, tok = batch["cu_seqlens_host"], batch["input_ids"].numpy()
    return all(
        len(tok[cu[j] : cu[j + 1]]) == 3 + 7 * (i % 5) and (tok[cu[j] : cu[j + 1]] == i % 97 + 1).all()
        for j, i in enumerate(batch["sample_ids"].tolist())
    )


def attempt(what, fn):
    t = time.monotonic()
    try:
        fn()
        result(what=what, refused=False)
    except Exception as e:  # noqa: BLE001 - what the test checks
        result(what=what, refused=True, exc=type(e).__name__, msg=str(e), after=round(time.monotonic() - t, 3))


def scenario_loader_contract():
    """A loader built before fleet.init is refused; so is a group over a subset of the ranks, on
    every rank. A loader reusing its buffer with 6 / 4 / 2 batches (then 3 / 5 / 1): len() is 6
    (then 5) on every rank, every rank receives that many batches, every sample with its own
    tokens. A rank whose loader has no len() makes len() a named error on every rank. close()
    releases the loader's group and refuses another epoch."""
    attempt("before fleet.init", lambda: pf.distributed_loader([[smp(0, 4)]]))
    rank, world = init()
    subset = dist.new_group([0, 1], backend="gloo")  # rank 2 is outside it
    attempt("subset group", lambda: pu.distributed.BalancedLoader([[smp(rank, 4)]], group=subset))
    loader = ReusingLoader(rank, [[6, 4, 2], [3, 5, 1]])
    bl = pf.distributed_loader(loader)
    built_len = len(bl)  # agreed when the loader was built
    for epoch in range(2):
        loader.epoch = epoch  # a sampler's set_epoch: the lengths change
        it = iter(bl)  # agreed again as the epoch starts
        lens, seen, mine, received = {len(bl)}, [], True, 0
        for batch in it:
            received += 1
            mine = mine and own_tokens(batch)
            seen += batch["sample_ids"].tolist()
            if rank == 0 and received == 1:
                lens.add(len(bl))  # len() on one rank only, mid-epoch
        want = sorted(
            1000 * r + 100 * epoch + 10 * s + k
            for r in range(world)
            for s in range(loader.sizes[epoch][r])
            for k in range(3)
        )
        result(
            what=f"epoch {epoch}", lens=sorted(lens), received=received, own_tokens=mine, complete=all_ids(seen) == want
        )
    result(what="built", len=built_len)
    unknown = pf.distributed_loader(iter([[smp(rank, 4)]]) if rank == 1 else [[smp(rank, 4)]])
    attempt("len unknown on rank 1", lambda: len(unknown))
    bl.close()
    result(what="closed", released=bool(getattr(bl.group, "released", False)))
    attempt("iterate after close", lambda: iter(bl))


# ------------------------------------------------------------------ group lifetime, sub-groups, settings


def open_files_and_threads():
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def scenario_groups_released(n):
    """``n`` balanced loaders and ``n`` all-reduces made, used (one step) and closed one after
    the other: the process's open files and threads stay where the first of each left them."""
    from paddle_unpad.distributed import groups

    rank, world = init()
    model = model_of()

    def one_of_each(i):
        loader = pf.distributed_loader([[smp(100 * i + 10 * rank, 3 + rank)]])
        got = [int(j) for b in loader for j in b["sample_ids"].tolist()]
        loader.close()
        sync = pf.GradientAllReduce(model)
        step(model, sync, rank)
        model.clear_gradients()
        sync.close()
        return sorted(got)

    one_of_each(0)
    before, created = open_files_and_threads(), len(groups.CREATED)
    t = time.monotonic()
    ok = all(len(one_of_each(i)) > 0 for i in range(1, n + 1))
    result(
        before=before,
        after=open_files_and_threads(),
        used=ok,
        created=len(groups.CREATED) - created,
        reused=groups.REUSED["count"],
        seconds=round(time.monotonic() - t, 2),
    )


def scenario_subgroup_then_all():
    """Every rank makes Paddle's group over ranks 0 and 1 (Paddle's rule); the all-reduce over it
    is built and stepped on its members only; then a balanced loader over all three ranks."""
    rank, world = init()
    pair = dist.new_group([0, 1], backend="gloo")
    model = model_of()
    if rank == 2:  # outside the pair: refused here by name, without waiting for anyone
        attempt("all-reduce over a group without this rank", lambda: pf.GradientAllReduce(model, group=pair))
    if rank in (0, 1):
        sync = pf.GradientAllReduce(model, group=pair, timeout=20.0)
        step(model, sync, rank)
        sync.close()
        again = pf.GradientAllReduce(model, group=pair, timeout=20.0)  # one more over the same pair
        step(model, again, rank)
        again.close()
    seen = reported(
        lambda: [
            int(i)
            for b in pf.distributed_loader([[smp(10 * rank + k, 3 + k) for k in range(2)]])
            for i in b["sample_ids"].tolist()
        ]
    )
    sync = pf.GradientAllReduce(model)  # and an all-reduce over every rank after it
    step(model, sync, rank)
    sync.close()
    result(complete=all_ids(seen) == sorted(10 * r + k for r in range(world) for k in range(2)))


def scenario_settings_differ():
    """The last rank switched the per-group stores off (one machine exporting it): every rank is
    told at pu.fleet.DistributedStrategy(), before fleet.init makes a group."""
    if int(os.environ["PADDLE_TRAINER_ID"]) == int(os.environ["PADDLE_TRAINERS_NUM"]) - 1:
        os.environ["PADDLE_UNPAD_GLOO_GROUP_STORES"] = "0"
    reported(pf.DistributedStrategy)
    result(built=True)


SCENARIOS = {
    "loader_contract": scenario_loader_contract,
    "peer_killed": lambda: scenario_peer_signal(signal.SIGKILL),
    "peer_stopped": lambda: scenario_peer_signal(signal.SIGSTOP),
    "fewer_or_no_batches": lambda: scenario_counts([4, 1, 0]),
    "models_differ": scenario_models_differ,
    "allreduce_twice": scenario_allreduce_twice,
    "allreduce_timeout": scenario_allreduce_timeout,
    "allreduce_peer_stopped": scenario_allreduce_peer_stopped,
    "skipped_step": scenario_skipped_step,
    "allreduce_misuse": scenario_allreduce_misuse,
    "allreduce_exception_before_wait": scenario_allreduce_exception_before_wait,
    "loader_timeout": scenario_loader_timeout,
    "break_and_del": scenario_break_and_del,
    "balance_on_one_rank_only": scenario_balance_on_one_rank_only,
    "missing_loader": scenario_missing_loader,
    "string_field": scenario_string_field,
    "bad_arguments": scenario_bad_arguments,
    "groups_released": lambda: scenario_groups_released(int(os.environ.get("N_OBJECTS", "100"))),
    "subgroup_then_all": scenario_subgroup_then_all,
    "settings_differ": scenario_settings_differ,
    "allreduce_model_changes": scenario_allreduce_model_changes,
    "late_sized_loader": scenario_late_sized_loader,
}

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    SCENARIOS[sys.argv[1]]()
    print("ALL OK", flush=True)

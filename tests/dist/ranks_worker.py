"""One rank of a fault scenario of the distributed layer on 3+ CPU ranks
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
    batches = [[smp(100 * s + 10 * rank + k, sentinel if (rank == last and s == 1 and k == 0) else 60 - 20 * rank + k)
                for k in range(3)] for s in range(4)]
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
            sync.wait()
            model.clear_gradients()

    reported(train)


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
    result(after_break=after_break, after_del_iterator=after_del_iterator, rest_of_epoch=n_more,
           after_epoch=after_epoch, in_flight_at_exit=exchange_threads(), exit_from=round(time.monotonic() - worker_util.T0, 3))


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
    attempts = {"all-reduce timeout": lambda: pf.GradientAllReduce(model, timeout=too_long),
                "parameter listed twice": lambda: pf.GradientAllReduce(list(model.parameters()) * 2),
                "loader timeout": lambda: pf.distributed_loader([[smp(rank, 4)]], timeout=too_long),
                "token_fields string": lambda: pf.distributed_loader([[smp(rank, 4)]], token_fields="input_ids")}
    for what, attempt in attempts.items():
        try:
            attempt()
            result(what=what, refused=False)
        except (ValueError, TypeError) as e:
            result(what=what, refused=True, exc=type(e).__name__, msg=str(e))
    sync = pf.GradientAllReduce(model)
    step(model, sync, rank)
    seen = [int(i) for b in pf.distributed_loader([[smp(10 * rank + k, 3 + k) for k in range(2)]])
            for i in b["sample_ids"].tolist()]
    sync.close()
    result(afterwards=all_ids(seen) == sorted(10 * r + k for r in range(world) for k in range(2)))


SCENARIOS = {
    "peer_killed": lambda: scenario_peer_signal(signal.SIGKILL),
    "peer_stopped": lambda: scenario_peer_signal(signal.SIGSTOP),
    "fewer_or_no_batches": lambda: scenario_counts([4, 1, 0]),
    "models_differ": scenario_models_differ,
    "allreduce_twice": scenario_allreduce_twice,
    "allreduce_timeout": scenario_allreduce_timeout,
    "allreduce_peer_stopped": scenario_allreduce_peer_stopped,
    "skipped_step": scenario_skipped_step,
    "loader_timeout": scenario_loader_timeout,
    "break_and_del": scenario_break_and_del,
    "balance_on_one_rank_only": scenario_balance_on_one_rank_only,
    "missing_loader": scenario_missing_loader,
    "string_field": scenario_string_field,
    "bad_arguments": scenario_bad_arguments,
}

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    SCENARIOS[sys.argv[1]]()
    print("ALL OK", flush=True)

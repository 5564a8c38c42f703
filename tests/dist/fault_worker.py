"""One rank of a fault-injection run of the sample exchange (tests/test_exchange_faults.py).

``fault_worker.py SCENARIO`` runs as rank ``PADDLE_TRAINER_ID`` of 2, started by the test
(directly, with the environment ``paddle.distributed.launch`` would give it, or by the
launcher).  It prints ``READY`` once the exchange's process groups exist, then one
``RESULT {json}`` line per observed outcome.  A scenario that expects a failure lets the
exception end the process, as a user's script would: the test checks the exit code, and
that nothing aborted on the way out.  Nothing here leaves through ``os._exit``.
"""

import atexit
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402

import paddle_unpad.fleet as pf  # noqa: E402
import worker_util  # noqa: E402  (tests/dist)
from worker_util import result  # noqa: E402
from paddle_unpad.data import sample_list_collate  # noqa: E402


def init(**configs):
    return worker_util.init({"timeout": 20.0, "close_timeout": 2.0, "check_plan": True}, configs)[0]


def run_loop(loader, expect_failure=True):
    """Iterate; report what came out; re-raise a failure so that it ends the process."""
    t = time.monotonic()
    seen = []
    try:
        for b in loader:
            seen.append(b["sample_ids"].tolist())
    except BaseException as e:
        result(exc=type(e).__name__, msg=str(e), after=round(time.monotonic() - t, 3))
        raise
    result(batches=seen, after=round(time.monotonic() - t, 3))
    if expect_failure:
        raise SystemExit("expected the exchange to fail, it did not")
    return seen


def smp(i, n, extra):
    return {"input_ids": np.ones(n, np.int64), "extra": extra, "sample_id": i}


# ------------------------------------------------------------------ mis-shaped samples
def scenario_shape_scalar_then_vector():
    """Rank 0: 4 samples with a scalar int64 `extra`; rank 1's last sample has `extra` [3]."""
    rank = init()
    if rank == 0:
        batch = [smp(k, 64, np.int64(k)) for k in range(4)]
    else:
        batch = [smp(4, 1, np.int64(4)), smp(5, 2, np.int64(5)), smp(6, 3, np.int64(6)), smp(7, 4, np.full(3, -5))]
    loader = pf.distributed_loader([batch])
    print("READY", flush=True)
    run_loop(loader)


def scenario_shape_vector_then_scalar():
    """The other way round: batches of `extra` [3], one sample with a scalar."""
    rank = init()
    if rank == 0:
        batch = [smp(k, 64, np.full(3, k)) for k in range(4)]
    else:
        batch = [smp(4, 1, np.full(3, 4)), smp(5, 2, np.full(3, 5)), smp(6, 3, np.full(3, 6)), smp(7, 4, np.int64(-5))]
    loader = pf.distributed_loader([batch])
    print("READY", flush=True)
    run_loop(loader)


def scenario_shape_token_tail_then_ranks():
    """A per-token field whose trailing shape differs inside a batch (caught, reported),
    then two ranks whose batches are each consistent but differ from each other."""
    rank = init()

    def tok(i, n, width):
        return {"input_ids": np.ones(n, np.int64), "labels": np.zeros((n, width), np.int64), "sample_id": i}

    if rank == 0:
        batch = [tok(k, 50, 2) for k in range(4)]
    else:
        batch = [tok(4, 1, 2), tok(5, 2, 2), tok(6, 3, 3)]
    loader = pf.distributed_loader([batch])
    print("READY", flush=True)
    try:
        run_loop(loader)
    except Exception:  # reported by run_loop; the group stays usable: go on
        pass
    if rank == 0:
        batch = [smp(k, 64, np.int64(k)) for k in range(3)]
    else:
        batch = [smp(4 + k, 1 + k, np.full(3, k)) for k in range(3)]
    run_loop(_reuse(loader, [batch]))


def _reuse(first, batches):
    """A second loader on the first one's process group (creating groups is the slow part)."""
    from paddle_unpad.distributed import BalancedLoader

    return BalancedLoader(
        batches, group=first.group, timeout=first.timeout, close_timeout=first.close_timeout, check_plan=True
    )


# ------------------------------------------------------------------ DataLoader and collate_fn
class Samples(paddle.io.Dataset):
    def __init__(self, n, seed=0):
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(1, 64, size=n)
        self.lengths[::3] = 64  # some long ones, so that balancing moves samples

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        s = int(self.lengths[i])
        return {"input_ids": np.full(s, i % 50 + 1, np.int64), "labels": np.int64(i % 2), "sample_id": np.int64(i)}


class RankBatches(paddle.io.BatchSampler):
    """Rank r's batches: contiguous chunks, so that rank 0 gets the long samples first."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def rank_batches(rank, n, per_rank, world=2):
    out = []
    for start in range(0, n, per_rank * world):
        ids = list(range(start + rank * per_rank, min(n, start + (rank + 1) * per_rank)))
        if ids:
            out.append(ids)
    return out


def scenario_num_workers():
    """paddle.io.DataLoader with num_workers=2, two epochs: every sample exactly once."""
    rank = init()
    n = 48
    ds = Samples(n, seed=3)
    batches = rank_batches(rank, n, per_rank=6)
    dl = paddle.io.DataLoader(ds, batch_sampler=RankBatches(batches), collate_fn=sample_list_collate, num_workers=2)
    loader = pf.distributed_loader(dl)
    print("READY", flush=True)
    for epoch in range(2):
        seen = run_loop(loader, expect_failure=False)
        all_seen = []
        dist.all_gather_object(all_seen, seen)
        flat = sorted(i for per_rank in all_seen for b in per_rank for i in b)
        mine = sorted(i for b in batches for i in b)
        moved = sum(1 for b in seen for i in b if i not in mine)
        result(epoch=epoch, complete=flat == list(range(n)), moved_in=moved)


def scenario_collate_raises(num_workers):
    """Rank 1's collate_fn raises at its second batch."""
    rank = init(timeout=60.0)
    n = 24
    ds = Samples(n, seed=5)

    def collate(samples):
        if rank == 1 and samples[0]["sample_id"] >= 12:
            raise ValueError("collate_fn failed on purpose")
        return sample_list_collate(samples)

    dl = paddle.io.DataLoader(
        ds, batch_sampler=RankBatches(rank_batches(rank, n, per_rank=6)), collate_fn=collate, num_workers=num_workers
    )
    loader = pf.distributed_loader(dl)
    print("READY", flush=True)
    run_loop(loader)


def scenario_clean_exit_order():
    """Two ranks finish cleanly; rank 1 then lingers 1.5 s in its exit (an exit handler that
    runs before the package's): rank 0 must still end after rank 1 (see
    paddle_unpad.distributed.groups.leave_in_order)."""
    rank = init()
    batches = [[smp(10 * rank + 2 * s + k, 3 + 5 * k + 7 * rank, np.int64(k)) for k in range(2)] for s in range(2)]
    loader = pf.distributed_loader(batches)
    print("READY", flush=True)
    seen = run_loop(loader, expect_failure=False)
    if rank == 1:
        atexit.register(time.sleep, 1.5)
    result(steps=len(seen))


def scenario_failed_exit_order():
    """Both ranks finish the exchange, then raise (a failed job); rank 1 lingers 1.5 s in its
    exit: rank 0 must still end after rank 1."""
    rank = init()
    batches = [[smp(10 * rank + 2 * s + k, 3 + 5 * k + 7 * rank, np.int64(k)) for k in range(2)] for s in range(2)]
    seen = run_loop(pf.distributed_loader(batches), expect_failure=False)
    result(steps=len(seen))
    if rank == 1:
        atexit.register(time.sleep, 1.5)
    raise RuntimeError(f"rank {rank} failed on purpose after the exchange")


SCENARIOS = {
    "shape_scalar_then_vector": scenario_shape_scalar_then_vector,
    "shape_vector_then_scalar": scenario_shape_vector_then_scalar,
    "shape_token_tail_then_ranks": scenario_shape_token_tail_then_ranks,
    "num_workers": scenario_num_workers,
    "collate_raises": lambda: scenario_collate_raises(0),
    "collate_raises_workers": lambda: scenario_collate_raises(2),
    "clean_exit_order": scenario_clean_exit_order,
    "failed_exit_order": scenario_failed_exit_order,
}

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    SCENARIOS[sys.argv[1]]()
    print("ALL OK", flush=True)

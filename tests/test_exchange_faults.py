"""Fault injection into the sample exchange: 2 CPU ranks (gloo), each run bounded (3 ranks,
dead and stopped peers, uneven batch counts: tests/test_distributed_faults.py).

Each test starts ``tests/dist/fault_worker.py SCENARIO`` as ranks 0 and 1 -- directly, with
the environment ``paddle.distributed.launch`` gives its workers (so that each rank's own
exit code and timing are seen), or through the launcher itself -- and checks what every
rank printed, how it exited and how long it took.  No rank may abort (SIGABRT,
"terminate called ...") or outlive its error.

Each launch runs once (the plugin gives every gloo group its own rendezvous store, see
tests/test_gloo_groups.py): a failed launch is a failure.
"""

import json
import os
import time

import pytest

from launch_util import launch_job
from rank_runner import ABORT_MARKS, assert_no_abort, one_failure
from rank_runner import run_ranks as _run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "dist", "fault_worker.py")

pytestmark = pytest.mark.dist


def run_ranks(scenario, bound=75.0, kill_after_exit_of=None):
    return _run_ranks(WORKER, [scenario], 2, bound=bound, kill_after_exit_of=kill_after_exit_of)


# ------------------------------------------------------------------ mis-shaped samples
@pytest.mark.parametrize("scenario", ["shape_scalar_then_vector", "shape_vector_then_scalar"])
def test_mis_shaped_field_fails_on_the_owner_and_reaches_the_peer(scenario):
    r0, r1 = run_ranks(scenario)
    assert_no_abort([r0, r1])
    own, peer = one_failure(r1), one_failure(r0)
    # the rank that owns the sample: a SampleError naming the sample index, its id and the field
    assert own["exc"] == "SampleError", r1
    assert "sample 3 (id 7) on rank 1: field 'extra'" in own["msg"], own
    # the peer: a named error carrying the owner's rank and message, no corrupted batch
    assert peer["exc"] == "ExchangeError", r0
    assert "rank 1 failed at step 0" in peer["msg"] and "field 'extra'" in peer["msg"], peer
    assert not any("batches" in r for r in r0.results + r1.results)
    for rk in (r0, r1):
        assert rk.rc == 1, rk
        assert rk.exit_s < 30, rk
    assert own["after"] < 5 and peer["after"] < 5, (own, peer)


def test_mis_shaped_per_token_field_and_ranks_with_different_layouts():
    r0, r1 = run_ranks("shape_token_tail_then_ranks")
    assert_no_abort([r0, r1])
    first0, second0 = [r for r in r0.results if "exc" in r]
    first1, second1 = [r for r in r1.results if "exc" in r]
    assert first1["exc"] == "SampleError" and "sample 2 (id 6) on rank 1: field 'labels'" in first1["msg"], r1
    assert "shape [s, 3]" in first1["msg"] and "shape [s, 2]" in first1["msg"], first1
    assert first0["exc"] == "ExchangeError" and "rank 1 failed" in first0["msg"], r0
    # each rank's batch is consistent, the two differ: every rank says how
    for res in (second0, second1):
        assert res["exc"] == "SampleError", res
        assert "field 'extra'" in res["msg"] and "rank 0" in res["msg"] and "rank 1" in res["msg"], res
    assert r0.rc == 1 and r1.rc == 1, (r0, r1)


# ------------------------------------------------------------------ DataLoader workers
def test_dataloader_with_workers_is_balanced_and_exits(tmp_path):
    t0 = time.monotonic()
    rc, out, logs = launch_job([WORKER, "num_workers"], 2, tmp_path / "log", 90)
    assert rc != "timeout", f"the launcher did not exit within 90 s: {out[-3000:]}"
    took = time.monotonic() - t0
    logs = list(logs.values())
    assert len(logs) == 2, (out[-3000:], logs)
    assert rc == 0, (out[-3000:], logs)
    for t in logs:
        for mark in ABORT_MARKS:
            assert mark not in t
        res = [json.loads(line.split("RESULT ", 1)[1]) for line in t.splitlines() if "RESULT " in line]
        epochs = [r for r in res if "epoch" in r]
        assert [r["epoch"] for r in epochs] == [0, 1], t[-3000:]
        assert all(r["complete"] for r in epochs), epochs
        assert "ALL OK" in t
    moved = [
        json.loads(line.split("RESULT ", 1)[1])["moved_in"]
        for t in logs
        for line in t.splitlines()
        if "RESULT " in line and "moved_in" in line
    ]
    assert sum(moved) > 0, moved
    assert took < 90


# ------------------------------------------------------------------ collate_fn raising
@pytest.mark.parametrize("scenario", ["collate_raises", "collate_raises_workers"])
def test_raising_collate_fn_names_rank_and_message_on_every_rank(scenario):
    r0, r1 = run_ranks(scenario)
    assert_no_abort([r0, r1])
    own, peer = one_failure(r1), one_failure(r0)
    assert "collate_fn failed on purpose" in own["msg"], r1
    assert peer["exc"] == "ExchangeError", r0
    # the step is the first one whose batch the loader could not deliver: with workers,
    # Paddle may give up on the batches before the failed one
    assert "rank 1 failed at step" in peer["msg"] and "collate_fn failed on purpose" in peer["msg"], peer
    for rk in (r0, r1):
        assert rk.rc != 0, rk
        assert rk.exit_s < 30, rk
    assert own["after"] < 10 and peer["after"] < 10, (own, peer)  # the exchange timeout is 60 s here


# ------------------------------------------------------------------ exit order
def test_rank_0_leaves_a_clean_job_after_its_peers():
    """Rank 0 hosts the job's TCP store, and a peer hanging up while rank 0 is in its C++
    teardown aborts rank 0 (Paddle 3.x, after the work is done): on a clean exit rank 0
    waits until its peers' processes are gone, even when a peer is slow to leave."""
    r0, r1 = run_ranks("clean_exit_order")
    assert_no_abort([r0, r1])
    assert r0.rc == 0 and r1.rc == 0, (r0, r1)
    assert [r["steps"] for r in r0.results if "steps" in r] == [2], r0
    assert r0.exit_s >= r1.exit_s, f"rank 0 ended at {r0.exit_s} s, before rank 1 ({r1.exit_s} s)"


def test_rank_0_leaves_a_failed_job_after_its_peers():
    """The same when every rank dies of an exception (they hang up together): each ends with
    its own error and exit code 1, nothing aborts, and rank 0 ends after the lingering rank 1."""
    r0, r1 = run_ranks("failed_exit_order")
    assert_no_abort([r0, r1])
    for rk in (r0, r1):
        assert rk.rc == 1 and f"rank {rk.rank} failed on purpose" in rk.out, rk
        assert [r["steps"] for r in rk.results if "steps" in r] == [2], rk
    assert r0.exit_s >= r1.exit_s, f"rank 0 ended at {r0.exit_s} s, before rank 1 ({r1.exit_s} s)"
    assert r0.exit_s < 20, r0  # the wait is bounded: 5 s for the count, then the peers' own exit

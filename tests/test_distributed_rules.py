"""Which backend and thread every collective of the plugin uses (docs/distributed.md, *Groups,
backends and threads*), recorded on 2 CPU ranks by tests/dist/rules_worker.py through
``paddle_unpad.distributed.groups.RECORDER`` -- the one place every collective passes.

* In a GPU job (the device check mocked; gloo stands in for NCCL): every device (NCCL)
  collective is issued by the training thread, in the same order on every rank; the
  all-reduce starts no thread; the sample exchange is all on a gloo host group, in its own
  thread; a device collective from any other thread is refused.
* In a CPU job: the all-reduce's collectives come from its communication thread, on gloo.
"""

import os

import pytest

from rank_runner import assert_no_abort, run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist", "rules_worker.py")

pytestmark = pytest.mark.dist


def _results(mode):
    ranks = run_ranks(WORKER, [mode], 2, bound=90)
    assert_no_abort(ranks)
    for rk in ranks:
        assert rk.rc == 0, rk
    return [rk.results[0] for rk in ranks]


def test_gpu_job_issues_every_nccl_collective_from_the_training_thread():
    for res in _results("gpu"):
        rec = res["record"]
        device = [r for r in rec if r["role"] == "device"]
        host = [r for r in rec if r["role"] == "host"]
        assert device and all(r["backend"] == "nccl" and r["thread"] == "MainThread" for r in device), device
        assert res["same_device_order_on_every_rank"], res
        exchange = [r for r in rec if r["purpose"] == "sample exchange"]
        assert exchange and all(
            r["backend"] == "gloo" and r["thread"].startswith("paddle_unpad-exchange") for r in exchange
        ), exchange
        # the all-reduce's host values (its step header) go over a gloo group of its own, from the training thread
        control = [r for r in host if r["purpose"] == "gradient all-reduce control"]
        assert control and all(r["backend"] == "gloo" and r["thread"] == "MainThread" for r in control), control
        assert "paddle_unpad-grad-allreduce" not in res["threads_after_training"], res["threads_after_training"]
        assert res["guard"] and "training thread" in res["guard"] and "NCCL" in res["guard"], res["guard"]


def test_cpu_job_reduces_on_a_gloo_group_from_its_communication_thread():
    for res in _results("cpu"):
        rec = res["record"]
        reduce_ops = [r for r in rec if r["purpose"] == "gradient all-reduce"]
        assert reduce_ops and all(
            r["backend"] == "gloo" and r["thread"] == "paddle_unpad-grad-allreduce" for r in reduce_ops
        ), reduce_ops
        assert not [r for r in rec if r["backend"] == "nccl"]
        assert all(r["thread"].startswith("paddle_unpad-exchange") for r in rec if r["purpose"] == "sample exchange")

"""paddle_unpad.fleet.GradientAllReduce: the same gradients as one dense all-reduce, fewer bytes,
arguments checked (a peer that stops: tests/test_distributed_faults.py).

The 2-rank runs (tests/dist/grad_sync_worker.py, each bounded by a timeout) compare every
gradient bit for bit with the plain flat all-reduce over several steps: a converted BERT
(overlapped or not, tables by rows or whole, tiny buckets), a masked-LM model whose decoder
is tied to the word embeddings (that table must be reduced whole), and a model with a
layer only one rank uses (the other rank has no gradient for it).
"""

import json
import os
import re

import numpy as np
import paddle
import pytest

import paddle_unpad as pu
from launch_util import launch_job

pytestmark = pytest.mark.paddle_gpu_stage

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist", "grad_sync_worker.py")
ABORT_MARKS = ("terminate called", "SIGABRT", "Aborted", "Segmentation fault")


def _launch(tmp_path, timeout=240):
    rc, out, logs = launch_job([WORKER], 2, tmp_path / "log", timeout)
    records = [json.loads(ln) for text in logs.values() for ln in text.splitlines() if ln.startswith("{")]
    return rc, out, logs, records


@pytest.mark.dist
def test_same_gradients_as_the_dense_all_reduce(tmp_path):
    rc, out, logs, records = _launch(tmp_path)
    assert rc == 0, out[-3000:] + "".join(t[-3000:] for t in logs.values())
    assert not any(m in t for t in logs.values() for m in ABORT_MARKS)
    done = {(r["rank"], r["kind"], json.dumps(r["kw"], sort_keys=True)): r for r in records if r.get("equal")}
    assert len(done) == 2 * 9, sorted(done)
    by = {(k, kw): r for (rank, k, kw), r in done.items() if rank == 0}

    def stats(kind, **kw):
        return by[(kind, json.dumps(kw, sort_keys=True))]["stats"]

    for s in (stats("cls", bucket_mb=0.01), stats("cls", bucket_mb=0.01, overlap=False)):
        # word (1 MiB) and position (32 KiB) tables by rows; token types (512 bytes) are packed
        assert s["tables_by_rows"] == 2 and s["last_bytes"] < s["dense_bytes"] / 2
        assert s["tables_unproven"] == 0  # the converted model looks its rows up through the layers
    assert stats("pretraining", bucket_mb=0.01)["tables_by_rows"] == 1  # the tied word table goes whole
    assert stats("cls", row_sparse_embeddings=False)["tables_by_rows"] == 0
    assert stats("branchy", bucket_mb=0.1)["tables_by_rows"] == 1
    for r in records:
        assert r["stats"]["steps"] == 3


def test_single_process_is_a_no_op_and_arguments_are_checked():
    lin = paddle.nn.Linear(4, 3)
    sync = pu.fleet.GradientAllReduce(lin)
    lin(paddle.ones([2, 4])).sum().backward()
    before = lin.weight.grad.numpy().copy()
    assert sync.wait() == 0.0
    np.testing.assert_array_equal(lin.weight.grad.numpy(), before)
    assert sync.wait(step=np.int64(3)) == 0.0
    for bad in (-1, True, 1.0, "1"):
        with pytest.raises(TypeError, match=r"wait: step must be a non-negative int.*got " + re.escape(repr(bad))):
            sync.wait(step=bad)
    for kw, word, error in (
        (dict(bucket_mb=0), "bucket_mb", ValueError),
        (dict(timeout=float("nan")), "timeout", ValueError),
        (dict(dense_fraction=1.5), "dense_fraction", ValueError),
        (dict(bucket_mb=True), "bucket_mb", TypeError),
    ):
        with pytest.raises(error, match=word):
            pu.fleet.GradientAllReduce(lin, **kw)
    frozen = paddle.nn.Linear(2, 2)
    for p in frozen.parameters():
        p.stop_gradient = True
    with pytest.raises(ValueError, match="no trainable parameters"):
        pu.fleet.GradientAllReduce(frozen)


def test_listed_twice_or_not_a_parameter_is_refused_by_name():
    lin = paddle.nn.Linear(4, 3)
    with pytest.raises(ValueError, match=rf"parameter '{lin.weight.name}' is listed twice \(items 0 and 2\)"):
        pu.fleet.GradientAllReduce([lin.weight, lin.bias, lin.weight])
    with pytest.raises(TypeError, match=r"item 1 is a str"):
        pu.fleet.GradientAllReduce([lin.weight, "bias"])


def test_one_live_all_reduce_per_parameter():
    from paddle_unpad.distributed import GradientSyncError

    lin = paddle.nn.Linear(4, 3)
    first = pu.fleet.GradientAllReduce(lin)
    with pytest.raises(GradientSyncError, match=rf"parameter '{lin.weight.name}' is already reduced by a live"):
        pu.fleet.GradientAllReduce(lin)
    first.close()
    second = pu.fleet.GradientAllReduce(lin)  # the first is closed: its parameters are free again
    second.close()
    second.close()  # idempotent
    with pytest.raises(GradientSyncError, match=r"wait\(\) after close\(\)"):
        second.wait()


@pytest.mark.parametrize(
    "kw,error,pattern",
    [
        (dict(timeout=1e12), ValueError, r"timeout .*at most threading.TIMEOUT_MAX.*got 1000000000000\.0"),
        (dict(overlap="yes"), TypeError, r"overlap must be True, False or None.*'yes'"),
        (dict(average=1), TypeError, r"average must be True or False, got 1"),
    ],
)
def test_all_reduce_options_name_the_key_and_value(kw, error, pattern):
    with pytest.raises(error, match=r"^paddle_unpad\.distributed\.GradientAllReduce: " + pattern):
        pu.fleet.GradientAllReduce(paddle.nn.Linear(2, 2), **kw)


def test_built_before_the_job_is_initialized_is_refused(monkeypatch):
    from paddle_unpad.distributed import GradientSyncError

    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "3")  # launched as one of 3 ranks, no fleet.init yet
    with pytest.raises(
        GradientSyncError,
        match=r"^paddle_unpad\.distributed\.GradientAllReduce: built before the "
        r"job was initialized: .* one of 3 ranks",
    ):
        pu.fleet.GradientAllReduce(paddle.nn.Linear(2, 2))


def test_a_sparse_embedding_is_refused_by_name():
    model = paddle.nn.Sequential(paddle.nn.Linear(2, 2), paddle.nn.Embedding(10, 2, sparse=True))
    with pytest.raises(
        ValueError,
        match=rf"sparse embedding \(layer '1', nn.Embedding\(sparse=True\), weight "
        rf"'{model[1].weight.name}'\).*sparse=False",
    ):
        pu.fleet.GradientAllReduce(model)
    model[1].weight.stop_gradient = True  # a frozen one is not reduced at all
    pu.fleet.GradientAllReduce(model).close()


def test_rows_proof_sees_any_row_outside_the_looked_up_ones():
    from paddle_unpad.distributed.grad_rows import _only_rows

    g = np.zeros((50, 6), np.float32)
    g[[3, 7]] = 1.0
    assert _only_rows(paddle.to_tensor(g), np.array([3, 7, 9]))
    for row, value in ((0, 1e-38), (49, -2.0), (20, float("nan"))):  # tiny, last, not a number
        bad = g.copy()
        bad[row, 5] = value
        assert not _only_rows(paddle.to_tensor(bad), np.array([3, 7, 9])), (row, value)
    odd = np.zeros((5, 3), np.float16)  # rows of 6 bytes
    odd[4, 2] = 1.0
    assert not _only_rows(paddle.to_tensor(odd), np.array([0, 1]))
    assert _only_rows(paddle.to_tensor(odd), np.array([4]))


def test_a_parameter_new_to_the_model_or_resized_is_noted_for_the_trailer():
    """What wait() notes for the step's trailer (which makes it the same error on every rank; on 2
    ranks: tests/test_distributed_faults.py): a trainable parameter of the model that it was not
    built with, or one whose shape changed -- by identity and shape, named by its attribute path."""
    model = paddle.nn.Sequential(paddle.nn.Linear(4, 3), paddle.nn.Linear(3, 2))
    sync = pu.fleet.GradientAllReduce(model)
    sync._check_trainable()
    assert sync._replaced == (0, "")
    model[1].weight.get_tensor().set(np.zeros((5, 2), np.float32), paddle.CPUPlace())  # resized in place
    sync._check_trainable()
    assert sync._replaced == (2, f"'1.weight' ({model[1].weight.name}: shape [3, 2] then, [5, 2] now)")
    sync._replaced = (0, "")
    model[1] = paddle.nn.Linear(3, 2)  # a new head
    sync._check_trainable()
    assert sync._replaced == (1, f"'1.weight' ({model[1].weight.name}, shape [3, 2])")
    for p in model[1].parameters():  # frozen, the new layer is not reduced and not wanted
        p.stop_gradient = True
    sync._replaced = (0, "")
    sync._check_trainable()
    assert sync._replaced == (0, "")
    sync.close()

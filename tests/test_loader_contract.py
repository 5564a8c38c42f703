"""The balanced loader's contract, in one process: what it keeps of the user's batches, what
``len()`` says, and the named errors of loaders it cannot use (Paddle's default collate, a
packed batch, a launched rank before ``fleet.init``, a closed loader). The same contract on 3
ranks: tests/test_distributed_faults.py (scenario ``loader_contract``)."""

import threading

import numpy as np
import paddle
import pytest

import paddle_unpad as pu
import paddle_unpad.fleet as pf
from paddle_unpad.distributed.source import Source

pytestmark = pytest.mark.paddle_gpu_stage


class ReusingLoader:
    """Yields batches whose samples are views of one buffer, overwritten for every batch (a
    fast pipeline's habit). Sample ``i`` holds the tokens ``i % 97 + 1``."""

    def __init__(self, n_batches, per_batch=3, width=8):
        self.n, self.per, self.width = n_batches, per_batch, width
        self.buf = np.zeros((per_batch, width), np.int64)

    def __len__(self):
        return self.n

    def __iter__(self):
        for b in range(self.n):
            ids = [b * self.per + k for k in range(self.per)]
            for k, i in enumerate(ids):
                self.buf[k] = i % 97 + 1
            yield [{"input_ids": self.buf[k, : 3 + k], "sample_id": i} for k, i in enumerate(ids)]


def test_a_taken_batch_shares_no_memory_with_the_loader():
    loader = ReusingLoader(3)
    src = Source(loader)
    taken = [src.take() for _ in range(3)]  # what the exchange holds while the loader goes on
    assert [kind for kind, _ in taken] == ["batch"] * 3
    for kind, batch in taken:
        for smp in batch:
            want = int(smp["sample_id"]) % 97 + 1
            assert not np.shares_memory(smp["input_ids"], loader.buf)
            assert smp["input_ids"].tolist() == [want] * len(smp["input_ids"]), (smp, want)
    padded = {"input_ids": loader.buf, "attention_mask": np.ones_like(loader.buf)}
    src = Source([padded])
    kind, got = src.take()
    loader.buf[:] = -1
    assert kind == "batch" and not np.shares_memory(got["input_ids"], loader.buf)
    assert int(got["input_ids"].min()) > 0


def test_len_is_the_loaders_and_named_when_unknown():
    assert len(pf.distributed_loader(ReusingLoader(5))) == 5
    dl = pf.distributed_loader(iter([[{"input_ids": np.ones(2, np.int64)}]]))
    with pytest.raises(
        TypeError,
        match=r"^paddle_unpad\.fleet\.distributed_loader: len\(\) is not known: the "
        r"loader has no len\(\)",
    ):
        len(dl)
    assert len(list(dl)) == 1  # list() asks len() for a hint: an unknown length does not stop it


class VariedLengths(paddle.io.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {"input_ids": np.full(2 + i, i + 1, np.int64), "sample_id": np.int64(i)}


def first_batch_within(loader, seconds=60.0):
    """``next(iter(loader))`` on a thread, bounded: (its exception, whether it returned)."""
    out = {}

    def run():
        try:
            out["batch"] = next(iter(loader))
        except BaseException as e:  # noqa: BLE001 - what the test checks
            out["exc"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"no batch and no error within {seconds} s"
    return out.get("exc")


def test_default_collate_is_a_named_error_not_a_hang():
    dl = paddle.io.DataLoader(VariedLengths(), batch_size=3, num_workers=0)  # Paddle's default collate_fn
    exc = first_batch_within(pf.distributed_loader(dl))
    assert isinstance(exc, ValueError), repr(exc)
    assert str(exc).startswith("paddle_unpad.fleet.distributed_loader: the DataLoader's default collate_fn failed")
    assert "collate_fn=pu.data.sample_list_collate" in str(exc)
    ok = paddle.io.DataLoader(VariedLengths(), batch_size=3, collate_fn=pu.data.sample_list_collate)
    assert first_batch_within(pf.distributed_loader(ok)) is None  # the fix named works


class Failing(VariedLengths):
    def __getitem__(self, i):
        raise KeyError(f"no sample {i} today")


def test_a_dataset_error_under_the_default_collate_stays_the_datasets():
    dl = paddle.io.DataLoader(Failing(), batch_size=3, num_workers=0)
    exc = first_batch_within(pf.distributed_loader(dl))
    assert isinstance(exc, KeyError) and "no sample 0 today" in str(exc), repr(exc)


def test_a_packing_collator_in_the_dataloader_names_the_fix():
    batches = [pu.data.PackingCollator(return_tensors="np")([VariedLengths()[i] for i in range(3)])]
    with pytest.raises(
        TypeError,
        match=r"^paddle_unpad\.data: the batch is already packed .*"
        r"collate_fn=pu\.data\.sample_list_collate",
    ):
        list(pf.distributed_loader(batches))
    with pytest.raises(
        TypeError,
        match=r"needs lists of samples.*collate_fn=pu\.data\.sample_list_collate.*keys "
        r"\['input_ids'\]",
    ):
        list(pf.distributed_loader([{"input_ids": np.ones((2, 3), np.int64)}]))


def test_a_launched_rank_before_fleet_init_is_refused(monkeypatch):
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "3")
    for build, name in (
        (lambda: pf.distributed_loader([]), "fleet.distributed_loader"),
        (lambda: pu.distributed.BalancedLoader([]), "distributed.BalancedLoader"),
    ):
        with pytest.raises(
            pf.ExchangeError,
            match=rf"^paddle_unpad\.{name}: built before the job was initialized.*"
            r"of 3 ranks.*call fleet\.init",
        ):
            build()


def test_a_closed_loader_refuses_another_epoch():
    dl = pf.distributed_loader(ReusingLoader(2))
    assert len(list(dl)) == 2
    dl.close()
    dl.close()  # idempotent
    with pytest.raises(ValueError, match=r"^paddle_unpad\.fleet\.distributed_loader: iterating a closed loader"):
        iter(dl)


def test_counts_of_the_wrong_length_are_refused_where_they_are_given(monkeypatch):
    """A list of counts needs one count per rank: refused where the number of ranks is known
    (before: at the first step's plan). In one process the counts are not used."""
    from paddle_unpad.balance.planner import check_counts
    from paddle_unpad.distributed import options

    assert check_counts([3, 5], ranks=2) == [3, 5] and check_counts("equal", ranks=2) == "equal"
    with pytest.raises(
        ValueError,
        match=r"^paddle_unpad\.balance\.plan: counts must hold one count per rank \(2 ranks "
        r"in this job\), got 1: \[4\]$",
    ):
        check_counts([4], ranks=2)
    with pytest.raises(
        ValueError,
        match=r"^paddle_unpad\.fleet\.distributed_loader: counts must hold one count per "
        r"rank \(3 ranks in this job\), got 2",
    ):
        options.check_counts_per_rank({"counts": [1, 2]}, "fleet.distributed_loader", 3)
    options.check_counts_per_rank({"counts": [1, 2]}, "fleet.distributed_loader", 1)  # one process: unused
    assert len(pf.distributed_loader(ReusingLoader(2), counts=[4])) == 2
    strategy = pf.DistributedStrategy()
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")  # launched as one of 2 ranks, before fleet.init
    with pytest.raises(
        ValueError,
        match=r"^paddle_unpad\.fleet\.DistributedStrategy: unpad_configs\['counts'\] must "
        r"hold one count per rank \(2 ranks in this job\), got 1: \[4\]$",
    ):
        strategy.unpad_configs = {"counts": [4]}
    strategy.unpad_configs = {"counts": [4, 4]}
    assert strategy.unpad_configs["counts"] == [4, 4]

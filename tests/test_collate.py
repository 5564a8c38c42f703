"""Packing collator (paddle_unpad.data)."""

import numpy as np
import paddle
import pytest

from paddle_unpad.data import PackingCollator, SampleError, check_lengths, normalize_batch, pack_samples

pytestmark = pytest.mark.paddle_gpu_stage


def _samples():
    return [
        {
            "input_ids": np.array([5, 6, 7]),
            "labels": np.array([1, 2, 3]),
            "sample_id": 11,
            "token_type_ids": np.array([0, 0, 1]),
        },
        {"input_ids": np.array([8]), "labels": np.array([4]), "sample_id": 12, "token_type_ids": np.array([1])},
        {
            "input_ids": np.array([9, 9]),
            "labels": np.array([5, 6]),
            "sample_id": 13,
            "token_type_ids": np.array([0, 1]),
        },
    ]


def test_packs_a_list_of_samples():
    b = PackingCollator(max_seqlen=8)(_samples())
    assert b["input_ids"].dtype == paddle.int64 and b["input_ids"].numpy().tolist() == [5, 6, 7, 8, 9, 9]
    assert b["cu_seqlens"].dtype == paddle.int32 and b["cu_seqlens"].numpy().tolist() == [0, 3, 4, 6]
    assert b["cu_seqlens_host"].dtype == np.int32 and b["cu_seqlens_host"].tolist() == [0, 3, 4, 6]
    assert isinstance(b["max_seqlen"], int) and b["max_seqlen"] == 3
    assert b["position_ids"].numpy().tolist() == [0, 1, 2, 0, 0, 1]
    assert b["token_type_ids"].numpy().tolist() == [0, 0, 1, 1, 0, 1]
    assert b["labels"].numpy().tolist() == [1, 2, 3, 4, 5, 6]
    assert b["sample_ids"].tolist() == [11, 12, 13]
    assert b["num_samples"] == 3 and b["global_num_samples"] == 3


def test_per_sample_fields_defaults_and_padded_input():
    smp = [
        {"input_ids": [3, 4], "labels": np.int64(1), "weight": np.float32(0.5)},
        {"input_ids": [7, 7, 7], "labels": np.int64(0), "weight": np.float32(2.0)},
    ]
    b = PackingCollator(return_tensors="np")(smp)
    assert b["labels"].tolist() == [1, 0]  # a 0-d label is per sample
    assert b["weight"].dtype == np.float32 and b["weight"].tolist() == [0.5, 2.0]
    assert b["token_type_ids"].tolist() == [0] * 5 and b["position_ids"].tolist() == [0, 1, 0, 1, 2]
    assert b["sample_ids"].tolist() == [0, 1]  # positional ids when the samples have none
    padded = {
        "input_ids": np.array([[3, 4, 0], [7, 7, 7]]),
        "attention_mask": np.array([[1, 1, 0], [1, 1, 1]]),
        "labels": np.array([[1, 2, -100], [3, 4, 5]]),
    }
    b = PackingCollator(return_tensors="np", token_fields=("input_ids", "labels"))(padded)
    assert b["input_ids"].tolist() == [3, 4, 7, 7, 7] and b["labels"].tolist() == [1, 2, 3, 4, 5]
    assert b["cu_seqlens_host"].tolist() == [0, 2, 5]


def test_errors_name_the_sample_and_rank():
    with pytest.raises(SampleError, match="sample id 12 on rank 3 has 5 tokens, more than max_seqlen=4"):
        PackingCollator(max_seqlen=4, rank=3)(
            [{"input_ids": [1], "sample_id": 11}, {"input_ids": [1] * 5, "sample_id": 12}]
        )
    with pytest.raises(SampleError, match="sample id 7 on rank 0 is empty"):
        PackingCollator()([{"input_ids": [], "sample_id": 7}])
    with pytest.raises(SampleError, match="per-token field 'labels'"):
        PackingCollator()([{"input_ids": [1, 2], "labels": [1, 2, 3], "sample_id": 7}])
    with pytest.raises(SampleError, match="no 'input_ids'"):
        normalize_batch([{"ids": [1]}])
    with pytest.raises(TypeError):
        normalize_batch(42)


def test_empty_batch_and_schema():
    b = pack_samples([], [], [], schema=(("input_ids", "t", "<i8", ()), ("labels", "s", "<i8", ())))
    assert b["input_ids"].shape == (0,) and b["labels"].shape == (0,)
    assert b["cu_seqlens_host"].tolist() == [0] and b["max_seqlen"] == 0


def test_usable_as_dataloader_collate_fn():
    class DS(paddle.io.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return _samples()[i]

    dl = paddle.io.DataLoader(DS(), batch_size=2, collate_fn=PackingCollator(max_seqlen=8))
    batches = list(dl)
    assert [b["sample_ids"].tolist() for b in batches] == [[11, 12], [13]]
    assert batches[0]["cu_seqlens_host"].tolist() == [0, 3, 4]


def test_mlm_labels_give_packed_masked_positions_on_the_host():
    from paddle_unpad.data import PackingCollator

    samples = [
        {"input_ids": np.arange(4), "mlm_labels": np.array([-1, 7, -1, 9])},
        {"input_ids": np.arange(3), "mlm_labels": np.array([-100, -1, -1])},
        {"input_ids": np.arange(2), "mlm_labels": np.array([5, -1])},
    ]
    b = PackingCollator(return_tensors="np")(samples)
    # rows 1 and 3 of sample 0; none of sample 1 (starts at row 4); row 0 of sample 2 (row 7)
    assert b["masked_positions"].tolist() == [1, 3, 7]
    assert b["masked_labels"].tolist() == [7, 9, 5]
    assert b["masked_positions"].dtype == np.int64
    pd = PackingCollator()(samples)
    assert pd["masked_positions"].numpy().tolist() == [1, 3, 7]


def test_sample_list_collate_survives_paddle_dataloader_with_python_lists():
    # tokenizers return lists; paddle's DataLoader silently yields nothing for raw lists
    import paddle

    from paddle_unpad.data import PackingCollator, sample_list_collate

    ds = [{"input_ids": list(range(1, n + 2)), "labels": n % 2} for n in range(5)]
    batches = list(paddle.io.DataLoader(ds, batch_size=2, collate_fn=sample_list_collate))
    assert len(batches) == 3
    packed = PackingCollator(return_tensors="np")(batches[0])
    assert packed["input_ids"].tolist() == [1, 1, 2]
    assert packed["labels"].tolist() == [0, 1]


def _pc(batch, **kw):
    return PackingCollator(return_tensors="np", **kw)(batch)


def test_every_sample_needs_the_batch_layout():
    """Errors name the sample's index in its batch, its id, the rank and the field."""
    ok = {"input_ids": np.array([1, 2]), "labels": np.int64(1)}
    # a field only a later sample has (was dropped without a word)
    with pytest.raises(SampleError, match=r"sample 1 \(id 9\) on rank 2 has a field 'weight' that sample 0"):
        PackingCollator(rank=2)([ok, dict(ok, weight=np.float32(1.0), sample_id=9)])
    # a field a later sample lacks (was a bare KeyError)
    with pytest.raises(SampleError, match=r"sample 2 \(id 2\) on rank 0 has no field 'labels'"):
        _pc([ok, ok, {"input_ids": np.array([3])}])
    # per-sample label in one sample, per-token labels in another (was numpy's shape error)
    with pytest.raises(SampleError, match=r"sample 1 \(id 1\).*field 'labels' is per-token.*per-sample"):
        _pc([ok, {"input_ids": np.array([1, 2]), "labels": np.array([0, 1])}])
    # same number of dimensions, different trailing shape / dtype
    with pytest.raises(SampleError, match=r"sample 1 \(id 1\).*field 'extra'.*shape \[3\].*shape \[2\]"):
        _pc([dict(ok, extra=np.zeros(2)), dict(ok, extra=np.zeros(3))])
    with pytest.raises(SampleError, match=r"field 'emb' is per-token, dtype float32, shape \[s, 4\].*\[s, 8\]"):
        _pc(
            [
                {"input_ids": np.array([1]), "emb": np.zeros((1, 8), np.float32)},
                {"input_ids": np.array([1, 2]), "emb": np.zeros((2, 4), np.float32)},
            ],
            token_fields=("input_ids", "emb"),
        )
    with pytest.raises(SampleError, match=r"field 'labels'.*dtype float64.*dtype int64"):
        _pc([ok, dict(ok, labels=np.float64(1.0))])


@pytest.mark.parametrize("field", ["input_ids", "token_type_ids", "position_ids", "mlm_labels"])
def test_index_fields_must_hold_integers(field):
    smp = {"input_ids": np.array([5, 6]), field: np.array([1.7, 2.2])}
    with pytest.raises(SampleError, match=rf"sample 0 \(id 0\) on rank 0: field '{field}' must hold integers.*float64"):
        _pc([smp])


@pytest.mark.parametrize(
    "bad, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError), ("512", TypeError)]
)
def test_max_seqlen_must_be_positive_or_none(bad, error):
    with pytest.raises(error, match=rf"max_seqlen must be a positive int or None.*{bad!r}"):
        PackingCollator(max_seqlen=bad)
    with pytest.raises(error, match=r"max_seqlen must be a positive int or None"):
        check_lengths([4, 5], [0, 1], 0, bad)


def test_no_length_limit_only_with_none():
    long = [{"input_ids": np.ones(5000, np.int64)}]
    assert _pc(long, max_seqlen=None)["max_seqlen"] == 5000
    with pytest.raises(SampleError, match="more than max_seqlen=4999"):
        _pc(long, max_seqlen=4999)


def test_positional_ids_count_per_call():
    """A sample without an id is named by its index in the call, in sample_ids and in errors,
    however many calls came before and whatever the rank; a sample's own id wins."""
    collate = PackingCollator(return_tensors="np", max_seqlen=4, rank=3)
    ok = [{"input_ids": [1, 2]}, {"input_ids": [3]}]
    for _ in range(3):
        assert collate(ok)["sample_ids"].tolist() == [0, 1]
    padded = {"input_ids": np.array([[3, 4, 0], [7, 7, 7]]), "attention_mask": np.array([[1, 1, 0], [1, 1, 1]])}
    assert collate(padded)["sample_ids"].tolist() == [0, 1]
    with pytest.raises(SampleError, match=r"^paddle_unpad.data: sample id 1 on rank 3 has 5 tokens"):
        collate([{"input_ids": [1]}, {"input_ids": [1] * 5}])
    with pytest.raises(SampleError, match=r"^paddle_unpad.data: sample id 12 on rank 3 has 5 tokens"):
        collate([{"input_ids": [1]}, {"input_ids": [1] * 5, "sample_id": 12}])
    with pytest.raises(SampleError, match=r"sample 1 \(id 1\) on rank 3 has no field 'labels'"):
        collate([{"input_ids": [1], "labels": np.int64(0)}, {"input_ids": [2]}])


@pytest.mark.parametrize(
    "key, value", [("sample_id", "abc"), ("sample_id", "7"), ("idx", 2.5), ("id", None), ("id", [1, 2])]
)
def test_id_fields_must_be_single_ints(key, value):
    with pytest.raises(
        SampleError,
        match=rf"^paddle_unpad.data: sample 1 on rank 0: id field '{key}' must be a "
        r"single int, got",
    ):
        _pc([{"input_ids": [1]}, {"input_ids": [2], key: value}])


def test_text_fields_are_named():
    batch = [{"input_ids": [1, 2], "text": "a b"}, {"input_ids": [3], "text": "c"}]
    with pytest.raises(
        SampleError,
        match=r"^paddle_unpad.data: sample 0 \(id 0\) on rank 0: field 'text' holds "
        r"text \(dtype <U3\)",
    ):
        PackingCollator()(batch)
    with pytest.raises(SampleError, match=r"sample 0 \(id 7\) on rank 0: field 'labels' holds text"):
        PackingCollator()([{"input_ids": [1], "label": "pos", "sample_id": 7}])
    assert _pc(batch)["text"].tolist() == ["a b", "c"]  # numpy batches keep them


def test_label_keys_become_labels():
    """As PaddleNLP's DataCollatorWithPadding: 'label' (per sample) and 'label_ids' (per token)
    reach the model as 'labels'; a sample with 'labels' too is refused, naming it."""
    from paddle_unpad.data import sample_list_collate

    b = _pc([{"input_ids": [1, 2], "label": 1}, {"input_ids": [3], "label": 0}])
    assert "label" not in b and b["labels"].tolist() == [1, 0]
    b = _pc([{"input_ids": [1, 2], "label_ids": [4, 5]}, {"input_ids": [3], "label_ids": [6]}])
    assert "label_ids" not in b and b["labels"].tolist() == [4, 5, 6]
    assert PackingCollator()([{"input_ids": [1], "label": 2}])["labels"].numpy().tolist() == [2]
    with pytest.raises(SampleError, match=r"^paddle_unpad.data: sample 1 on rank 0 has both 'labels' and 'label'"):
        _pc([{"input_ids": [1], "label": 1}, {"input_ids": [2], "label": 1, "labels": 0}])
    listed = sample_list_collate([{"input_ids": [1, 2], "label": 1}])
    assert set(listed[0]) == {"input_ids", "labels"} and listed[0]["labels"].tolist() == 1
    with pytest.raises(SampleError, match=r"sample 0 of the DataLoader batch has both 'labels' and 'label_ids'"):
        sample_list_collate([{"input_ids": [1], "label_ids": [1], "labels": [0]}])

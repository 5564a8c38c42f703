"""Packing collator (paddle_unpad.data)."""
import numpy as np
import paddle
import pytest

from paddle_unpad.data import PackingCollator, SampleError, pack_samples, normalize_batch


def _samples():
    return [
        {"input_ids": np.array([5, 6, 7]), "labels": np.array([1, 2, 3]), "sample_id": 11,
         "token_type_ids": np.array([0, 0, 1])},
        {"input_ids": np.array([8]), "labels": np.array([4]), "sample_id": 12,
         "token_type_ids": np.array([1])},
        {"input_ids": np.array([9, 9]), "labels": np.array([5, 6]), "sample_id": 13,
         "token_type_ids": np.array([0, 1])},
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
    smp = [{"input_ids": [3, 4], "labels": np.int64(1), "weight": np.float32(0.5)},
           {"input_ids": [7, 7, 7], "labels": np.int64(0), "weight": np.float32(2.0)}]
    b = PackingCollator(return_tensors="np")(smp)
    assert b["labels"].tolist() == [1, 0]  # a 0-d label is per sample
    assert b["weight"].dtype == np.float32 and b["weight"].tolist() == [0.5, 2.0]
    assert b["token_type_ids"].tolist() == [0] * 5 and b["position_ids"].tolist() == [0, 1, 0, 1, 2]
    assert b["sample_ids"].tolist() == [0, 1]  # positional ids when the samples have none
    padded = {"input_ids": np.array([[3, 4, 0], [7, 7, 7]]), "attention_mask": np.array([[1, 1, 0], [1, 1, 1]]),
              "labels": np.array([[1, 2, -100], [3, 4, 5]])}
    b = PackingCollator(return_tensors="np", token_fields=("input_ids", "labels"))(padded)
    assert b["input_ids"].tolist() == [3, 4, 7, 7, 7] and b["labels"].tolist() == [1, 2, 3, 4, 5]
    assert b["cu_seqlens_host"].tolist() == [0, 2, 5]


def test_errors_name_the_sample_and_rank():
    with pytest.raises(SampleError, match="sample id 12 on rank 3 has 5 tokens, more than max_seqlen=4"):
        PackingCollator(max_seqlen=4, rank=3)([{"input_ids": [1], "sample_id": 11},
                                               {"input_ids": [1] * 5, "sample_id": 12}])
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

"""Tests of paddle_unpad.varlen: unpad_input / pad_input / cu_seqlens helpers."""

import numpy as np
import paddle
import pytest

from paddle_unpad import cu_seqlens_from_lengths, pad_input, unpad_input
from paddle_unpad.varlen import check_cu_seqlens, check_no_empty_sequences, cu_seqlens_host
from testutil import empty_refused_here

pytestmark = pytest.mark.paddle_gpu_stage


def _mask_from_lengths(lengths, seqlen):
    return (np.arange(seqlen)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)


# ---------------------------------------------------------------- hand-checked indices


def test_lengths_4_3_6_by_hand():
    mask = _mask_from_lengths([4, 3, 6], 6)
    x = paddle.arange(3 * 6 * 2, dtype="float32").reshape([3, 6, 2])
    packed, indices, cu, max_seqlen = unpad_input(x, paddle.to_tensor(mask))
    assert indices.dtype == paddle.int64 and cu.dtype == paddle.int32
    assert indices.numpy().tolist() == [0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 15, 16, 17]
    assert cu.numpy().tolist() == [0, 4, 7, 13]
    assert max_seqlen == 6 and isinstance(max_seqlen, int)
    assert packed.shape == [13, 2]
    flat = np.arange(36, dtype=np.float32).reshape(18, 2)
    assert (packed.numpy() == flat[[0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 15, 16, 17]]).all()

    cu2, max2 = cu_seqlens_from_lengths([4, 3, 6])
    assert cu2.dtype == paddle.int32 and cu2.place.is_cpu_place()
    assert cu2.numpy().tolist() == [0, 4, 7, 13] and max2 == 6 and isinstance(max2, int)
    h = cu_seqlens_host([4, 3, 6])
    assert h.dtype == np.int32 and h.tolist() == [0, 4, 7, 13]


def test_not_left_aligned_by_hand():
    mask = np.array([[0, 1, 0, 1, 1, 0], [1, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0]], dtype=np.int32)
    x = paddle.arange(18, dtype="float32").reshape([3, 6])
    packed, indices, cu, max_seqlen = unpad_input(x, paddle.to_tensor(mask))
    assert indices.numpy().tolist() == [1, 3, 4, 6, 11]
    assert cu.numpy().tolist() == [0, 3, 5, 5]
    assert max_seqlen == 3
    assert packed.numpy().tolist() == [1.0, 3.0, 4.0, 6.0, 11.0]
    back = pad_input(packed, indices, 3, 6)
    assert (back.numpy() == np.arange(18, dtype=np.float32).reshape(3, 6) * mask).all()


@pytest.mark.parametrize("mask_dtype", ["bool", "int32", "int64", "float32", "float64", "uint8"])
def test_mask_dtypes(mask_dtype):
    mask = np.array([[1, 0, 1], [0, 1, 1]])
    x = paddle.to_tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    packed, indices, cu, m = unpad_input(x, paddle.to_tensor(mask.astype(mask_dtype)))
    assert indices.numpy().tolist() == [0, 2, 4, 5]
    assert cu.numpy().tolist() == [0, 2, 4] and m == 2
    assert packed.numpy().tolist() == [0.0, 2.0, 4.0, 5.0]


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("left_aligned", [True, False])
@pytest.mark.parametrize("trailing", [(), (5,), (3, 4)])
def test_round_trip(left_aligned, trailing, rng):
    B, S = 5, 9
    lengths = np.array([9, 0, 3, 1, 7])
    if left_aligned:
        mask = _mask_from_lengths(lengths, S)
    else:
        mask = np.stack([rng.permutation(_mask_from_lengths([n], S)[0]) for n in lengths])
    x = rng.standard_normal((B, S) + trailing).astype(np.float32)
    packed, indices, cu, max_seqlen = unpad_input(paddle.to_tensor(x), paddle.to_tensor(mask))
    assert packed.shape == [int(lengths.sum())] + list(trailing)
    assert cu.numpy().tolist() == [0] + np.cumsum(lengths).tolist()
    assert max_seqlen == int(lengths.max())
    assert indices.numpy().tolist() == np.flatnonzero(mask.reshape(-1)).tolist()
    back = pad_input(packed, indices, B, S).numpy()
    m = mask.reshape((B, S) + (1,) * len(trailing))
    assert back.shape == x.shape
    assert (back == x * m).all()


def test_round_trip_integer_tokens():
    ids = paddle.to_tensor(np.array([[101, 7, 102, 0], [101, 102, 0, 0]], dtype=np.int64))
    packed, indices, cu, m = unpad_input(ids, ids != 0)
    assert packed.dtype == paddle.int64
    assert packed.numpy().tolist() == [101, 7, 102, 101, 102]
    assert cu.numpy().tolist() == [0, 3, 5] and m == 3
    assert (pad_input(packed, indices, 2, 4).numpy() == ids.numpy()).all()


def test_pad_input_accepts_int32_indices():
    packed = paddle.to_tensor([[1.0, 2.0], [3.0, 4.0]])
    out = pad_input(packed, paddle.to_tensor([3, 0], dtype="int32"), 2, 2)
    assert out.numpy().tolist() == [[[3.0, 4.0], [0.0, 0.0]], [[0.0, 0.0], [1.0, 2.0]]]


# ---------------------------------------------------------------- empty cases


def test_zero_length_rows():
    mask = _mask_from_lengths([0, 2, 0, 0, 1], 3)
    x = paddle.arange(15, dtype="float32").reshape([5, 3])
    packed, indices, cu, m = unpad_input(x, paddle.to_tensor(mask))
    assert indices.numpy().tolist() == [3, 4, 12]
    assert cu.numpy().tolist() == [0, 0, 2, 2, 2, 3] and m == 2
    cu2, m2 = cu_seqlens_from_lengths([0, 2, 0, 0, 1])
    assert cu2.numpy().tolist() == [0, 0, 2, 2, 2, 3] and m2 == 2


def test_all_zero_mask():
    x = paddle.ones([3, 4, 2])
    packed, indices, cu, m = unpad_input(x, paddle.zeros([3, 4], dtype="int32"))
    assert packed.shape == [0, 2] and indices.shape == [0]
    assert cu.numpy().tolist() == [0, 0, 0, 0] and m == 0
    back = pad_input(packed, indices, 3, 4)
    assert back.shape == [3, 4, 2] and (back.numpy() == 0).all()


def test_empty_batch():
    x = paddle.ones([0, 4, 2])
    if not empty_refused_here(unpad_input, x, paddle.zeros([0, 4], dtype="int32")):
        _check_empty_batch(x)

    for empty in ([], (), np.zeros(0, dtype=np.int64)):
        cu, m = cu_seqlens_from_lengths(empty)
        assert cu.numpy().tolist() == [0] and cu.dtype == paddle.int32 and m == 0
        assert cu_seqlens_host(empty).tolist() == [0]


def _check_empty_batch(x):
    packed, indices, cu, m = unpad_input(x, paddle.zeros([0, 4], dtype="int32"))
    assert packed.shape == [0, 2] and indices.shape == [0]
    assert cu.numpy().tolist() == [0] and cu.dtype == paddle.int32 and m == 0
    assert pad_input(packed, indices, 0, 4).shape == [0, 4, 2]


def test_host_lengths_variants():
    for lengths in (
        [3, 1],
        (3, 1),
        np.array([3, 1], dtype=np.int32),
        np.array([3, 1], dtype=np.uint16),
        [np.int64(3), np.int32(1)],
        paddle.to_tensor([3, 1]),
    ):
        cu, m = cu_seqlens_from_lengths(lengths)
        assert cu.numpy().tolist() == [0, 3, 4] and m == 3 and isinstance(m, int)
    cu, _ = cu_seqlens_from_lengths([2, 2], place="cpu")
    assert cu.place.is_cpu_place()
    cu, _ = cu_seqlens_from_lengths([2, 2], place=paddle.CPUPlace())
    assert cu.place.is_cpu_place()


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("left_aligned", [True, False])
def test_unpad_gradient(left_aligned, rng):
    B, S, H = 4, 7, 3
    lengths = [7, 0, 2, 5]
    mask = _mask_from_lengths(lengths, S)
    if not left_aligned:
        mask = mask[:, ::-1].copy()
    x_np = rng.standard_normal((B, S, H)).astype(np.float64)
    x = paddle.to_tensor(x_np, stop_gradient=False)
    packed, indices, _, _ = unpad_input(x, paddle.to_tensor(mask))
    w = rng.standard_normal((int(sum(lengths)), H))
    (packed * paddle.to_tensor(w)).sum().backward()
    expected = np.zeros((B * S, H))
    expected[np.flatnonzero(mask.reshape(-1))] = w
    np.testing.assert_array_equal(x.grad.numpy(), expected.reshape(B, S, H))


@pytest.mark.parametrize("left_aligned", [True, False])
def test_pad_gradient(left_aligned, rng):
    B, S, H = 3, 5, 2
    lengths = [1, 5, 3]
    mask = _mask_from_lengths(lengths, S)
    if not left_aligned:
        mask = np.stack([rng.permutation(r) for r in mask])
    idx = np.flatnonzero(mask.reshape(-1))
    packed = paddle.to_tensor(rng.standard_normal((idx.size, H)), stop_gradient=False)
    out = pad_input(packed, paddle.to_tensor(idx), B, S)
    g = rng.standard_normal((B, S, H))
    (out * paddle.to_tensor(g)).sum().backward()
    np.testing.assert_array_equal(packed.grad.numpy(), g.reshape(B * S, H)[idx])


def test_round_trip_gradient(rng):
    """d/dx of sum(pad(unpad(x)) * g) is g * mask."""
    B, S = 3, 4
    mask = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]])
    x = paddle.to_tensor(rng.standard_normal((B, S, 2)), stop_gradient=False)
    packed, indices, _, _ = unpad_input(x, paddle.to_tensor(mask))
    g = rng.standard_normal((B, S, 2))
    (pad_input(packed, indices, B, S) * paddle.to_tensor(g)).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), g * mask[:, :, None])


# ---------------------------------------------------------------- errors name the argument


def test_unpad_errors():
    with pytest.raises(ValueError, match=r"x .*rank.*\[5\]"):
        unpad_input(paddle.ones([5]), paddle.ones([5, 1]))
    with pytest.raises(ValueError, match=r"attention_mask .*\[2, 3, 1\]"):
        unpad_input(paddle.ones([2, 3]), paddle.ones([2, 3, 1]))
    with pytest.raises(ValueError, match=r"attention_mask shape \[2, 4\].*x shape \[2, 3, 5\]"):
        unpad_input(paddle.ones([2, 3, 5]), paddle.ones([2, 4]))
    with pytest.raises(ValueError, match=r"attention_mask shape \[3, 3\]"):
        unpad_input(paddle.ones([2, 3, 5]), paddle.ones([3, 3]))
    with pytest.raises(TypeError, match="attention_mask"):
        unpad_input(paddle.ones([2, 3]), [[1, 1, 1], [1, 1, 1]])
    with pytest.raises(TypeError, match="x must be"):
        unpad_input(np.ones((2, 3)), paddle.ones([2, 3]))


def test_pad_errors():
    packed = paddle.ones([3, 2])
    idx = paddle.to_tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"indices has 2 entries but packed has 3"):
        pad_input(packed, paddle.to_tensor([0, 1]), 2, 2)
    with pytest.raises(ValueError, match=r"indices must be 1-D.*\[3, 1\]"):
        pad_input(packed, idx.reshape([3, 1]), 2, 2)
    with pytest.raises(TypeError, match=r"indices must be int64 or int32.*float32"):
        pad_input(packed, idx.astype("float32"), 2, 2)
    with pytest.raises(ValueError, match=r"batch_size .*-1"):
        pad_input(packed, idx, -1, 2)
    with pytest.raises(TypeError, match=r"seqlen .*2\.5"):
        pad_input(packed, idx, 2, 2.5)
    with pytest.raises(TypeError, match=r"batch_size .*True"):
        pad_input(packed, idx, True, 4)
    with pytest.raises(ValueError, match=r"packed has 3 rows, more than batch_size \* seqlen = 1 \* 2"):
        pad_input(packed, idx, 1, 2)


@pytest.mark.parametrize("dtype", ["int64", "int32"])
def test_pad_index_range_and_duplicates(dtype):
    """An index of -1 would wrap to the last row; a repeated one would overwrite a token."""
    packed = paddle.to_tensor(np.arange(6, dtype=np.float32).reshape(3, 2))
    cases = [
        ([0, 1, -1], r"indices\[2\] = -1 is out of range.*\[0, batch_size \* seqlen = 6\)"),
        ([0, 6, 1], r"indices\[1\] = 6 is out of range"),
        ([4, 1, 4], r"indices must be distinct, but indices\[0\] = indices\[2\] = 4"),
    ]
    for idx, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            pad_input(packed, paddle.to_tensor(np.array(idx, dtype=dtype)), 2, 3)
    out = pad_input(packed, paddle.to_tensor(np.array([5, 0, 3], dtype=dtype)), 2, 3).numpy().reshape(6, 2)
    np.testing.assert_array_equal(out[[5, 0, 3]], packed.numpy())
    np.testing.assert_array_equal(out[[1, 2, 4]], 0)


@pytest.mark.parametrize(
    "bad,error,pattern",
    [
        ([3, -1, 2], ValueError, r"lengths.*lengths\[1\] = -1"),
        (np.array([0, 0, -7]), ValueError, r"lengths.*lengths\[2\] = -7"),
        ([3, 2.5], TypeError, r"lengths.*lengths\[1\] = 2\.5"),
        ([3.0, 2.0], TypeError, r"lengths.*lengths\[0\] = 3\.0"),
        (np.array([1.0, 2.0]), TypeError, r"lengths.*float64"),
        ([True, False], TypeError, r"lengths.*lengths\[0\] = True"),
        (np.array([[1, 2], [3, 4]]), ValueError, r"lengths must be 1-D.*\[2, 2\]"),
        ([[1, 2], [3]], ValueError, r"lengths must be 1-D.*lengths\[0\] = \[1, 2\]"),
        (5, TypeError, r"lengths .*5"),
        ("123", TypeError, r"lengths .*'123'"),
        ([2**31, 1], ValueError, r"lengths\[0\] = 2147483648 is more than int32"),
        ([2**30, 2**30], ValueError, r"lengths sum to 2147483648"),
        # each fits int64, their sum wraps to 0: the check must not look at the wrapped sum
        ([2**62, 2**62], ValueError, r"lengths\[0\] = 4611686018427387904 is more than int32"),
        (np.array([1, 2**63 - 1], np.int64), ValueError, r"lengths\[1\] = 9223372036854775807 is more than int32"),
    ],
)
def test_lengths_errors(bad, error, pattern):
    with pytest.raises(error, match=r"^paddle_unpad\.cu_seqlens_from_lengths: " + pattern):
        cu_seqlens_from_lengths(bad)
    with pytest.raises(error, match=r"^paddle_unpad\.varlen\.cu_seqlens_host: " + pattern):
        cu_seqlens_host(bad)


def test_cu_seqlens_from_lengths_does_not_read_device():
    """A device tensor is refused (reading it would be a device-to-host sync)."""
    if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
        pytest.skip("no GPU: device tensors cannot be built here")
    with pytest.raises(ValueError, match="lengths"):
        cu_seqlens_from_lengths(paddle.to_tensor([1, 2], place=paddle.CUDAPlace(0)))


# ---------------------------------------------------------------- check_cu_seqlens


@pytest.mark.parametrize(
    "cu",
    [[0], [0, 0], [0, 3, 3, 7], np.array([0, 3, 7], np.int32), paddle.to_tensor(np.array([0, 3, 7], np.int32))],
    ids=["no_sequences", "one_empty", "with_empty", "numpy", "cpu_tensor"],
)
def test_check_cu_seqlens_accepts_and_returns_the_longest(cu):
    total = int(np.asarray(cu.numpy() if isinstance(cu, paddle.Tensor) else cu)[-1])
    longest = check_cu_seqlens(cu, total, 4)
    assert longest == (4 if total == 7 else 0) and isinstance(longest, int)


@pytest.mark.parametrize(
    "cu,total,max_seqlen,words",
    [
        ([[0, 2, 6]], 6, None, "cu_seqlens must be 1-D [batch + 1], got shape [1, 3]"),
        ([], 0, None, "cu_seqlens must have at least one element (0), got none"),
        ([2, 6], 6, None, "cu_seqlens[0] must be 0, got 2"),
        ([0, 4, 4, 2, 6], 6, None, "cu_seqlens must be non-decreasing, but cu_seqlens[3] = 2 < cu_seqlens[2] = 4"),
        ([0, 2, 5], 6, None, "cu_seqlens[-1] = 5 must equal the number of packed tokens q.shape[0] = 6"),
        ([0, 2, 6], 6, 3, "max_seqlen = 3 is smaller than the longest sequence in cu_seqlens (4)"),
    ],
    ids=["2d", "empty", "first", "decreasing", "last", "max_seqlen"],
)
def test_check_cu_seqlens_refusals(cu, total, max_seqlen, words):
    with pytest.raises(ValueError) as ei:
        check_cu_seqlens(np.asarray(cu, np.int32), total, max_seqlen)
    assert str(ei.value) == "paddle_unpad.ops.fmha: " + words
    # a caller names itself and the tensor that holds the tokens
    with pytest.raises(ValueError) as ei:
        check_cu_seqlens(np.asarray(cu, np.int32), total, max_seqlen, who="", tokens="len(x)")
    assert str(ei.value) == "paddle_unpad: " + words.replace("q.shape[0]", "len(x)")


@pytest.mark.parametrize("lengths, b", [([0, 3, 2], 0), ([3, 0, 2], 1), ([3, 2, 0], 2), ([0], 0), ([3, 0, 0], 1)])
def test_check_no_empty_sequences_names_the_first_empty_one(lengths, b):
    """Wherever it is: the first empty sequence, its index, the batch size and its offset."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    at = sum(lengths[:b])
    for form in (cu, np.array(cu, np.int32), cu_seqlens_from_lengths(lengths)[0]):
        with pytest.raises(
            ValueError,
            match=rf"^paddle_unpad: sequence {b} of {len(lengths)} is empty "
            rf"\(cu_seqlens\[{b}\] == cu_seqlens\[{b + 1}\] == {at}\): the pooler "
            r"needs at least the first \(\[CLS\]\) token",
        ):
            check_no_empty_sequences(form, "the pooler")


@pytest.mark.parametrize("cu", [[0], [0, 1], [0, 3, 4, 9]])
def test_check_no_empty_sequences_accepts_non_empty(cu):
    assert check_no_empty_sequences(np.array(cu, np.int32), "the pooler") is None

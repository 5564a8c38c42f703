"""fmha_qkvpacked: attention on the packed output of the QKV GEMM, its bias added in the kernel.

The native operator must give fmha's bits on q, k, v = unbind(qkv + bias) (output and the
gradient of qkv), the bias gradient must be the column sum of the qkv gradient, and the
plain-Paddle reference must agree within fmha's tolerance.
"""

import numpy as np
import paddle
import pytest

import paddle_unpad as pu
from paddle_unpad import ops
from paddle_unpad._runtime import native as _native

pytestmark = pytest.mark.paddle_gpu_stage

RTOL_MAX = ops.FMHA_TOLERANCE["float32"]
# ragged: empty and one-token sequences, odd sizes, the query (64) and key (128) tiles +-1
LENGTHS = [0, 1, 63, 64, 65, 3, 127, 128, 129, 0, 200]


def make(lengths, H, D, seed=0, bias=True):
    rng = np.random.default_rng(seed)
    T = int(sum(lengths))
    cu = paddle.to_tensor(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    qkv = rng.standard_normal((T, 3, H, D)).astype(np.float32)
    b = rng.standard_normal((3, H, D)).astype(np.float32) if bias else None
    g = rng.standard_normal((T, H, D)).astype(np.float32)
    return cu, qkv, b, g


def leaf(a):
    if a is None:
        return None
    t = paddle.to_tensor(a)
    t.stop_gradient = False
    return t


def run_packed(cu, mx, qkv, b, g, p, fn=None):
    fn = fn or pu.fmha_qkvpacked
    x, bt = leaf(qkv), leaf(b)
    out = fn(x, cu, mx, bias=bt, dropout=p, rng_state=(11, 3))
    grads = paddle.grad([out], [x] + ([bt] if bt is not None else []), grad_outputs=[paddle.to_tensor(g)])
    return [out.numpy()] + [t.numpy() for t in grads]


def run_split(cu, mx, qkv, b, g, p):
    """fmha on the split: the path fmha_qkvpacked replaces."""
    x, bt = leaf(qkv), leaf(b)
    q, k, v = paddle.unbind(x + bt if bt is not None else x, axis=1)
    out = pu.fmha(q, k, v, cu, mx, dropout=p, rng_state=(11, 3))
    grads = paddle.grad([out], [x] + ([bt] if bt is not None else []), grad_outputs=[paddle.to_tensor(g)])
    return [out.numpy()] + [t.numpy() for t in grads]


@pytest.mark.parametrize("D", [32, 64, 17])
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bitwise_fmha_on_the_split(native_ops, D, p, with_bias):
    cu, qkv, b, g = make(LENGTHS, 3, D, seed=D, bias=with_bias)
    mx = max(LENGTHS)
    packed, split = run_packed(cu, mx, qkv, b, g, p), run_split(cu, mx, qkv, b, g, p)
    np.testing.assert_array_equal(packed[0], split[0])  # out
    np.testing.assert_array_equal(packed[1], split[1])  # d qkv
    if with_bias:  # d bias = column sum of d qkv, in fixed chunks (float64 sum as the reference)
        want = packed[1].astype(np.float64).sum(axis=0)
        assert np.abs(packed[2] - want).max() <= 1e-5 * max(1.0, np.abs(want).max())
        assert np.abs(packed[2] - split[2]).max() <= 1e-5 * max(1.0, np.abs(split[2]).max())


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_against_the_reference(native_ops, p):
    lengths = [5, 0, 64, 129, 1]
    cu, qkv, b, g = make(lengths, 2, 32, seed=7)
    got = run_packed(cu, max(lengths), qkv, b, g, p)
    ref = run_packed(cu, max(lengths), qkv, b, g, p, fn=ops.fmha_qkvpacked_reference)
    for name, x, r in zip(("out", "dqkv", "dbias"), got, ref):
        err = np.abs(x - r).max()
        assert err <= RTOL_MAX * max(1.0, np.abs(r).max()), (name, err)


def test_reruns_bitwise_and_no_leak_between_sequences(native_ops):
    """A NaN in one sequence's q, k, v stays in that sequence: the others' outputs and
    gradients are unchanged, bit for bit, and so is a rerun."""
    lengths = [65, 1, 128, 7]
    cu, qkv, b, g = make(lengths, 2, 32, seed=3)
    first = run_packed(cu, 128, qkv, b, g, 0.1)
    again = run_packed(cu, 128, qkv, b, g, 0.1)
    for x, y in zip(first, again):
        np.testing.assert_array_equal(x, y)
    poisoned = qkv.copy()
    poisoned[65:66] = np.nan  # the one-token sequence
    got = run_packed(cu, 128, poisoned, b, g, 0.1)
    keep = np.r_[0:65, 66 : sum(lengths)]
    np.testing.assert_array_equal(got[0][keep], first[0][keep])
    np.testing.assert_array_equal(got[1][keep], first[1][keep])
    assert np.isnan(got[0][65]).all()


def test_without_the_native_operator_it_splits(native_ops, monkeypatch):
    lengths = [3, 9, 0, 4]
    cu, qkv, b, g = make(lengths, 2, 8, seed=5)
    want = run_split(cu, 9, qkv, b, g, 0.1)
    real = _native.has_op
    monkeypatch.setattr(_native, "has_op", lambda name: False if name == "pu_fmha_qkv" else real(name))
    got = run_packed(cu, 9, qkv, b, g, 0.1)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "qkv_shape, bias_shape, match",
    [
        (
            [10, 2, 4],
            None,
            r"^paddle_unpad\.ops\.fmha_qkvpacked: qkv must be 4-D \[total_tokens, 3, heads, head_dim\], got shape \[10, 2, 4\]",
        ),
        ([10, 2, 2, 4], None, r"^paddle_unpad\.ops\.fmha_qkvpacked: qkv must be 4-D .* got shape \[10, 2, 2, 4\]"),
        (
            [10, 3, 2, 4],
            [3, 2, 5],
            r"^paddle_unpad\.ops\.fmha_qkvpacked: bias must have shape \[3, heads, head_dim\] = "
            r"\[3, 2, 4\], got \[3, 2, 5\]",
        ),
    ],
)
def test_bad_shapes_are_named(qkv_shape, bias_shape, match):
    cu = paddle.to_tensor(np.array([0, 10], np.int32))
    bias = None if bias_shape is None else paddle.zeros(bias_shape)
    with pytest.raises(ValueError, match=match):
        pu.fmha_qkvpacked(paddle.zeros(qkv_shape), cu, 10, bias=bias)


def test_bad_bias_dtype_and_scalars_are_named():
    cu = paddle.to_tensor(np.array([0, 10], np.int32))
    with pytest.raises(
        TypeError,
        match=r"^paddle_unpad\.ops\.fmha_qkvpacked: bias dtype float64 differs from qkv dtype "
        r"float32",
    ):
        pu.fmha_qkvpacked(paddle.zeros([10, 3, 2, 4]), cu, 10, bias=paddle.zeros([3, 2, 4], dtype="float64"))
    with pytest.raises(ValueError, match=r"^paddle_unpad\.ops\.fmha_qkvpacked: dropout must be in \[0, 1\), got 1.5"):
        pu.fmha_qkvpacked(paddle.zeros([10, 3, 2, 4]), cu, 10, dropout=1.5)
    with pytest.raises(
        TypeError, match=r"^paddle_unpad\.ops\.fmha_qkvpacked: qkv must be a paddle.Tensor, got ndarray"
    ):
        pu.fmha_qkvpacked(np.zeros([10, 3, 2, 4], np.float32), cu, 10)


def test_bad_cu_seqlens_is_named_by_the_operator(native_ops):
    cu = paddle.to_tensor(np.array([0, 4, 3], np.int32))  # not monotone
    with pytest.raises(ValueError, match=r"^paddle_unpad\.ops\.fmha_qkvpacked: cu_seqlens"):
        pu.fmha_qkvpacked(paddle.zeros([3, 3, 2, 8]), cu, 4)

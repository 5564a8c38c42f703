"""tests/amp_emulation.py, the CPU stand-in for Paddle's GPU AMP that test_gpu_rules.py trusts,
against the rules of Paddle's AMP as its documentation and lists state them (the op lists
are read from paddle.amp.amp_lists, the expected dtypes below from those rules), and the
half-precision compute against float32 math rounded once."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import amp_emulation
from amp_emulation import emulated_amp


def _t(shape, dtype="float32", seed=0):
    x = paddle.to_tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)
    x.stop_gradient = False
    return x


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_o1_white_list_runs_half_black_list_float32_others_promote(dtype):
    x, w = _t([4, 8]), _t([8, 8], seed=1)
    half = getattr(paddle, dtype)
    with emulated_amp(), paddle.amp.auto_cast(level="O1", dtype=dtype):
        y = paddle.matmul(x, w)  # white list
        assert y.dtype == half
        assert (y + x).dtype == paddle.float32  # gray, a float32 input: promoted
        assert F.gelu(y).dtype == half  # gray, only half inputs
        assert F.layer_norm(y, [8]).dtype == paddle.float32  # black list in O1
        assert F.softmax(y).dtype == paddle.float32  # black list
        assert F.linear(x, w).dtype == half  # the GEMM of a linear layer
        loss = F.cross_entropy(y, paddle.to_tensor([0, 1, 2, 3]))
        assert loss.dtype == paddle.float32
    loss.backward()
    assert x.grad.dtype == paddle.float32 and w.grad.dtype == paddle.float32  # through the casts


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_o2_casts_all_but_its_black_list_and_norms_follow_x(dtype):
    half = getattr(paddle, dtype)
    x16, ln_w = _t([4, 8]).astype(dtype), _t([8], seed=2)
    table = _t([10, 8], seed=3).astype(dtype)
    with emulated_amp():
        with paddle.amp.auto_cast(level="O2", dtype=dtype):
            assert F.layer_norm(x16, [8], weight=ln_w).dtype == half  # decides by x only
            assert F.embedding(paddle.to_tensor([1, 2]), table).dtype == paddle.float32  # O2 black list
            assert (x16 + _t([4, 8])).dtype == paddle.float32  # promotion is on by default
        with paddle.amp.auto_cast(level="O2", dtype=dtype, use_promote=False):
            assert (x16 + _t([4, 8])).dtype == half


def test_decorate_o2_keeps_layer_norm_float32_for_float16_only():
    for dtype, ln_dtype in (("float16", paddle.float32), ("bfloat16", paddle.bfloat16)):
        m = paddle.nn.Sequential(paddle.nn.Linear(8, 8), paddle.nn.LayerNorm(8))
        with emulated_amp():
            m = paddle.amp.decorate(models=m, level="O2", dtype=dtype)
        assert m[0].weight.dtype == getattr(paddle, dtype)
        assert m[1].weight.dtype == ln_dtype


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_ops_compute_in_float32_and_round_once(dtype):
    x, w = _t([5, 16]).astype(dtype), _t([16, 3], seed=4).astype(dtype)
    with emulated_amp():
        y = paddle.matmul(x, w)
        z = F.gelu(x)
    exact = paddle.matmul(x.astype("float32"), w.astype("float32")).astype(dtype)
    np.testing.assert_array_equal(y.astype("float32").numpy(), exact.astype("float32").numpy())
    np.testing.assert_array_equal(
        z.astype("float32").numpy(), F.gelu(x.astype("float32")).astype(dtype).astype("float32").numpy()
    )


def test_in_place_ops_write_back_and_grad_scaler_unscales():
    g = _t([6]).astype("float16")
    before = g.astype("float32").numpy()
    with emulated_amp():
        g.scale_(0.5)
        found = paddle.to_tensor(np.array([False]))
        amp_emulation.check_finite_and_unscale([g], paddle.to_tensor([4.0]), [g], found)
    np.testing.assert_allclose(g.astype("float32").numpy(), before * 0.125, rtol=1e-3)
    assert not bool(found.numpy()[0])
    bad = paddle.to_tensor(np.array([1.0, np.inf], np.float32)).astype("float16")
    with emulated_amp():
        amp_emulation.check_finite_and_unscale([bad], paddle.to_tensor([2.0]), [bad], found)
    assert bool(found.numpy()[0])


def test_everything_is_restored_on_exit():
    matmul, add = paddle._C_ops.matmul, paddle.Tensor.__add__
    with emulated_amp():
        assert paddle._C_ops.matmul is not matmul
    assert paddle._C_ops.matmul is matmul and paddle.Tensor.__add__ is add
    with pytest.warns(UserWarning, match="CUDAPlace"):  # a CPU: Paddle's AMP is off again
        with paddle.amp.auto_cast(level="O1"):
            assert paddle.matmul(_t([2, 2]), _t([2, 2])).dtype == paddle.float32

"""paddle_unpad.ops.bucketed_attention: the plain-Paddle attention fmha runs where no kernel fits
(float32 on a GPU, head sizes the CUDA kernel lacks), against the float64 reference of
tests/test_fmha.py, on the CPU (the same Paddle ops run on a GPU)."""

import math

import numpy as np
import paddle
import pytest

import philox_ref
from paddle_unpad import ops
from paddle_unpad._runtime import warn as _warn
from paddle_unpad.ops.bucketed_attention import bucket_plan, bucketed_attention
from test_fmha import GRID, OFFSET, SEED, assert_close, cu_seqlens_host, grid_case, make_inputs, reference

pytestmark = pytest.mark.paddle_gpu_stage


def _run(q, k, v, cu, max_seqlen, dout=None, p=0.0, rng=(SEED, OFFSET), scale=None):
    tq, tk, tv = (paddle.to_tensor(a, stop_gradient=dout is None) for a in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    rng_t = None if rng is None else paddle.to_tensor(list(rng), dtype="int64")
    out = bucketed_attention(tq, tk, tv, paddle.to_tensor(cu, dtype="int32"), max_seqlen, p, scale, rng_t)
    if dout is None:
        return (out.numpy(),)
    out.backward(paddle.to_tensor(dout))
    return out.numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


# The fmha grid (lengths 0, 1, odd, 63/64/65, 127/128/129, 511/512/513, 1000; head sizes 1..256;
# dropout with the Philox mask through rng_state), minus the slowest long cases.
CASES = [c for c in GRID if not c.startswith("long_")]


@pytest.mark.parametrize("case", CASES)
def test_matches_the_float64_reference(case):
    (q, k, v, dout, cu, max_seqlen), ref = grid_case(case)
    _, _, _, p, scale, _ = GRID[case]
    got = _run(q, k, v, cu, max_seqlen, dout, p=p, scale=scale)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert_close(f"{case}/{name}", g, r)


def test_buckets_pad_each_group_to_its_own_longest():
    lengths = [0, 1, 16, 17, 32, 33, 100, 129, 0, 7]
    plan = bucket_plan(cu_seqlens_host(lengths).astype(np.int64))
    got = [(sorted(np.asarray(lengths)[seqs].tolist()), L) for seqs, L in plan]
    assert got == [([129], 129), ([100], 100), ([33], 33), ([17, 32], 32), ([1, 7, 16], 16)]
    assert bucket_plan(np.array([0, 0, 0])) == []


def test_nan_in_one_sequence_stays_there():
    lengths, H, D = [5, 9, 0, 4, 20], 2, 32  # 5 and 4 share a bucket (padded to 5) with the NaN one
    q, k, v, dout, cu = make_inputs(lengths, H, D, seed=5)
    ref = reference(q, k, v, cu, 1.0 / math.sqrt(D), 0.0, None, dout)
    for a in (q, k, v):
        a[5:14] = np.nan  # sequence 1
    got = _run(q, k, v, cu, 20, dout)
    rows = np.r_[0:5, 14:38]
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert_close(name, g[rows], r[rows])


def test_reruns_are_bitwise_identical_and_empty_batches_work():
    q, k, v, dout, cu = make_inputs([33, 200, 0, 64, 1], 3, 64, seed=8)
    a, b = _run(q, k, v, cu, 200, dout, p=0.1), _run(q, k, v, cu, 200, dout, p=0.1)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()
    q0 = np.zeros((0, 2, 8), np.float32)
    assert _run(q0, q0, q0, cu_seqlens_host([0, 0]), 0)[0].shape == (0, 2, 8)


def test_without_rng_state_dropout_is_paddles_and_rescaled():
    """Paddle's own dropout (the stock model's) unless the Philox stream is given: with q = k = 0
    and v = 1 every output is the mean of 1 / (1 - p) over the kept probabilities of its row."""
    lengths, H, D, p = [300, 200], 2, 8, 0.25
    cu = cu_seqlens_host(lengths)
    T = int(cu[-1])
    zeros, ones = np.zeros((T, H, D), np.float32), np.ones((T, H, D), np.float32)
    paddle.seed(3)
    out = _run(zeros, zeros, ones, cu, 300, p=p, rng=None)[0]
    assert abs(out.mean() - 1.0) < 0.01, out.mean()  # unbiased: kept values are scaled by 1/(1-p)
    keep = philox_ref.dropout_keep_mask(SEED, OFFSET, p, cu, H)
    philox = _run(zeros, zeros, ones, cu, 300, p=p)[0]
    expect = np.concatenate([(keep[b].sum(-1) / ((1 - p) * s)).T for b, s in enumerate(lengths)])  # [T, H]
    np.testing.assert_allclose(philox[:, :, 0], expect, rtol=1e-5)
    assert not np.allclose(out, philox)


def test_fmha_takes_this_path_off_the_cpu_without_a_kernel(monkeypatch):
    """pu.fmha on a (mocked) GPU in float32: no kernel call, this path, one warning naming AMP."""
    q, k, v, dout, cu = make_inputs([7, 0, 40], 2, 32, seed=2)
    ref = reference(q, k, v, cu, 1.0 / math.sqrt(32), 0.0, None, dout)
    monkeypatch.setattr(ops._call, "on_cpu", lambda t: False)
    monkeypatch.setattr(ops._native, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(ops._call, "call_native", lambda *a: pytest.fail(f"a kernel was called: {a[0]}"))
    monkeypatch.setattr(_warn, "_shown", set())
    tq, tk, tv = (paddle.to_tensor(a, stop_gradient=False) for a in (q, k, v))
    with pytest.warns(
        RuntimeWarning,
        match=r"fmha: the CUDA kernel takes float16 and bfloat16, not float32 "
        r"\(AMP.*is the fast path\)",
    ):
        out = ops.fmha(tq, tk, tv, paddle.to_tensor(cu), 40)
    out.backward(paddle.to_tensor(dout))
    for name, g, r in zip(
        ("out", "dq", "dk", "dv"), (out.numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()), ref
    ):
        assert_close(name, g, r)

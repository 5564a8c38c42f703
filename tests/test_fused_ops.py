"""Tests of the fused encoder ops: paddle_unpad.ops.bias_gelu and
paddle_unpad.ops.bias_dropout_residual_layer_norm (native op when loaded), and their
plain-Paddle ``*_reference`` twins.

Everything is checked against the test's own float64 numpy reference with analytic
gradients; the dropout keep mask comes from tests/philox_ref.py's Philox in the row-wise
counter layout (counter = (j // 4, row, 0xffffffff, offset), word j % 4).
"""

import functools
import hashlib
import math
import os
import re
import subprocess
import sys

import numpy as np
import paddle
import pytest

import paddle_unpad
from paddle_unpad import ops

import philox_ref
import testutil
from testutil import cpu_flags, empty_refused_here, run_benchmark

pytestmark = pytest.mark.paddle_gpu_stage

RTOL_MAX = ops.FUSED_OPS_TOLERANCE["float32"]  # max abs error <= RTOL_MAX * max abs of the reference (per tensor)
SEED, OFFSET = 2**40 + 4321, 11  # a seed with both key words non-zero
EPS = 1e-12  # PaddleNLP BERT's layer_norm_eps

TOKENS = [0, 1, 7, 4096]
HIDDEN = [32, 384, 768, 1024]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def fused_native():
    """Skip locally / fail in CI when the native fused ops are not loaded."""
    return testutil.require_native(
        paddle_unpad.ops_available(), ("bias_gelu", "bias_dropout_residual_layer_norm"), "fused"
    )


def _impl(name, request, op):
    if name == "native":
        request.getfixturevalue("fused_native")
        return getattr(ops, op)
    return getattr(ops, op + "_reference")


# ------------------------------------------------------------------------- references


def erf64(u):
    """float64 erf (Paddle's CPU erf kernel is std::erf)."""
    return paddle.erf(paddle.to_tensor(np.asarray(u, dtype=np.float64))).numpy()


def gelu_reference(x, bias, dy):
    """float64 gelu(x + bias) and its gradients: y, dx, dbias."""
    u = np.asarray(x, np.float64) + np.asarray(bias, np.float64)
    cdf = 0.5 * (1.0 + erf64(u / math.sqrt(2.0)))
    y = u * cdf
    dx = np.asarray(dy, np.float64) * (cdf + u * np.exp(-0.5 * u * u) / math.sqrt(2.0 * math.pi))
    return y, dx, dx.reshape(-1, u.shape[-1]).sum(axis=0)


def ln_reference(x, bias, res, w, b, dy, p, keep, eps=EPS):
    """float64 y, dx, dbias, dresidual, dln_weight, dln_bias of the fused LayerNorm block."""
    x, bias, res, w, b, dy = (np.asarray(a, np.float64) for a in (x, bias, res, w, b, dy))
    F = x.shape[-1]
    x, res, dy = (a.reshape(-1, F) for a in (x, res, dy))
    m = keep.reshape(-1, F) / (1.0 - p) if keep is not None else 1.0
    z = res + (x + bias) * m
    mu = z.mean(axis=-1, keepdims=True)
    var = ((z - mu) ** 2).mean(axis=-1, keepdims=True)
    rs = 1.0 / np.sqrt(var + eps)
    xh = (z - mu) * rs
    y = xh * w + b
    g = dy * w
    dz = rs * (g - g.mean(axis=-1, keepdims=True) - xh * (g * xh).mean(axis=-1, keepdims=True))
    dx = dz * m
    return y, dx, dx.sum(axis=0), dz, (dy * xh).sum(axis=0), dy.sum(axis=0)


def assert_close(name, got, ref, rtol_max=RTOL_MAX):
    testutil.assert_close(name, got, ref, rtol_max)


# ------------------------------------------------------------------------- inputs


@functools.lru_cache(maxsize=2)
def gelu_inputs(T, F, seed=0):
    rng = np.random.default_rng(seed + 7 * T + F)
    x = rng.standard_normal((T, F), dtype=np.float32) * np.float32(2.5)
    if T:  # the tails and the middle of gelu in every case
        x[0, : min(F, 64)] = np.linspace(-13.0, 13.0, min(F, 64), dtype=np.float32)
    bias = (rng.standard_normal(F) * 0.5).astype(np.float32)
    dy = rng.standard_normal((T, F), dtype=np.float32)
    return x, bias, dy


@functools.lru_cache(maxsize=1)
def gelu_grid_case(T, F):
    x, bias, dy = gelu_inputs(T, F)
    return (x, bias, dy), gelu_reference(x, bias, dy)


@functools.lru_cache(maxsize=8)
def ln_inputs(T, F, seed=0):
    rng = np.random.default_rng(seed + 13 * T + F)
    x = rng.standard_normal((T, F)).astype(np.float32)
    bias = (rng.standard_normal(F) * 0.2).astype(np.float32)
    res = (rng.standard_normal((T, F)) * 1.5 + 0.5).astype(np.float32)
    w = (1.0 + rng.standard_normal(F) * 0.2).astype(np.float32)
    b = (rng.standard_normal(F) * 0.2).astype(np.float32)
    dy = rng.standard_normal((T, F)).astype(np.float32)
    return x, bias, res, w, b, dy


@functools.lru_cache(maxsize=2)
def keep_mask(T, F, p):
    return philox_ref.rowwise_keep(SEED, OFFSET, p, T, F) if p > 0 else None


def run_gelu(fn, x, bias, dy=None):
    tx = paddle.to_tensor(x, stop_gradient=dy is None)
    tb = paddle.to_tensor(bias, stop_gradient=dy is None)
    y = fn(tx, tb)
    assert y.dtype == paddle.float32 and list(y.shape) == list(x.shape)
    if dy is None:
        return y.numpy()
    y.backward(paddle.to_tensor(dy))
    return y.numpy(), tx.grad.numpy(), tb.grad.numpy()


def run_ln(fn, x, bias, res, w, b, dy=None, p=0.0, **kw):
    ts = [paddle.to_tensor(a, stop_gradient=dy is None) for a in (x, bias, res, w, b)]
    kw.setdefault("rng_state", (SEED, OFFSET))
    y = fn(*ts, dropout=p, epsilon=kw.pop("epsilon", EPS), **kw)
    assert y.dtype == paddle.float32 and list(y.shape) == list(x.shape)
    if dy is None:
        return y.numpy()
    y.backward(paddle.to_tensor(dy))
    tx, tbias, tres, tw, tb = ts
    return y.numpy(), tx.grad.numpy(), tbias.grad.numpy(), tres.grad.numpy(), tw.grad.numpy(), tb.grad.numpy()


LN_NAMES = ("y", "dx", "dbias", "dresidual", "dln_weight", "dln_bias")


# ------------------------------------------------------------------------- the grid


# The plain-Paddle reference is checked on all but the two largest cases (keeps the file fast).
GELU_GRID = [
    (T, h, impl)
    for T in TOKENS
    for h in HIDDEN
    for impl in ("native", "reference")
    if impl == "native" or T * h <= 4096 * 384
]


@pytest.mark.parametrize("T,hidden,impl", GELU_GRID)
def test_bias_gelu_grid(T, hidden, impl, request):
    """F = 4 * hidden (the FFN's intermediate size)."""
    fn = _impl(impl, request, "bias_gelu")
    F = 4 * hidden
    (x, bias, dy), ref = gelu_grid_case(T, F)
    if T == 0 and empty_refused_here(run_gelu, fn, x, bias, dy):
        return
    got = run_gelu(fn, x, bias, dy)
    for name, g, r in zip(("y", "dx", "dbias"), got, ref):
        assert_close(f"T={T}/F={F}/{impl}/{name}", g, r)
    if T == 0:
        assert (got[2] == 0).all()


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("T", TOKENS)
def test_bias_dropout_residual_layer_norm_grid(T, hidden, p, impl, request):
    fn = _impl(impl, request, "bias_dropout_residual_layer_norm")
    x, bias, res, w, b, dy = ln_inputs(T, hidden)
    ref = ln_reference(x, bias, res, w, b, dy, p, keep_mask(T, hidden, p))
    if T == 0 and empty_refused_here(run_ln, fn, x, bias, res, w, b, dy, p=p):
        return
    got = run_ln(fn, x, bias, res, w, b, dy, p=p)
    for name, g, r in zip(LN_NAMES, got, ref):
        assert_close(f"T={T}/hidden={hidden}/p={p}/{impl}/{name}", g, r)
    if T == 0:
        for g in got[2:3] + got[4:]:
            assert g.shape == (hidden,) and (g == 0).all()


# Vector tails, single columns, other ranks: shapes the grid does not reach.
ODD = [((5, 1), 0.0), ((3, 7), 0.1), ((9, 33), 0.1), ((70, 100), 0.0), ((2, 3, 257), 0.1), ((300, 17), 0.3)]


@pytest.mark.parametrize("shape,p", ODD, ids=[f"{'x'.join(map(str, s))}-p{p}" for s, p in ODD])
def test_odd_shapes(shape, p, fused_native):
    rng = np.random.default_rng(len(shape) + shape[-1])
    F = shape[-1]
    x, res, dy = (rng.standard_normal(shape).astype(np.float32) * 2 for _ in range(3))
    bias, w, b = (rng.standard_normal(F).astype(np.float32) for _ in range(3))
    got = run_gelu(ops.bias_gelu, x, bias, dy)
    for name, g, r in zip(("y", "dx", "dbias"), got, gelu_reference(x, bias, dy)):
        assert_close(f"gelu {shape}/{name}", g, r)
    rows = int(np.prod(shape[:-1]))
    keep = philox_ref.rowwise_keep(SEED, OFFSET, p, rows, F) if p > 0 else None
    ref = ln_reference(x, bias, res, w, b, dy, p, keep)
    got = run_ln(ops.bias_dropout_residual_layer_norm, x, bias, res, w, b, dy, p=p)
    for name, g, r in zip(LN_NAMES, got, ref):
        assert_close(f"ln {shape}/{name}", g.reshape(r.shape), r)


def test_ops_available_lists_fused_ops():
    avail = paddle_unpad.ops_available()
    for op in ("bias_gelu", "bias_dropout_residual_layer_norm"):
        assert isinstance(avail[op]["cpu"], bool) and isinstance(avail[op]["gpu"], bool)


# ------------------------------------------------------------------------- agreement with Paddle


def test_matches_paddle_transformer_encoder_layer(fused_native):
    """A post-LN, erf-GELU nn.TransformerEncoderLayer (what PaddleNLP BERT uses), rebuilt from
    the attention sub-layer, matmuls and the two fused ops, gives the layer's output."""
    paddle.seed(3)
    H, heads, B, S = 64, 4, 3, 11
    layer = paddle.nn.TransformerEncoderLayer(
        H, heads, 4 * H, dropout=0.0, activation="gelu", attn_dropout=0.0, act_dropout=0.0, normalize_before=False
    )
    layer.norm1._epsilon = layer.norm2._epsilon = EPS
    layer.eval()
    src = paddle.to_tensor(np.random.default_rng(0).standard_normal((B, S, H)).astype(np.float32))
    want = layer(src).numpy()
    attn = layer.self_attn(src, src, src)  # includes out_proj's bias
    ob = layer.self_attn.out_proj.bias
    h1 = ops.bias_dropout_residual_layer_norm(
        attn - ob, ob, src, layer.norm1.weight, layer.norm1.bias, epsilon=layer.norm1._epsilon
    )
    h = ops.bias_gelu(paddle.matmul(h1, layer.linear1.weight), layer.linear1.bias)
    out = ops.bias_dropout_residual_layer_norm(
        paddle.matmul(h, layer.linear2.weight),
        layer.linear2.bias,
        h1,
        layer.norm2.weight,
        layer.norm2.bias,
        epsilon=layer.norm2._epsilon,
    )
    assert_close("layer rebuilt from the fused ops", out.numpy(), want)
    # and the single block against paddle's own layer_norm
    x, bias, res, w, b, _ = ln_inputs(7, 384)
    tx, tbias, tres, tw, tb = (paddle.to_tensor(a) for a in (x, bias, res, w, b))
    ref = paddle.nn.functional.layer_norm(tres + tx + tbias, [384], weight=tw, bias=tb, epsilon=EPS)
    got = ops.bias_dropout_residual_layer_norm(tx, tbias, tres, tw, tb)
    assert_close("bdrln vs layer_norm", got.numpy(), ref.numpy())
    assert_close("bias_gelu vs gelu", ops.bias_gelu(tx, tbias).numpy(), paddle.nn.functional.gelu(tx + tbias).numpy())


def test_none_vectors_and_training_false(fused_native):
    x, bias, res, w, b, dy = ln_inputs(7, 96)
    ones, zeros = np.ones(96, np.float32), np.zeros(96, np.float32)
    tx, tres = paddle.to_tensor(x), paddle.to_tensor(res)
    got = ops.bias_dropout_residual_layer_norm(tx, None, tres, None, None, dropout=0.5, training=False)
    assert_close(
        "None vectors, training=False", got.numpy(), ln_reference(x, zeros, res, ones, zeros, dy, 0.0, None)[0]
    )
    assert_close("bias_gelu(x, None)", ops.bias_gelu(tx, None).numpy(), gelu_reference(x, zeros, dy)[0])


# ------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_mask_layout_exact(impl, p, request):
    """dx = dz * keep / (1 - p): its zeros show the kernel's keep mask, which must be exactly the
    row-wise Philox layout, and the dropped fraction must be ~p."""
    fn = _impl(impl, request, "bias_dropout_residual_layer_norm")
    shape = (3, 50, 131)  # rows flatten the leading dimensions; 131 % 4 != 0
    rows, F = 150, 131
    x, bias, res, w, b, dy = (a.reshape(shape) if a.ndim == 2 else a for a in ln_inputs(rows, F, seed=5))
    got = run_ln(fn, x, bias, res, w, b, dy, p=p)
    kept = got[1].reshape(rows, F) != 0
    want = philox_ref.rowwise_keep(SEED, OFFSET, p, rows, F)
    mism = np.argwhere(kept != want)
    assert mism.size == 0, (
        f"{len(mism)} of {want.size} keep-mask elements differ, first [row, col] = {mism[:5].tolist()}"
    )
    np.testing.assert_array_equal(want, paddle_unpad.ops.philox.rowwise_keep_mask(SEED, OFFSET, p, rows, F))
    frac = 1.0 - kept.mean()
    assert abs(frac - p) < 5 * math.sqrt(p * (1 - p) / kept.size), (frac, p)


def test_dropout_stream_differs_from_attention_stream():
    """Counter word 2 = 0xffffffff: never one of fmha's heads, so no counter is shared."""
    rows, F = 64, 64
    rw = philox_ref.rowwise_keep(SEED, OFFSET, 0.5, rows, F)
    att = philox_ref.dropout_keep_mask(SEED, OFFSET, 0.5, [0, rows], 1)[0][0]  # head 0, [rows, rows]
    assert rw.shape == att.shape and not np.array_equal(rw, att)


def test_paddle_seed_reproducible_and_fresh(fused_native):
    x, bias, res, w, b, dy = ln_inputs(33, 64)
    fn = ops.bias_dropout_residual_layer_norm
    runs = []
    for _ in range(2):
        paddle.seed(1234)
        runs.append(run_ln(fn, x, bias, res, w, b, dy, p=0.1, rng_state=None))
    for a, c in zip(runs[0], runs[1]):
        assert a.tobytes() == c.tobytes()
    paddle.seed(1234)
    first = run_ln(fn, x, bias, res, w, b, p=0.1, rng_state=None)
    second = run_ln(fn, x, bias, res, w, b, p=0.1, rng_state=None)
    assert not np.array_equal(first, second), "two calls after one paddle.seed used the same mask"
    no_drop = run_ln(fn, x, bias, res, w, b, p=0.0)
    assert not np.array_equal(first, no_drop)


def test_rng_state_tensor_accepted(fused_native):
    x, bias, res, w, b, dy = ln_inputs(7, 40)
    a = run_ln(ops.bias_dropout_residual_layer_norm, x, bias, res, w, b, p=0.2)
    state = paddle.to_tensor([SEED, OFFSET], dtype="int64", place=paddle.CPUPlace())
    c = run_ln(ops.bias_dropout_residual_layer_norm, x, bias, res, w, b, p=0.2, rng_state=state)
    assert a.tobytes() == c.tobytes()


# ------------------------------------------------------------------------- memory safety


def _poison_allocator(nbytes):
    """Hand NaN-filled blocks back to Paddle's allocator, so that outputs the kernels forget
    to write (or scratch they read before writing) come up NaN."""
    blocks = [paddle.full([max(1, nbytes // 4)], float("nan"), dtype="float32") for _ in range(8)]
    del blocks


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_nan_around_inputs_is_never_read(p, fused_native):
    """Every input is a view into a NaN-filled buffer (extra rows before/after, extra columns;
    vectors are slices of NaN buffers): nothing of it may reach the outputs, and no gradient
    may leak outside the views."""
    T, F, pad = 37, 100, 5
    x, bias, res, w, b, dy = ln_inputs(T, F, seed=3)
    gx, gbias, gdy = gelu_inputs(T, F, seed=3)
    keep = philox_ref.rowwise_keep(SEED, OFFSET, p, T, F) if p > 0 else None

    def matrix(a):
        buf = np.full((pad + T + pad, F + 7), np.nan, dtype=np.float32)
        buf[pad : pad + T, :F] = a
        tb = paddle.to_tensor(buf, stop_gradient=False)
        return tb, tb[pad : pad + T, :F]

    def vector(a):
        buf = np.full(F + 2 * pad, np.nan, dtype=np.float32)
        buf[pad : pad + F] = a
        tb = paddle.to_tensor(buf, stop_gradient=False)
        return tb, tb[pad : pad + F]

    _poison_allocator(4 * (T + 2 * pad) * (F + 7) * 4)
    bufs, views = zip(matrix(x), vector(bias), matrix(res), vector(w), vector(b))
    y = ops.bias_dropout_residual_layer_norm(*views, dropout=p, epsilon=EPS, rng_state=(SEED, OFFSET))
    y.backward(paddle.to_tensor(dy))
    ref = ln_reference(x, bias, res, w, b, dy, p, keep)
    assert_close("y", y.numpy(), ref[0])
    grads = {"x": ref[1], "bias": ref[2], "residual": ref[3], "ln_weight": ref[4], "ln_bias": ref[5]}
    for (name, r), tb in zip(grads.items(), bufs):
        g = tb.grad.numpy()
        inside = g[pad : pad + T, :F] if g.ndim == 2 else g[pad : pad + F]
        assert_close(f"d{name}", inside, r)
        outside = g.copy()
        if g.ndim == 2:
            outside[pad : pad + T, :F] = 0.0
        else:
            outside[pad : pad + F] = 0.0
        assert (outside == 0.0).all(), f"d{name}: gradient leaked outside the view"

    _poison_allocator(4 * (T + 2 * pad) * (F + 7) * 4)
    (bx, vx), (bb, vb) = matrix(gx), vector(gbias)
    yg = ops.bias_gelu(vx, vb)
    yg.backward(paddle.to_tensor(gdy))
    ref = gelu_reference(gx, gbias, gdy)
    assert_close("gelu y", yg.numpy(), ref[0])
    assert_close("gelu dx", bx.grad.numpy()[pad : pad + T, :F], ref[1])
    assert_close("gelu dbias", bb.grad.numpy()[pad : pad + F], ref[2])
    assert np.count_nonzero(bx.grad.numpy()) == np.count_nonzero(bx.grad.numpy()[pad : pad + T, :F])


def test_nan_row_stays_in_its_row(fused_native):
    """A NaN in one row of x poisons only that row's outputs and row gradients."""
    T, F = 20, 96
    x, bias, res, w, b, dy = ln_inputs(T, F, seed=4)
    x = x.copy()
    x[6, 50] = np.nan
    ref = ln_reference(np.nan_to_num(x), bias, res, w, b, dy, 0.1, philox_ref.rowwise_keep(SEED, OFFSET, 0.1, T, F))
    got = run_ln(ops.bias_dropout_residual_layer_norm, x, bias, res, w, b, dy, p=0.1)
    others = np.r_[0:6, 7:T]
    for name, g, r in zip(("y", "dx"), (got[0], got[1]), (ref[0], ref[1])):
        assert_close(name, g[others], r[others])
    assert np.isnan(got[0][6]).all()
    gy, gdx, _ = run_gelu(ops.bias_gelu, x, bias, dy)
    gref = gelu_reference(np.nan_to_num(x), bias, dy)
    bad = np.zeros_like(x, dtype=bool)
    bad[6, 50] = True
    assert np.isnan(gy[bad]).all() and np.isfinite(gy[~bad]).all()
    assert_close("gelu y", np.where(bad, 0, gy), np.where(bad, 0, gref[0]))


def test_constant_row_gives_ln_bias(fused_native):
    """Zero variance: y = ln_bias exactly (xhat = 0), no NaN from the rsqrt."""
    x = np.zeros((3, 64), np.float32)
    res = np.full((3, 64), 2.5, np.float32)
    _, bias, _, w, b, _ = ln_inputs(3, 64)
    y = run_ln(ops.bias_dropout_residual_layer_norm, x, np.zeros(64, np.float32), res, w, b)
    np.testing.assert_array_equal(y, np.broadcast_to(b, y.shape))


# ------------------------------------------------------------------------- determinism


def _digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _all_results():
    """Outputs and gradients of both ops on shapes with several reduction chunks."""
    out = []
    for T, F in ((600, 384), (1000, 1024), (301, 33)):
        out += run_gelu(ops.bias_gelu, *gelu_inputs(T, 4 * F))
        out += run_ln(ops.bias_dropout_residual_layer_norm, *ln_inputs(T, F), p=0.1)
        out += run_ln(ops.bias_dropout_residual_layer_norm, *ln_inputs(T, F), p=0.0)
    # > 256 * 32768 elements: the chunk count is capped (chunks grow with the rows instead)
    out += run_ln(ops.bias_dropout_residual_layer_norm, *ln_inputs(1100, 8192), p=0.1)
    return out


def test_many_chunks_accuracy(fused_native):
    """The shape above, where reduction chunks hold more rows than the default, is accurate."""
    T, F = 1100, 8192
    x, bias, res, w, b, dy = ln_inputs(T, F)
    ref = ln_reference(x, bias, res, w, b, dy, 0.0, None)
    got = run_ln(ops.bias_dropout_residual_layer_norm, x, bias, res, w, b, dy, p=0.0)
    for name, g, r in zip(LN_NAMES, got, ref):
        assert_close(f"{name}", g, r)


def test_repeat_is_bitwise_identical(fused_native):
    assert _digest(_all_results()) == _digest(_all_results())


_CHILD = (
    "import sys; sys.path[:0] = [{tests!r}, {root!r}]\n"
    "import test_fused_ops as t\n"
    "print('DIGEST', t._digest(t._all_results()))\n"
)


def _child_digest(env_extra):
    env = dict(os.environ, **env_extra)
    code = _CHILD.format(tests=os.path.join(ROOT, "tests"), root=ROOT)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("DIGEST")]
    assert line, r.stdout[-2000:]
    return line[-1].split()[1]


def test_thread_count_independent(fused_native):
    """PADDLE_UNPAD_NUM_THREADS=1, 2 and 3 (separate processes: the pool is sized once) give
    bitwise-identical outputs and gradients, equal to this process's."""
    if os.environ.get("PU_TEST_VARIANT_CHILD"):
        pytest.skip("already inside a variant run")
    here = _digest(_all_results())
    for n in ("1", "2", "3"):
        assert _child_digest({"PADDLE_UNPAD_NUM_THREADS": n}) == here, f"PADDLE_UNPAD_NUM_THREADS={n}"


def fused_isa():
    """The ISA the fused kernels dispatched to in this process."""
    import ctypes

    from paddle_unpad._runtime import native as _native

    lib = ctypes.CDLL(_native.info()["path"])
    lib.paddle_unpad_fused_cpu_isa.restype = ctypes.c_char_p
    return lib.paddle_unpad_fused_cpu_isa().decode()


def test_fused_isa_in_use(fused_native):
    want = os.environ.get("PADDLE_UNPAD_CPU_ISA")
    got = fused_isa()
    assert got in ("avx512", "avx2", "sse2")
    if want:
        assert got == want
    elif {"avx512f", "avx512vl", "avx512dq", "avx512bw"} <= cpu_flags():
        assert got == "avx512"


_VARIANT_TESTS = (
    "fused_isa_in_use or (grid and native and not 4096) or odd_shapes or mask_layout or nan or constant_row"
)


@pytest.mark.parametrize("isa", ["avx2", "sse2"])
def test_isa_variants(isa, fused_native):
    """The narrower kernels (forced with PADDLE_UNPAD_CPU_ISA) pass the same checks."""
    if isa == "avx2" and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2+FMA")
    if os.environ.get("PU_TEST_VARIANT_CHILD"):
        pytest.skip("already inside a variant run")
    env = dict(os.environ, PU_TEST_VARIANT_CHILD="1", PADDLE_UNPAD_CPU_ISA=isa)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", _VARIANT_TESTS]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, f"checks failed with PADDLE_UNPAD_CPU_ISA={isa}:\n{tail}"
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], tail


# ------------------------------------------------------------------------- autograd corner cases


def test_partial_gradients(fused_native):
    """Only residual and ln_weight require grad; only x for bias_gelu."""
    x, bias, res, w, b, dy = ln_inputs(50, 64)
    ref = ln_reference(x, bias, res, w, b, dy, 0.1, philox_ref.rowwise_keep(SEED, OFFSET, 0.1, 50, 64))
    tx, tbias, tb = (paddle.to_tensor(a) for a in (x, bias, b))
    tres, tw = (paddle.to_tensor(a, stop_gradient=False) for a in (res, w))
    y = ops.bias_dropout_residual_layer_norm(tx, tbias, tres, tw, tb, dropout=0.1, rng_state=(SEED, OFFSET))
    dres, dw = paddle.grad([y], [tres, tw], grad_outputs=[paddle.to_tensor(dy)])
    assert_close("dresidual", dres.numpy(), ref[3])
    assert_close("dln_weight", dw.numpy(), ref[4])
    gx, gb, gdy = gelu_inputs(50, 64)
    tx = paddle.to_tensor(gx, stop_gradient=False)
    (dx,) = paddle.grad([ops.bias_gelu(tx, paddle.to_tensor(gb))], [tx], grad_outputs=[paddle.to_tensor(gdy)])
    assert_close("gelu dx", dx.numpy(), gelu_reference(gx, gb, gdy)[1])


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_input_gradient_with_frozen_layer_norm_parameters(impl, request):
    """ln_weight / ln_bias with stop_gradient=True (frozen): dx and dresidual still right.
    Paddle 3.3.1's own paddle.nn.functional.layer_norm gets dx wrong here; the reference
    must not inherit that."""
    fn = _impl(impl, request, "bias_dropout_residual_layer_norm")
    x, bias, res, w, b, dy = ln_inputs(33, 64)
    ref = ln_reference(x, bias, res, w, b, dy, 0.0, None)
    tx, tres = (paddle.to_tensor(a, stop_gradient=False) for a in (x, res))
    tw, tb = paddle.to_tensor(w), paddle.to_tensor(b)
    assert tw.stop_gradient and tb.stop_gradient
    y = fn(tx, paddle.to_tensor(bias), tres, tw, tb, dropout=0.0)
    dx, dres = paddle.grad([y], [tx, tres], grad_outputs=[paddle.to_tensor(dy)])
    assert_close("y", y.numpy(), ref[0])
    assert_close("dx", dx.numpy(), ref[1])
    assert_close("dresidual", dres.numpy(), ref[3])


def test_upstream_gradient_through_a_transpose(fused_native):
    """The output gradient arrives through a transposed (possibly strided) view."""
    T, F = 40, 48
    x, bias, res, w, b, dy = ln_inputs(T, F)
    ts = [paddle.to_tensor(a, stop_gradient=False) for a in (x, bias, res, w, b)]
    y = ops.bias_dropout_residual_layer_norm(*ts, epsilon=EPS)
    (y.transpose([1, 0]) * paddle.to_tensor(np.ascontiguousarray(dy.T))).sum().backward()
    ref = ln_reference(x, bias, res, w, b, dy, 0.0, None)
    for name, t, r in zip(LN_NAMES[1:], (ts[0], ts[1], ts[2], ts[3], ts[4]), (ref[1], ref[2], ref[3], ref[4], ref[5])):
        assert_close(name, t.grad.numpy(), r)
    gx, gb, gdy = gelu_inputs(T, F)
    tx, tb = (paddle.to_tensor(a, stop_gradient=False) for a in (gx, gb))
    (ops.bias_gelu(tx, tb).transpose([1, 0]) * paddle.to_tensor(np.ascontiguousarray(gdy.T))).sum().backward()
    gref = gelu_reference(gx, gb, gdy)
    assert_close("gelu dx", tx.grad.numpy(), gref[1])
    assert_close("gelu dbias", tb.grad.numpy(), gref[2])


def test_output_used_twice(fused_native):
    """y feeds two branches (gradients add up before the grad op)."""
    x, bias, res, w, b, dy = ln_inputs(9, 32)
    ts = [paddle.to_tensor(a, stop_gradient=False) for a in (x, bias, res, w, b)]
    y = ops.bias_dropout_residual_layer_norm(*ts)
    loss = (y * paddle.to_tensor(dy)).sum() + (y * paddle.to_tensor(dy)).sum()
    loss.backward()
    ref = ln_reference(x, bias, res, w, b, 2 * dy, 0.0, None)
    assert_close("dx", ts[0].grad.numpy(), ref[1])
    assert_close("dln_bias", ts[4].grad.numpy(), ref[5])


# ------------------------------------------------------------------------- static graph export


def test_to_static_save_load(tmp_path, fused_native):
    H = 32

    class Block(paddle.nn.Layer):
        """The FFN half of a BERT layer on packed [T, H] tokens."""

        def __init__(self):
            super().__init__()
            self.linear1 = paddle.nn.Linear(H, 4 * H)
            self.linear2 = paddle.nn.Linear(4 * H, H)
            self.norm = paddle.nn.LayerNorm(H, epsilon=EPS)

        def forward(self, x):
            h = ops.bias_gelu(paddle.matmul(x, self.linear1.weight), self.linear1.bias)
            o = paddle.matmul(h, self.linear2.weight)
            return ops.bias_dropout_residual_layer_norm(
                o,
                self.linear2.bias,
                x,
                self.norm.weight,
                self.norm.bias,
                dropout=0.1,
                epsilon=EPS,
                training=self.training,
            )

    paddle.seed(0)
    block = Block()
    block.eval()
    x = paddle.to_tensor(np.random.default_rng(1).standard_normal((13, H)).astype(np.float32))
    eager = block(x).numpy()
    spec = [paddle.static.InputSpec([None, H], "float32", name="x")]
    static_block = paddle.jit.to_static(block, input_spec=spec, full_graph=True)
    np.testing.assert_allclose(static_block(x).numpy(), eager, rtol=1e-5, atol=1e-6)
    path = str(tmp_path / "block")
    paddle.jit.save(static_block, path)
    loaded = paddle.jit.load(path)
    loaded.eval()
    np.testing.assert_allclose(loaded(x).numpy(), eager, rtol=1e-5, atol=1e-6)
    # dynamic T through the same program, including no tokens at all (Paddle 3.x: 2.6's own
    # matmul cannot take an empty batch)
    from paddle_unpad._runtime import paddle_compat as _paddle_compat

    for T in (1, 0, 70) if _paddle_compat.EMPTY_TENSORS_SUPPORTED else (1, 70):
        x2 = paddle.to_tensor(np.random.default_rng(T).standard_normal((T, H)).astype(np.float32))
        np.testing.assert_allclose(loaded(x2).numpy(), block(x2).numpy(), rtol=1e-5, atol=1e-6)


def test_to_static_training_backward(fused_native):
    """Traced in training mode (dropout drawn per run inside the program): forward and
    backward run, gradients are finite and dropout is active."""
    H = 16

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.lin = paddle.nn.Linear(H, H)
            self.norm = paddle.nn.LayerNorm(H)

        def forward(self, x):
            h = ops.bias_gelu(paddle.matmul(x, self.lin.weight), self.lin.bias)
            return ops.bias_dropout_residual_layer_norm(
                h, self.lin.bias, x, self.norm.weight, self.norm.bias, dropout=0.5, training=self.training
            )

    paddle.seed(0)
    block = Block()
    block.train()
    static_block = paddle.jit.to_static(
        block, input_spec=[paddle.static.InputSpec([None, H], "float32")], full_graph=True
    )
    x = paddle.to_tensor(np.random.default_rng(1).standard_normal((40, H)).astype(np.float32))
    a = static_block(x)
    a.sum().backward()
    g = block.lin.weight.grad.numpy()
    assert np.isfinite(g).all() and np.abs(g).sum() > 0
    b = static_block(x)
    assert not np.array_equal(a.numpy(), b.numpy()), "two runs of the traced program used the same mask"


# ------------------------------------------------------------------------- input checks


def _gelu_call(x=None, bias=None):
    x = paddle.ones([4, 8]) if x is None else x
    bias = paddle.ones([8]) if bias is None else bias
    return ops.bias_gelu(x, bias)


def _ln_call(**kw):
    args = dict(
        x=paddle.ones([4, 8]),
        bias=paddle.ones([8]),
        residual=paddle.ones([4, 8]),
        ln_weight=paddle.ones([8]),
        ln_bias=paddle.ones([8]),
    )
    opts = {k: kw.pop(k) for k in ("dropout", "epsilon", "rng_state") if k in kw}
    args.update(kw)
    return ops.bias_dropout_residual_layer_norm(**args, **opts)


ERRORS = {
    "gelu_x_int": (lambda: _gelu_call(x=paddle.ones([4, 8], dtype="int32")), [r"bias_gelu", r"\bx\b", "int32"]),
    "gelu_x_float64": (
        lambda: _gelu_call(x=paddle.ones([4, 8], dtype="float64"), bias=paddle.ones([8], "float64")),
        [r"\bx\b", "float64"],
    ),
    "gelu_x_0d": (lambda: _gelu_call(x=paddle.ones([])), [r"\bx\b", "dimension"]),
    "gelu_x_numpy": (lambda: _gelu_call(x=np.ones((4, 8), np.float32)), [r"\bx\b", "ndarray"]),
    "gelu_bias_len": (lambda: _gelu_call(bias=paddle.ones([9])), [r"\bbias\b", r"\[8\]", r"\[9\]"]),
    "gelu_bias_2d": (lambda: _gelu_call(bias=paddle.ones([1, 8])), [r"\bbias\b", r"\[1, 8\]"]),
    "gelu_bias_dtype": (lambda: _gelu_call(bias=paddle.ones([8], dtype="float64")), [r"\bbias\b", "float64"]),
    "ln_residual_shape": (lambda: _ln_call(residual=paddle.ones([5, 8])), [r"\bresidual\b", r"\[5, 8\]", r"\[4, 8\]"]),
    "ln_residual_dtype": (
        lambda: _ln_call(residual=paddle.ones([4, 8], dtype="float64")),
        [r"\bresidual\b", "float64"],
    ),
    "ln_bias_len": (lambda: _ln_call(bias=paddle.ones([7])), [r"\bbias\b", r"\[7\]"]),
    "ln_weight_len": (lambda: _ln_call(ln_weight=paddle.ones([16])), [r"\bln_weight\b", r"\[16\]"]),
    "ln_bias_param_2d": (lambda: _ln_call(ln_bias=paddle.ones([2, 4])), [r"\bln_bias\b", r"\[2, 4\]"]),
    "ln_weight_dtype": (lambda: _ln_call(ln_weight=paddle.ones([8], dtype="float64")), [r"\bln_weight\b", "float64"]),
    "ln_x_int": (lambda: _ln_call(x=paddle.ones([4, 8], dtype="int64")), [r"\bx\b", "int64"]),
    "ln_f_zero": (
        lambda: _ln_call(
            x=paddle.ones([4, 0]),
            residual=paddle.ones([4, 0]),
            bias=paddle.ones([0]),
            ln_weight=paddle.ones([0]),
            ln_bias=paddle.ones([0]),
        ),
        [r"x\.shape\[-1\]", "0"],
    ),
    "ln_dropout_one": (lambda: _ln_call(dropout=1.0), ["dropout", r"1\.0"]),
    "ln_dropout_negative": (lambda: _ln_call(dropout=-0.1), ["dropout", r"-0\.1"]),
    "ln_epsilon_zero": (lambda: _ln_call(epsilon=0.0), ["epsilon", r"0\.0"]),
    "ln_epsilon_nan": (lambda: _ln_call(epsilon=float("nan")), ["epsilon", "nan"]),
    "ln_rng_state_bad": (
        lambda: _ln_call(dropout=0.1, rng_state=paddle.to_tensor([1, 2, 3], dtype="int64")),
        ["rng_state", "3"],
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_input_errors(case, fused_native):
    call, needles = ERRORS[case]
    with pytest.raises((ValueError, TypeError)) as ei:
        call()
    msg = str(ei.value)
    op = "bias_gelu" if case.startswith("gelu_") else "bias_dropout_residual_layer_norm"
    assert msg.startswith(f"paddle_unpad.ops.{op}: "), msg  # every message names the operator the user called
    for needle in needles:
        assert re.search(needle, msg), f"error message for {case} does not mention {needle!r}: {msg!r}"


def _ln_args(residual=(4, 8), ln_weight=(8,), dropout=0.0, epsilon=1e-5):
    """Arguments of pu_bias_dropout_residual_layer_norm on a [4, 8] input, valid but for those given."""
    return lambda: (
        paddle.ones([4, 8]),
        paddle.ones([8]),
        paddle.ones(list(residual)),
        paddle.ones(list(ln_weight)),
        paddle.ones([8]),
        None,
        dropout,
        epsilon,
    )


# The C++ checks themselves (the Python checks above run first in normal use).
NATIVE_ERRORS = {
    "gelu_bias_len": (
        "pu_bias_gelu",
        lambda: (paddle.ones([4, 8]), paddle.ones([9])),
        ["bias_gelu:", r"\bbias\b", "9"],
    ),
    "gelu_bias_dtype": (
        "pu_bias_gelu",
        lambda: (paddle.ones([4, 8]), paddle.ones([8], "float64")),
        [r"\bbias\b", "float64"],
    ),
    "gelu_x_dtype": (
        "pu_bias_gelu",
        lambda: (paddle.ones([4, 8], "float64"), paddle.ones([8], "float64")),
        [r"\bx\b", "float64"],
    ),
    "ln_residual": (
        "pu_bias_dropout_residual_layer_norm",
        _ln_args(residual=[3, 8]),
        ["bias_dropout_residual_layer_norm:", "residual", "3, 8"],
    ),
    "ln_weight": (
        "pu_bias_dropout_residual_layer_norm",
        _ln_args(ln_weight=[5]),
        ["ln_weight", r"\[5\]"],
    ),
    "ln_dropout": (
        "pu_bias_dropout_residual_layer_norm",
        _ln_args(dropout=1.5),
        ["dropout", r"1\.5"],
    ),
    "ln_epsilon": (
        "pu_bias_dropout_residual_layer_norm",
        _ln_args(epsilon=-1.0),
        ["epsilon", "-1"],
    ),
    "ln_no_rng": (
        "pu_bias_dropout_residual_layer_norm",
        _ln_args(dropout=0.1),
        ["rng_state"],
    ),
}


@pytest.mark.parametrize("case", list(NATIVE_ERRORS))
def test_native_input_errors(case, fused_native):
    op, args, needles = NATIVE_ERRORS[case]
    with pytest.raises(ValueError) as ei:
        ops._call.call_native(op, *args())
    msg = str(ei.value)
    for needle in needles:
        assert re.search(needle, msg), f"native error for {case} does not mention {needle!r}: {msg!r}"


# ------------------------------------------------------------------------- benchmark smoke run


def test_bench_fused_ops_quick(tmp_path):
    import json

    out = tmp_path / "fused_ops.json"
    r = run_benchmark("bench_fused_ops.py", "--quick", "--threads", "1", "--out", str(out), timeout=300)
    assert "== forward ==" in r.stdout and "== forward + backward ==" in r.stdout, r.stdout
    res = json.loads(out.read_text())
    assert res["config"]["threads"] == 1 and res["config"]["quick"] is True
    ops_seen = {(row["op"], row["mode"], row["dropout"]) for row in res["rows"]}
    assert len(ops_seen) == 6, ops_seen
    for row in res["rows"]:
        assert row["fused_ms"] > 0 and row["unfused_ms"] > 0 and row["max_abs_diff"] < 1e-4
        assert abs(row["speedup"] - row["unfused_ms"] / row["fused_ms"]) < 1e-9 * row["speedup"]

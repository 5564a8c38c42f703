"""The fused CUDA kernels (custom_ops/kernels/cuda: bias_gelu, bias_dropout_residual_layer_norm),
run on the CPU under a small emulation of the CUDA execution model (tests/cuda_emu/emu.h:
a block's threads are fibers, __shared__ is static, barriers and warp shuffles are
emulated), through the C-ABI harness, against the float64 references of the CPU tests.

This is not a GPU run. It checks what does not depend on the hardware: indexing, the
vector / element and register / general paths, row chunks and the ordered column sums,
NaN-filled neighbours (nothing read or written outside a buffer), the row-wise Philox
dropout layout (forward and backward masks vs tests/philox_ref.py), zero rows. Precision
of the device math, speed and real concurrency are for tests/gpu on a GPU machine.

Skips locally when g++ or the CUDA headers are missing; fails under CI (CI=true) instead.
"""

import ctypes
import functools
import os
import sys

import numpy as np
import pytest

import philox_ref
import test_fused_ops as cpu_tests  # float64 references, seeds
from paddle_unpad import ops

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emu"))
import emu_build  # noqa: E402
import host_buffers  # noqa: E402
from host_buffers import to_storage  # noqa: E402

CODE = {"float16": 0, "bfloat16": 1, "float32": 2}
TOL = ops.FUSED_OPS_GPU_TOLERANCE  # {dtype: {"out", "grad": max abs err / max |ref|}}
PAD = 8  # NaN elements / rows around every buffer (keeps 16-byte alignment)

pytestmark = pytest.mark.build
ELEMENTWISE, WIDE = 1, 2  # `path` bits of the harness


@pytest.fixture(scope="module")
def lib():
    """The emulated kernels and harness (tests/cuda_emu/emu_build.py), typed."""
    return emu_build.load(pytest)


# ------------------------------------------------------------------------- host buffers


def Buffer(shape, dt, fill=None):
    return host_buffers.Buffer(shape, dt, PAD, fill)


def call(lib, rc, what):
    assert rc == 0, f"{what}: {lib.pu_harness_last_error().decode()}"


def assert_close(dt, kind, what, got, ref):
    ref = np.asarray(ref, np.float64)
    if ref.size:
        err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6)
        tol = TOL[dt][kind]
        assert err <= tol, f"{what}: max err / max |ref| = {err:.3e} > {tol:.1e}"


@functools.lru_cache(maxsize=None)
def values(rows, cols, seed):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((rows, cols)) * 2,
        "residual": rng.standard_normal((rows, cols)),
        "dy": rng.standard_normal((rows, cols)),
        "bias": rng.standard_normal(cols) * 0.5,
        "ln_weight": 1 + rng.standard_normal(cols) * 0.2,
        "ln_bias": rng.standard_normal(cols) * 0.2,
    }


# ------------------------------------------------------------------------- runs


def run_gelu(lib, rows, cols, dt, path=0):
    v = {k: to_storage(a, dt) for k, a in values(rows, cols, 1).items()}
    x, bias, dy = (Buffer(v[k][0].shape, dt, v[k][0]) for k in ("x", "bias", "dy"))
    y, dx, dbias = Buffer((rows, cols), dt), Buffer((rows, cols), dt), Buffer((cols,), dt)
    ws = np.zeros(lib.pu_bias_gelu_bwd_workspace_bytes(rows, cols) // 4 + 1, np.float32)
    head = (rows, cols, CODE[dt], path)
    call(lib, lib.pu_bias_gelu_fwd(*head, x.ptr, bias.ptr, y.ptr, None), "bias_gelu forward")
    call(
        lib,
        lib.pu_bias_gelu_bwd(*head, x.ptr, bias.ptr, dy.ptr, dx.ptr, dbias.ptr, ctypes.c_void_p(ws.ctypes.data), None),
        "bias_gelu backward",
    )
    ref = cpu_tests.gelu_reference(v["x"][1], v["bias"][1], v["dy"][1])
    for name, buf, r in zip(("y", "dx", "dbias"), (y, dx, dbias), ref):
        buf.check(name)
        assert_close(dt, "out" if name == "y" else "grad", f"bias_gelu {name}", buf.values(), r)


# bdrln's three dtypes (fused_cuda.cuh): x and bias (and dx, dbias) in dt; residual, y, dy,
# dresidual in the residual's; ln_weight, ln_bias and their gradients in the LayerNorm's.
X_KEYS, RES_KEYS = ("x", "bias", "dx", "dbias"), ("residual", "y", "dy", "dresidual")


def run_bdrln(lib, rows, cols, dt, p, path=0, seed=cpu_tests.SEED, offset=cpu_tests.OFFSET, rdt=None, wdt=None):
    """Forward + backward of bdrln through the harness against the float64 reference; each
    output within the tolerance of its own dtype. Returns the raw output bits."""
    rdt, wdt = rdt or dt, wdt or dt

    def dtype_of(k):
        return dt if k in X_KEYS else (rdt if k in RES_KEYS else wdt)

    v = {k: to_storage(a, dtype_of(k)) for k, a in values(rows, cols, 2).items()}
    ins = {k: Buffer(s.shape, dtype_of(k), s) for k, (s, _) in v.items()}
    outs = {k: Buffer((rows, cols), dtype_of(k)) for k in ("y", "dx", "dresidual")}
    outs.update({k: Buffer((cols,), dtype_of(k)) for k in ("dbias", "dln_weight", "dln_bias")})
    mean, rstd = Buffer((rows,), "float32"), Buffer((rows,), "float32")
    ws = np.zeros(lib.pu_bdrln_bwd_workspace_bytes(rows, cols) // 4 + 1, np.float32)
    head = (rows, cols, CODE[dt], CODE[rdt], CODE[wdt], p, cpu_tests.EPS, seed & (2**64 - 1), offset, path)
    call(
        lib,
        lib.pu_bdrln_fwd(
            *head,
            *(ins[k].ptr for k in ("x", "bias", "residual", "ln_weight", "ln_bias")),
            outs["y"].ptr,
            mean.ptr,
            rstd.ptr,
            None,
        ),
        "bdrln forward",
    )
    call(
        lib,
        lib.pu_bdrln_bwd(
            *head,
            *(ins[k].ptr for k in ("x", "bias", "residual", "ln_weight")),
            mean.ptr,
            rstd.ptr,
            ins["dy"].ptr,
            *(outs[k].ptr for k in ("dx", "dresidual", "dbias", "dln_weight", "dln_bias")),
            ctypes.c_void_p(ws.ctypes.data),
            None,
        ),
        "bdrln backward",
    )
    keep = philox_ref.rowwise_keep(seed, offset, p, rows, cols) if p > 0 else None
    f = {k: s[1] for k, s in v.items()}
    y, dx, dbias, dres, dw, db = cpu_tests.ln_reference(
        f["x"], f["bias"], f["residual"], f["ln_weight"], f["ln_bias"], f["dy"], p, keep
    )
    z = f["residual"] + (f["x"] + f["bias"]) * (keep / (1 - p) if p > 0 else 1.0)
    ref = {"y": y, "dx": dx, "dresidual": dres, "dbias": dbias, "dln_weight": dw, "dln_bias": db}
    for name, buf in outs.items():
        buf.check(name)
        assert_close(dtype_of(name), "out" if name == "y" else "grad", f"bdrln {name}", buf.values(), ref[name])
    mean.check("mean")
    rstd.check("rstd")
    assert_close("float32", "out", "bdrln mean", mean.values(), z.mean(-1) if rows else np.zeros(0))
    if p > 0 and rows:  # the backward drops what the forward dropped: dx = 0 there, else dz / (1 - p)
        live = outs["dresidual"].values() != 0
        np.testing.assert_array_equal((outs["dx"].values() != 0)[live], keep[live])
    bits = {k: b.view.copy() for k, b in outs.items()}
    bits.update(mean=mean.view.copy(), rstd=rstd.view.copy())
    return bits


# ------------------------------------------------------------------------- tests


@pytest.mark.parametrize("path", [0, ELEMENTWISE])
@pytest.mark.parametrize("rows,cols", [(0, 384), (1, 8), (7, 771), (70, 384)])
@pytest.mark.parametrize("dt", list(CODE))
def test_bias_gelu(lib, dt, rows, cols, path):
    run_gelu(lib, rows, cols, dt, path)


@pytest.mark.parametrize("path", [0, ELEMENTWISE, WIDE, WIDE | ELEMENTWISE])
@pytest.mark.parametrize("rows,cols,p", [(0, 32, 0.1), (1, 384, 0.0), (7, 771, 0.1), (40, 32, 0.1)])
@pytest.mark.parametrize("dt", list(CODE))
def test_bdrln(lib, dt, rows, cols, p, path):
    run_bdrln(lib, rows, cols, dt, p, path)


@pytest.mark.parametrize("dt,cols", [("float32", 1031), ("bfloat16", 8200)])
def test_bdrln_long_rows_take_the_general_path(lib, dt, cols):
    run_bdrln(lib, 3, cols, dt, 0.1)


def test_column_sums_over_many_chunks(lib):
    run_bdrln(lib, 300, 64, "float32", 0.1)  # 19 chunks of 16 rows
    run_bdrln(lib, 300, 64, "float32", 0.1, path=WIDE)
    run_gelu(lib, 300, 40, "float32")  # 5 chunks of 64 rows


def test_dropout_layout_with_a_high_seed(lib):
    run_bdrln(lib, 33, 96, "float16", 0.2, seed=2**63 + 5, offset=2**32 + 9)


# The combinations AMP hands over: half GEMM output with float32 LayerNorm parameters and a
# half (O2, pure half stream) or float32 (O1, and O2 with promotion) residual; and the half
# residual with half parameters of a fully cast model.
AMP_COMBOS = [
    (dt, rdt, wdt)
    for dt in ("float16", "bfloat16")
    for rdt, wdt in ((dt, "float32"), ("float32", "float32"), ("float32", dt))
]


@pytest.mark.parametrize("path", [0, ELEMENTWISE, WIDE])
@pytest.mark.parametrize("rows,cols,p", [(0, 32, 0.1), (7, 771, 0.1), (40, 64, 0.1), (33, 384, 0.0)])
@pytest.mark.parametrize("dt,rdt,wdt", AMP_COMBOS)
def test_bdrln_mixed_dtypes(lib, dt, rdt, wdt, rows, cols, p, path):
    first = run_bdrln(lib, rows, cols, dt, p, path, rdt=rdt, wdt=wdt)
    if rows and path == 0:  # reruns give the same bits
        again = run_bdrln(lib, rows, cols, dt, p, path, rdt=rdt, wdt=wdt)
        for name, bits in first.items():
            np.testing.assert_array_equal(bits.view(np.uint8), again[name].view(np.uint8), err_msg=name)


def test_bdrln_mixed_dtypes_long_rows(lib):
    run_bdrln(lib, 3, 8200, "bfloat16", 0.1, rdt="float32", wdt="float32")  # general path: 1025 vectors


def test_refusals_name_the_argument(lib):
    f32, f16, bf16 = CODE["float32"], CODE["float16"], CODE["bfloat16"]
    head = (4, 8, f32, f32, f32, 0.0, 0.0, 0, 0, 0)  # epsilon = 0
    assert lib.pu_bdrln_fwd(*head, *([None] * 8), None) != 0
    assert "epsilon" in lib.pu_harness_last_error().decode()
    for rdt, wdt, word in (
        (bf16, f32, "residual dtype bfloat16"),
        (f16, bf16, "ln_weight/ln_bias dtype bfloat16"),
        (f16, 9, "ln_weight/ln_bias dtype code 9"),
    ):
        assert lib.pu_bdrln_fwd(4, 8, f16, rdt, wdt, 0.0, 1e-5, 0, 0, 0, *([None] * 8), None) != 0
        assert word in lib.pu_harness_last_error().decode()
    assert lib.pu_bdrln_fwd(4, 8, f32, f16, f32, 0.0, 1e-5, 0, 0, 0, *([None] * 8), None) != 0
    assert "x dtype float32" in lib.pu_harness_last_error().decode()
    assert lib.pu_bias_gelu_fwd(4, 8, 7, 0, None, None, None, None) != 0
    assert "dtype" in lib.pu_harness_last_error().decode()

"""CUDA fused encoder kernels (through the C-ABI harness) against a PyTorch fp32 reference:
bias_gelu and bias_dropout_residual_layer_norm (bdrln), forward and backward.

The reference takes the same (rounded) inputs upcast to float32 and runs
``gelu(x + bias)`` / ``layer_norm(residual + dropout(x + bias))`` with autograd; its
dropout keep-mask comes from tests/philox_ref.py in the row-wise counter layout, the
numpy Philox the CPU tests check the CPU kernels against. Error = max |ours - ref| /
max |ref| per tensor, within the dtype's tolerance.

Every buffer the kernels read or write sits between NaN-filled rows (vectors: NaN-filled
elements), PAD of them, which keeps views 16-byte aligned: a kernel that reads a
neighbour produces NaN, one that writes past its rows overwrites the NaN.
"""

import functools

import numpy as np
import pytest

import philox_ref
from torch_checks import check_neighbours, op_rules, poisoned, rel_err
import pu_harness

ROWS = (0, 1, 7, 4096)
HIDDEN = (32, 384, 768, 1024, 771)  # 771: odd, element-wise loads, two vectors per thread
DTYPES = ("float16", "bfloat16", "float32")

pytestmark = pytest.mark.gpu
SEED, OFFSET = 2**40 + 4321, 11  # both Philox key words non-zero (as the CPU tests)
EPS = 1e-12  # PaddleNLP BERT's layer_norm_eps
P_DROP = 0.1
PAD = 8  # NaN rows / elements around every buffer (8 elements: 16-byte aligned views)
TOL = op_rules().FUSED_OPS_GPU_TOLERANCE  # {dtype: {"out", "grad": max err / max |ref|}}


# ------------------------------------------------------------------------- helpers


# keep masks are reused across dtypes and parametrisations
rowwise_keep = functools.lru_cache(maxsize=None)(philox_ref.rowwise_keep)


def inputs(torch, rows, cols, dtype, seed=0):
    """x, residual, dy [rows, cols]; bias, ln_weight, ln_bias [cols] (weights near 1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale + shift).to(dtype)

    return {
        "x": randn(rows, cols, scale=2.0),
        "residual": randn(rows, cols),
        "dy": randn(rows, cols),
        "bias": randn(cols, scale=0.5),
        "ln_weight": randn(cols, scale=0.2, shift=1.0),
        "ln_bias": randn(cols, scale=0.2),
    }


def keep_tensor(torch, rows, cols, p, seed=SEED, offset=OFFSET):
    return torch.from_numpy(rowwise_keep(seed, offset, p, rows, cols)).cuda()


# ------------------------------------------------------------------------- references


def gelu_reference(torch, t):
    x, b = (t[k].detach().float().requires_grad_() for k in ("x", "bias"))
    y = torch.nn.functional.gelu(x + b)  # approximate="none": the erf form
    y.backward(t["dy"].float())
    return y.detach(), x.grad, b.grad


def bdrln_reference(torch, t, p, keep, eps=EPS):
    names = ("x", "bias", "residual", "ln_weight", "ln_bias")
    x, b, res, w, lb = (t[k].detach().float().requires_grad_() for k in names)
    h = x + b
    if p > 0:
        h = h * torch.where(
            keep, torch.tensor(1.0 / (1.0 - p), dtype=torch.float32, device="cuda"), torch.zeros((), device="cuda")
        )
    z = res + h
    y = torch.nn.functional.layer_norm(z, (z.shape[-1],), w, lb, eps)
    mean = z.detach().mean(-1)
    rstd = 1.0 / torch.sqrt(z.detach().var(-1, unbiased=False) + eps)
    y.backward(t["dy"].float())
    return {
        "y": y.detach(),
        "mean": mean,
        "rstd": rstd,
        "dx": x.grad,
        "dresidual": res.grad,
        "dbias": b.grad,
        "dln_weight": w.grad,
        "dln_bias": lb.grad,
    }


# ------------------------------------------------------------------------- runs of ours


def run_gelu(torch, harness, t, path=pu_harness.PATH_DEFAULT):
    """Forward + backward with every buffer NaN-poisoned around: y, dx, dbias."""
    rows, cols = t["x"].shape
    x, bias, dy = (poisoned(torch, t[k].shape, t[k].dtype, PAD, t[k])[1] for k in ("x", "bias", "dy"))
    bufs = {
        "y": poisoned(torch, (rows, cols), x.dtype, PAD),
        "dx": poisoned(torch, (rows, cols), x.dtype, PAD),
        "dbias": poisoned(torch, (cols,), x.dtype, PAD),
    }
    harness.bias_gelu_fwd(x, bias, y=bufs["y"][1], path=path)
    harness.bias_gelu_bwd(x, bias, dy, dx=bufs["dx"][1], dbias=bufs["dbias"][1], path=path)
    torch.cuda.synchronize()
    for name, (full, _) in bufs.items():
        check_neighbours(torch, full, name, PAD)
    return {k: v[1] for k, v in bufs.items()}


def run_bdrln(torch, harness, t, p, seed=SEED, offset=OFFSET, path=pu_harness.PATH_DEFAULT):
    """Forward + backward with every buffer NaN-poisoned around: dict of outputs. Each output
    takes the dtype of the input it belongs to (y and dresidual the residual's, dbias x's,
    dln_* the LayerNorm parameters')."""
    rows, cols = t["x"].shape
    ins = {k: poisoned(torch, t[k].shape, t[k].dtype, PAD, t[k])[1] for k in t}
    shapes = {
        "y": ((rows, cols), "residual"),
        "dx": ((rows, cols), "x"),
        "dresidual": ((rows, cols), "residual"),
        "dbias": ((cols,), "x"),
        "dln_weight": ((cols,), "ln_weight"),
        "dln_bias": ((cols,), "ln_weight"),
    }
    bufs = {k: poisoned(torch, s, t[of].dtype, PAD) for k, (s, of) in shapes.items()}
    bufs["mean"] = poisoned(torch, (rows,), torch.float32, PAD)
    bufs["rstd"] = poisoned(torch, (rows,), torch.float32, PAD)
    kw = dict(dropout=p, epsilon=EPS, seed=seed, offset=offset, path=path)
    harness.bdrln_fwd(
        ins["x"],
        ins["bias"],
        ins["residual"],
        ins["ln_weight"],
        ins["ln_bias"],
        y=bufs["y"][1],
        mean=bufs["mean"][1],
        rstd=bufs["rstd"][1],
        **kw,
    )
    harness.bdrln_bwd(
        ins["x"],
        ins["bias"],
        ins["residual"],
        ins["ln_weight"],
        bufs["mean"][1],
        bufs["rstd"][1],
        ins["dy"],
        dx=bufs["dx"][1],
        dresidual=bufs["dresidual"][1],
        dbias=bufs["dbias"][1],
        dln_weight=bufs["dln_weight"][1],
        dln_bias=bufs["dln_bias"][1],
        **kw,
    )
    torch.cuda.synchronize()
    for name, (full, _) in bufs.items():
        check_neighbours(torch, full, name, PAD)
    return {k: v[1] for k, v in bufs.items()}


def assert_matches(torch, ours, ref, dtype, names_out, names_grad, what):
    """Each tensor within the tolerance of `dtype`, or of its own dtype when that is coarser
    (AMP mixes: a half dy rounds dresidual's float32 reference too)."""
    report = {n: rel_err(torch, ours[n], ref[n]) for n in names_out + names_grad}
    for n in names_out + names_grad:
        kind = "out" if n in names_out else "grad"
        own = str(ours[n].dtype).replace("torch.", "")
        tol = max(TOL[dtype][kind], TOL.get(own, TOL[dtype])[kind])
        assert report[n] <= tol, f"{what}: {n} rel err {report[n]:.3e} > {tol:.1e}; all: {report}"


def check_bdrln(torch, harness, t, p, rows, cols, dtype, what, path=pu_harness.PATH_DEFAULT):
    """run_bdrln on t within the tolerance of bdrln_reference with the same keep mask; returns ours."""
    ours = run_bdrln(torch, harness, t, p, path=path)
    ref = bdrln_reference(torch, t, p, keep_tensor(torch, rows, cols, p))
    assert_matches(
        torch,
        ours,
        ref,
        dtype,
        ["y", "mean", "rstd"],
        ["dx", "dresidual", "dbias", "dln_weight", "dln_bias"],
        what,
    )
    return ours


# ------------------------------------------------------------------------- tests

# Every kernel path: 16-byte vectors or elements, row in registers or the general (wide) path.
PATHS = {
    "default": 0,
    "elementwise": pu_harness.PATH_ELEMENTWISE,
    "wide": pu_harness.PATH_WIDE,
    "wide+elementwise": pu_harness.PATH_WIDE | pu_harness.PATH_ELEMENTWISE,
}


@pytest.mark.parametrize("cols", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu_matches_torch(torch_cuda, harness, dtype, rows, cols):
    torch = torch_cuda
    t = inputs(torch, rows, cols, getattr(torch, dtype), seed=rows * 7 + cols)
    ours = run_gelu(torch, harness, t)
    y, dx, dbias = gelu_reference(torch, t)
    assert_matches(
        torch,
        ours,
        {"y": y, "dx": dx, "dbias": dbias},
        dtype,
        ["y"],
        ["dx", "dbias"],
        f"bias_gelu {dtype} [{rows}, {cols}]",
    )
    if rows == 0:
        assert (ours["dbias"] == 0).all(), "dbias of no rows must be zeros"


@pytest.mark.parametrize("p", [0.0, P_DROP])
@pytest.mark.parametrize("cols", HIDDEN)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bdrln_matches_torch(torch_cuda, harness, dtype, rows, cols, p):
    torch = torch_cuda
    t = inputs(torch, rows, cols, getattr(torch, dtype), seed=rows * 5 + cols)
    ours = check_bdrln(torch, harness, t, p, rows, cols, dtype, f"bdrln {dtype} [{rows}, {cols}] p={p}")
    if rows == 0:
        for n in ("dbias", "dln_weight", "dln_bias"):
            assert (ours[n] == 0).all(), f"{n} of no rows must be zeros"


# The dtypes AMP hands over: a half GEMM output x (and bias) with float32 LayerNorm parameters
# and a half (O2) or float32 (O1) residual stream; bfloat16 O2 also casts the LayerNorm
# parameters. y, dy and dresidual take the residual's dtype.
AMP_MIXES = [
    (dt, rdt, wdt)
    for dt in ("float16", "bfloat16")
    for rdt, wdt in ((dt, "float32"), ("float32", "float32"), ("float32", dt))
]


@pytest.mark.parametrize("path", ["default", "elementwise", "wide"])
@pytest.mark.parametrize("rows,cols", [(0, 768), (7, 771), (4096, 1024)])
@pytest.mark.parametrize("dtype,residual_dtype,ln_dtype", AMP_MIXES)
def test_bdrln_amp_mixes_match_torch(torch_cuda, harness, dtype, residual_dtype, ln_dtype, rows, cols, path):
    torch = torch_cuda
    t = inputs(torch, rows, cols, getattr(torch, dtype), seed=rows + cols)
    for k in ("residual", "dy"):
        t[k] = t[k].to(getattr(torch, residual_dtype))
    for k in ("ln_weight", "ln_bias"):
        t[k] = t[k].to(getattr(torch, ln_dtype))
    ours = check_bdrln(
        torch,
        harness,
        t,
        P_DROP,
        rows,
        cols,
        dtype,
        f"bdrln x {dtype}, residual {residual_dtype}, LayerNorm {ln_dtype} [{rows}, {cols}] {path}",
        path=PATHS[path],
    )
    again = run_bdrln(torch, harness, t, P_DROP, path=PATHS[path])
    for name in ours:
        assert torch.equal(ours[name], again[name]), f"{name} differs between two identical runs"


# Every kernel path on the same problems: 16-byte vectors or elements, row in registers
# or the general (wide) path.
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("rows,cols", [(7, 768), (4096, 1024), (33, 771)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_path_matches_torch(torch_cuda, harness, dtype, rows, cols, path):
    torch = torch_cuda
    t = inputs(torch, rows, cols, getattr(torch, dtype), seed=3)
    check_bdrln(torch, harness, t, P_DROP, rows, cols, dtype, f"bdrln path {path}", path=PATHS[path])
    g = run_gelu(torch, harness, t, path=PATHS[path] & pu_harness.PATH_ELEMENTWISE)
    y, dx, dbias = gelu_reference(torch, t)
    assert_matches(
        torch, g, {"y": y, "dx": dx, "dbias": dbias}, dtype, ["y"], ["dx", "dbias"], f"bias_gelu path {path}"
    )


@pytest.mark.parametrize("dtype,cols", [("float16", 16392), ("float32", 4100), ("float32", 1031)])
def test_long_rows_take_the_wide_path(torch_cuda, harness, dtype, cols):
    """Rows longer than the register path holds (1024 vectors) by default."""
    torch = torch_cuda
    t = inputs(torch, 19, cols, getattr(torch, dtype), seed=4)
    check_bdrln(torch, harness, t, P_DROP, 19, cols, dtype, f"bdrln wide {dtype} {cols}")


@pytest.mark.parametrize("cols", [32, 771, 1024])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_mask_is_the_cpu_mask(torch_cuda, harness, dtype, cols):
    """x + bias = 1, residual = 0, w = 1, b = 0: z is the multiplier itself, so y > 0
    exactly where an element was kept (rows with both kinds); the backward pass must
    drop the same elements (dx = 0 there, dx = dresidual / (1 - p) elsewhere)."""
    torch = torch_cuda
    dt = getattr(torch, dtype)
    rows, p = 40, 0.3
    for seed, offset in ((SEED, OFFSET), (2**63 + 5, 2**32 + 9)):
        keep = rowwise_keep(seed, offset, p, rows, cols)
        t = {
            "x": torch.ones(rows, cols, dtype=dt, device="cuda"),
            "residual": torch.zeros(rows, cols, dtype=dt, device="cuda"),
            "dy": torch.randn(rows, cols, device="cuda").to(dt),
            "bias": torch.zeros(cols, dtype=dt, device="cuda"),
            "ln_weight": torch.ones(cols, dtype=dt, device="cuda"),
            "ln_bias": torch.zeros(cols, dtype=dt, device="cuda"),
        }
        out = run_bdrln(torch, harness, t, p, seed=seed, offset=offset)
        mixed = keep.any(axis=1) & ~keep.all(axis=1)
        got = (out["y"].float() > 0).cpu().numpy()
        np.testing.assert_array_equal(got[mixed], keep[mixed], err_msg=f"forward mask, seed {seed}")
        dx, dres = out["dx"].float().cpu().numpy(), out["dresidual"].float().cpu().numpy()
        live = dres != 0
        np.testing.assert_array_equal((dx != 0)[live], keep[live], err_msg=f"backward mask, seed {seed}")


def test_reruns_are_bitwise_identical(torch_cuda, harness):
    torch = torch_cuda
    t = inputs(torch, 4096, 1024, torch.bfloat16, seed=9)
    a, b = run_bdrln(torch, harness, t, P_DROP), run_bdrln(torch, harness, t, P_DROP)
    for name in a:
        assert torch.equal(a[name], b[name]), f"bdrln {name} differs between two identical runs"
    t = inputs(torch, 4096, 3072, torch.float16, seed=10)
    a, b = run_gelu(torch, harness, t), run_gelu(torch, harness, t)
    for name in a:
        assert torch.equal(a[name], b[name]), f"bias_gelu {name} differs between two identical runs"


def test_misaligned_views_fall_back_to_elements(torch_cuda, harness):
    """A view one element off a 16-byte boundary: element-wise loads, same results."""
    torch = torch_cuda
    rows, cols = 7, 768
    t = inputs(torch, rows, cols, torch.float16, seed=12)
    base = torch.empty(rows * cols + 1, dtype=torch.float16, device="cuda")
    x = base[1:].view(rows, cols)
    x.copy_(t["x"])
    y = harness.bias_gelu_fwd(x, t["bias"])
    ref = gelu_reference(torch, t)[0]
    torch.cuda.synchronize()
    assert rel_err(torch, y, ref) <= TOL["float16"]["out"]


def test_unsupported_problems_are_refused(torch_cuda, harness):
    torch = torch_cuda
    x = torch.zeros(4, 8, device="cuda")
    v = torch.zeros(8, device="cuda")
    with pytest.raises(pu_harness.HarnessError, match="epsilon"):
        harness.bdrln_fwd(x, v, x, v, v, epsilon=0.0)
    with pytest.raises(pu_harness.HarnessError, match="dropout"):
        harness.bdrln_fwd(x, v, x, v, v, dropout=1.0)
    e = torch.zeros(4, 0, device="cuda")
    with pytest.raises(pu_harness.HarnessError, match="normalised size"):
        harness.bdrln_fwd(e, e[0], e, e[0], e[0])
    with pytest.raises(pu_harness.HarnessError, match="dtype"):
        harness.bias_gelu_fwd(x.double(), v.double())

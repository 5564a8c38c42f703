"""CUDA FMHA kernels (through the C-ABI harness) against a PyTorch fp32 reference.

The reference runs on the padded batch: [B, H, S, D] with a key-padding mask, softmax
in fp32, the dropout keep-mask from tests/philox_ref.py (the numpy Philox the CPU tests
use). Error = max |ours - ref| / max |ref| per tensor; it must stay within the dtype's
tolerance or twice the error of the same padded math run by torch in the low precision.

Every buffer the kernels read or write sits between NaN-filled rows, at least PAD of them
and as many more as keep the view 16-byte aligned (torch_checks.guard_rows), since the
kernel entry refuses a less aligned pointer: a kernel that reads a neighbour produces NaN,
one that writes past its rows overwrites the NaN.

The backward runs in both modes: the default one-pass kernel (dQ added with fp32 atomics,
so only dQ's last bits may change between runs) and ``deterministic=True`` (bitwise reruns).
"""

import functools
import math

import numpy as np
import pytest

import philox_ref
from torch_checks import check_neighbours, op_rules, poisoned, rel_err

LENGTHS = (0, 1, 127, 129, 1000, 2048)  # ragged, with an empty sequence
HEADS = 2
SEED, OFFSET = 2**40 + 12345, 7  # both Philox key words non-zero
PAD = 3  # at least this many NaN rows around every buffer (more where alignment needs them)
TOL = op_rules().FMHA_GPU_TOLERANCE  # {dtype: {"out", "grad": max err / max |ref|, "lse": max abs err}}
DTYPES = ("float16", "bfloat16")

pytestmark = pytest.mark.gpu


def cu_of(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@functools.lru_cache(maxsize=None)
def keep_masks(lengths, heads, seed, offset, p):
    return philox_ref.dropout_keep_mask(seed, offset, p, cu_of(lengths), heads)


def tdtype(torch, name):
    return getattr(torch, name)


def reference(torch, q, k, v, dout, lengths, scale, p, masks, compute_dtype):
    """Padded-batch attention in compute_dtype; returns packed fp32 out, lse, dq, dk, dv."""
    T, H, D = q.shape
    cu = cu_of(lengths)
    nz = [(i, s) for i, s in enumerate(lengths) if s > 0]
    B, S = len(nz), max(s for _, s in nz)

    def pad(x):  # [T, H, D] -> [B, H, S, D]
        out = x.new_zeros(B, S, H, D)
        for bi, (i, s) in enumerate(nz):
            out[bi, :s] = x[cu[i] : cu[i] + s]
        return out.permute(0, 2, 1, 3)

    def unpad(x):  # [B, H, S, ...] -> [T, H, ...]
        res = torch.zeros((T, H, *x.shape[3:]), device="cuda", dtype=torch.float32)
        for bi, (i, s) in enumerate(nz):
            res[cu[i] : cu[i] + s] = x[bi, :, :s].transpose(0, 1).float()
        return res

    qp, kp, vp = (pad(x.to(compute_dtype)).detach().requires_grad_() for x in (q, k, v))
    lens = torch.tensor([s for _, s in nz], device="cuda")
    keymask = torch.arange(S, device="cuda")[None, :] < lens[:, None]
    scores = (qp @ kp.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~keymask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if p > 0:
        z = torch.zeros(B, H, S, S, device="cuda")
        for bi, (i, s) in enumerate(nz):
            z[bi, :, :s, :s] = torch.from_numpy(masks[i].astype(np.float32)).cuda() / (1.0 - p)
        probs = probs * z
    outp = probs.to(compute_dtype) @ vp
    outp.backward(pad(dout.to(compute_dtype)))
    return (
        unpad(outp.detach()),
        unpad(lse.detach()[..., None])[..., 0],
        unpad(qp.grad),
        unpad(kp.grad),
        unpad(vp.grad),
    )


def run_ours(torch, harness, q, k, v, dout, lengths, scale, p, seed=SEED, offset=OFFSET, deterministic=False, **kw):
    """Forward + backward with every buffer NaN-poisoned around; returns out, lse, dq, dk, dv.
    kw (grouping, streams) go to both passes, `deterministic` to the backward."""
    T, H, D = q.shape
    cu = cu_of(lengths)
    ins = [poisoned(torch, x.shape, x.dtype, PAD, x)[1] for x in (q, k, v, dout)]
    bufs = {n: poisoned(torch, (T, H, D), q.dtype, PAD) for n in ("out", "dq", "dk", "dv")}
    bufs["lse"] = poisoned(torch, (T, H), torch.float32, PAD)
    harness.fwd(ins[0], ins[1], ins[2], cu, scale, p, seed, offset, out=bufs["out"][1], lse=bufs["lse"][1], **kw)
    harness.bwd(
        ins[0],
        ins[1],
        ins[2],
        bufs["out"][1],
        bufs["lse"][1],
        ins[3],
        cu,
        scale,
        p,
        seed,
        offset,
        dq=bufs["dq"][1],
        dk=bufs["dk"][1],
        dv=bufs["dv"][1],
        deterministic=deterministic,
        **kw,
    )
    torch.cuda.synchronize()
    for name, (full, _) in bufs.items():
        check_neighbours(torch, full, name, PAD)
    return tuple(bufs[n][1] for n in ("out", "lse", "dq", "dk", "dv"))


def inputs(torch, lengths, H, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = int(sum(lengths))
    return [torch.randn(T, H, D, device="cuda", generator=g).to(dtype) for _ in range(4)]


NAMES = ("out", "lse", "dq", "dk", "dv")


def assert_same_bits(torch, a, b, what, dtype, atomic_dq):
    """a, b: (out, lse, dq, dk, dv), bit for bit. atomic_dq (the default backward): dq only
    within the dtype's gradient tolerance, as its fp32 atomic additions come in any order."""
    for name, x, y in zip(NAMES, a, b):
        if name == "dq" and atomic_dq:
            err = rel_err(torch, x, y)
            assert err <= TOL[dtype]["grad"], f"dq {what}: rel err {err:.3e} > {TOL[dtype]['grad']}"
        else:
            assert torch.equal(x, y), f"{name} {what}"


@pytest.mark.parametrize("p", [0.0, 0.1, 0.17])
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_reference(torch_cuda, harness, dtype, D, p):
    """Both backward modes against the same references, and the default against the
    deterministic one."""
    torch = torch_cuda
    dt = tdtype(torch, dtype)
    q, k, v, dout = inputs(torch, LENGTHS, HEADS, D, dt)
    scale = 1.0 / math.sqrt(D)
    masks = keep_masks(LENGTHS, HEADS, SEED, OFFSET, p) if p > 0 else None
    ref = reference(torch, q, k, v, dout, LENGTHS, scale, p, masks, torch.float32)
    low = reference(torch, q, k, v, dout, LENGTHS, scale, p, masks, dt)
    runs = {det: run_ours(torch, harness, q, k, v, dout, LENGTHS, scale, p, deterministic=det) for det in (False, True)}
    for det, ours in runs.items():
        report = {}
        for idx, name in ((0, "out"), (2, "dq"), (3, "dk"), (4, "dv")):
            err, err_low = rel_err(torch, ours[idx], ref[idx]), rel_err(torch, low[idx], ref[idx])
            kind = "out" if name == "out" else "grad"
            report[name] = (err, err_low)
            assert err <= max(TOL[dtype][kind], 2.0 * err_low), (f"deterministic={det}", name, report)
        lse_err = (ours[1] - ref[1]).abs().max().item()
        assert lse_err <= TOL[dtype]["lse"], (f"deterministic={det}", "lse", lse_err)
    for name, x, y in zip(NAMES, runs[False], runs[True]):
        if name in ("out", "lse"):  # the same forward, run twice
            assert torch.equal(x, y), f"{name} differs between two identical forward runs"
        else:
            err = rel_err(torch, x, y)
            assert err <= TOL[dtype]["grad"], f"{name}: default vs deterministic backward, rel err {err:.3e}"


def mixed_rows_mask(torch, x, rows, s, ref, what):
    """x[rows, :, :s] > 0 equals the keep-mask `ref` [H, i, j] on every (head, query) row that
    keeps some keys and drops others (the only rows where the sign carries the mask)."""
    got = (x[rows, :, :s].float() > 0).permute(1, 0, 2).cpu().numpy()  # [H, i, j]
    mixed = ref.any(axis=-1) & ~ref.all(axis=-1)
    np.testing.assert_array_equal(got[mixed], ref[mixed], err_msg=what)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_mask_is_the_cpu_mask(torch_cuda, harness, dtype):
    """q = 0 makes P uniform (1/s); v = k = one-hot of the key index turns out into the
    keep-mask row by row. dout = one-hot of the query index turns dv into its transpose;
    dout = ones makes dq[i, j] = (keep_ij - kept_i / s) / (s (1 - p)): positive where kept,
    negative where dropped. Both backward modes (their dK/dV and dQ kernels make the mask)."""
    torch = torch_cuda
    dt = tdtype(torch, dtype)
    lengths, H, D, p = (5, 128, 77, 0, 100, 128), 3, 128, 0.3
    cu = cu_of(lengths)
    T = int(cu[-1])
    q = torch.zeros(T, H, D, device="cuda", dtype=dt)
    onehot = torch.zeros(T, H, D, device="cuda", dtype=dt)
    ones = torch.zeros(T, H, D, device="cuda", dtype=dt)
    for b, s in enumerate(lengths):
        ones[cu[b] : cu[b] + s, :, :s] = 1
        for j in range(s):
            onehot[cu[b] + j, :, j] = 1
    for seed, offset in ((SEED, OFFSET), (2**63 + 5, 2**32 + 9)):
        masks = philox_ref.dropout_keep_mask(seed, offset, p, cu, H)
        out, lse = harness.fwd(q, onehot, onehot, cu, 1.0, p, seed, offset)
        grads = {
            det: (
                harness.bwd(q, onehot, onehot, out, lse, onehot, cu, 1.0, p, seed, offset, deterministic=det)[2],
                harness.bwd(q, onehot, onehot, out, lse, ones, cu, 1.0, p, seed, offset, deterministic=det)[0],
            )
            for det in (False, True)
        }
        torch.cuda.synchronize()
        for b, s in enumerate(lengths):
            if s == 0:
                continue
            rows = slice(int(cu[b]), int(cu[b]) + s)
            got = (out[rows, :, :s].float() > 0).permute(1, 0, 2).cpu().numpy()  # [H, i, j]
            np.testing.assert_array_equal(got, masks[b], err_msg=f"forward mask, sequence {b}")
            kept = out[rows, :, :s].float().permute(1, 0, 2)[torch.from_numpy(masks[b]).cuda()]
            torch.testing.assert_close(kept, torch.full_like(kept, 1.0 / (s * (1 - p))), rtol=TOL[dtype]["out"], atol=0)
            for det, (dv, dq) in grads.items():
                got_t = (dv[rows, :, :s].float() > 0).permute(1, 2, 0).cpu().numpy()  # [H, i, j]
                np.testing.assert_array_equal(got_t, masks[b], err_msg=f"dK/dV mask, deterministic={det}, sequence {b}")
                mixed_rows_mask(torch, dq, rows, s, masks[b], f"dQ mask, deterministic={det}, sequence {b}")


@pytest.mark.parametrize("deterministic,p", [(True, 0.0), (True, 0.1), (False, 0.1)])
def test_reruns_are_bitwise_identical(torch_cuda, harness, deterministic, p):
    """deterministic=True: every output bit for bit. The default backward: all but dq."""
    torch = torch_cuda
    q, k, v, dout = inputs(torch, LENGTHS, HEADS, 64, torch.bfloat16)
    kw = dict(deterministic=deterministic)
    a = run_ours(torch, harness, q, k, v, dout, LENGTHS, 0.125, p, **kw)
    b = run_ours(torch, harness, q, k, v, dout, LENGTHS, 0.125, p, **kw)
    c = run_ours(torch, harness, q, k, v, dout, LENGTHS, 0.125, p, streams=1, **kw)
    assert_same_bits(torch, a, b, "differs between two identical runs", "bfloat16", not deterministic)
    assert_same_bits(torch, a, c, "differs between 4 streams and 1 stream", "bfloat16", not deterministic)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouping_gives_the_same_bits(torch_cuda, harness, dtype, deterministic):
    """Per row, every tile configuration runs the same instructions on the same key blocks."""
    torch = torch_cuda
    q, k, v, dout = inputs(torch, LENGTHS, HEADS, 128, tdtype(torch, dtype), seed=3)
    kw = dict(deterministic=deterministic)
    a = run_ours(torch, harness, q, k, v, dout, LENGTHS, 0.09, 0.2, grouping=True, **kw)
    b = run_ours(torch, harness, q, k, v, dout, LENGTHS, 0.09, 0.2, grouping=False, **kw)
    assert_same_bits(torch, a, b, "differs between grouped and ungrouped launches", dtype, not deterministic)


@pytest.mark.parametrize("deterministic", [True, False])
def test_sequences_are_isolated(torch_cuda, harness, deterministic):
    """A NaN sequence between two others changes nothing in them (bit for bit; the default
    backward's dq within tolerance)."""
    torch = torch_cuda
    H, D = 2, 64
    A, B, C = 300, 70, 129
    q, k, v, dout = inputs(torch, (A, B, C), H, D, torch.float16, seed=5)
    for x in (q, k, v, dout):
        x[A : A + B] = float("nan")
    kw = dict(grouping=False)
    T = A + B + C
    out = torch.empty(T, H, D, device="cuda", dtype=torch.float16)
    lse = torch.empty(T, H, device="cuda")
    harness.fwd(q, k, v, cu_of((A, B, C)), 0.125, 0.0, out=out, lse=lse, **kw)
    dq, dk, dv = harness.bwd(q, k, v, out, lse, dout, cu_of((A, B, C)), 0.125, deterministic=deterministic, **kw)
    keep = torch.cat([torch.arange(A), torch.arange(A + B, T)]).cuda()
    q2, k2, v2, d2 = (x[keep].contiguous() for x in (q, k, v, dout))
    out2, lse2 = harness.fwd(q2, k2, v2, cu_of((A, C)), 0.125, 0.0, **kw)
    dq2, dk2, dv2 = harness.bwd(q2, k2, v2, out2, lse2, d2, cu_of((A, C)), 0.125, deterministic=deterministic, **kw)
    torch.cuda.synchronize()
    mine = tuple(x[keep] for x in (out, lse, dq, dk, dv))
    for name, x in zip(NAMES, mine):
        assert torch.isfinite(x.float()).all(), f"{name}: NaN leaked from the neighbour"
    assert_same_bits(torch, mine, (out2, lse2, dq2, dk2, dv2), "changed by the neighbour", "float16", not deterministic)


@pytest.mark.parametrize("grouping", [True, False])
def test_many_short_sequences(torch_cuda, harness, grouping):
    """More sequences than one launch carries (440), lengths 0..40."""
    torch = torch_cuda
    rng = np.random.default_rng(7)
    lengths = tuple(int(x) for x in rng.integers(0, 41, size=1000))
    q, k, v, dout = inputs(torch, lengths, 3, 64, torch.float16, seed=11)
    ours = run_ours(torch, harness, q, k, v, dout, lengths, 0.125, 0.0, grouping=grouping)
    ref = reference(torch, q, k, v, dout, lengths, 0.125, 0.0, None, torch.float32)
    low = reference(torch, q, k, v, dout, lengths, 0.125, 0.0, None, torch.float16)
    for idx, name in ((0, "out"), (2, "dq"), (3, "dk"), (4, "dv")):
        err, err_low = rel_err(torch, ours[idx], ref[idx]), rel_err(torch, low[idx], ref[idx])
        assert err <= max(TOL["float16"]["out" if name == "out" else "grad"], 2.0 * err_low), (name, err, err_low)


def test_single_token_and_empty_batches(torch_cuda, harness):
    torch = torch_cuda
    # A batch with no tokens at all: nothing is launched, nothing fails.
    e = torch.empty(0, 2, 64, device="cuda", dtype=torch.float16)
    out, lse = harness.fwd(e, e, e, cu_of((0, 0)), 0.125)
    harness.bwd(e, e, e, out, lse, e, cu_of((0, 0)), 0.125)
    # One token between empty sequences: softmax of one score is exactly 1.
    q, k, v, dout = inputs(torch, (0, 1, 0), 2, 64, torch.float16)
    out, lse, dq, dk, dv = run_ours(torch, harness, q, k, v, dout, (0, 1, 0), 0.125, 0.0)
    assert torch.equal(out, v)
    assert torch.equal(dv, dout)
    assert dq.abs().max().item() < 1e-3 and dk.abs().max().item() < 1e-3


def test_unsupported_problems_are_refused(torch_cuda, harness):
    import pu_harness

    torch = torch_cuda
    x = torch.zeros(4, 2, 48, device="cuda", dtype=torch.float16)
    with pytest.raises(pu_harness.HarnessError, match="head size"):
        harness.fwd(x, x, x, cu_of((4,)), 0.1)
    y = torch.zeros(4, 2, 64, device="cuda", dtype=torch.float32)
    with pytest.raises(pu_harness.HarnessError, match="float32"):
        harness.fwd(y, y, y, cu_of((4,)), 0.1)
    z = torch.zeros(4, 2, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(pu_harness.HarnessError, match="cu_seqlens"):
        harness.fwd(z, z, z, cu_of((3,)), 0.1)


def offset_copy(torch, x, nbytes):
    """x's values in a view `nbytes` past a 16-byte boundary (torch allocations are aligned)."""
    skip = nbytes // x.element_size()
    view = torch.full((x.numel() + skip,), float("nan"), dtype=x.dtype, device="cuda")[skip:].view(x.shape)
    view.copy_(x)
    assert view.data_ptr() % 16 == nbytes, (view.data_ptr() % 16, nbytes)
    return view


def test_misaligned_views_are_refused_by_name(torch_cuda, harness):
    """The kernels move 16-byte vectors: a view off a 16-byte boundary is refused with the
    tensor's name before anything runs (the outputs keep their NaN), and the same call with
    aligned tensors goes through."""
    import pu_harness

    torch = torch_cuda
    lengths, H, D = (5, 130), 2, 64
    cu = cu_of(lengths)
    q, k, v, dout = inputs(torch, lengths, H, D, torch.float16, seed=13)
    T = q.shape[0]
    out, lse = harness.fwd(q, k, v, cu, 0.125)
    ws_bytes = harness.lib.pu_fmha_bwd_workspace_bytes(T, H, D, 0)
    ws = torch.empty((ws_bytes + 3) // 4 + 4, dtype=torch.float32, device="cuda")  # room for 16 bytes in
    lse_row3 = torch.full((T + 6, H), float("nan"), device="cuda")[3 : 3 + T]  # 24 bytes in with 2 heads
    assert lse_row3.data_ptr() % 16 == 8
    nan_out = torch.full_like(q, float("nan"))
    fwd_cases = {
        "q": dict(q=offset_copy(torch, q, 2)),
        "v": dict(v=offset_copy(torch, v, 8)),
        "out": dict(out=offset_copy(torch, nan_out, 2)),
        "lse": dict(lse=lse_row3),
    }
    for name, bad in fwd_cases.items():
        args = dict(q=q, k=k, v=v, out=torch.full_like(q, float("nan")), lse=None)
        args.update(bad)
        with pytest.raises(pu_harness.HarnessError, match=rf"\b{name} must be 16-byte aligned"):
            harness.fwd(args["q"], args["k"], args["v"], cu, 0.125, out=args["out"], lse=args["lse"])
        torch.cuda.synchronize()
        assert torch.isnan(args["out"].float()).all(), f"forward refused for {name} but wrote out"
    bwd_cases = {
        "dout": dict(dout=offset_copy(torch, dout, 2)),
        "lse": dict(lse=offset_copy(torch, lse, 4)),
        "dq": dict(dq=offset_copy(torch, nan_out, 2)),
        "dv": dict(dv=offset_copy(torch, nan_out, 6)),
        "workspace": dict(workspace=ws[1:]),
    }
    for name, bad in bwd_cases.items():
        for det in (False, True):
            args = dict(dout=dout, lse=lse, dq=None, dv=None, workspace=None)
            args.update(bad)
            dk = torch.full_like(q, float("nan"))
            with pytest.raises(pu_harness.HarnessError, match=rf"\b{name} must be 16-byte aligned"):
                harness.bwd(
                    q,
                    k,
                    v,
                    out,
                    args["lse"],
                    args["dout"],
                    cu,
                    0.125,
                    dq=args["dq"],
                    dk=dk,
                    dv=args["dv"],
                    workspace=args["workspace"],
                    deterministic=det,
                )
            torch.cuda.synchronize()
            assert torch.isnan(dk.float()).all(), f"backward refused for {name} but wrote dk"
    dq, dk, dv = harness.bwd(q, k, v, out, lse, dout, cu, 0.125, workspace=ws[4:])
    torch.cuda.synchronize()
    for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(x.float()).all(), f"{name}: the aligned call after the refusals failed"

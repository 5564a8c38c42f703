"""CUDA FMHA kernels (through the C-ABI harness) against a PyTorch fp32 reference.

The reference runs on the padded batch: [B, H, S, D] with a key-padding mask, softmax
in fp32, the dropout keep-mask from tests/philox_ref.py (the numpy Philox the CPU tests
use). Error = max |ours - ref| / max |ref| per tensor; it must stay within the dtype's
tolerance or twice the error of the same padded math run by torch in the low precision.

Every buffer the kernels read or write sits between NaN-filled rows: a kernel that reads
a neighbour produces NaN, one that writes past its rows overwrites the NaN.
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
PAD = 3  # NaN rows around every buffer
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
    return (unpad(outp.detach()), unpad(lse.detach()[..., None])[..., 0], unpad(qp.grad),
            unpad(kp.grad), unpad(vp.grad))


def run_ours(torch, harness, q, k, v, dout, lengths, scale, p, seed=SEED, offset=OFFSET, **kw):
    """Forward + backward with every buffer NaN-poisoned around; returns out, lse, dq, dk, dv."""
    T, H, D = q.shape
    cu = cu_of(lengths)
    ins = [poisoned(torch, x.shape, x.dtype, PAD, x)[1] for x in (q, k, v, dout)]
    bufs = {n: poisoned(torch, (T, H, D), q.dtype, PAD) for n in ("out", "dq", "dk", "dv")}
    bufs["lse"] = poisoned(torch, (T, H), torch.float32, PAD)
    harness.fwd(ins[0], ins[1], ins[2], cu, scale, p, seed, offset, out=bufs["out"][1],
                lse=bufs["lse"][1], **kw)
    harness.bwd(ins[0], ins[1], ins[2], bufs["out"][1], bufs["lse"][1], ins[3], cu, scale, p, seed,
                offset, dq=bufs["dq"][1], dk=bufs["dk"][1], dv=bufs["dv"][1], **kw)
    torch.cuda.synchronize()
    for name, (full, _) in bufs.items():
        check_neighbours(torch, full, name, PAD)
    return tuple(bufs[n][1] for n in ("out", "lse", "dq", "dk", "dv"))


def inputs(torch, lengths, H, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = int(sum(lengths))
    return [torch.randn(T, H, D, device="cuda", generator=g).to(dtype) for _ in range(4)]


@pytest.mark.parametrize("p", [0.0, 0.17])
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_reference(torch_cuda, harness, dtype, D, p):
    torch = torch_cuda
    dt = tdtype(torch, dtype)
    q, k, v, dout = inputs(torch, LENGTHS, HEADS, D, dt)
    scale = 1.0 / math.sqrt(D)
    masks = keep_masks(LENGTHS, HEADS, SEED, OFFSET, p) if p > 0 else None
    ours = run_ours(torch, harness, q, k, v, dout, LENGTHS, scale, p)
    ref = reference(torch, q, k, v, dout, LENGTHS, scale, p, masks, torch.float32)
    low = reference(torch, q, k, v, dout, LENGTHS, scale, p, masks, dt)
    report = {}
    for idx, name in ((0, "out"), (2, "dq"), (3, "dk"), (4, "dv")):
        err, err_low = rel_err(torch, ours[idx], ref[idx]), rel_err(torch, low[idx], ref[idx])
        kind = "out" if name == "out" else "grad"
        report[name] = (err, err_low)
        assert err <= max(TOL[dtype][kind], 2.0 * err_low), (name, report)
    lse_err = (ours[1] - ref[1]).abs().max().item()
    assert lse_err <= TOL[dtype]["lse"], ("lse", lse_err)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_mask_is_the_cpu_mask(torch_cuda, harness, dtype):
    """q = k = 0 makes P uniform (1/s); v = one-hot of the key index turns out into the
    keep-mask row by row, and dout = one-hot of the query index turns dv into its transpose."""
    torch = torch_cuda
    dt = tdtype(torch, dtype)
    lengths, H, D, p = (5, 128, 77, 0, 100, 128), 3, 128, 0.3
    cu = cu_of(lengths)
    T = int(cu[-1])
    for seed, offset in ((SEED, OFFSET), (2**63 + 5, 2**32 + 9)):
        masks = philox_ref.dropout_keep_mask(seed, offset, p, cu, H)
        q = torch.zeros(T, H, D, device="cuda", dtype=dt)
        onehot = torch.zeros(T, H, D, device="cuda", dtype=dt)
        for b, s in enumerate(lengths):
            for j in range(s):
                onehot[cu[b] + j, :, j] = 1
        out, lse = harness.fwd(q, q, onehot, cu, 1.0, p, seed, offset)
        dq, dk, dv = harness.bwd(q, q, onehot, out, lse, onehot, cu, 1.0, p, seed, offset)
        torch.cuda.synchronize()
        for b, s in enumerate(lengths):
            if s == 0:
                continue
            rows = slice(int(cu[b]), int(cu[b]) + s)
            got = (out[rows, :, :s].float() > 0).permute(1, 0, 2).cpu().numpy()  # [H, i, j]
            np.testing.assert_array_equal(got, masks[b], err_msg=f"forward mask, sequence {b}")
            kept = out[rows, :, :s].float().permute(1, 0, 2)[torch.from_numpy(masks[b]).cuda()]
            torch.testing.assert_close(kept, torch.full_like(kept, 1.0 / (s * (1 - p))), rtol=TOL[dtype]["out"],
                                       atol=0)
            got_t = (dv[rows, :, :s].float() > 0).permute(1, 2, 0).cpu().numpy()  # [H, i, j]
            np.testing.assert_array_equal(got_t, masks[b], err_msg=f"backward mask, sequence {b}")


def test_reruns_are_bitwise_identical(torch_cuda, harness):
    torch = torch_cuda
    q, k, v, dout = inputs(torch, LENGTHS, HEADS, 64, torch.bfloat16)
    a = run_ours(torch, harness, q, k, v, dout, LENGTHS, 0.125, 0.1)
    b = run_ours(torch, harness, q, k, v, dout, LENGTHS, 0.125, 0.1)
    c = run_ours(torch, harness, q, k, v, dout, LENGTHS, 0.125, 0.1, streams=1)
    for name, x, y, z in zip(("out", "lse", "dq", "dk", "dv"), a, b, c):
        assert torch.equal(x, y), f"{name} differs between two identical runs"
        assert torch.equal(x, z), f"{name} differs between 4 streams and 1 stream"


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouping_gives_the_same_bits(torch_cuda, harness, dtype):
    """Per row, every tile configuration runs the same instructions on the same key blocks."""
    torch = torch_cuda
    q, k, v, dout = inputs(torch, LENGTHS, HEADS, 128, tdtype(torch, dtype), seed=3)
    a = run_ours(torch, harness, q, k, v, dout, LENGTHS, 0.09, 0.2, grouping=True)
    b = run_ours(torch, harness, q, k, v, dout, LENGTHS, 0.09, 0.2, grouping=False)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), a, b):
        assert torch.equal(x, y), f"{name}: grouped and ungrouped launches differ"


def test_sequences_are_isolated(torch_cuda, harness):
    """A NaN sequence between two others changes nothing in them (bit for bit)."""
    torch = torch_cuda
    H, D = 2, 64
    A, B, C = 300, 70, 129
    q, k, v, dout = inputs(torch, (A, B, C), H, D, torch.float16, seed=5)
    for x in (q, k, v, dout):
        x[A : A + B] = float("nan")
    harness_kw = dict(grouping=False)
    T = A + B + C
    out = torch.empty(T, H, D, device="cuda", dtype=torch.float16)
    lse = torch.empty(T, H, device="cuda")
    harness.fwd(q, k, v, cu_of((A, B, C)), 0.125, 0.0, out=out, lse=lse, **harness_kw)
    dq, dk, dv = harness.bwd(q, k, v, out, lse, dout, cu_of((A, B, C)), 0.125, **harness_kw)
    keep = torch.cat([torch.arange(A), torch.arange(A + B, T)]).cuda()
    q2, k2, v2, d2 = (x[keep].contiguous() for x in (q, k, v, dout))
    out2, lse2 = harness.fwd(q2, k2, v2, cu_of((A, C)), 0.125, 0.0, **harness_kw)
    dq2, dk2, dv2 = harness.bwd(q2, k2, v2, out2, lse2, d2, cu_of((A, C)), 0.125, **harness_kw)
    torch.cuda.synchronize()
    for name, x, y in (("out", out, out2), ("lse", lse, lse2), ("dq", dq, dq2), ("dk", dk, dk2),
                       ("dv", dv, dv2)):
        assert torch.isfinite(x[keep].float()).all(), f"{name}: NaN leaked from the neighbour"
        assert torch.equal(x[keep], y), f"{name}: the neighbour changed the result"


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

"""The CUDA FMHA kernels (custom_ops/kernels/cuda/fmha_*: flash-attention-2 forward, the
one-pass backward and the deterministic two-kernel backward, Philox dropout, the grouped
multi-stream launch) run on the CPU under the emulation of tests/cuda_emu (fibers for
threads, emulated mma.sync / ldmatrix / movmatrix / cp.async / ex2.approx, themselves
checked by test_cuda_emulated_isa.py), through the C-ABI harness, against the float64
reference of the CPU tests (tests/test_fmha.py).
The emulation also fails a launch on an asynchronous-copy race between warps (a missing
wait_group or __syncthreads), an out-of-bounds or misaligned shared-memory operand, or a
barrier that not every thread reaches; shared memory starts as NaN in every block.

Every run: NaN guard rows around every buffer (inputs, outputs, lse, the backward
workspace), which must stay NaN and never reach a result. Checked here: forward output and
lse, dq / dk / dv for fp16 and bf16, head sizes 32 / 64 / 128, both backward modes, a
ragged batch with lengths 0, 1, odd, tile +- 1 and a sequence longer than two tiles
(forward tiles of 64 and 128 query rows, backward key blocks of 128 / 64), dropout 0, 0.1
and 0.5; the dropout mask equal to the CPU kernel's (and to tests/philox_ref.py) for the
same (seed, offset) in the forward, in P Z of dV and in dS of dQ and dK, in both modes; the
two modes' dK and dV bit for bit equal and their dQ within tolerance; grouped and single
launches bit for bit equal (dQ of the one-pass mode: within tolerance, its additions are
unordered on a GPU); deterministic reruns bitwise identical; a NaN sequence leaves its
neighbours' bits unchanged (dQ included); more sequences than one launch carries; what the
kernels execute, counted as they run: one Philox call per eight attention elements in every
kernel that makes the mask, and the tensor-core work per element of each backward.
Tolerances: paddle_unpad.ops.FMHA_GPU_TOLERANCE.

Not a GPU run: hardware precision (ex2.approx, the tensor cores' internal sums), races
between real warps, register limits and speed are for tests/gpu on a GPU machine.
Locally skipped when the emulation cannot be built (no g++ / CUDA headers); fails under CI.
"""

import ctypes
import functools
import math
import os
import sys

import numpy as np
import pytest

import philox_ref
import testutil
from paddle_unpad import ops
from test_fmha import reference

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emu"))
import emu_build  # noqa: E402
import pu_harness  # noqa: E402  (tests/gpu, on the path by emu_build)
from host_buffers import Buffer, aligned_empty, to_storage  # noqa: E402

pytestmark = pytest.mark.build

CODE = {"float16": 0, "bfloat16": 1}
TOL = ops.FMHA_GPU_TOLERANCE
PAD = 8  # NaN rows around every buffer
SEED, OFFSET = 2**40 + 12345, 7  # both Philox key words non-zero
HEADS = 2
# Forward tiles are 64 or 128 query rows (the grouped launch picks per length bucket: here
# 64 for <= 64, 128 for 65..128, 64 above; the single launch 128 for all), key blocks 64;
# backward blocks 64 (32 for D = 128). Lengths: empty ones (first, middle, last), 1, odd,
# every tile size +- 1, and 257 = more than two tiles of any size.
LENGTHS = (0, 1, 63, 2, 65, 0, 129, 31, 127, 33, 7, 257, 0)


def cu_of(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@pytest.fixture(scope="module")
def lib():
    lib = emu_build.load(pytest)
    lib.emu_take_counters.argtypes = [ctypes.c_void_p]
    lib.emu_set_block_order.argtypes = [ctypes.c_int]
    return lib


MODES = {"one_pass": 0, "deterministic": 1}


def take_counters(lib):
    """{mma, philox, atomics} the kernels executed since the last call."""
    out = np.zeros(3, np.uint64)
    lib.emu_take_counters(out.ctypes.data_as(ctypes.c_void_p))
    return dict(zip(("mma", "philox", "atomics"), (int(x) for x in out)))


@functools.lru_cache(maxsize=None)
def problem_values(lengths, heads, d, dt, seed=0):
    """q, k, v, dout as (storage, float64 values) pairs; q and k scaled for peaked softmaxes."""
    rng = np.random.default_rng(seed)
    T = int(sum(lengths))
    q, k, v, dout = (rng.standard_normal((T, heads, d)) for _ in range(4))
    return tuple(to_storage(x, dt) for x in (q * 1.5, k * 1.5, v, dout))


def run(lib, lengths, d, dt, p, values=None, scale=None, heads=HEADS, mode="one_pass", **launch):
    """Forward + backward through the harness; returns dict of float64 out, lse, dq, dk, dv
    (and the raw storage under "bits"), after checking every guard row. launch: grouping=True,
    streams=4, seed=SEED, offset=OFFSET (the rest of pu_harness.fmha_problem's arguments)."""
    cu = cu_of(lengths)
    T = int(cu[-1])
    vals = values or problem_values(tuple(lengths), heads, d, dt)
    heads = vals[0][0].shape[1]
    q, k, v, dout = (Buffer(s.shape, dt, PAD, s) for s, _ in vals)
    out, dq, dk, dv = (Buffer((T, heads, d), dt, PAD) for _ in range(4))
    lse = Buffer((T, heads), "float32", PAD)
    ws = Buffer((max(lib.pu_fmha_bwd_workspace_bytes(T, heads, d, MODES[mode]) // 4, 1),), "float32", PAD)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    launch = {"seed": SEED, "offset": OFFSET, **launch}
    cu, head = pu_harness.fmha_problem(cu, (T, heads, d), CODE[dt], scale, p, **launch)
    rc = lib.pu_fmha_fwd(*head, q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, None)
    assert rc == 0, "forward: " + lib.pu_harness_last_error().decode()
    rc = lib.pu_fmha_bwd(
        *head, MODES[mode], q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, dout.ptr, dq.ptr, dk.ptr, dv.ptr, ws.ptr, None
    )
    assert rc == 0, "backward: " + lib.pu_harness_last_error().decode()
    bufs = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    for name, b in bufs.items():
        b.check(name)
    for name, b in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        b.check(name)  # never written, guards intact
    ws.view[...] = 0  # scratch: only its guards must be intact
    ws.check("workspace")
    res = {name: b.values() for name, b in bufs.items()}
    res["bits"] = {name: b.view.copy() for name, b in bufs.items()}
    return res


def lse_reference(q, k, cu, scale):
    lse = np.zeros(q.shape[:2])
    for b in range(len(cu) - 1):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        if s1 > s0:
            S = np.einsum("ihd,jhd->hij", q[s0:s1], k[s0:s1]) * scale
            m = S.max(-1, keepdims=True)
            lse[s0:s1] = (m[..., 0] + np.log(np.exp(S - m).sum(-1))).T
    return lse


def emulated(lib, lengths, d, dt, p, grouping=True, mode="one_pass"):
    """run(), once per problem for the whole module (the tests compare the same runs)."""
    return _emulated(lib, lengths, d, dt, p, grouping, mode)


@functools.lru_cache(maxsize=None)
def _emulated(lib, lengths, d, dt, p, grouping, mode):
    return run(lib, lengths, d, dt, p, grouping=grouping, mode=mode)


def check_against_reference(res, lengths, d, dt, p, seed=SEED, offset=OFFSET, heads=HEADS):
    cu = cu_of(lengths)
    q, k, v, dout = (x for _, x in problem_values(tuple(lengths), heads, d, dt))
    keep = philox_ref.dropout_keep_mask(seed, offset, p, cu, heads) if p > 0 else None
    scale = 1.0 / math.sqrt(d)
    ref = dict(zip(("out", "dq", "dk", "dv"), reference(q, k, v, cu, scale, p, keep, dout)))
    for name, r in ref.items():
        testutil.assert_close(f"{dt}/D={d}/p={p}/{name}", res[name], r, TOL[dt]["out" if name == "out" else "grad"])
    err = np.abs(res["lse"] - lse_reference(q, k, cu, scale)).max()
    assert err <= TOL[dt]["lse"], f"{dt}/D={d}/p={p}/lse: max abs err {err:.3e} > {TOL[dt]['lse']}"


# ------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "mode,p", [("one_pass", 0.0), ("one_pass", 0.1), ("one_pass", 0.5), ("deterministic", 0.0), ("deterministic", 0.1)]
)
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("dt", list(CODE))
def test_matches_float64_reference(lib, dt, d, p, mode):
    check_against_reference(emulated(lib, LENGTHS, d, dt, p, mode=mode), LENGTHS, d, dt, p)


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("dt", list(CODE))
def test_the_two_backward_modes_agree(lib, dt, d, p):
    """The key-block kernel is the same code in both modes up to dQ: dK and dV bit for bit;
    dQ (fp32 atomics and one conversion against an in-register sum) within tolerance."""
    one = emulated(lib, LENGTHS, d, dt, p)
    det = emulated(lib, LENGTHS, d, dt, p, mode="deterministic")
    for name in ("out", "lse", "dk", "dv"):
        np.testing.assert_array_equal(one["bits"][name], det["bits"][name], err_msg=f"{name}: the modes differ")
    testutil.assert_close(f"{dt}/D={d}/p={p}/dq one-pass vs deterministic", one["dq"], det["dq"], TOL[dt]["grad"])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("dt", list(CODE))
def test_single_launch_gives_the_grouped_bits(lib, dt, d, mode, p=0.1):
    """Grouping picks 64-row forward tiles for some buckets, the single launch 128 for all:
    per row, both run the same instructions on the same key blocks. The one-pass dQ adds its
    key blocks' parts in launch order, which grouping changes: within tolerance there."""
    grouped = emulated(lib, LENGTHS, d, dt, p, mode=mode)
    single = emulated(lib, LENGTHS, d, dt, p, grouping=False, mode=mode)
    for name in ("out", "lse", "dq", "dk", "dv"):
        if name == "dq" and mode == "one_pass":
            testutil.assert_close(
                f"{dt}/D={d}/p={p}/dq grouped vs single", grouped["dq"], single["dq"], TOL[dt]["grad"]
            )
            continue
        np.testing.assert_array_equal(
            grouped["bits"][name], single["bits"][name], err_msg=f"{name}: grouped and single launches differ"
        )


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_the_one_pass_dq_does_not_depend_on_which_key_block_comes_first(lib, p):
    """Each dQ tile takes a part from every key block of its sequence: the first to arrive
    stores it, the others add theirs, the last converts the tile. Blocks run last to first,
    the roles go to other blocks: dK, dV (and the forward) keep their bits, dQ stays within
    tolerance of the reference."""
    first = emulated(lib, LENGTHS, 64, "bfloat16", p)
    lib.emu_set_block_order(1)
    try:
        last = run(lib, LENGTHS, 64, "bfloat16", p)
    finally:
        lib.emu_set_block_order(0)
    for name in ("out", "lse", "dk", "dv"):
        np.testing.assert_array_equal(first["bits"][name], last["bits"][name], err_msg=f"{name}: block order matters")
    check_against_reference(last, LENGTHS, 64, "bfloat16", p)
    testutil.assert_close(f"p={p}/dq first-to-last vs last-to-first", first["dq"], last["dq"], TOL["bfloat16"]["grad"])


def test_deterministic_reruns_and_stream_counts_are_bitwise_identical(lib):
    first = emulated(lib, LENGTHS, 64, "bfloat16", 0.1, mode="deterministic")
    again = run(lib, LENGTHS, 64, "bfloat16", 0.1, mode="deterministic")
    one_stream = run(lib, LENGTHS, 64, "bfloat16", 0.1, streams=1, mode="deterministic")
    for name in ("out", "lse", "dq", "dk", "dv"):
        np.testing.assert_array_equal(first["bits"][name], again["bits"][name], err_msg=f"{name}: rerun differs")
        np.testing.assert_array_equal(
            first["bits"][name], one_stream["bits"][name], err_msg=f"{name}: 4 streams and 1 stream differ"
        )


def _probe_values(lengths, heads, d, dt, dout_ones):
    """q = onehot(query index), k = 0 or onehot(key index), v = onehot(key index) [T, H, D]:
    see test_dropout_mask_is_the_cpu_kernels."""
    cu = cu_of(lengths)
    T = int(cu[-1])
    onehot = np.zeros((T, heads, d))
    for b, s in enumerate(lengths):
        onehot[cu[b] + np.arange(s), :, np.arange(s)] = 1.0
    zeros = np.zeros((T, heads, d))
    if dout_ones:  # scores q k^T = 1 on the diagonal, 0 elsewhere; dO = 1 everywhere
        return tuple(to_storage(x, dt) for x in (onehot, onehot, onehot, np.ones((T, heads, d))))
    return tuple(to_storage(x, dt) for x in (zeros, zeros, onehot, onehot))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dt,seed,offset", [("float16", SEED, OFFSET), ("bfloat16", 2**63 + 5, 2**32 + 9)])
def test_dropout_mask_is_the_cpu_kernels(lib, native_ops, dt, seed, offset, mode):
    """Every place a kernel applies the mask, read back through one-hot inputs:
    - q = k = 0 makes every probability 1/s; v = one-hot of the key index turns out into the
      keep mask (times 1 / (s (1 - p))), and dout = one-hot of the query index turns dv into
      its transpose (P Z of the dV product). The CPU kernel (float32) runs the same problem.
    - q = k = v = one-hot and dout = 1: dP = 1, so dS = P (Z - delta) with delta = sum_j P Z:
      > 0 where kept, < 0 where dropped (in a row with keys of both kinds); dq[i, j] = dS[i, j]
      (the dQ product of either mode) and dk[j, i] = dS[i, j] (the dK product)."""
    import paddle

    import paddle_unpad

    lengths, H, D, p = (5, 0, 70, 128, 1), 2, 128, 0.3
    cu = cu_of(lengths)
    masks = philox_ref.dropout_keep_mask(seed, offset, p, cu, H)
    probe = dict(scale=1.0, mode=mode, seed=seed, offset=offset)
    res, ones = (
        run(lib, lengths, D, dt, p, values=_probe_values(lengths, H, D, dt, dout_ones), **probe)
        for dout_ones in (False, True)
    )

    zeros, onehot = (x for _, x in _probe_values(lengths, H, D, dt, False)[1:3])
    f32 = [paddle.to_tensor(x.astype(np.float32), stop_gradient=False) for x in (zeros, zeros, onehot)]
    cpu_out = paddle_unpad.fmha(
        *f32, paddle.to_tensor(cu), max(lengths), dropout=p, scale=1.0, rng_state=(seed, offset)
    )
    cpu_out.backward(paddle.to_tensor(onehot.astype(np.float32)))
    cpu_out, cpu_dv = cpu_out.numpy(), f32[2].grad.numpy()
    for b, s in enumerate(lengths):
        if s == 0:
            continue
        rows = slice(int(cu[b]), int(cu[b]) + s)
        fwd = res["out"][rows, :, :s].transpose(1, 0, 2) > 0  # [h, i, j]
        bwd = res["dv"][rows, :, :s].transpose(1, 2, 0) > 0  # dv[j, h, i] = kept(i, j) / (s (1 - p))
        cpu = cpu_out[rows, :, :s].transpose(1, 0, 2) > 0
        cpu_bwd = cpu_dv[rows, :, :s].transpose(1, 2, 0) > 0
        np.testing.assert_array_equal(cpu, masks[b], err_msg=f"CPU kernel vs philox_ref, sequence {b}")
        np.testing.assert_array_equal(fwd, cpu, err_msg=f"forward mask vs the CPU kernel's, sequence {b}")
        np.testing.assert_array_equal(bwd, cpu_bwd, err_msg=f"P Z mask vs the CPU kernel's, sequence {b}")
        kept = res["out"][rows, :, :s].transpose(1, 0, 2)[masks[b]]
        np.testing.assert_allclose(kept, 1.0 / (s * (1 - p)), rtol=TOL[dt]["out"])
        mixed = masks[b].any(axis=2, keepdims=True) & ~masks[b].all(axis=2, keepdims=True)  # the sign tells
        ds_q = ones["dq"][rows, :, :s].transpose(1, 0, 2)  # [h, i, j] = dS[i, j]
        ds_k = ones["dk"][rows, :, :s].transpose(1, 2, 0)  # dk[j, h, i] -> [h, i, j]
        for name, ds in (("dQ", ds_q), ("dK", ds_k)):
            np.testing.assert_array_equal(
                (ds > 0) & mixed, masks[b] & mixed, err_msg=f"dS mask of the {name} product vs philox_ref, sequence {b}"
            )


@pytest.mark.parametrize("mode,bwd_flop,bwd_calls", [("one_pass", 10, 1), ("deterministic", 14, 2)])
def test_the_kernels_execute_one_philox_call_per_eight_elements(lib, mode, bwd_flop, bwd_calls):
    """Counted as the emulated kernels run (so independent of unrolling): equal lengths of
    whole tiles, dropout 0.1. Forward: one Philox call per 8 attention elements, 2 matmuls of
    2 d FLOP each per element; backward: the mask made once per kernel that applies it (one
    kernel in one pass, two in the deterministic mode), 5 matmuls in one pass and 7 in the
    deterministic mode; the one-pass dQ: one atomic addition per dQ element and key block after
    the first."""
    lengths, H, d = (128, 256), 2, 64
    elements = H * sum(s * s for s in lengths)
    take_counters(lib)
    cu = cu_of(lengths)
    T = int(cu[-1])
    vals = problem_values(tuple(lengths), H, d, "bfloat16")
    q, k, v, dout = (Buffer(x.shape, "bfloat16", PAD, x) for x, _ in vals)
    out, dq, dk, dv = (Buffer((T, H, d), "bfloat16", PAD) for _ in range(4))
    lse = Buffer((T, H), "float32", PAD)
    ws = Buffer((lib.pu_fmha_bwd_workspace_bytes(T, H, d, MODES[mode]) // 4,), "float32", PAD)
    head = (cu.ctypes.data_as(ctypes.c_void_p), len(lengths), T, H, d, CODE["bfloat16"], 0.125, 0.1, SEED, OFFSET, 1, 4)
    assert lib.pu_fmha_fwd(*head, q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, None) == 0
    fwd = take_counters(lib)
    assert (
        lib.pu_fmha_bwd(
            *head, MODES[mode], q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, dout.ptr, dq.ptr, dk.ptr, dv.ptr, ws.ptr, None
        )
        == 0
    ), lib.pu_harness_last_error().decode()
    bwd = take_counters(lib)
    assert fwd["philox"] * 8 == elements, (fwd, elements)
    assert fwd["mma"] * 4096 == elements * 4 * d, (fwd, elements)
    assert bwd["philox"] * 8 == bwd_calls * elements, (bwd, elements)
    assert bwd["mma"] * 4096 == elements * bwd_flop * d, (bwd, elements)
    # one pass: of the key blocks that each hold a part of a dQ row, the first stores its part and
    # the others add theirs (a sequence of one key block stores its dQ straight)
    added = sum((-(-s // 128) - 1) * s for s in lengths) * H * d
    assert bwd["atomics"] == (added if mode == "one_pass" else 0), bwd


def _run_raw(lib, lengths, d, dt, values, grouping, mode):
    """Like run(), without the finiteness check (a NaN sequence is expected here)."""
    cu = cu_of(lengths)
    T, H = int(cu[-1]), values[0][0].shape[1]
    q, k, v, dout = (aligned_empty(s.shape, s.dtype) for s, _ in values)
    for dst, (src, _) in zip((q, k, v, dout), values):
        dst[...] = src
    out, dq, dk, dv = (aligned_empty((T, H, d), q.dtype) for _ in range(4))
    lse = aligned_empty((T, H), np.float32)
    ws = aligned_empty((max(lib.pu_fmha_bwd_workspace_bytes(T, H, d, MODES[mode]) // 4, 1),), np.float32)
    p_ = [ctypes.c_void_p(a.ctypes.data) for a in (q, k, v, out, lse, dout, dq, dk, dv, ws)]
    head = (cu.ctypes.data_as(ctypes.c_void_p), len(lengths), T, H, d, CODE[dt], 0.125, 0.0, 0, 0, int(grouping), 4)
    assert lib.pu_fmha_fwd(*head, *p_[:5], None) == 0, lib.pu_harness_last_error().decode()
    assert lib.pu_fmha_bwd(*head, MODES[mode], *p_, None) == 0, lib.pu_harness_last_error().decode()
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_nan_sequence_leaves_its_neighbours_bits_unchanged(lib, mode):
    lengths, d, dt = (67, 33, 20), 64, "float16"
    vals = problem_values(lengths, HEADS, d, dt, seed=5)
    poisoned = []
    for s, x in vals:
        s = s.copy()
        s[67:100] = np.nan
        poisoned.append((s, x))
    keep = np.r_[0:67, 100:120]
    kept_vals = tuple((s[keep], x[keep]) for s, x in vals)
    for grouping in (True, False):
        both = _run_raw(lib, lengths, d, dt, tuple(poisoned), grouping, mode)
        alone = _run_raw(lib, (67, 20), d, dt, kept_vals, grouping, mode)
        for name in ("out", "lse", "dq", "dk", "dv"):
            got = both[name][keep]
            assert np.isfinite(got.astype(np.float64)).all(), f"{name}: NaN leaked from the neighbour"
            np.testing.assert_array_equal(got, alone[name], err_msg=f"{name}: the neighbour changed the result")


@pytest.mark.parametrize("grouping,mode", [(True, "one_pass"), (False, "deterministic")])
def test_more_sequences_than_one_launch_carries(lib, grouping, mode):
    """450 sequences of 1..9 tokens, one bucket either way: two launches (440 + 10)."""
    lengths = tuple(int(x) for x in np.random.default_rng(7).integers(1, 10, size=450))
    res = run(lib, lengths, 32, "float16", 0.1, grouping=grouping, heads=1, mode=mode)
    check_against_reference(res, lengths, 32, "float16", 0.1, heads=1)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("lengths", [(0, 0), ()], ids=["two_empty_sequences", "no_sequences"])
def test_batches_without_tokens(lib, lengths, mode):
    res = run(lib, lengths, 64, "bfloat16", 0.1, mode=mode)
    assert all(res[name].size == 0 for name in ("out", "lse", "dq", "dk", "dv"))


def test_refusals_name_the_problem(lib):
    cu = cu_of((4,))
    x = Buffer((4, 1, 48), "float16", PAD)
    head = (cu.ctypes.data_as(ctypes.c_void_p), 1, 4, 1, 48, 0, 0.1, 0.0, 0, 0, 1, 4)
    assert lib.pu_fmha_fwd(*head, x.ptr, x.ptr, x.ptr, x.ptr, x.ptr, None) != 0
    assert "head size" in lib.pu_harness_last_error().decode()
    bad = cu_of((3,))
    head = (bad.ctypes.data_as(ctypes.c_void_p), 1, 4, 1, 32, 0, 0.1, 0.0, 0, 0, 1, 4)
    assert lib.pu_fmha_fwd(*head, x.ptr, x.ptr, x.ptr, x.ptr, x.ptr, None) != 0
    assert "cu_seqlens" in lib.pu_harness_last_error().decode()


@pytest.mark.parametrize("cu", [(1, 4), (0, 3, 2, 4), (0, 3)], ids=["first", "decreasing", "last"])
def test_refused_cu_seqlens_read_as_in_python(lib, cu):
    """The CUDA layer (behind the C-ABI harness, as behind the Paddle op) refuses cu_seqlens
    in the words of the Python check: one rule, one message, whichever side catches it (the
    Python side adds the prefix "paddle_unpad.ops.", as the Paddle op's wrapper does)."""
    from paddle_unpad.varlen import check_cu_seqlens

    cu = np.asarray(cu, np.int32)
    with pytest.raises(ValueError) as py:
        check_cu_seqlens(cu, 4)
    x = Buffer((4, 1, 32), "float16", PAD)
    head = (cu.ctypes.data_as(ctypes.c_void_p), len(cu) - 1, 4, 1, 32, 0, 0.1, 0.0, 0, 0, 1, 4)
    assert lib.pu_fmha_fwd(*head, x.ptr, x.ptr, x.ptr, x.ptr, x.ptr, None) != 0
    assert lib.pu_harness_last_error().decode() == str(py.value).removeprefix("paddle_unpad.ops.")


def test_python_routes_by_the_cuda_layers_own_limits(lib, monkeypatch):
    """FMHA_SUPPORT["gpu"], as the Python dispatch reads it where the CUDA kernels are built,
    agrees with the CUDA layer: what Python sends to the kernel the kernel takes, and what
    Python routes to the bucketed attention (naming why) the kernel refuses."""
    import paddle

    monkeypatch.setattr(ops._call, "on_cpu", lambda t: False)  # as if q lived on a GPU of a CUDA build
    monkeypatch.setattr(ops._native, "has_op", lambda name: True)
    monkeypatch.setattr(ops._native, "has_cuda_kernels", lambda: True)
    cu = cu_of((4,))
    for code, dt, d in ((0, "float16", 48), (2, "float32", 64), (0, "float16", 64), (1, "bfloat16", 128)):
        q = paddle.ones([4, 1, d], dtype=dt)
        refusal = ops.attention._fmha_gpu_kernel_refusal(q)
        x = Buffer((4, 1, d), "float16", PAD)
        lse = Buffer((4, 1), "float32", PAD)
        head = (cu.ctypes.data_as(ctypes.c_void_p), 1, 4, 1, d, code, 0.1, 0.0, 0, 0, 1, 4)
        rc = lib.pu_fmha_fwd(*head, x.ptr, x.ptr, x.ptr, x.ptr, lse.ptr, None)
        assert (rc != 0) == (refusal is not None), (dt, d, refusal, lib.pu_harness_last_error().decode())
        if refusal is not None:  # both name what they refuse
            word = dt if "float32" in refusal else str(d)
            assert word in refusal and word in lib.pu_harness_last_error().decode(), (refusal, dt, d)


@pytest.mark.parametrize("tensor", ["q", "v", "lse", "dout", "dq", "workspace"])
def test_a_misaligned_view_is_refused_by_name(lib, tensor):
    """Every pointer the kernels take must be 16-byte aligned (their 16-byte loads and
    stores); a view that is not is refused before anything runs, naming the tensor."""
    lengths, d, dt = (5, 9), 32, "float16"
    cu = cu_of(lengths)
    T, H = int(cu[-1]), 2
    bufs = {name: aligned_empty((T + 2, H, d), np.float16) for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")}
    bufs["lse"] = aligned_empty((T + 2, H), np.float32)
    bufs["workspace"] = aligned_empty((lib.pu_fmha_bwd_workspace_bytes(T, H, d, 0) // 4 + 64,), np.float32)
    for b in bufs.values():
        b[...] = 0
    ptr = {name: b.ctypes.data for name, b in bufs.items()}
    ptr[tensor] += 4 if tensor in ("lse", "workspace") else 2  # one element in: still a valid address
    p_ = {name: ctypes.c_void_p(a) for name, a in ptr.items()}
    head = (cu.ctypes.data_as(ctypes.c_void_p), len(lengths), T, H, d, CODE[dt], 0.125, 0.1, 1, 2, 1, 4)
    fwd = lib.pu_fmha_fwd(*head, p_["q"], p_["k"], p_["v"], p_["out"], p_["lse"], None)
    if tensor in ("q", "v", "lse"):
        assert fwd != 0
    else:
        assert fwd == 0, lib.pu_harness_last_error().decode()
        rc = lib.pu_fmha_bwd(
            *head, 0, *(p_[n] for n in ("q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv", "workspace")), None
        )
        assert rc != 0
    assert (
        lib.pu_harness_last_error().decode()
        == f"fmha: {tensor} must be 16-byte aligned on GPU (its data pointer is not)"
    )

"""The emulated sm80 instructions (tests/cuda_emu/emu_isa.h) on their own, before they are
trusted to run the FMHA kernels: one warp executes one instruction on random fragments
(tests/cuda_emu/isa_probes.cu) and the result is compared with a plain matrix product /
transpose assembled here, in numpy, from the PTX ISA's fragment layouts (g = lane // 4,
c = lane % 4; a b32 register holds two 16-bit elements, the lower index in the low half).

Also: the execution model's own checks (a barrier nobody can pass, a shared-memory access
out of bounds or misaligned, a tensor-core instruction with a lane missing, a cp.async and
another warp's ldmatrix of the same bytes with no __syncthreads between them) fail the
launch with a reason instead of hanging or passing.
Locally skipped when the emulation cannot be built (no g++ / CUDA headers); fails under CI.
"""

import ctypes
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emu"))
import emu_build  # noqa: E402

pytestmark = pytest.mark.build

DTYPES = {"float16": 0, "bfloat16": 1}


@pytest.fixture(scope="module")
def lib():
    return emu_build.load(pytest)


def ptr(a):
    return ctypes.c_void_p(a.ctypes.data)


def random_b16(rng, shape, dt):
    """Random finite values as 16-bit patterns of dt, and the values they hold (float64)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if dt == "float16":
        bits = x.astype(np.float16).view(np.uint16)
        return bits, bits.view(np.float16).astype(np.float64)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncation is fine: any bf16 will do
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def pack(lo, hi):
    return lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)


def fragment_positions():
    """Per lane, the (row, col) of each half of each register, from the PTX ISA:
    A 16x16: reg 0 (g, 2c+h), reg 1 (g+8, 2c+h), reg 2 (g, 2c+8+h), reg 3 (g+8, 2c+8+h);
    B 16x8 (k, n): reg 0 (2c+h, g), reg 1 (2c+8+h, g); C/D 16x8: e -> (g + 8*(e//2), 2c + e%2)."""
    a, b, cd = {}, {}, {}
    for lane in range(32):
        g, c = lane // 4, lane % 4
        for h in range(2):
            a[lane, 0, h] = (g, 2 * c + h)
            a[lane, 1, h] = (g + 8, 2 * c + h)
            a[lane, 2, h] = (g, 2 * c + 8 + h)
            a[lane, 3, h] = (g + 8, 2 * c + 8 + h)
            b[lane, 0, h] = (2 * c + h, g)
            b[lane, 1, h] = (2 * c + 8 + h, g)
        for e in range(4):
            cd[lane, e] = (g + 8 * (e // 2), 2 * c + e % 2)
    return a, b, cd


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_mma_m16n8k16_is_a_matrix_product(lib, dt, seed):
    rng = np.random.default_rng(seed)
    a_bits, a_val = random_b16(rng, (32, 4, 2), dt)
    b_bits, b_val = random_b16(rng, (32, 2, 2), dt)
    c = rng.standard_normal((32, 4)).astype(np.float32)
    a_pos, b_pos, cd_pos = fragment_positions()
    A, B, C = np.full((16, 16), np.nan), np.full((16, 8), np.nan), np.full((16, 8), np.nan)
    for (lane, r, h), rc in a_pos.items():
        A[rc] = a_val[lane, r, h]
    for (lane, r, h), rc in b_pos.items():
        B[rc] = b_val[lane, r, h]
    for (lane, e), rc in cd_pos.items():
        C[rc] = c[lane, e]
    assert not np.isnan(A).any() and not np.isnan(B).any() and not np.isnan(C).any()  # layouts are onto
    D = A @ B + C
    bound = np.abs(A) @ np.abs(B) + np.abs(C)  # scale of the fp32 rounding
    d = np.full((32, 4), np.nan, np.float32)
    regs_a = np.ascontiguousarray(pack(a_bits[..., 0], a_bits[..., 1]))
    regs_b = np.ascontiguousarray(pack(b_bits[..., 0], b_bits[..., 1]))
    assert lib.emu_probe_mma(DTYPES[dt], ptr(regs_a), ptr(regs_b), ptr(c), ptr(d)) == 0, (
        lib.emu_probe_last_error().decode()
    )
    for (lane, e), rc in cd_pos.items():
        assert abs(d[lane, e] - D[rc]) <= 2e-6 * bound[rc], (lane, e, d[lane, e], D[rc])


def ldmatrix_case(seed, trans):
    """4 random 8x8 b16 matrices whose 32 rows sit in shuffled 16-byte slots of shared memory."""
    rng = np.random.default_rng(seed)
    slots = 48
    image = rng.integers(0, 2**16, size=slots * 8, dtype=np.uint16)
    slot_of = rng.permutation(slots)[:32]  # lane 8i + r gives the address of row r of matrix i
    offsets = (slot_of * 8).astype(np.int32)
    mats = np.stack(
        [np.stack([image[offsets[8 * i + r] : offsets[8 * i + r] + 8] for r in range(8)]) for i in range(4)]
    )  # [4, 8, 8]
    want = np.empty((32, 4), np.uint32)
    for lane in range(32):
        r, w = lane // 4, lane % 4
        for i in range(4):
            m = mats[i].T if trans else mats[i]
            want[lane, i] = int(m[r, 2 * w]) | (int(m[r, 2 * w + 1]) << 16)
    return image, offsets, want


@pytest.mark.parametrize("trans", [False, True], ids=["x4", "x4_trans"])
@pytest.mark.parametrize("seed", [0, 1])
def test_ldmatrix_gives_each_lane_its_rows(lib, trans, seed):
    image, offsets, want = ldmatrix_case(seed, trans)
    out = np.zeros((32, 4), np.uint32)
    assert lib.emu_probe_ldmatrix(ptr(image), image.size, ptr(offsets), int(trans), ptr(out)) == 0, (
        lib.emu_probe_last_error().decode()
    )
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("offset,why", [(48 * 8 - 4, "out of bounds"), (3, "aligned")])
def test_ldmatrix_outside_shared_memory_fails_the_launch(lib, offset, why):
    image, offsets, _ = ldmatrix_case(0, False)
    offsets[5] = offset
    out = np.zeros((32, 4), np.uint32)
    assert lib.emu_probe_ldmatrix(ptr(image), image.size, ptr(offsets), 0, ptr(out)) != 0
    assert why in lib.emu_probe_last_error().decode()


def test_mma_with_a_lane_missing_fails_the_launch(lib):
    d = np.zeros(32, np.float32)
    assert lib.emu_probe_partial_warp_mma(ptr(d)) != 0
    assert "all 32 lanes" in lib.emu_probe_last_error().decode()


def test_cp_async_zero_fills_and_lands_at_its_wait(lib):
    rng = np.random.default_rng(4)
    src = rng.integers(0, 2**16, size=64 * 8, dtype=np.uint16)
    valid = rng.integers(0, 2, size=64).astype(np.int32)
    valid[:2] = (0, 1)
    valid[32:34] = (0, 1)
    after1, after0 = np.zeros(64 * 8, np.uint16), np.zeros(64 * 8, np.uint16)
    assert lib.emu_probe_cp_async(ptr(src), ptr(valid), ptr(after1), ptr(after0)) == 0, (
        lib.emu_probe_last_error().decode()
    )
    copied = np.where(np.repeat(valid, 8) != 0, src, 0).astype(np.uint16)
    # wait_group 1: the first group (chunks 0..31) is complete; the newest may not be, and
    # the emulation completes nothing earlier than it must (shared memory starts as 0xffff).
    np.testing.assert_array_equal(after1[: 32 * 8], copied[: 32 * 8])
    assert (after1[32 * 8 :] == 0xFFFF).all()
    np.testing.assert_array_equal(after0, copied)


def test_ex2_approx_is_exp2_with_flush_to_zero(lib):
    x = np.array([-np.inf, -1000, -149, -126.5, -126, -3.25, -1, 0, 0.5, 1, 10.75, 127, 128, np.nan], np.float32)
    y = np.zeros_like(x)
    assert lib.emu_probe_exp2(ptr(x), ptr(y), x.size) == 0
    with np.errstate(over="ignore"):
        want = np.exp2(x.astype(np.float64)).astype(np.float32)
    want[want < np.finfo(np.float32).tiny] = 0.0  # .ftz: subnormal results are +0
    finite = np.isfinite(want)
    np.testing.assert_allclose(y[finite], want[finite], rtol=1e-6, atol=0)
    assert np.isposinf(y[x == 128]).all() and np.isnan(y[np.isnan(x)]).all()
    assert not np.signbit(y[x == -np.inf]).any()


def test_movmatrix_transposes_the_lanes_rows():
    """PTX ISA: lane 4r + w holds row r, elements 2w (low 16 bits) and 2w + 1 of an 8x8 b16
    matrix, as an ldmatrix register; movmatrix.trans hands back the transpose that way."""
    lib = emu_build.load(pytest)
    m = np.arange(64, dtype=np.uint32).reshape(8, 8) * 3 + 1000  # distinct 16-bit values
    lanes = np.arange(32)
    x = (m[lanes // 4, 2 * (lanes % 4)] | (m[lanes // 4, 2 * (lanes % 4) + 1] << 16)).astype(np.uint32)
    y = np.zeros(32, np.uint32)
    assert lib.emu_probe_movmatrix(ptr(x), ptr(y)) == 0, lib.emu_probe_last_error().decode()
    t = m.T
    want = (t[lanes // 4, 2 * (lanes % 4)] | (t[lanes // 4, 2 * (lanes % 4) + 1] << 16)).astype(np.uint32)
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("mask", [1, 2, 4, 8, 16])
def test_shfl_xor(lib, mask):
    x = np.arange(32, dtype=np.float32) * 1.5 - 7
    y = np.zeros(32, np.float32)
    assert lib.emu_probe_shuffle(ptr(x), ptr(y), mask) == 0
    np.testing.assert_array_equal(y, x[np.arange(32) ^ mask])


def test_a_barrier_nobody_can_pass_fails_instead_of_hanging(lib):
    out = np.zeros(64, np.int32)
    assert lib.emu_probe_divergent_barrier(ptr(out)) != 0
    assert "deadlock" in lib.emu_probe_last_error().decode()
    # The failure is reported once; the next launch runs normally.
    x, y = np.ones(32, np.float32), np.zeros(32, np.float32)
    assert lib.emu_probe_shuffle(ptr(x), ptr(y), 1) == 0


@pytest.mark.parametrize("war", [0, 1], ids=["read_after_write", "write_after_read"])
def test_a_missing_barrier_around_an_async_copy_is_a_race(lib, war):
    """In both orders, warp 0 runs before warp 1 (fibers switch in thread order), so
    the writer of the read-after-write case has landed its copies when the reader comes."""
    src = np.arange(32 * 8, dtype=np.uint16)
    out = np.zeros((64, 4), np.uint32)
    assert lib.emu_probe_race(ptr(src), war, ptr(out)) != 0
    assert "race" in lib.emu_probe_last_error().decode()

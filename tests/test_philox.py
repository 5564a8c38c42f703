"""Tests of the test suite's Philox reference (tests/philox_ref.py) and of the package's own."""

import importlib

import numpy as np
import pytest

import philox_ref as P

pytestmark = pytest.mark.paddle_gpu_stage

# Random123 known-answer vectors for Philox4x32: (counter, key) and the outputs of Philox4x32-10
# and of Philox4x32-7 (the attention layout's generator), from the same file.
KAT_INPUTS = [
    ((0, 0, 0, 0), (0, 0)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)),
]
OUTPUTS_10 = [
    (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8),
    (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
]
OUTPUTS_7 = [
    (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48),
    (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662),
    (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A),
]
KAT = [(ctr, key, out) for (ctr, key), out in zip(KAT_INPUTS, OUTPUTS_10)]
KAT7 = [(ctr, key, out) for (ctr, key), out in zip(KAT_INPUTS, OUTPUTS_7)]


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_known_answers(ctr, key, expected):
    out = P.philox4x32(ctr, key)
    assert tuple(int(w) for w in out) == expected
    assert all(w.dtype == np.uint32 for w in out)


@pytest.mark.parametrize("ctr,key,expected", KAT7)
def test_known_answers_seven_rounds(ctr, key, expected):
    assert tuple(int(w) for w in P.philox4x32(ctr, key, rounds=7)) == expected


def test_vectorised_matches_scalar():
    """Many counters at once give the same words as one counter at a time."""
    rng = np.random.default_rng(0)
    ctr = rng.integers(0, 2**32, size=(4, 50), dtype=np.uint64)
    key = (0xA4093822, 0x299F31D0)
    vec = np.stack(P.philox4x32(tuple(ctr), key))
    for i in range(ctr.shape[1]):
        one = P.philox4x32(tuple(int(c) for c in ctr[:, i]), key)
        assert tuple(int(w) for w in one) == tuple(int(w) for w in vec[:, i])
    # the third KAT placed in the middle of a batch
    ctr[:, 17] = KAT[2][0]
    vec = np.stack(P.philox4x32(tuple(ctr), KAT[2][1]))
    assert tuple(int(w) for w in vec[:, 17]) == KAT[2][2]


def test_threshold():
    assert P.dropout_threshold(0.0) == 0
    assert P.dropout_threshold(0.5) == 2**31
    assert P.dropout_threshold(0.1) == int(np.floor(0.1 * 2.0**32))
    assert P.dropout_threshold(1.0) == 2**32 - 1
    assert P.attention_threshold(0.0) == 0
    assert P.attention_threshold(0.5) == 2**15
    assert P.attention_threshold(0.1) == 6553  # floor(6553.6)
    assert P.attention_threshold(1.0) == 2**16 - 1


def test_seed_key():
    assert P.seed_key(0x0123456789ABCDEF) == (0x89ABCDEF, 0x01234567)
    assert P.seed_key(-1) == (0xFFFFFFFF, 0xFFFFFFFF)  # taken as uint64


def test_keep_mask_layout_by_hand():
    """Element [h, i, j] of sequence b uses counter (4 (j // 16) + (j // 2) % 4,
    cu[b] + 16 (i // 16) + i % 8, h, offset), word 2 ((i // 8) % 2) + (j // 8) % 2, its low
    16 bits for even j and its high 16 bits for odd j."""
    seed, offset, p = 0x1234_5678_9ABC_DEF0, 0x1_0000_0007, 0.3
    cu = [0, 4, 4, 11, 45]
    masks = P.dropout_keep_mask(seed, offset, p, cu, num_heads=2)
    thr = P.attention_threshold(p)
    key = (seed & 0xFFFFFFFF, seed >> 32)
    assert [m.shape for m in masks] == [(2, 4, 4), (2, 0, 0), (2, 7, 7), (2, 34, 34)]
    for b in range(4):
        s = cu[b + 1] - cu[b]
        for h in range(2):
            for i in range(s):
                for j in range(s):
                    ctr = (4 * (j // 16) + (j // 2) % 4, cu[b] + 16 * (i // 16) + i % 8, h, 7)  # offset mod 2^32
                    word = int(P.philox4x32(ctr, key, rounds=7)[2 * ((i // 8) % 2) + (j // 8) % 2])
                    draw = word & 0xFFFF if j % 2 == 0 else word >> 16
                    assert masks[b][h, i, j] == (draw >= thr)


def test_each_attention_call_serves_eight_elements_once():
    """The attention layout's (counter, word, half) of every element of a ragged batch: no two
    elements share a draw, each call holds exactly eight elements of a 16-aligned block where
    the block is full (queries {i, i ^ 8} x keys {j, j ^ 1, j ^ 8, j ^ 9}), and no counter of
    one sequence or head is another's."""
    cu, H = [0, 32, 33, 81, 121], 3
    draws, calls = {}, {}
    for b in range(len(cu) - 1):
        t0, s = cu[b], cu[b + 1] - cu[b]
        for h in range(H):
            for i in range(s):
                for j in range(s):
                    ctr = (4 * (j // 16) + (j // 2) % 4, t0 + 16 * (i // 16) + i % 8, h)
                    slot = (ctr, 2 * ((i // 8) % 2) + (j // 8) % 2, j % 2)
                    assert slot not in draws, (b, h, i, j, draws.get(slot))
                    draws[slot] = (b, h, i, j)
                    calls.setdefault(ctr, set()).add((b, h, i, j))
    for ctr, elems in calls.items():
        assert len({(b, h) for b, h, _, _ in elems}) == 1, ctr
        b, h, i, j = min(elems)
        s = cu[b + 1] - cu[b]
        full = {(b, h, ii, jj) for ii in (i, i ^ 8) for jj in (j, j ^ 1, j ^ 8, j ^ 9) if ii < s and jj < s}
        assert elems == full, (ctr, sorted(elems))
        if s % 16 == 0:
            assert len(elems) == 8, (ctr, len(elems))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_drop_fraction(p):
    masks = P.dropout_keep_mask(seed=2024, offset=3, p=p, cu_seqlens=[0, 100, 300, 301], num_heads=4)
    kept = np.concatenate([m.ravel() for m in masks])
    n = kept.size  # 4 * (100^2 + 200^2 + 1)
    dropped = 1.0 - kept.mean()
    assert abs(dropped - p) < 5 * np.sqrt(p * (1 - p) / n), (dropped, p, n)


def test_zero_p_keeps_everything():
    masks = P.dropout_keep_mask(seed=1, offset=0, p=0.0, cu_seqlens=[0, 5, 9], num_heads=3)
    assert all(m.all() for m in masks)


def test_streams_differ_by_seed_and_offset():
    cu = [0, 64]
    base = P.dropout_keep_mask(7, 0, 0.5, cu, 2)[0]
    assert (base != P.dropout_keep_mask(8, 0, 0.5, cu, 2)[0]).any()
    assert (base != P.dropout_keep_mask(7, 1, 0.5, cu, 2)[0]).any()
    assert (base != P.dropout_keep_mask(7 + 2**32, 0, 0.5, cu, 2)[0]).any()  # high seed word counts
    assert (base == P.dropout_keep_mask(7, 2**32, 0.5, cu, 2)[0]).all()  # only offset's low 32 bits


def _package_philox():
    try:
        return importlib.import_module("paddle_unpad.ops.philox")
    except ImportError as e:  # pragma: no cover - depends on the package state
        pytest.skip(f"paddle_unpad.ops.philox not importable: {e}")


def test_package_philox_known_answers():
    mod = _package_philox()
    for ctr, key, expected in KAT:
        out = mod.philox4x32_10(*ctr, *key)
        assert tuple(int(np.asarray(w).reshape(())) for w in out) == expected
    for ctr, key, expected in KAT7:
        out = mod.philox4x32(*ctr, *key, rounds=mod.ATTENTION_ROUNDS)
        assert tuple(int(np.asarray(w).reshape(())) for w in out) == expected


def test_package_philox_agrees_on_random_counters():
    mod = _package_philox()
    rng = np.random.default_rng(1)
    ctr = rng.integers(0, 2**32, size=(4, 1000), dtype=np.uint64).astype(np.uint32)
    key = tuple(int(x) for x in rng.integers(0, 2**32, size=2, dtype=np.uint64))
    ours = np.stack(P.philox4x32(tuple(ctr), key))
    theirs = np.stack(mod.philox4x32_10(*ctr, *key))
    np.testing.assert_array_equal(ours, theirs)


def test_package_threshold_agrees():
    mod = _package_philox()
    for p in (0.0, 1e-12, 0.1, 0.25, 0.5, 0.9, 0.999999999, 1 - 2**-40):
        assert int(mod.dropout_threshold(p)) == P.dropout_threshold(p), p
        assert int(mod.attention_dropout_threshold(p)) == P.attention_threshold(p), p


def test_package_dropout_mask_agrees():
    mod = _package_philox()
    cu = np.array([0, 5, 5, 70, 71], dtype=np.int32)
    for seed, offset, p in [(0, 0, 0.1), (2**40 + 17, 2**33 + 5, 0.3), (12345, 99, 0.9), (2**64 - 3, 1, 0.5)]:
        ours = P.dropout_keep_mask(seed, offset, p, cu, 3)
        for b in range(len(cu) - 1):
            theirs = mod.attention_keep_mask(seed, offset, p, int(cu[b]), int(cu[b + 1] - cu[b]), 3)
            assert theirs.shape == ours[b].shape, (b, theirs.shape, ours[b].shape)
            np.testing.assert_array_equal(theirs, ours[b], err_msg=f"sequence {b}, seed {seed}, offset {offset}")

"""Independent numpy Philox4x32-10 (Random123 style) and the FMHA dropout keep-mask layout.

This is the test suite's own reference, written separately from the package's
``paddle_unpad/ops/philox.py`` so that the two can be checked against each other.

Philox4x32-10, one round on counter ``(c0, c1, c2, c3)`` and key ``(k0, k1)``::

    (c0, c1, c2, c3) <- (mulhi(M1, c2) ^ c1 ^ k0, mullo(M1, c2),
                         mulhi(M0, c0) ^ c3 ^ k1, mullo(M0, c0))

with ``M0 = 0xD2511F53``, ``M1 = 0xCD9E8D57``; ten rounds, the key bumped by
``(W0, W1) = (0x9E3779B9, 0xBB67AE85)`` between rounds (the first round uses the
unbumped key). All arithmetic is on uint64 arrays holding 32-bit values, so the
32x32 -> 64-bit products are exact.

Dropout layout used by the FMHA kernels (and checked by ``dropout_keep_mask``), Philox4x32-7:

* key ``(k0, k1) = (seed & 0xffffffff, (seed >> 32) & 0xffffffff)``, seed as uint64;
* counter ``(4 * (j // 16) + (j // 2) % 4, t0 + 16 * (i // 16) + i % 8, h, offset & 0xffffffff)``:
  ``i`` and ``j`` the query's and the key's index inside their sequence, ``t0`` the
  sequence's first row in the packed ``[T, H, D]`` tensor, ``h`` the head;
* 16-bit draw ``r``: word ``out[2 * ((i // 8) % 2) + (j // 8) % 2]``, its low half for even
  ``j``, its high half for odd ``j``; threshold ``min(floor(p * 2**16), 2**16 - 1)``
  (float64); the element is dropped iff ``r < threshold``; kept elements are scaled by
  ``1 / (1 - p)``.

The fused ops' row-wise layout (``rowwise_keep``) keeps a whole 32-bit word per element.
"""

from __future__ import annotations

import math

import numpy as np

M0 = 0xD2511F53
M1 = 0xCD9E8D57
W0 = 0x9E3779B9
W1 = 0xBB67AE85
MASK32 = 0xFFFFFFFF
ROUNDS = 10  # the row-wise layout's Philox4x32-10
ATTENTION_ROUNDS = 7  # the attention layout's Philox4x32-7

_U64 = np.uint64


def _u32(a):
    """Any int / array -> uint64 array holding the value mod 2**32."""
    return np.asarray(a, dtype=np.uint64) & _U64(MASK32)


def philox4x32(counter, key, rounds=ROUNDS):
    """Philox4x32 over many counters at once.

    Args:
        counter: 4 array-likes (c0, c1, c2, c3) of uint32 values, broadcastable together.
        key: 2 array-likes (k0, k1) of uint32 values, broadcastable with the counters.
        rounds: number of rounds (10 for Philox4x32-10).

    Returns:
        tuple of 4 uint32 numpy arrays (the broadcast shape): the output words.
    """
    c0, c1, c2, c3 = np.broadcast_arrays(*[_u32(c) for c in counter])
    k0, k1 = (_u32(k) for k in key)
    m0, m1, mask = _U64(M0), _U64(M1), _U64(MASK32)
    w0, w1 = _U64(W0), _U64(W1)
    for r in range(rounds):
        if r:
            k0 = (k0 + w0) & mask
            k1 = (k1 + w1) & mask
        p0 = m0 * c0  # exact: both factors < 2**32
        p1 = m1 * c2
        c0, c1, c2, c3 = (
            (p1 >> _U64(32)) ^ c1 ^ k0,
            p1 & mask,
            (p0 >> _U64(32)) ^ c3 ^ k1,
            p0 & mask,
        )
    return tuple(np.asarray(c, dtype=np.uint32) for c in (c0, c1, c2, c3))


def dropout_threshold(p):
    """uint32 threshold of the row-wise layout: an element whose word is below it is dropped."""
    return min(math.floor(float(p) * 2.0**32), 2**32 - 1)


def attention_threshold(p):
    """16-bit threshold of the attention layout: an element whose draw is below it is dropped."""
    return min(math.floor(float(p) * 2.0**16), 2**16 - 1)


def seed_key(seed):
    """(k0, k1) from a seed taken as uint64."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return s & MASK32, (s >> 32) & MASK32


def random_draws(seed, offset, t0, s, h):
    """The 16-bit draws r[h, i, j] of a sequence of length ``s`` whose first packed row is
    ``t0``, for heads ``h`` (array [H]).

    Returns uint32 ``[len(h), s, s]`` holding values < 2**16.
    """
    k0, k1 = seed_key(seed)
    h = np.asarray(h, dtype=np.uint64)[:, None]
    j = np.arange(s)
    c0 = (4 * (j // 16) + (j // 2) % 4)[None, :]
    draws = np.zeros((h.shape[0], s, s), dtype=np.uint32)
    for i in range(s):  # one query row at a time, all keys and heads at once
        row_pair = int(t0) + 16 * (i // 16) + i % 8
        out = np.stack(philox4x32((c0, row_pair, h, int(offset) & MASK32), (k0, k1), ATTENTION_ROUNDS))  # [4, H, s]
        word = out[2 * ((i // 8) % 2) + (j // 8) % 2, :, j].T  # [H, s]
        draws[:, i, :] = np.where(j % 2 == 0, word & np.uint32(0xFFFF), word >> np.uint32(16))
    return draws


def dropout_keep_mask(seed, offset, p, cu_seqlens, num_heads):
    """Per-sequence attention-dropout keep masks, in the FMHA kernels' counter layout.

    Args:
        seed: int (taken as uint64), offset: int (low 32 bits used), p: drop probability.
        cu_seqlens: int array-like [B + 1].
        num_heads: H.

    Returns:
        list over sequences b of bool ``[H, s_b, s_b]`` arrays, ``[h, i, j]`` True where
        the attention probability of query i (packed row ``cu_seqlens[b] + i``) to key j
        is kept.
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    thr = np.uint32(attention_threshold(p)) if attention_threshold(p) > 0 else None
    heads = np.arange(num_heads)
    masks = []
    for b in range(cu.shape[0] - 1):
        start, end = int(cu[b]), int(cu[b + 1])
        s = end - start
        if s == 0 or thr is None:
            masks.append(np.ones((num_heads, s, s), dtype=bool))
            continue
        masks.append(random_draws(seed, offset, start, s, heads) >= thr)
    return masks


def rowwise_keep(seed, offset, p, rows, cols):
    """bool [rows, cols] keep mask of the fused ops' row-wise dropout layout: element (r, j)
    uses word j % 4 of counter (j // 4, r, 0xffffffff, offset)."""
    thr = dropout_threshold(p)
    if thr == 0 or rows == 0:
        return np.ones((rows, cols), dtype=bool)
    nblk = (cols + 3) // 4
    c0 = np.arange(nblk, dtype=np.uint64)[None, :]
    c1 = np.arange(rows, dtype=np.uint64)[:, None]
    words = philox4x32((c0, c1, 0xFFFFFFFF, offset), seed_key(seed))
    w = np.stack(words, axis=-1).reshape(rows, nblk * 4)[:, :cols]
    return w >= np.uint32(thr)

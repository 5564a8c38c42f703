"""Philox4x32 in numpy, and the dropout masks it defines.

The same generator and counter layouts as ``custom_ops/kernels/common/philox.h``; the
reference implementation of ``fmha`` uses it so that it drops exactly the elements the
native kernels drop. Attention dropout, Philox4x32-7 (``ATTENTION_ROUNDS``):

    key     = (seed & 0xffffffff, seed >> 32)
    counter = (4 * (j // 16) + (j // 2) % 4,        # j, i: key and query index in their
               t0 + (i & ~8), h, offset & 0xffffffff)  # sequence, t0 its first packed row
    word    = philox(counter, key)[2 * ((i // 8) % 2) + (j // 8) % 2]
    draw    = word & 0xffff if j is even else word >> 16   # 16 bits per element
    dropped iff draw < floor(p * 2**16)             # kept values are scaled by 1/(1-p)

(one call: queries {i, i ^ 8} x keys {j, j ^ 1, j ^ 8, j ^ 9}, the eight elements one GPU
lane holds of two adjacent mma accumulator tiles);

The fused ``bias_dropout_residual_layer_norm`` drops element (r, j) of its [N, F] input
(r: row, all leading dimensions flattened; j: column) with the row-wise layout, Philox4x32-10

    counter = (j // 4, r, 0xffffffff, offset & 0xffffffff)  # same key
    word    = philox(counter, key)[j % 4]           # 32 bits per element
    dropped iff word < floor(p * 2**32)

(see ``rowwise_keep_mask``); counter word 2 = 0xffffffff is never a head index, so it
never shares a counter with the attention layout.
"""

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LO = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)


ATTENTION_ROUNDS = 7  # the attention layout's Philox4x32-7 (philox.h says why); row-wise: 10


def philox4x32(c0, c1, c2, c3, k0, k1, rounds=10):
    """Vectorised Philox4x32-``rounds``: counters are broadcastable uint32 arrays, key two ints.

    Returns four uint32 arrays (the output words).
    """
    c = [np.asarray(x, dtype=np.uint64) & _LO for x in (c0, c1, c2, c3)]
    c0, c1, c2, c3 = np.broadcast_arrays(*c)
    k0, k1 = int(k0) & 0xFFFFFFFF, int(k1) & 0xFFFFFFFF
    for _ in range(rounds):
        p0 = _M0 * c0
        p1 = _M1 * c2
        c0, c1, c2, c3 = (
            (p1 >> _32) ^ c1 ^ np.uint64(k0),
            p1 & _LO,
            (p0 >> _32) ^ c3 ^ np.uint64(k1),
            p0 & _LO,
        )
        k0 = (k0 + _W0) & 0xFFFFFFFF
        k1 = (k1 + _W1) & 0xFFFFFFFF
    return tuple(x.astype(np.uint32) for x in (c0, c1, c2, c3))


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 (the row-wise layout's generator)."""
    return philox4x32(c0, c1, c2, c3, k0, k1, rounds=10)


ATTENTION_DRAW_BITS = 16  # bits of one attention-dropout draw; the row-wise layout draws 32


def dropout_threshold(p, bits=32):
    """Threshold below which a ``bits``-bit draw means "drop" (p in [0, 1)):
    ``min(floor(p * 2**bits), 2**bits - 1)``."""
    top = float(1 << bits)
    t = float(p) * top
    if t >= top - 1.0:
        return (1 << bits) - 1
    return max(int(np.floor(t)), 0)


def attention_dropout_threshold(p):
    """The attention layout's 16-bit threshold."""
    return dropout_threshold(p, ATTENTION_DRAW_BITS)


def attention_keep_mask(seed, offset, p, t0, seqlen, num_heads):
    """Keep-mask of attention dropout for one sequence.

    Args:
        seed, offset: the Philox stream (Python ints; seed as uint64).
        p: drop probability in [0, 1).
        t0: row of the sequence's first token in the packed [T, H, D] tensor.
        seqlen: length of the sequence.
        num_heads: H.
    Returns:
        bool ndarray [num_heads, seqlen (queries), seqlen (keys)], True = kept.
    """
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    if seqlen == 0:
        return np.zeros((num_heads, 0, 0), dtype=bool)
    h = np.arange(num_heads, dtype=np.uint64)[:, None, None]
    i = np.arange(seqlen, dtype=np.uint64)[None, :, None]
    j = np.arange(seqlen, dtype=np.uint64)[None, None, :]
    c0 = ((j >> np.uint64(4)) << np.uint64(2)) | ((j >> np.uint64(1)) & np.uint64(3))
    c1 = np.uint64(t0) + (i & ~np.uint64(8))
    words = philox4x32(c0, c1, h, int(offset) & 0xFFFFFFFF, seed & 0xFFFFFFFF, seed >> 32, rounds=ATTENTION_ROUNDS)
    which = (((i >> np.uint64(2)) & np.uint64(2)) | ((j >> np.uint64(3)) & np.uint64(1))).astype(np.int64)
    w = np.choose(np.broadcast_to(which, words[0].shape), words)
    draw = (w >> ((j & np.uint64(1)) * np.uint64(16)).astype(np.uint32)) & np.uint32(0xFFFF)
    return draw >= np.uint32(attention_dropout_threshold(p))


ROWWISE_COUNTER_WORD2 = 0xFFFFFFFF


def rowwise_keep_mask(seed, offset, p, num_rows, num_cols):
    """Keep-mask of the row-wise dropout of ``bias_dropout_residual_layer_norm``.

    Args:
        seed, offset: the Philox stream (Python ints; seed as uint64).
        p: drop probability in [0, 1).
        num_rows: N, the rows of the op's input with leading dimensions flattened (< 2**32).
        num_cols: F, the normalised size.
    Returns:
        bool ndarray [num_rows, num_cols], True = kept.
    """
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    if num_rows == 0 or num_cols == 0:
        return np.ones((num_rows, num_cols), dtype=bool)
    r = np.arange(num_rows, dtype=np.uint64)[:, None]
    blocks = np.arange((num_cols + 3) // 4, dtype=np.uint64)[None, :]  # counter word 0 = j // 4
    words = philox4x32_10(blocks, r, ROWWISE_COUNTER_WORD2, int(offset) & 0xFFFFFFFF, seed & 0xFFFFFFFF, seed >> 32)
    w = np.stack(words, axis=-1).reshape(num_rows, -1)[:, :num_cols]  # column j = word j % 4
    return w >= np.uint32(dropout_threshold(p))

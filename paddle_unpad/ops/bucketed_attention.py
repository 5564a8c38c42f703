"""Attention over packed sequences in plain Paddle ops, a few padded batches at a time.

``fmha`` runs this where no kernel fits the tensors: float32 on a GPU (the CUDA kernels
take float16 / bfloat16), a head size the CUDA kernels lack, or a build without CUDA
kernels. The sequences are grouped into length buckets (powers of two); each bucket is
padded to its own longest sequence -- not the batch's -- and attended with batched
``matmul -> softmax -> dropout -> matmul`` exactly as the stock padded model does, so
float32 keeps float32 semantics (and Paddle's TF32 setting for its GEMMs) and autograd
gives the backward pass. Per bucket of ``n`` sequences padded to ``L`` it holds
``n * heads * L * L`` scores, against ``B * heads * S_max^2`` for the stock model.

Why this and not a float32 CUDA kernel: attention is ``s / (6 * hidden)`` of a BERT
layer's FLOPs (2.8% for BERT-base at 128 tokens, 11% at 512), and with TF32 on (Paddle's
default on Ampere and newer) cuBLAS's batched GEMMs run on tensor cores, which a SIMT
float32 kernel cannot; what padding within a bucket costs is below 2x of that share.
AMP (float16 / bfloat16) is the fast path; see docs/gpu.md.

Dropout: ``paddle.nn.functional.dropout`` on the probabilities (Paddle's generator, as the
stock model), unless the caller fixes the Philox stream with ``rng_state``: then the mask
is the one the kernels and ``fmha_reference`` draw (built on the host with numpy: exact,
slow, meant for tests).
"""

import collections
import threading

import numpy as np
import paddle
import paddle.nn.functional as F

from .philox import attention_keep_mask
from ..varlen import check_cu_seqlens

__all__ = ["bucketed_attention", "bucket_plan"]

_MIN_BUCKET = 16  # lengths up to 16 share one bucket; above, one bucket per power of two


def bucket_plan(cu):
    """The buckets of the sequences of host ``cu`` (int64 prefix sums).

    Returns a list of ``(seqs, L)``: the indices of the non-empty sequences whose lengths fall
    in one power-of-two range, longest range first, and ``L`` their longest length.
    """
    lengths = np.diff(cu)
    live = np.flatnonzero(lengths > 0)
    if live.size == 0:
        return []
    tier = np.maximum(np.ceil(np.log2(np.maximum(lengths[live], 1))).astype(np.int64), int(np.log2(_MIN_BUCKET)))
    plan = []
    for t in sorted(set(tier.tolist()), reverse=True):
        seqs = live[tier == t]
        plan.append((seqs, int(lengths[seqs].max())))
    return plan


class _Indices:
    """Host-built index tensors of one ``cu_seqlens`` on one place, reused by every layer."""

    def __init__(self, cu, place):
        self.buckets = []
        order = []
        for seqs, L in bucket_plan(cu):
            starts, lens = cu[seqs], np.diff(cu)[seqs]
            pos = np.arange(L, dtype=np.int64)[None, :]
            valid = pos < lens[:, None]
            # a padded position reads its sequence's last token: finite, of the same sequence,
            # and masked out as a key; padded query rows are never gathered back
            rows = starts[:, None] + np.minimum(pos, (lens - 1)[:, None])
            keys_masked = not bool(valid.all())
            key_bias = None
            if keys_masked:
                key_bias = np.where(valid, 0.0, -np.inf).astype(np.float32).reshape(len(seqs), 1, 1, L)
            self.buckets.append(
                {
                    "n": len(seqs),
                    "L": L,
                    "rows": paddle.to_tensor(rows.reshape(-1), dtype="int64", place=place),
                    "valid": paddle.to_tensor(np.flatnonzero(valid.reshape(-1)), dtype="int64", place=place),
                    "key_bias": key_bias,
                    "seqs": seqs,
                }
            )
            order.append(rows[valid])
        tokens = np.concatenate(order) if order else np.zeros(0, np.int64)
        inverse = np.empty_like(tokens)
        inverse[tokens] = np.arange(tokens.size, dtype=np.int64)
        self.inverse = paddle.to_tensor(inverse, dtype="int64", place=place)
        self.key_bias = {}  # (bucket, dtype) -> tensor, made on first use

    def bias(self, i, dtype, place):
        key = (i, str(dtype))
        if key not in self.key_bias:
            self.key_bias[key] = paddle.to_tensor(self.buckets[i]["key_bias"], place=place).astype(dtype)
        return self.key_bias[key]


_cache = collections.OrderedDict()
_cache_lock = threading.Lock()
_CACHE_SIZE = 8  # one batch's cu_seqlens serves every layer (and the backward)


def _indices(cu, place):
    key = (cu.tobytes(), str(place))
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    made = _Indices(cu, place)
    with _cache_lock:
        _cache[key] = made
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return made


def bucketed_attention(q, k, v, cu_seqlens, max_seqlen, p, scale, rng=None):
    """Softmax attention of every sequence with itself, on packed ``[T, H, D]`` q, k, v.

    Args:
        q, k, v: [T, H, D], one floating dtype, any place.
        cu_seqlens: [B + 1] int32 CPU tensor (or host values); read on the host.
        max_seqlen: int bound on every length (checked).
        p: attention-probability dropout in [0, 1) (0: none).
        scale: multiplier of q k^T.
        rng: None (dropout from Paddle's generator) or a [2] int64 CPU tensor (seed,
            offset): the Philox mask of ``paddle_unpad.ops.philox.attention_keep_mask``.
    Returns:
        [T, H, D] of q's dtype; differentiable w.r.t. q, k and v (Paddle autograd).
    """
    cu = cu_seqlens.numpy() if hasattr(cu_seqlens, "numpy") else np.asarray(cu_seqlens)
    cu = cu.astype(np.int64)
    total, heads = q.shape[0], q.shape[1]
    check_cu_seqlens(cu, total, max_seqlen)
    if total == 0 or cu[-1] == 0:
        return q * 0.0
    idx = _indices(cu, q.place)
    if p > 0.0 and rng is not None:
        seed, offset = (int(x) for x in rng.numpy())
    outs = []
    q_scaled = q * scale  # [T, H, D]: cheaper here than on every bucket's [n, H, L, L] scores
    for i, b in enumerate(idx.buckets):
        n, L = b["n"], b["L"]
        qb, kb, vb = (
            paddle.gather(x, b["rows"]).reshape([n, L, heads, -1]).transpose([0, 2, 1, 3]) for x in (q_scaled, k, v)
        )  # [n, H, L, D]
        scores = paddle.matmul(qb, kb, transpose_y=True)
        if b["key_bias"] is not None:
            scores = scores + idx.bias(i, scores.dtype, q.place)
        probs = F.softmax(scores, axis=-1)
        if p > 0.0:
            if rng is None:
                probs = F.dropout(probs, p=p, training=True, mode="upscale_in_train")
            else:
                probs = probs * _philox_multiplier(cu, b, heads, seed, offset, p, probs.dtype, q.place)
        ctx = paddle.matmul(probs, vb).transpose([0, 2, 1, 3]).reshape([n * L, heads, -1])
        outs.append(paddle.gather(ctx, b["valid"]))
    packed = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)
    return paddle.gather(packed, idx.inverse)


def _philox_multiplier(cu, bucket, heads, seed, offset, p, dtype, place):
    """[n, H, L, L]: 0 where the Philox mask drops, 1 / (1 - p) where it keeps (padding: 0)."""
    n, L = bucket["n"], bucket["L"]
    m = np.zeros((n, heads, L, L), np.float32)
    for j, s in enumerate(bucket["seqs"]):
        t0, length = int(cu[s]), int(cu[s + 1] - cu[s])
        keep = attention_keep_mask(seed, offset, p, t0, length, heads)
        m[j, :, :length, :length] = keep.astype(np.float32) / np.float32(1.0 - p)
    return paddle.to_tensor(m, place=place).astype(dtype)

"""The buckets of a :class:`~paddle_unpad.distributed.grad_sync.GradientAllReduce`: which
gradients are reduced together, in which order, and how a bucket's gradients go into one
collective and back.

The plan is fixed at construction and compared across the ranks (it decides the sizes of every
collective), so it depends on the parameters and ``bucket_mb`` only. Buckets follow the reverse
registration order -- the order the backward completes the gradients -- so that with overlap the
first bucket is complete first. A gradient of at least ``bucket_mb`` is a bucket of its own,
reduced in its own memory; the small ones (biases, LayerNorm) are packed together, one copy in
and one out, so that they cost one collective instead of one each.
"""

from __future__ import annotations

import threading

import numpy as np
import paddle

from .._runtime import paddle_compat as compat
from . import groups


def nbytes(p) -> int:
    """Bytes of a parameter or gradient."""
    return int(np.prod(p.shape)) * p.element_size()


class Bucket:
    """Parameters reduced in one collective (or, with a ``table``, one embedding table reduced by
    rows). ``pending`` counts the gradients of this pass not complete yet; ``ready`` is set when
    none is left, for the thread or the hook that reduces it."""

    __slots__ = ("params", "table", "pending", "ready", "nbytes")

    def __init__(self, params, table=None):
        self.params, self.table = list(params), table  # table: the grad_rows.Table of a by-rows bucket
        self.nbytes = sum(nbytes(p) for p in self.params)
        self.pending = len(self.params)
        self.ready = threading.Event()


def plan(params, limit, table_of):
    """The buckets of ``params``, in the order the backward completes them. ``limit``: bytes
    (``bucket_mb``); ``table_of(p)``: the rows table of a large gradient reduced by rows, or None
    -- called only for a gradient of at least ``limit``, so that small tables get no hook."""
    buckets, small, small_bytes = [], [], 0
    for p in reversed(params):
        size = nbytes(p)
        if size >= limit:
            buckets.append(Bucket([p], table_of(p)))
        else:
            small.append(p)
            small_bytes += size
            if small_bytes >= limit:
                buckets.append(Bucket(small))
                small, small_bytes = [], 0
    if small:
        buckets.append(Bucket(small))
    return buckets


def gradient_of(p):
    """``(gradient, sparse)``: ``p``'s gradient as it takes part in the pass, and whether it was a
    sparse one. Every rank reduces every bucket whole, so a parameter without a gradient this
    step takes part with zeros, and so does a SelectedRows gradient (named by the trailer)."""
    g = p.grad
    if g is None:  # no gradient on this rank this step
        if p.stop_gradient:  # frozen since construction: left alone, named by the trailer
            return paddle.zeros(p.shape, dtype=p.dtype), False
        compat.set_grad(p, paddle.zeros(p.shape, dtype=p.dtype))
        return p.grad.detach(), False  # shares the gradient's memory
    if g.is_selected_rows():
        return paddle.zeros(p.shape, dtype=p.dtype), True
    return g.detach(), False


def start_dense(group, grads, sync_op, scale):
    """Issue the all-reduce of a dense bucket's gradients ``grads``: ``(task, finish)``. One
    gradient is reduced in its own memory; several are packed into one flat tensor first.
    ``finish()``, after the task, scales the sums by ``scale`` (None: leave them) and copies a
    packed bucket's sums back into the gradients; it returns the bytes reduced."""
    sent = sum(nbytes(g) for g in grads)
    flat = grads[0] if len(grads) == 1 else paddle.concat([g.reshape([-1]) for g in grads])
    task = groups.all_reduce(group, flat, sync_op=sync_op)

    def finish():
        if scale is not None:
            flat.scale_(scale)
        if len(grads) > 1:
            for g, part in zip(grads, paddle.split(flat, [int(np.prod(g.shape)) for g in grads])):
                g.set_value(part.reshape(g.shape))
        return sent

    return task, finish


def initial_stats(buckets):
    """GradientAllReduce.stats before its first step: what its buckets hold."""
    return {
        "steps": 0,
        "exposed_s": 0.0,
        "bytes": 0,
        "last_bytes": 0,
        "buckets": len(buckets),
        "dense_bytes": sum(b.nbytes for b in buckets),
        "tables_by_rows": sum(b.table is not None for b in buckets),
        "tables_unproven": 0,
    }


def count_step(stats, seconds, nbytes):
    """One step into ``stats``: the seconds wait() took and the bytes reduced; returns the seconds."""
    stats["steps"] += 1
    stats["exposed_s"] += seconds
    stats["bytes"] += nbytes
    stats["last_bytes"] = nbytes
    return seconds

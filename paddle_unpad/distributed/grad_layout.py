"""The agreement of a :class:`~paddle_unpad.distributed.grad_sync.GradientAllReduce` at
construction: every rank's layout (parameter shapes and dtypes, bucket plan, options) compared
through the job's store before any collective.

The layout decides the size of every collective of every step; ranks whose layouts differ
would issue all-reduces of mismatched sizes, which abort inside gloo. Compared through the
store within ``timeout``, they are a :class:`GradientSyncError` on every rank that names the
first difference, and a rank that never builds its all-reduce is named too.
"""

from __future__ import annotations

import json

from . import groups
from .errors import GradientSyncError


def layout(world, options, params, buckets) -> dict:
    """What must be the same on every rank (``timeout`` may differ: it bounds this rank's own wait)."""
    return {
        "ranks": world,
        "options": {k: v for k, v in options.items() if k != "timeout"},
        "parameters": [[list(p.shape), str(p.dtype).replace("paddle.", "")] for p in params],
        "buckets": [[len(b.params), b.nbytes, b.table is not None] for b in buckets],
    }


def agree(mine, ranks, timeout):
    """Compare this rank's layout ``mine`` with the other ``ranks``' within ``timeout``; raise
    :class:`GradientSyncError` on every rank when one is missing or any differs."""
    values, missing = groups.agree("gradient-all-reduce", json.dumps(mine, sort_keys=True), timeout, ranks)
    me = ranks.index(groups.job()[0])
    if missing:
        absent, waited = [ranks[i] for i in missing], max(timeout, groups.AGREE_MIN_S)
        raise GradientSyncError(
            f"paddle_unpad.distributed.GradientAllReduce: rank(s) {absent} did not build the all-reduce within {waited:g} s (this is rank {ranks[me]}): build it at the same point on every rank"
        )
    if values is not None:
        first = _first_difference([json.loads(v) for v in values], ranks)
        raise GradientSyncError(
            f"paddle_unpad.distributed.GradientAllReduce: the ranks' models or options differ -- {first}; every rank must reduce the same parameters with the same options (this is rank {ranks[me]})"
        )


def _first_difference(layouts, ranks) -> str:
    """The first way the ranks' layouts differ, in words."""
    ref = layouts[0]
    for i, lay in enumerate(layouts[1:], 1):
        if lay is None:
            continue
        a, b = ranks[0], ranks[i]
        if len(lay["parameters"]) != len(ref["parameters"]):
            return f"rank {a} has {len(ref['parameters'])} trainable parameters, rank {b} {len(lay['parameters'])}"
        for k, (p, q) in enumerate(zip(ref["parameters"], lay["parameters"])):
            if p != q:
                return f"parameter {k} is {p[1]} {p[0]} on rank {a} but {q[1]} {q[0]} on rank {b}"
        for key in sorted(set(ref["options"]) | set(lay["options"])):
            if ref["options"].get(key) != lay["options"].get(key):
                return f"option {key} is {ref['options'].get(key)!r} on rank {a} but {lay['options'].get(key)!r} on rank {b}"
        if lay != ref:
            return f"the bucket plans differ between rank {a} and rank {b}"
    return "the layouts differ"

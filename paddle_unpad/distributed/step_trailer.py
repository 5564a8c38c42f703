"""The trailer of a gradient all-reduce pass: what each rank says about its step, all-gathered
after the step's reduction, and the one error every rank raises when any rank's is not right.

A rank that skipped a batch, ran a second backward, froze or replaced a parameter, or is
leaving would otherwise step with gradients paired with another step's or another rank's
unreduced ones -- or wait in a collective its peers never issue. Every rank issues the same
trailer collective whatever went wrong on it, so each of these is seen by all of them at the
same ``wait()`` and named the same way. The trailer is int64 words (a host all-gather on the
control group): ``_TRAILER_WORDS`` flags, then the description of a new or resized parameter.
"""

from __future__ import annotations

import numbers
from typing import Optional

import numpy as np

from . import groups
from .errors import GradientSyncError

_TRAILER_WORDS = 6  # step, closing, second gradient, frozen/unfrozen, sparse, new/resized parameter
_TEXT_WORDS = 16  # then the new or resized parameter, described in up to 128 bytes
TRAILER = "the step trailer all-gather"
_NEW_PARAMETER = "is not one of the parameters it was built with (a layer replaced or added, a weight re-assigned, an embedding resized)"
_CLOSED_EARLY = "an exception or exit between backward() and wait(), or close() before wait()"
_ACCUMULATION = "gradient accumulation needs GradientAllReduce(overlap=False), with wait() after the last backward only -- with overlap a bucket is reduced as soon as the first backward completes it"
_NOT_REDUCED = (
    "its gradient would not be reduced like the others (the all-reduce keeps the parameters it saw at construction)"
)
_REBUILD = "close() the all-reduce and build a new GradientAllReduce on every rank"
_STOP_GRADIENT_CHANGED = "its gradient would not be averaged like the others: after changing stop_gradient, close() the all-reduce and build a new GradientAllReduce"


def _words(text: str) -> np.ndarray:
    raw = text.encode("utf-8")[: 8 * _TEXT_WORDS]
    return np.frombuffer(raw.ljust(8 * _TEXT_WORDS, b"\0"), dtype=np.int64)


def _text(words) -> str:
    return np.ascontiguousarray(words, dtype=np.int64).tobytes().rstrip(b"\0").decode("utf-8", "replace")


def checked_step(step) -> Optional[int]:
    """``wait(step=)`` as the trailer carries it: a non-negative int, or None (then the count of
    passes stands in for it)."""
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise TypeError(
            f"paddle_unpad.distributed.GradientAllReduce.wait: step must be a non-negative int (the batch's global step, batch['step']), got {step!r}"
        )
    return int(step)


def pack(step, closing, again, changed, sparse, replaced) -> np.ndarray:
    """This rank's trailer. ``again``, ``sparse``: the index of the parameter with a second
    gradient, a sparse one (-1: none); ``changed``: +-(index in the model's parameters + 1) of
    one unfrozen / frozen since construction (0: none); ``replaced``: (1 new / 2 resized
    trainable parameter, its description), (0, "") for none."""
    mine = np.zeros(_TRAILER_WORDS + _TEXT_WORDS, np.int64)
    mine[:_TRAILER_WORDS] = [step, closing, again + 1, changed, sparse + 1, replaced[0]]
    mine[_TRAILER_WORDS:] = _words(replaced[1])
    return mine


def check(control, mine, ranks, params, known, step):
    """All-gather every rank's trailer ``mine`` on ``control`` and raise on every rank alike when
    any rank's is not right. ``params``: the reduced parameters, ``known``: the model's, each
    rank's own lists, which name a flagged parameter by index."""
    try:
        rows = groups.all_gather_array(control, mine)
    except Exception as e:  # noqa: BLE001
        raise failed(TRAILER, e, ranks, step) from e
    problem = _problem(rows, ranks, params, known)
    if problem is not None:
        raise GradientSyncError(
            f"paddle_unpad.distributed.GradientAllReduce: {problem} (this is rank {groups.job()[0]})"
        )


def failed(what, exc, ranks, step) -> GradientSyncError:
    """The error of a collective of a pass that failed: the peers that left the job named (rank 0
    when the job's store is gone with it), else the backend's own words."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    left = groups.who_left(ranks)
    if left:
        return GradientSyncError(
            f"paddle_unpad.distributed.GradientAllReduce: {left}, so {what} of step {step} failed and its gradients are not reduced (this is rank {groups.job()[0]}; {type(exc).__name__}: {first})"
        )
    if what == TRAILER:
        return GradientSyncError(
            f"paddle_unpad.distributed.GradientAllReduce: {what} failed -- a peer died or stopped ({type(exc).__name__}: {first})"
        )
    return GradientSyncError(f"paddle_unpad.distributed.GradientAllReduce: {what} failed: {exc}")


def _name(params, index):
    return repr(params[index].name) if 0 <= index < len(params) else f"#{index}"


def _problem(rows, ranks, params, known) -> Optional[str]:
    """The first thing wrong with the pass, in words, from every rank's trailer (None: nothing)."""
    closing = [ranks[i] for i, r in enumerate(rows) if r[1]]
    if closing:
        step = int(rows[0][0])
        return f"rank(s) {closing} closed the all-reduce with the reduction of step {step} open ({_CLOSED_EARLY}); this step's gradients are not reduced on any rank"
    if np.any(rows[:, 0] != rows[0, 0]):
        steps = ", ".join(f"rank {ranks[i]} step {int(r[0])}" for i, r in enumerate(rows))
        return f"the ranks are reducing the gradients of different steps ({steps}): a rank skipped a step's backward or wait(), or ran an extra one; every rank must reduce every step"
    return _flagged(rows, ranks, params, known)


def _flagged(rows, ranks, params, known) -> Optional[str]:
    """What a rank flagged in its trailer: a sparse gradient, a second backward, a change of
    the trainable set (the parameter named from this rank's own list)."""
    for i, r in enumerate(rows):
        if r[4]:
            name = _name(params, int(r[4]) - 1)
            return f"parameter {name} has a sparse (SelectedRows) gradient on rank {ranks[i]} (nn.Embedding(sparse=True)); only dense gradients are all-reduced: build the embedding with sparse=False"
    for i, r in enumerate(rows):
        if r[2]:
            name = _name(params, int(r[2]) - 1)
            return f"parameter {name} got a second gradient before wait() on rank {ranks[i]} (two backward passes in one step): {_ACCUMULATION}"
    for i, r in enumerate(rows):
        if r[5]:
            what = _text(r[_TRAILER_WORDS:])
            how = _NEW_PARAMETER if r[5] == 1 else "changed shape since it was built"
            return f"a trainable parameter of the model on rank {ranks[i]}, {what}, {how}: {_NOT_REDUCED}; after changing the model's layers, {_REBUILD}"
    for i, r in enumerate(rows):
        if r[3]:
            k = abs(int(r[3])) - 1
            now = "trainable now (stop_gradient=False)" if r[3] > 0 else "frozen now (stop_gradient=True)"
            was = "frozen" if r[3] > 0 else "trainable"
            return f"parameter {_name(known, k)} is {now} on rank {ranks[i]} but was {was} when this GradientAllReduce was built, so {_STOP_GRADIENT_CHANGED}"
    return None

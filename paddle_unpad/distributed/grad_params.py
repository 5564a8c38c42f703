"""The parameters a :class:`~paddle_unpad.distributed.grad_sync.GradientAllReduce` reduces:
which ones it takes at construction, that no other live all-reduce takes them too, and whether
the model's trainable set is still the one it was built with.

The set is fixed at construction because every rank must issue the same collectives: a
parameter frozen, unfrozen, added or resized afterwards on one rank would change its bucket
sizes, or leave a gradient unaveraged. :func:`trainable_change` finds such a change at every
``wait()`` (by identity and shape), for the step trailer to make it an error on every rank.
"""

from __future__ import annotations

import weakref
from typing import Dict

import paddle

from .._runtime import paddle_compat as compat
from .errors import GradientSyncError

_OWNERS: Dict[int, "weakref.ref"] = {}  # id(parameter) -> the live all-reduce that reduces it
_SPARSE_GRADIENT = "its gradient is a SelectedRows, which the all-reduce cannot reduce: build it with sparse=False (on CPU jobs the table is reduced by the rows the step used anyway)"
_TWO_OWNERS = "two would reduce every gradient twice, and their hooks and threads would interleave"


def trainable(model, is_layer):
    """The trainable parameters of ``model`` (a layer, or a list of parameters, none twice)."""
    params = list(model.parameters() if is_layer else model)
    seen = {}
    for i, p in enumerate(params):
        if not isinstance(p, paddle.Tensor):
            raise TypeError(
                f"paddle_unpad.distributed.GradientAllReduce: model must be a paddle.nn.Layer or a list of parameters, item {i} is a {type(p).__name__}"
            )
        if id(p) in seen:
            raise ValueError(
                f"paddle_unpad.distributed.GradientAllReduce: parameter {p.name!r} is listed twice (items {seen[id(p)]} and {i}); it would be reduced twice and the ranks' collectives would not match"
            )
        seen[id(p)] = i
    params = [p for p in params if not p.stop_gradient]
    if not params:
        raise ValueError("paddle_unpad.distributed.GradientAllReduce: model has no trainable parameters")
    return params


def refuse_sparse_tables(model):
    """A sparse embedding's gradient is a SelectedRows, which no collective here can take."""
    for name, layer in model.named_sublayers(include_self=True):
        if (
            isinstance(layer, paddle.nn.Embedding)
            and compat.embedding_is_sparse(layer)
            and not layer.weight.stop_gradient
        ):
            where = name or "model"
            raise ValueError(
                f"paddle_unpad.distributed.GradientAllReduce: model has a sparse embedding (layer {where!r}, nn.Embedding(sparse=True), weight {layer.weight.name!r}); {_SPARSE_GRADIENT}"
            )


def claim(params, owner):
    """Make ``owner`` the one all-reduce of ``params``; refused while another live, unclosed one
    reduces any of them (two would reduce every gradient twice, their hooks interleaved)."""
    for p in params:
        ref = _OWNERS.get(id(p))
        other = ref() if ref is not None else None
        if other is not None and other is not owner and not other._closed:
            raise GradientSyncError(
                f"paddle_unpad.distributed.GradientAllReduce: parameter {p.name!r} is already reduced by a live GradientAllReduce ({other!r}); close() that one first ({_TWO_OWNERS})"
            )
    me = weakref.ref(owner)
    for p in params:
        _OWNERS[id(p)] = me


def release(params, owner):
    """Free the ``params`` that ``owner`` claimed, for another all-reduce to take."""
    for p in params:
        ref = _OWNERS.get(id(p))
        if ref is not None and ref() is owner:
            del _OWNERS[id(p)]


class TrainableSet:
    """The model's parameters at construction (frozen ones too), to see at wait() one frozen or
    unfrozen since, or a trainable one that was not among them (a layer replaced or added, a
    weight re-assigned) or changed shape. Holding them keeps their ids unique."""

    def __init__(self, model, is_layer, reduced):
        self.known = list(model.parameters() if is_layer else model)
        self.model = model if is_layer else None
        self.shapes = {id(p): list(p.shape) for p in self.known}
        self.reduced = reduced

    def change(self):
        return trainable_change(self.known, self.reduced, self.model, self.shapes)


def trainable_change(known, reduced, model, shapes):
    """``(changed, replaced)``: the first parameter of ``known`` (the model's, frozen ones too)
    frozen or unfrozen since construction, as +-(index + 1) of one unfrozen / frozen (0: none);
    else the first trainable parameter of ``model`` (a layer, or None) that was not one of them
    then (a layer replaced or added, a weight re-assigned, a resized embedding) or whose shape
    differs from ``shapes`` (by id), as (1 new / 2 resized, its description), (0, "") for none.
    ``reduced``: the ids of the parameters reduced."""
    for i, p in enumerate(known):
        if id(p) in reduced and p.stop_gradient:
            return -(i + 1), (0, "")
        if id(p) not in reduced and not p.stop_gradient and p.grad is not None:
            return i + 1, (0, "")
    if model is None:
        return 0, (0, "")
    for name, p in model.named_parameters():
        if p.stop_gradient:
            continue
        then = shapes.get(id(p))
        if then is None:
            return 0, (1, f"{name!r} ({p.name}, shape {list(p.shape)})")
        if then != list(p.shape):
            return 0, (2, f"{name!r} ({p.name}: shape {then} then, {list(p.shape)} now)")
    return 0, (0, "")

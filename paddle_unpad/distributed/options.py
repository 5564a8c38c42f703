"""The distributed layer's options: one table of defaults and checks, one validator.

Two users read it. The sample exchange -- the fleet strategy's ``unpad_configs``,
:func:`paddle_unpad.fleet.distributed_loader`, :class:`~paddle_unpad.distributed.BalancedLoader`
and ``UnpadTrainer(unpad_configs=...)`` -- takes the rows of scope ``"exchange"``; the
gradient all-reduce (:class:`~paddle_unpad.distributed.GradientAllReduce`) the rows of scope
``"allreduce"``. A key both use (``timeout``) is one row. A bad value fails where it is given,
with the same message everywhere, and the result is one read-only value,
:class:`ResolvedOptions`, that carries the public name they were given to (its errors name
it) to the loader or the all-reduce. The on/off switch of the exchange is ``balance``;
``DistributedStrategy.unpad`` is its fleet-style spelling (``strategy.amp`` / ``amp_configs``
is the model).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Mapping, NamedTuple, Optional, Tuple

from ..balance.cost import check_cost
from ..balance.planner import DEFAULT_TOL, check_counts, check_tol
from ..data.collate import check_max_seqlen

EXCHANGE, ALLREDUCE = "exchange", "allreduce"


class Option(NamedTuple):
    default: Any
    meaning: str
    scopes: Tuple[str, ...]


#: every option: its default, its meaning, and who takes it
OPTIONS: Dict[str, Option] = {
    "balance": Option(
        True, "exchange samples so that ranks get equal cost (False: each rank packs its own batches)", (EXCHANGE,)
    ),
    "cost": Option(
        "quadratic",
        "cost of a sample: 'quadratic' (= 'flops', BERT-large FLOPs), 'tokens' (= 'token'), a CostModel or a callable length -> cost",
        (EXCHANGE,),
    ),
    "counts": Option(
        "equal",
        "samples per rank: 'equal', 'source' (keep each rank's count) or a list of ints >= 0, one per rank (a float count is a TypeError)",
        (EXCHANGE,),
    ),
    "tol": Option(DEFAULT_TOL, "planner stopping tolerance (max/mean - 1)", (EXCHANGE,)),
    "prefetch": Option(2, "batches prepared ahead of the training loop", (EXCHANGE,)),
    "timeout": Option(
        300.0,
        "seconds to wait for a peer (a batch of the exchange, the all-reduce in wait(), the ranks' settings) before failing: a stalled or dead peer",
        (EXCHANGE, ALLREDUCE),
    ),
    "max_seqlen": Option(512, "longest legal sample (None: no limit)", (EXCHANGE,)),
    "check_plan": Option(False, "all-gather each step's plan hash and compare (for tests)", (EXCHANGE,)),
    "close_timeout": Option(10.0, "seconds close() waits for the exchange thread", (EXCHANGE,)),
    "bucket_mb": Option(
        1.0,
        "a gradient of at least this many MiB is all-reduced on its own, in place; smaller ones are packed into buckets of about this size",
        (ALLREDUCE,),
    ),
    "average": Option(True, "divide the summed gradients by the number of ranks (False: keep the sum)", (ALLREDUCE,)),
    "row_sparse_embeddings": Option(
        None,
        "reduce embedding tables by the rows the step used (None: on CPU jobs, off on GPU jobs, where reading the ids back would make the step wait)",
        (ALLREDUCE,),
    ),
    "dense_fraction": Option(
        0.5, "reduce a table whole once the union of its used rows exceeds this share of its rows", (ALLREDUCE,)
    ),
    "overlap": Option(
        None, "reduce while the backward runs (None: True); False: after the backward, in wait()", (ALLREDUCE,)
    ),
}
DEFAULTS: Dict[str, Any] = {k: o.default for k, o in OPTIONS.items() if EXCHANGE in o.scopes}
ALLREDUCE_DEFAULTS: Dict[str, Any] = {k: o.default for k, o in OPTIONS.items() if ALLREDUCE in o.scopes}


def _is_number(v):
    return not isinstance(v, bool) and isinstance(v, (int, float))


def _finite_number(v, strictly_positive):
    return math.isfinite(v) and (v > 0 if strictly_positive else v >= 0)


def _refuse(where, name, v, rule, wrong_type):
    raise (TypeError if wrong_type else ValueError)(f"paddle_unpad.{where}: {name} must be {rule}, got {v!r}")


def _check_seconds(where, name, v, strictly_positive):
    # threading waits take at most threading.TIMEOUT_MAX seconds: a larger value would raise
    # OverflowError at the first wait, long after it was given
    if not _is_number(v) or not _finite_number(v, strictly_positive) or v > threading.TIMEOUT_MAX:
        _refuse(
            where,
            name,
            v,
            f"a finite number of seconds {'> 0' if strictly_positive else '>= 0'} and at most threading.TIMEOUT_MAX ({threading.TIMEOUT_MAX:.4g})",
            not _is_number(v),
        )


# key -> (rule in words, the value's type is right, the value is right)
_NUMBER_RULES = {
    "bucket_mb": ("a finite number > 0", _is_number, lambda v: _finite_number(v, True)),
    "dense_fraction": ("a number in [0, 1]", _is_number, lambda v: _finite_number(v, False) and v <= 1),
    "prefetch": ("an int >= 1", lambda v: isinstance(v, int) and not isinstance(v, bool), lambda v: v >= 1),
    "balance": ("True or False", lambda v: isinstance(v, bool), lambda v: True),
    "check_plan": ("True or False", lambda v: isinstance(v, bool), lambda v: True),
    "average": ("True or False", lambda v: isinstance(v, bool), lambda v: True),
    "row_sparse_embeddings": (
        "True, False or None (the default)",
        lambda v: v is None or isinstance(v, bool),
        lambda v: True,
    ),
    "overlap": ("True, False or None (the default)", lambda v: v is None or isinstance(v, bool), lambda v: True),
}


def _check(key, v, where, arg):
    name = f"{arg}[{key!r}]" if arg else key
    if key in _NUMBER_RULES:
        rule, right_type, right_value = _NUMBER_RULES[key]
        if not right_type(v) or not right_value(v):
            _refuse(where, name, v, rule, not right_type(v))
    elif key in ("timeout", "close_timeout"):
        _check_seconds(where, name, v, key == "timeout")
    elif key == "max_seqlen":
        return check_max_seqlen(v, name, where)
    elif key == "cost":
        check_cost(v, name, where)
    elif key == "counts":
        return check_counts(v, name, where)
    elif key == "tol":
        return check_tol(v, name, where)
    return v


@dataclass(frozen=True, eq=False)
class ResolvedOptions(Mapping):
    """Options as :func:`resolve` returned them: every value checked, read only (a mapping of
    the keys of one scope; a list comes out as a copy), and ``where``, the public name they were
    given to (after ``paddle_unpad.``), which errors about them name."""

    _values: Dict[str, Any]  # never changed: resolve() makes a new value
    where: str
    scope: str = EXCHANGE

    def __getitem__(self, key: str) -> Any:
        v = self._values[key]
        return list(v) if isinstance(v, list) else v

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def resolve(
    options: Dict[str, Any], where: str, arg: str = "", base: Optional[ResolvedOptions] = None, scope: str = EXCHANGE
) -> ResolvedOptions:
    """``base`` (default: the defaults of ``scope``) updated with ``options``, every key of
    ``options`` checked, as a :class:`ResolvedOptions` named ``where``.

    Options are resolved once, where a user gives them (``fleet.DistributedStrategy``,
    ``fleet.distributed_loader``, ``BalancedLoader``, ``UnpadTrainer``, ``GradientAllReduce``);
    ``base``, a value this function returned, is not checked again.
    ``where`` is the public name the options were given to, after ``paddle_unpad.``
    (``"fleet.DistributedStrategy"``), ``arg`` the argument that holds them (``"unpad_configs"``;
    ``""`` for keyword arguments). A value of the wrong type raises TypeError, a bad value or
    an unknown key ValueError, naming ``where``, the key and the value."""
    if not isinstance(options, dict):
        raise TypeError(f"paddle_unpad.{where}: {arg or 'options'} must be a dict, got {type(options).__name__}")
    known = sorted(k for k, o in OPTIONS.items() if scope in o.scopes)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"paddle_unpad.{where}: {arg + ': ' if arg else ''}unknown keys {unknown}; known: {known}")
    if base is not None and not isinstance(base, ResolvedOptions):
        raise TypeError(f"paddle_unpad.{where}: base must be options resolve() returned, got {type(base).__name__}")
    merged = dict((DEFAULTS if scope == EXCHANGE else ALLREDUCE_DEFAULTS) if base is None else base)
    merged.update({k: _check(k, v, where, arg) for k, v in options.items()})
    return ResolvedOptions(merged, where, scope)


def check_counts_per_rank(configs: Mapping[str, Any], where: str, world: int, arg: str = ""):
    """A list of ``counts`` in resolved ``configs`` holds one count per rank: checked where the
    options are given, once the number of ranks is known there (``world`` > 1; in one process
    the counts are not used)."""
    if world > 1 and isinstance(configs.get("counts"), list):
        check_counts(configs["counts"], f"{arg}[{'counts'!r}]" if arg else "counts", where, ranks=world)


def markdown_table() -> str:
    """The options table of docs/api.md (a test keeps the two equal)."""
    rows = ["| option | default | taken by | meaning |", "|---|---|---|---|"]
    for key, o in OPTIONS.items():
        takers = " and ".join({EXCHANGE: "sample exchange", ALLREDUCE: "all-reduce"}[s] for s in o.scopes)
        rows.append(f"| `{key}` | `{o.default!r}` | {takers} | {o.meaning} |")
    return "\n".join(rows)

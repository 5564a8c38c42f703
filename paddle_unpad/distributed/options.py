"""The distributed layer's options: one table of defaults and checks, one validator.

Two users read it. The sample exchange -- the fleet strategy's ``unpad_configs``,
:func:`paddle_unpad.fleet.distributed_loader`, :class:`~paddle_unpad.distributed.BalancedLoader`
and ``UnpadTrainer(unpad_configs=...)`` -- takes the rows of scope ``"exchange"``; the
gradient all-reduce (:class:`~paddle_unpad.distributed.GradientAllReduce`) the rows of scope
``"allreduce"``. A key both use (``timeout``) is one row. A bad value fails where it is given,
with the same message everywhere. The on/off switch of the exchange is ``balance``;
``DistributedStrategy.unpad`` is its fleet-style spelling (``strategy.amp`` / ``amp_configs``
is the model).
"""
from __future__ import annotations

import math
import threading
from typing import Any, Dict, NamedTuple, Tuple

from ..balance.cost import check_cost
from ..balance.planner import DEFAULT_TOL
from ..data.collate import check_max_seqlen

EXCHANGE, ALLREDUCE = "exchange", "allreduce"


class Option(NamedTuple):
    default: Any
    meaning: str
    scopes: Tuple[str, ...]


#: every option: its default, its meaning, and who takes it
OPTIONS: Dict[str, Option] = {
    "balance": Option(True, "exchange samples so that ranks get equal cost (False: each rank packs its own batches)",
                      (EXCHANGE,)),
    "cost": Option("quadratic", "cost of a sample: 'quadratic' (= 'flops', BERT-large FLOPs), 'tokens' (= 'token'), "
                                "a CostModel or a callable length -> cost", (EXCHANGE,)),
    "counts": Option("equal", "samples per rank: 'equal', 'source' (keep each rank's count) or a list of counts",
                     (EXCHANGE,)),
    "tol": Option(DEFAULT_TOL, "planner stopping tolerance (max/mean - 1)", (EXCHANGE,)),
    "prefetch": Option(2, "batches prepared ahead of the training loop", (EXCHANGE,)),
    "timeout": Option(300.0, "seconds to wait for a peer (a batch of the exchange, the all-reduce in wait(), the "
                             "ranks' settings) before failing: a stalled or dead peer", (EXCHANGE, ALLREDUCE)),
    "max_seqlen": Option(512, "longest legal sample (None: no limit)", (EXCHANGE,)),
    "check_plan": Option(False, "all-gather each step's plan hash and compare (for tests)", (EXCHANGE,)),
    "close_timeout": Option(10.0, "seconds close() waits for the exchange thread", (EXCHANGE,)),
    "bucket_mb": Option(1.0, "a gradient of at least this many MiB is all-reduced on its own, in place; smaller "
                             "ones are packed into buckets of about this size", (ALLREDUCE,)),
    "average": Option(True, "divide the summed gradients by the number of ranks (False: keep the sum)", (ALLREDUCE,)),
    "row_sparse_embeddings": Option(None, "reduce embedding tables by the rows the step used (None: on CPU jobs, "
                                          "off on GPU jobs, where reading the ids back would make the step wait)",
                                    (ALLREDUCE,)),
    "dense_fraction": Option(0.5, "reduce a table whole once the union of its used rows exceeds this share of its "
                                  "rows", (ALLREDUCE,)),
    "overlap": Option(None, "reduce while the backward runs (None: True); False: after the backward, in wait()",
                      (ALLREDUCE,)),
}
DEFAULTS: Dict[str, Any] = {k: o.default for k, o in OPTIONS.items() if EXCHANGE in o.scopes}
ALLREDUCE_DEFAULTS: Dict[str, Any] = {k: o.default for k, o in OPTIONS.items() if ALLREDUCE in o.scopes}


def _finite_number(v, strictly_positive):
    return (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            and (v > 0 if strictly_positive else v >= 0))


def _check_seconds(name, v, strictly_positive):
    # threading waits take at most threading.TIMEOUT_MAX seconds: a larger value would raise
    # OverflowError at the first wait, long after it was given
    if not _finite_number(v, strictly_positive) or v > threading.TIMEOUT_MAX:
        raise ValueError(f"{name} must be a finite number of seconds {'> 0' if strictly_positive else '>= 0'} and "
                         f"at most threading.TIMEOUT_MAX ({threading.TIMEOUT_MAX:.4g}), got {v!r}")


def _check(key, v, where):
    name = f"{where}[{key!r}]"
    if key in ("balance", "check_plan", "average"):
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be True or False, got {v!r}")
    elif key in ("row_sparse_embeddings", "overlap"):
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"{name} must be True, False or None (the default), got {v!r}")
    elif key == "prefetch":
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    elif key in ("timeout", "close_timeout"):
        _check_seconds(name, v, key == "timeout")
    elif key == "tol":
        if not _finite_number(v, False):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    elif key == "bucket_mb":
        if not _finite_number(v, True):
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    elif key == "dense_fraction":
        if not _finite_number(v, False) or v > 1:
            raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
    elif key == "max_seqlen":
        return check_max_seqlen(v, name)
    elif key == "cost":
        check_cost(v, name)
    elif key == "counts":
        if not (v in ("equal", "source") if isinstance(v, str) else
                isinstance(v, (list, tuple)) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                                                     for c in v)):
            raise ValueError(f"{name} must be 'equal', 'source' or a list of ints >= 0, got {v!r}")
    return v


def resolve(options: Dict[str, Any], where: str = "unpad_configs", base: Dict[str, Any] = None,
            scope: str = EXCHANGE) -> Dict[str, Any]:
    """``base`` (default: the defaults of ``scope``) updated with ``options``, every key checked;
    unknown keys and bad values raise ValueError naming ``where``, the key and the value."""
    if not isinstance(options, dict):
        raise TypeError(f"{where} must be a dict, got {type(options).__name__}")
    known = sorted(k for k, o in OPTIONS.items() if scope in o.scopes)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {known}")
    merged = dict((DEFAULTS if scope == EXCHANGE else ALLREDUCE_DEFAULTS) if base is None else base)
    merged.update(options)
    return {k: _check(k, v, where) for k, v in merged.items()}


def markdown_table() -> str:
    """The options table of docs/api.md (a test keeps the two equal)."""
    rows = ["| option | default | taken by | meaning |", "|---|---|---|---|"]
    for key, o in OPTIONS.items():
        takers = " and ".join({EXCHANGE: "sample exchange", ALLREDUCE: "all-reduce"}[s] for s in o.scopes)
        rows.append(f"| `{key}` | `{o.default!r}` | {takers} | {o.meaning} |")
    return "\n".join(rows)

"""The load balancer's options: one table of defaults, one validator.

The fleet strategy (``strategy.unpad_configs``), :func:`paddle_unpad.fleet.distributed_loader`,
:class:`~paddle_unpad.balance.exchange.BalancedLoader` and ``UnpadTrainer(unpad_configs=...)``
all take these keys and check them here, so a bad value fails where it is given, with the
same message everywhere. The on/off switch is ``balance``; ``DistributedStrategy.unpad`` is the
fleet-style spelling of the same value (``strategy.amp`` / ``amp_configs`` is the model).
"""
from __future__ import annotations

import math
from typing import Any, Dict

from ..data.collate import check_max_seqlen
from .cost import check_cost
from .planner import DEFAULT_TOL

#: every option, its default and its meaning
OPTIONS: Dict[str, tuple] = {
    "balance": (True, "exchange samples so that ranks get equal cost (False: each rank packs its own batches)"),
    "cost": ("quadratic", "cost of a sample: 'quadratic' (= 'flops', BERT-large FLOPs), 'tokens' (= 'token'), a "
                          "CostModel or a callable length -> cost"),
    "counts": ("equal", "samples per rank: 'equal', 'source' (keep each rank's count) or a list of counts"),
    "tol": (DEFAULT_TOL, "planner stopping tolerance (max/mean - 1)"),
    "prefetch": (2, "batches prepared ahead of the training loop"),
    "timeout": (300.0, "seconds to wait for a batch before failing (a stalled or dead peer)"),
    "max_seqlen": (512, "longest legal sample (None: no limit)"),
    "check_plan": (False, "all-gather each step's plan hash and compare (for tests)"),
    "close_timeout": (10.0, "seconds close() waits for the exchange thread"),
}
DEFAULTS: Dict[str, Any] = {k: v[0] for k, v in OPTIONS.items()}


def _finite_number(v, strictly_positive):
    return (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            and (v > 0 if strictly_positive else v >= 0))


def _check(key, v, where):
    name = f"{where}[{key!r}]"
    if key in ("balance", "check_plan"):
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be True or False, got {v!r}")
    elif key == "prefetch":
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    elif key in ("timeout", "close_timeout"):
        if not _finite_number(v, key == "timeout"):
            raise ValueError(f"{name} must be a finite number of seconds {'> 0' if key == 'timeout' else '>= 0'}, "
                             f"got {v!r}")
    elif key == "tol":
        if not _finite_number(v, False):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
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


def resolve(options: Dict[str, Any], where: str = "unpad_configs", base: Dict[str, Any] = None) -> Dict[str, Any]:
    """``base`` (default: the defaults) updated with ``options``, every key checked; unknown keys and bad
    values raise ValueError naming ``where``, the key and the value."""
    if not isinstance(options, dict):
        raise TypeError(f"{where} must be a dict, got {type(options).__name__}")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(OPTIONS)}")
    merged = dict(DEFAULTS if base is None else base)
    merged.update(options)
    return {k: _check(k, v, where) for k, v in merged.items()}

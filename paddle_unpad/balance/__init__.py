"""Load balancing across ranks: the planning math (cost model, planner, workloads).

::

    from paddle_unpad import balance
    p = balance.plan(lengths_per_rank)                 # BERT-large FLOP cost (a*s + b*s^2)
    p = balance.plan(lengths_per_rank, cost="tokens")  # token-count cost
    p = balance.plan(lengths_per_rank, cost=balance.calibrate(model))
    # p[dst] == [(src_rank, src_index), ...]

The exchange that carries out a plan is :mod:`paddle_unpad.distributed` (``BalancedLoader``,
``ExchangeError``, ``ExchangeTimeout``); this package imports nothing of it (it needs paddle, the
planner does not).
"""

from .cost import DEFAULT_COST, CostModel, TokenCost, as_cost_fn, bert_cost, calibrate
from .planner import (
    imbalance,
    moved_samples,
    native_available,
    no_balance,
    plan,
    plan_dest,
    plan_hash,
    quantize_costs,
    rank_loads,
    sort_and_deal,
    target_counts,
)
from .workloads import bert_pretraining_lengths, global_batches

__all__ = [
    "plan",
    "plan_dest",
    "plan_hash",
    "CostModel",
    "TokenCost",
    "bert_cost",
    "calibrate",
    "DEFAULT_COST",
    "as_cost_fn",
    "imbalance",
    "rank_loads",
    "moved_samples",
    "sort_and_deal",
    "no_balance",
    "native_available",
    "quantize_costs",
    "target_counts",
    "bert_pretraining_lengths",
    "global_batches",
]

_IN_DISTRIBUTED = ("BalancedLoader", "ExchangeError", "ExchangeTimeout")


def __getattr__(name):
    # an earlier release reached these here; they live in paddle_unpad.distributed, and the
    # planner imports nothing of the exchange until an old caller asks for one
    if name in _IN_DISTRIBUTED:
        import importlib

        from .._runtime.warn import warn_once

        warn_once(
            ("balance-moved", name),
            f"paddle_unpad.balance.{name} moved to paddle_unpad.distributed.{name} (also paddle_unpad.fleet.{name}): import it from there",
            DeprecationWarning,
        )
        return getattr(importlib.import_module("paddle_unpad.distributed"), name)
    raise AttributeError(f"module 'paddle_unpad.balance' has no attribute {name!r}")

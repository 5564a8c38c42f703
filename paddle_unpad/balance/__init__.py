"""Load balancing across ranks: the planning math (cost model, planner, workloads).

::

    from paddle_unpad import balance
    p = balance.plan(lengths_per_rank)                 # BERT-large FLOP cost (a*s + b*s^2)
    p = balance.plan(lengths_per_rank, cost="tokens")  # token-count cost
    p = balance.plan(lengths_per_rank, cost=balance.calibrate(model))
    # p[dst] == [(src_rank, src_index), ...]

The exchange that carries out a plan is :mod:`paddle_unpad.distributed` (its names are
reachable here too, imported lazily: it needs paddle, the planner does not).
"""
from .cost import DEFAULT_COST, CostModel, TokenCost, as_cost_fn, bert_cost, calibrate
from .planner import (imbalance, moved_samples, native_available, no_balance, plan, plan_dest,
                      plan_hash, quantize_costs, rank_loads, sort_and_deal, target_counts)
from .workloads import bert_pretraining_lengths, global_batches

__all__ = [
    "plan", "plan_dest", "plan_hash", "CostModel", "TokenCost", "bert_cost", "calibrate",
    "DEFAULT_COST", "as_cost_fn", "imbalance", "rank_loads", "moved_samples", "sort_and_deal",
    "no_balance", "native_available", "quantize_costs", "target_counts",
    "bert_pretraining_lengths", "global_batches", "BalancedLoader", "ExchangeError",
]


def __getattr__(name):  # lazy: the exchange imports paddle
    if name in ("BalancedLoader", "ExchangeError", "ExchangeTimeout"):
        from .. import distributed

        return getattr(distributed, name)
    raise AttributeError(f"module 'paddle_unpad.balance' has no attribute {name!r}")

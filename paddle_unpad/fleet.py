"""The fleet hook: switch load balancing on from the DistributedStrategy.

::

    import paddle.distributed.fleet as fleet
    import paddle_unpad as pu

    strategy = pu.fleet.DistributedStrategy()      # a fleet.DistributedStrategy
    strategy.unpad = True
    strategy.unpad_configs = {"cost": "quadratic", "prefetch": 2, "timeout": 300}
    fleet.init(is_collective=True, strategy=strategy)

    loader = paddle.io.DataLoader(ds, batch_sampler=DistributedBatchSampler(ds, 32),
                                  collate_fn=pu.data.sample_list_collate)
    for batch in pu.fleet.distributed_loader(loader):   # balanced, packed batches
        ...

The strategy subclass behaves like ``hybrid_configs``: assigning ``unpad_configs`` merges
the given keys into the defaults and rejects unknown keys.  With ``unpad = False``, with a
plain ``fleet.DistributedStrategy`` or in a single process, :func:`distributed_loader`
only packs each rank's own batches (no exchange).
"""
from __future__ import annotations

import copy
import math
from typing import Any, Dict

from paddle.distributed import fleet as _fleet

from . import _paddle_compat as _compat
from .balance.exchange import BalancedLoader, ExchangeError, ExchangeTimeout  # noqa: F401
from .data.collate import check_max_seqlen
from .grad_sync import GradientAllReduce, GradientSyncError  # noqa: F401

__all__ = ["DistributedStrategy", "distributed_loader", "DEFAULT_UNPAD_CONFIGS", "current_strategy",
           "ExchangeError", "ExchangeTimeout", "GradientAllReduce", "GradientSyncError"]

#: keys of ``unpad_configs`` and their defaults (see :class:`BalancedLoader` for each)
DEFAULT_UNPAD_CONFIGS: Dict[str, Any] = {
    "cost": "quadratic",   # "tokens", "quadratic" (BERT-large FLOPs), a CostModel or a callable
    "counts": "equal",     # samples per rank: "equal", "source" or a list
    "tol": 1e-4,           # planner stopping tolerance (max/mean - 1)
    "prefetch": 2,         # batches prepared ahead of the training loop
    "timeout": 300.0,      # seconds to wait for a batch before failing (stalled peer)
    "max_seqlen": 512,     # longest legal sample (None: no limit)
    "check_plan": False,   # all-gather each step's plan hash and compare (tests)
    "close_timeout": 10.0,  # seconds to wait for the exchange thread on close
}


class DistributedStrategy(_fleet.DistributedStrategy):
    """``fleet.DistributedStrategy`` with two more fields: ``unpad`` (bool, default
    False) and ``unpad_configs`` (dict, see :data:`DEFAULT_UNPAD_CONFIGS`)."""

    _unpad_state = None  # per instance: {"unpad": bool, "configs": dict}

    def _state(self):
        st = self.__dict__.get("_unpad_state")
        if st is None:
            st = {"unpad": False, "configs": dict(DEFAULT_UNPAD_CONFIGS)}
            object.__setattr__(self, "_unpad_state", st)
        return st

    @property
    def unpad(self) -> bool:
        """Balance samples across ranks in :func:`distributed_loader` (default False)."""
        return self._state()["unpad"]

    @unpad.setter
    def unpad(self, flag: bool):
        if not isinstance(flag, bool):
            raise TypeError(f"unpad must be a bool, got {type(flag).__name__}")
        self._state()["unpad"] = flag

    @property
    def unpad_configs(self) -> Dict[str, Any]:
        """A copy of the load-balance settings (assign a dict to change some of them)."""
        return dict(self._state()["configs"])

    @unpad_configs.setter
    def unpad_configs(self, configs: Dict[str, Any]):
        if not isinstance(configs, dict):
            raise TypeError("unpad_configs must be a dict")
        unknown = sorted(set(configs) - set(DEFAULT_UNPAD_CONFIGS))
        if unknown:
            raise ValueError(f"unknown unpad_configs keys {unknown}; known: {sorted(DEFAULT_UNPAD_CONFIGS)}")
        merged = dict(self._state()["configs"])
        merged.update(configs)
        _validate(merged)
        self._state()["configs"] = merged

    def __deepcopy__(self, memo):
        # fleet.init deep-copies the strategy; keep the class and our fields
        cls = self.__class__
        new = cls.__new__(cls)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            object.__setattr__(new, k, copy.deepcopy(v, memo))
        return new

    def __str__(self):
        st = self._state()
        return super().__str__() + f"\nunpad: {st['unpad']}\nunpad_configs: {st['configs']}"


def _seconds(v, strictly_positive):
    return (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            and (v > 0 if strictly_positive else v >= 0))


def _validate(c):
    if isinstance(c["prefetch"], bool) or not isinstance(c["prefetch"], int) or c["prefetch"] < 1:
        raise ValueError(f"unpad_configs['prefetch'] must be an int >= 1, got {c['prefetch']!r}")
    if not _seconds(c["timeout"], True):
        raise ValueError(f"unpad_configs['timeout'] must be a finite number of seconds > 0, got {c['timeout']!r}")
    if not _seconds(c["close_timeout"], False):
        raise ValueError("unpad_configs['close_timeout'] must be a finite number of seconds >= 0, "
                         f"got {c['close_timeout']!r}")
    check_max_seqlen(c["max_seqlen"], "unpad_configs['max_seqlen']")
    if isinstance(c["tol"], bool) or not (isinstance(c["tol"], (int, float)) and math.isfinite(c["tol"])
                                          and c["tol"] >= 0):
        raise ValueError(f"unpad_configs['tol'] must be a finite number >= 0, got {c['tol']!r}")
    cost = c["cost"]
    if not (cost is None or callable(cost) or cost in ("tokens", "quadratic")):
        raise ValueError("unpad_configs['cost'] must be 'tokens', 'quadratic', a CostModel or a callable")


def current_strategy():
    """The strategy given to ``fleet.init`` (None before ``fleet.init``)."""
    return _compat.user_defined_strategy()


def distributed_loader(loader, strategy=None, **overrides) -> BalancedLoader:
    """Wrap a rank's own loader (yielding lists of samples) into an iterable of balanced,
    packed batches, like ``fleet.distributed_model`` wraps a model.

    Settings come from ``strategy`` (default: the one passed to ``fleet.init``), then
    ``overrides`` (same keys as ``unpad_configs``).  Balancing is on when the strategy is a
    :class:`DistributedStrategy` with ``unpad = True`` and there is more than one rank;
    otherwise each rank's batches are packed as they are.  Call it at the same point of
    the program on every rank (it creates the exchange's process group).
    """
    strategy = current_strategy() if strategy is None else strategy
    if isinstance(strategy, DistributedStrategy):
        enabled, configs = strategy.unpad, strategy.unpad_configs
    else:
        enabled, configs = False, dict(DEFAULT_UNPAD_CONFIGS)
    unknown = sorted(set(overrides) - set(DEFAULT_UNPAD_CONFIGS) - {"enabled", "token_fields", "place"})
    if unknown:
        raise ValueError(f"distributed_loader: unknown settings {unknown}")
    enabled = overrides.pop("enabled", enabled)
    configs.update(overrides)
    _validate(configs)
    return BalancedLoader(loader, enabled=enabled, **configs)

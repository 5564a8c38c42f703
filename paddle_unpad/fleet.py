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
from typing import Any, Dict

from paddle.distributed import fleet as _fleet

from ._runtime import host_malloc as _host_malloc
from ._runtime import paddle_compat as _compat
from .distributed import (
    BalancedLoader,
    ExchangeError,
    ExchangeTimeout,
    GradientAllReduce,  # noqa: F401
    GradientSyncError,
)
from .distributed import groups as _groups
from .distributed import options as _options

__all__ = [
    "DistributedStrategy",
    "distributed_loader",
    "DEFAULT_UNPAD_CONFIGS",
    "current_strategy",
    "ExchangeError",
    "ExchangeTimeout",
    "GradientAllReduce",
    "GradientSyncError",
]

#: keys of ``unpad_configs`` and their defaults (the table: :data:`paddle_unpad.distributed.options.OPTIONS`)
DEFAULT_UNPAD_CONFIGS: Dict[str, Any] = dict(_options.DEFAULTS)


def _defaults(where):
    # read when a strategy or loader is made, so that a program may change a default for the ones
    # after; only a changed entry is checked (the table's own defaults are valid)
    table = _options.DEFAULTS
    changed = {
        k: v
        for k, v in DEFAULT_UNPAD_CONFIGS.items()
        if k not in table or type(v) is not type(table[k]) or v != table[k]
    }
    return _options.resolve(changed, where, "DEFAULT_UNPAD_CONFIGS")


class DistributedStrategy(_fleet.DistributedStrategy):
    """``fleet.DistributedStrategy`` with two more fields: ``unpad`` (bool) and
    ``unpad_configs`` (dict, see :data:`DEFAULT_UNPAD_CONFIGS`). ``unpad`` is the
    fleet-style spelling of ``unpad_configs["balance"]`` (one value, two spellings, like
    ``strategy.amp`` beside ``amp_configs``)."""

    _unpad_state = None  # per instance: {"configs": options.ResolvedOptions}

    def __init__(self, *args, **kwargs):
        # before fleet.init makes the job's groups: each gloo group gets its own rendezvous store
        _groups.install_group_stores()
        _host_malloc.ensure("paddle_unpad.fleet.DistributedStrategy")  # a training job starts: before its model
        super().__init__(*args, **kwargs)
        self._state()  # the defaults as they are now

    def _state(self):
        st = self.__dict__.get("_unpad_state")
        if st is None:
            st = {"configs": _defaults("fleet.DistributedStrategy")}
            object.__setattr__(self, "_unpad_state", st)
        return st

    @property
    def unpad(self) -> bool:
        """Balance samples across ranks in :func:`distributed_loader` (``unpad_configs["balance"]``)."""
        return self._state()["configs"]["balance"]

    @unpad.setter
    def unpad(self, flag: bool):
        if not isinstance(flag, bool):
            raise TypeError(f"paddle_unpad.fleet.DistributedStrategy: unpad must be True or False, got {flag!r}")
        self._state()["configs"] = _options.resolve(
            {"balance": flag}, "fleet.DistributedStrategy", "unpad_configs", base=self._state()["configs"]
        )

    @property
    def unpad_configs(self) -> Dict[str, Any]:
        """A copy of the load-balance settings (assign a dict to change some of them)."""
        # resolved once: a list in the copy is a copy too, so changing it is not seen here
        return dict(self._state()["configs"])

    @unpad_configs.setter
    def unpad_configs(self, configs: Dict[str, Any]):
        resolved = _options.resolve(
            configs, "fleet.DistributedStrategy", "unpad_configs", base=self._state()["configs"]
        )
        # launched as one of N ranks: the number is known before fleet.init
        _options.check_counts_per_rank(resolved, "fleet.DistributedStrategy", _groups.launched_world(), "unpad_configs")
        self._state()["configs"] = resolved

    def __deepcopy__(self, memo):
        # fleet.init deep-copies the strategy; keep the class and our fields
        cls = self.__class__
        new = cls.__new__(cls)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            object.__setattr__(new, k, copy.deepcopy(v, memo))
        return new

    def __str__(self):
        return super().__str__() + f"\nunpad_configs: {self.unpad_configs}"


def current_strategy():
    """The strategy given to ``fleet.init`` (None before ``fleet.init``)."""
    return _compat.user_defined_strategy()


def distributed_loader(loader, strategy=None, **overrides) -> BalancedLoader:
    """Wrap a rank's own loader (yielding lists of samples) into an iterable of balanced,
    packed batches, like ``fleet.distributed_model`` wraps a model.

    Settings come from ``strategy`` (default: the one passed to ``fleet.init``), then
    ``overrides`` (the keys of ``unpad_configs``, e.g. ``balance=False``; also
    ``token_fields`` and ``place`` of :class:`BalancedLoader`). Balancing needs a
    :class:`DistributedStrategy` with ``unpad`` (= ``unpad_configs["balance"]``) on and more
    than one rank; with a plain ``fleet.DistributedStrategy`` each rank's batches are packed
    as they are. Call it at the same point of the program on every rank, after ``fleet.init``
    (it creates the exchange's process group; in a launched job of several ranks, before
    ``fleet.init`` it raises :class:`ExchangeError`). ``len()`` of the result is the number of
    batches each rank receives (see :class:`BalancedLoader`).
    """
    strategy = current_strategy() if strategy is None else strategy
    extra = {k: overrides.pop(k) for k in ("token_fields", "place") if k in overrides}
    if isinstance(strategy, DistributedStrategy):
        base = strategy._state()["configs"]
    else:  # no paddle_unpad settings: pack, do not exchange
        base, overrides = _defaults("fleet.distributed_loader"), {"balance": False, **overrides}
    configs = _options.resolve(overrides, "fleet.distributed_loader", base=base)
    return BalancedLoader.from_options(loader, configs, **extra)

"""Everything that talks between ranks, in one layer.

* :mod:`.groups` -- the one place that makes process groups and issues collectives: host
  groups (gloo, CPU tensors: the sample exchange, in every job) and device groups (the
  gradient all-reduce: NCCL in GPU jobs, issued from the training thread only; gloo in CPU
  jobs), and the agreement of settings through the store;
* :mod:`.workarounds` -- the plugin's changes to Paddle's distributed runtime (per-group
  stores, socket options, threads and exit order), applied on first use;
* the sample exchange, as it reads: :mod:`.wire` (what travels) -> :mod:`.source` (the rank's
  own loader) -> :mod:`.pipeline` (a batch read, checked, packed) -> :mod:`.exchange` (one
  epoch's background thread) -> :mod:`.loader` (:class:`BalancedLoader`);
* :mod:`.grad_sync` -- :class:`GradientAllReduce`, with its parts: :mod:`.grad_params` (the
  parameters it reduces), :mod:`.grad_buckets`, :mod:`.grad_rows` (embedding tables by rows),
  :mod:`.grad_layout` (the ranks' layouts agreed at construction), :mod:`.grad_reduction` (its
  groups and thread) and :mod:`.step_trailer` (each step's agreement);
* :mod:`.options` -- the one table of their settings.

The planning math lives in :mod:`paddle_unpad.balance`; :mod:`paddle_unpad.fleet` is the
public hook. See docs/distributed.md.
"""

from .errors import ExchangeError, ExchangeTimeout, GradientSyncError
from .grad_sync import GradientAllReduce
from .groups import install_group_stores
from .loader import BalancedLoader

__all__ = [
    "BalancedLoader",
    "GradientAllReduce",
    "ExchangeError",
    "ExchangeTimeout",
    "GradientSyncError",
    "install_group_stores",
]

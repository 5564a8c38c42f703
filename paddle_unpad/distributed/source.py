"""A rank's own loader, read on the training loop's thread for the exchange.

The exchange thread never iterates the user's loader: ``paddle.io.DataLoader`` with workers
may only be iterated by the thread that created its iterator (Paddle starts worker processes
from the main thread only). The training loop's thread calls :meth:`Source.take` and hands
each item to the exchange thread.
"""

from __future__ import annotations

import logging
import threading
import traceback
from typing import Mapping

import numpy as np

from .._runtime import paddle_compat as _compat
from . import workarounds

log = logging.getLogger("paddle_unpad.distributed")


def _own_value(v):
    """``v`` as an array nothing else holds: a copy of an array (the loader may overwrite it for
    its next batch), a paddle tensor's ``numpy()`` (already a copy), anything else as numpy
    reads it (a list's values are copied out of it)."""
    if isinstance(v, np.ndarray):
        return v.copy()
    if hasattr(v, "numpy") and callable(v.numpy):
        return np.asarray(v.numpy())
    return np.asarray(v)


def own_batch(batch):
    """A copy of ``batch`` that shares no memory with the user's loader.

    The exchange holds a batch for up to ``prefetch`` steps after the training loop took it,
    while the loader goes on: a loader that reuses its buffers (each batch's samples views of
    one array it overwrites) would otherwise change the samples under the exchange. One copy
    per field of each sample (of a padded dict batch: per field); what is not a sample dict
    (a wrong batch) is left for :func:`paddle_unpad.data.normalize_batch` to refuse by name."""
    if isinstance(batch, Mapping):
        return {k: _own_value(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [{k: _own_value(v) for k, v in smp.items()} if isinstance(smp, Mapping) else smp for smp in batch]
    return batch


def uses_default_collate(loader) -> bool:
    """Whether ``loader`` is a ``paddle.io.DataLoader`` left with Paddle's own collate_fn,
    which stacks the samples' fields (and fails on samples of different lengths)."""
    import paddle

    return isinstance(loader, paddle.io.DataLoader) and getattr(loader, "collate_fn", None) is None


def failed_in_default_collate(exc) -> bool:
    """Whether ``exc`` was raised inside Paddle's default collate_fn (not by the dataset): its
    traceback passes through it, or (a worker process's error) its message quotes it."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    return any(f.name == "default_collate_fn" for f in frames) or "in default_collate_fn" in str(exc)


_STACKS = "it stacks the samples into padded arrays, which samples of different lengths cannot be"
_USE_SAMPLE_LISTS = (
    "the balanced loader needs lists of samples: build the DataLoader with collate_fn=pu.data.sample_list_collate"
)


def default_collate_error(exc, where):
    """The error of a loader that failed with Paddle's default collate_fn: what to pass instead."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    # a worker's message is a traceback: its last line ("Type: message") says why
    cause = lines[-1][:200] if len(lines) > 1 else f"{type(exc).__name__}: {''.join(lines)[:200]}"
    err = ValueError(
        f"paddle_unpad.{where}: the DataLoader's default collate_fn failed ({cause}): {_STACKS}; {_USE_SAMPLE_LISTS}"
    )
    err.__cause__ = exc
    return err


class Source:
    """The rank's own loader, iterated on the thread that iterates the BalancedLoader.

    ``take()`` returns ``("batch", b)`` (a copy: :func:`own_batch`), ``("end", None)`` or
    ``("error", exception)``; after the first end or error it is done. ``where``: the public
    name errors start with; ``copy`` False for a reader that packs each batch before taking the
    next (nothing of the user's outlives the take there)."""

    _WAIT_THREAD_EXC_S = 1.0  # how long a woken reader waits for the dying thread's exception

    def __init__(self, loader, where="distributed.BalancedLoader", copy=True):
        self.it, self.error, self._done = None, None, False
        self._first = None  # the first item, taken early by prime()
        self.where, self.default_collate = where, uses_default_collate(loader)
        self.copy = copy  # False: the caller packs each batch before it takes the next one
        self.thread_failed = threading.Event()
        self._thread = None
        workarounds.catch_thread_deaths()  # before iter(): the loader's thread may fail at once
        try:
            self.it = iter(loader)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            self.error = e
            return
        th = _compat.dataloader_thread(self.it)
        if th is not None:
            self._thread = th
            workarounds.watch_thread(th, self.thread_died)

    @property
    def thread_exc(self):
        return workarounds.thread_exception(self._thread) if self._thread is not None else None

    def thread_died(self):
        self.thread_failed.set()
        self.wake_reader()

    def wake_reader(self):
        # closing (not killing) Paddle's queue lets the reader still return the batches
        # that were ready, then stop: take() turns that stop into the thread's error
        try:
            _compat.wake_dataloader_reader(self.it)
        except Exception:  # noqa: BLE001 - best effort; the timeout still applies
            log.debug("paddle_unpad: could not wake the DataLoader reader", exc_info=True)

    def _failure(self, fallback):
        if self._thread is not None and self.thread_failed.wait(self._WAIT_THREAD_EXC_S if fallback else 0):
            return self._error(self.thread_exc)  # the real cause, not "blocking queue killed"
        return self._error(fallback) if fallback is not None else ("end", None)

    def _error(self, exc):
        if self.default_collate and failed_in_default_collate(exc):
            return ("error", default_collate_error(exc, self.where))
        return ("error", exc)

    @property
    def done(self) -> bool:
        """Whether :meth:`take` has nothing more to give (an item taken early by :meth:`prime` is
        still to give)."""
        return self._done and self._first is None

    def prime(self):
        """Take the first item now and hold it for the first :meth:`take`: a batch sampler that sizes
        itself when its own iteration starts (its ``__iter__`` runs at the first ``next()``) has then
        done so, and ``len(loader)`` is the epoch's."""
        if self._first is None:
            self._first = self._take()

    def take(self):
        first, self._first = self._first, None
        return first if first is not None else self._take()

    def _take(self):
        if self._done:
            return ("end", None)
        if self.error is not None:
            self._done = True
            return ("error", self.error)
        try:
            batch = next(self.it)
        except StopIteration:
            self._done = True
            return self._failure(None)  # a loader thread that died ends the iteration early
        except (KeyboardInterrupt, SystemExit):
            # the user's own stop: raised at once; the iterator, closed on the way out,
            # tells the peers that this rank left
            self._done = True
            raise
        except Exception as e:  # noqa: BLE001 - reported to every rank
            self._done = True
            return self._failure(e)
        try:
            return ("batch", own_batch(batch) if self.copy else batch)
        except Exception as e:  # noqa: BLE001 - a value numpy cannot read: reported to every rank
            self._done = True
            return ("error", e)

    def close(self):
        if self._thread is not None:
            workarounds.unwatch_thread(self._thread, self.thread_died)
        self._done, self._first = True, None
        self.it = None  # Paddle's iterator shuts its workers down when released

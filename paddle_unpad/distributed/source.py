"""A rank's own loader, read on the training loop's thread for the exchange.

The exchange thread never iterates the user's loader: ``paddle.io.DataLoader`` with workers
may only be iterated by the thread that created its iterator (Paddle starts worker processes
from the main thread only). The training loop's thread calls :meth:`Source.take` and hands
each item to the exchange thread.
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Dict

from .. import _paddle_compat as _compat

log = logging.getLogger("paddle_unpad.distributed")

_WATCH_LOCK = threading.Lock()
_WATCHED: Dict[threading.Thread, "Source"] = {}
_THREAD_EXC: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # thread -> what ended it
_PREV_EXCEPTHOOK = None


def _excepthook(args):
    """``threading.excepthook`` once an exchange has iterated a loader.

    Paddle's single-process DataLoader (3.3.1) runs the dataset and ``collate_fn`` on a
    thread of its own; when they raise, that thread dies without waking the reader, and
    ``next()`` on the loader blocks for ever (and a process left blocked there aborts at
    exit).  This records the exception of every thread that dies of one, and wakes the
    reader of the source that owns the thread, so the error reaches every rank instead."""
    src = None
    if args.thread is not None:
        with _WATCH_LOCK:
            _THREAD_EXC[args.thread] = args.exc_value
            src = _WATCHED.pop(args.thread, None)
    if src is not None:
        src.thread_died()
    (_PREV_EXCEPTHOOK or threading.__excepthook__)(args)


def _install_excepthook():
    global _PREV_EXCEPTHOOK
    with _WATCH_LOCK:
        if threading.excepthook is not _excepthook:
            _PREV_EXCEPTHOOK = threading.excepthook
            threading.excepthook = _excepthook


class Source:
    """The rank's own loader, iterated on the thread that iterates the BalancedLoader.

    ``take()`` returns ``("batch", b)``, ``("end", None)`` or ``("error", exception)``;
    after the first end or error it is done."""

    _WAIT_THREAD_EXC_S = 1.0  # how long a woken reader waits for the dying thread's exception

    def __init__(self, loader):
        self.it, self.error, self.done = None, None, False
        self.thread_failed = threading.Event()
        self._thread = None
        _install_excepthook()  # before iter(): the loader's thread may fail at once
        try:
            self.it = iter(loader)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            self.error = e
            return
        th = _compat.dataloader_thread(self.it)
        if th is not None:
            self._thread = th
            with _WATCH_LOCK:
                already = th in _THREAD_EXC
                if not already:
                    _WATCHED[th] = self
            if already:
                self.thread_died()

    @property
    def thread_exc(self):
        return _THREAD_EXC.get(self._thread) if self._thread is not None else None

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
            return ("error", self.thread_exc)  # the real cause, not "blocking queue killed"
        return ("error", fallback) if fallback is not None else ("end", None)

    def take(self):
        if self.done:
            return ("end", None)
        if self.error is not None:
            self.done = True
            return ("error", self.error)
        try:
            return ("batch", next(self.it))
        except StopIteration:
            self.done = True
            return self._failure(None)  # a loader thread that died ends the iteration early
        except (KeyboardInterrupt, SystemExit):
            # the user's own stop: raised at once; the iterator, closed on the way out,
            # tells the peers that this rank left
            self.done = True
            raise
        except Exception as e:  # noqa: BLE001 - reported to every rank
            self.done = True
            return self._failure(e)

    def close(self):
        with _WATCH_LOCK:
            if self._thread is not None and _WATCHED.get(self._thread) is self:
                del _WATCHED[self._thread]
        self.done = True
        self.it = None  # Paddle's iterator shuts its workers down when released

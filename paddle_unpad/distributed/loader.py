"""The balanced loader: balanced, packed batches one or more steps ahead of the training loop.

Failures (see docs/distributed.md, *Failure behaviour*, for what a user sees on each):

* ranks whose loaders differ in a setting that must agree (``balance``, the planner's
  settings, timeouts, ``max_seqlen``, ``check_plan``, ``token_fields``) -- or a rank that
  builds no loader -- are a named error on every rank when the loaders are built, within
  ``timeout`` (:func:`~paddle_unpad.distributed.groups.agree`: no collective, so no hang);
* a bad sample or a loader that raises on one rank: that rank raises its own exception,
  every other rank :class:`ExchangeError` naming the rank and the message, at the same
  step, before any sample is sent;
* a peer that dies: the next collective fails at once, and every survivor raises
  :class:`ExchangeError`; a peer that stalls: the training loop waits at most ``timeout``
  seconds for a batch, then raises :class:`ExchangeTimeout`;
* an epoch ends -- the ``for`` loop finishes, ``break``s (the iterator is released), raises,
  or the loader is deleted -- and its thread stops there; a thread stopped mid-epoch sends a
  last "closing" header, so that peers still waiting fail at once with a clear message, and
  a later epoch starts in step. At interpreter exit every thread is stopped and joined
  (:mod:`.groups`).
"""
from __future__ import annotations

import json
import logging
import queue
import time
import weakref
from typing import Sequence

from ..data.collate import DEFAULT_TOKEN_FIELDS, check_lengths, normalize_batch, pack_samples, to_paddle
from . import groups, wire
from .errors import ExchangeError, ExchangeTimeout
from .exchange import END_ITEM, POLL_S, Epoch, Settings
from .options import resolve as resolve_options
from .source import Source

__all__ = ["BalancedLoader", "check_token_fields"]

log = logging.getLogger("paddle_unpad.distributed")

# the settings every rank's loader must share: the collectives each step issues depend on them
_AGREED = ("balance", "counts", "tol", "timeout", "close_timeout", "max_seqlen", "check_plan")


def check_token_fields(token_fields, where="distributed.BalancedLoader"):
    """``token_fields`` as a tuple of field names; a string (read character by character
    otherwise) or anything but names is refused, naming the value."""
    if isinstance(token_fields, (str, bytes)) or not all(isinstance(f, str) for f in _iterable(token_fields)):
        raise TypeError(f"paddle_unpad.{where}: token_fields must be a sequence of field names (e.g. ('input_ids', "
                        f"'token_type_ids')), got {token_fields!r}")
    return tuple(token_fields)


def _iterable(x):
    try:
        return list(x)
    except TypeError:
        return [None]


class BalancedLoader:
    """Iterable of balanced, packed batches over a rank's own loader.

    ``loader`` yields, per step, a list of samples (see :mod:`paddle_unpad.data`); every
    rank must iterate its loader in step with the others (as with
    ``DistributedBatchSampler``). It is iterated on the thread that iterates this object, so
    any ``paddle.io.DataLoader`` works, ``num_workers > 0`` included. In a single process (or
    with ``balance=False``) the batches are packed as they are, synchronously. See
    :func:`paddle_unpad.fleet.distributed_loader`.

    Args:
        options: the exchange's options (:data:`paddle_unpad.distributed.options.OPTIONS`, scope
            ``exchange``; the defaults where not given): ``balance`` (False: pack each rank's
            own batches), ``cost``, ``counts``, ``tol`` (the planner's,
            :func:`paddle_unpad.balance.plan`), ``prefetch``, ``timeout`` (seconds the training
            loop waits for a batch before :class:`ExchangeTimeout`, and for the other ranks'
            loaders when this one is built), ``max_seqlen`` (longer or empty samples raise
            :class:`~paddle_unpad.data.SampleError` naming the sample id and rank),
            ``check_plan``, ``close_timeout``.
        token_fields: per-token fields of a sample (packed along the tokens): a sequence of names.
        place: where the packed tensors go (default: Paddle's current place).
        group: a gloo process group over all ranks to use (default: a new one, created here --
            build loaders at the same point of the program on every rank).
    """

    def __init__(self, loader, token_fields: Sequence[str] = DEFAULT_TOKEN_FIELDS, place=None, group=None,
                 **options):
        o = resolve_options(options, "distributed.BalancedLoader")
        self.loader, self.options, self.place = loader, o, place
        self.token_fields = check_token_fields(token_fields)
        self.cost, self.counts, self.tol, self.max_seqlen = o["cost"], o["counts"], o["tol"], o["max_seqlen"]
        self.prefetch, self.timeout, self.close_timeout = o["prefetch"], float(o["timeout"]), float(o["close_timeout"])
        self.check_plan = o["check_plan"]
        self.plan_key, self.plan_desc = wire.plan_settings(self.cost, self.counts, self.tol)
        self.rank, self.world = groups.job()
        if self.world > 1:
            self._agree_settings()
        self.distributed = o["balance"] and self.world > 1
        self.group = None
        if self.distributed:
            if group is None:
                self.group = groups.new_group("sample exchange", groups.HOST)
            else:
                self.group = group if isinstance(group, groups.Group) else groups.wrap_host_group(
                    group, "distributed.BalancedLoader")
            groups.use_for_exit_order(self.group)
        self._settings = Settings(self.group, self.rank, self.world, o, self.token_fields, place, self.plan_key,
                                  self.plan_desc)
        self._live = _Live(self.close_timeout)
        weakref.finalize(self, self._live.close)  # the loader dropped: its epoch stops
        self.stats = {"steps": 0, "thread_cpu_s": 0.0, "moved_in": 0, "moved_bytes": 0, "wire_bytes": 0}

    def _agree_settings(self):
        # the planner's settings compare by their fingerprint (a cost name and the CostModel it
        # stands for plan alike) and are named by their description
        mine = {k: self.options[k] for k in _AGREED if k not in ("counts", "tol")}
        mine.update(planner=self.plan_key, token_fields=list(self.token_fields))
        text = json.dumps({"compared": mine, "planner": self.plan_desc}, sort_keys=True, default=repr)
        values, missing = groups.agree("balanced-loader", text, self.timeout)
        if missing:
            raise ExchangeError(
                f"paddle_unpad.distributed: exchange: rank(s) {missing} did not build this balanced loader within "
                f"{max(self.timeout, groups.AGREE_MIN_S):g} s (this is rank {self.rank}): build the loaders at the "
                "same point of the program on every rank, with the same settings (balance=False on one rank only "
                "counts: it builds a loader too)")
        if values is not None:
            got = [json.loads(v) for v in values]

            def shown(g, k):
                return g["planner"] if k == "planner" else repr(g["compared"][k])

            diff = [f"{'planner settings' if k == 'planner' else k}: "
                    + ", ".join(f"rank {r} {shown(g, k)}" for r, g in enumerate(got))
                    for k in sorted(mine) if len({json.dumps(g["compared"][k], sort_keys=True) for g in got}) > 1]
            if diff:  # (descriptions alone may differ: a cost name and the CostModel it stands for)
                raise ExchangeError("paddle_unpad.distributed: exchange: the ranks built their balanced loaders with "
                                    "different "
                                    f"settings ({'; '.join(diff)}); every rank must pass the same (this is rank "
                                    f"{self.rank})")

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        if not self._live.close():
            raise ExchangeError(f"paddle_unpad.distributed: exchange on rank {self.rank}: the previous epoch's "
                                "exchange thread "
                                f"did not stop within {self.close_timeout:g} s (it is inside a collective with a "
                                "peer that is gone?); its group cannot carry another epoch")
        if not self.distributed:
            return self._local_iter()
        epoch = Epoch(self._settings, Source(self.loader))
        self.stats = epoch.stats
        it = EpochIterator(self, epoch, self.timeout, self.close_timeout)
        self._live.set(epoch)
        return it

    def _local_iter(self):
        for step, batch in enumerate(self.loader):
            samples, lengths, ids = normalize_batch(batch, self.rank, step, self.token_fields)
            check_lengths(lengths, ids, self.rank, self.max_seqlen)
            packed = pack_samples(samples, lengths, ids, self.token_fields)
            packed["step"] = step
            groups.note_batch_step(step)
            yield to_paddle(packed, self.place)

    def close(self):
        """Stop the current epoch's exchange thread, waiting up to ``close_timeout``."""
        self._live.close()


class _Live:
    """The loader's current epoch (held by the loader, not by the exchange thread)."""

    def __init__(self, close_timeout):
        self.epoch, self.close_timeout = None, close_timeout

    def set(self, epoch):
        self.epoch = epoch

    def close(self) -> bool:
        epoch, self.epoch = self.epoch, None
        return True if epoch is None else _close_epoch(epoch, self.close_timeout)


def _close_epoch(epoch, close_timeout) -> bool:
    stopped = epoch.close(close_timeout)
    if not stopped:
        log.warning("paddle_unpad: exchange thread of rank %d did not stop within %.1f s (blocked in a collective "
                    "with a peer that is gone?); it is joined at exit", epoch.s.rank, close_timeout)
    src, epoch.src = epoch.src, None
    if src is not None:
        src.close()
    return stopped


class EpochIterator:
    """One pass over a balanced loader (what ``iter(loader)`` returns). Releasing it -- the end
    of a ``for`` loop, a ``break``, ``del`` -- stops its exchange thread there."""

    def __init__(self, loader: BalancedLoader, epoch: Epoch, timeout: float, close_timeout: float):
        # the loader lives as long as its iterator (``for b in distributed_loader(dl):`` holds only this)
        self.loader = loader
        self._epoch, self.timeout, self.close_timeout = epoch, timeout, close_timeout
        self.finished = False
        self.steps_done = 0
        self._finalizer = weakref.finalize(self, _close_epoch, epoch, close_timeout)

    @property
    def stats(self):
        return self._epoch.stats

    def __iter__(self):
        return self

    def _feed(self):
        """Hand the loader's next batches to the exchange thread, up to ``prefetch`` ahead."""
        e = self._epoch
        src = e.src
        try:
            while src is not None and not src.done and not e.inq.full() and not e.stop.is_set():
                e.inq.put_nowait(src.take())
        except BaseException:  # Ctrl-C / SystemExit inside the loader: this rank leaves
            self.close()
            raise

    def __next__(self):
        if self.finished:
            raise StopIteration
        e = self._epoch
        deadline = time.monotonic() + self.timeout
        while True:
            self._feed()
            left = deadline - time.monotonic()
            try:
                item = e.q.get(timeout=max(0.0, min(POLL_S, left)))
                break
            except queue.Empty:
                if left <= 0:
                    phase = e.phase
                    self.finished = True
                    e.stop.set()  # the thread leaves when its collective returns (at the latest gloo's timeout)
                    raise ExchangeTimeout(
                        f"paddle_unpad.distributed: exchange on rank {e.s.rank}: no balanced batch within "
                        f"{self.timeout:g} s "
                        f"after step {self.steps_done}; the exchange thread is {phase} (a rank stalled, died, or "
                        "its loader is slower than the timeout; set unpad_configs['timeout'])") from None
        if item is END_ITEM:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        self.steps_done += 1
        groups.note_batch_step(item["step"])
        self._feed()
        return item

    def close(self):
        """Stop the exchange thread (idempotent)."""
        self.finished = True
        self._finalizer()

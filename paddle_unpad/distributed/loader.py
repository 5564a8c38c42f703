"""The balanced loader: balanced, packed batches one or more steps ahead of the training loop.

Failures (see docs/distributed.md, *Failure behaviour*, for what a user sees on each):

* ranks whose loaders differ in a setting that must agree (``balance``, the planner's
  settings, timeouts, ``max_seqlen``, ``check_plan``, ``token_fields``) -- or a rank that
  builds no loader -- are a named error on every rank when the loaders are built, within
  ``timeout`` (:func:`~paddle_unpad.distributed.groups.agree`: no collective, so no hang);
* a loader built before ``fleet.init`` in a launched job, or given a group over a subset of
  the ranks, is refused at construction, on every rank alike (decided from the environment
  and the group's rank list, which every rank sees the same);
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
  (:mod:`.workarounds`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import weakref
from typing import Sequence

from ..data.collate import DEFAULT_TOKEN_FIELDS
from . import groups, wire
from .errors import ExchangeError, ExchangeTimeout, StoreHostLeft
from .exchange import Epoch, Settings
from .options import EXCHANGE, ResolvedOptions, check_counts_per_rank
from .options import resolve as resolve_options
from .pipeline import Pipeline
from .source import Source

__all__ = ["BalancedLoader", "check_token_fields"]


# the settings every rank's loader must share: the collectives each step issues depend on them
_AGREED = ("balance", "counts", "tol", "timeout", "close_timeout", "max_seqlen", "check_plan")


def check_token_fields(token_fields, where="distributed.BalancedLoader"):
    """``token_fields`` as a tuple of field names; a string (read character by character
    otherwise) or anything but names is refused, naming the value."""
    if isinstance(token_fields, (str, bytes)) or not all(isinstance(f, str) for f in _iterable(token_fields)):
        raise TypeError(
            f"paddle_unpad.{where}: token_fields must be a sequence of field names (e.g. ('input_ids', 'token_type_ids')), got {token_fields!r}"
        )
    return tuple(token_fields)


def _iterable(x):
    try:
        return list(x)
    except TypeError:
        return [None]


_BUILD_ALIKE = "build the loaders at the same point of the program on every rank, with the same settings (balance=False on one rank only counts: it builds a loader too)"
_LEN_OF_ALL = "every rank receives as many batches as the longest rank's loader gives, so len() needs every rank's"
_ITERATE_ALIKE = "every rank must iterate its balanced loader as many times as the others"
_THREAD_STUCK = "it is inside a collective with a peer that is gone?"


class BalancedLoader:
    """Iterable of balanced, packed batches over a rank's own loader.

    ``loader`` yields, per step, a list of samples (see :mod:`paddle_unpad.data`); every
    rank must iterate its loader in step with the others (as with
    ``DistributedBatchSampler``). It is iterated on the thread that iterates this object, so
    any ``paddle.io.DataLoader`` works, ``num_workers > 0`` included. In a single process (or
    with ``balance=False``) the batches are packed as they are, synchronously. See
    :func:`paddle_unpad.fleet.distributed_loader`.

    Args:
        options: keywords, the exchange's options (:data:`paddle_unpad.distributed.options.OPTIONS`, scope
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
            build loaders at the same point of the program on every rank). A group passed in is
            the caller's: :meth:`close` leaves it open.

    ``len(loader)`` is the number of global steps: the largest ``len()`` of the ranks' own
    loaders, agreed through the job's store when the loader is built and again when each epoch
    starts (``iter()``), after each rank has drawn the epoch's first batch from its loader: a
    batch sampler that sizes itself when its own iteration starts (not in ``set_epoch``) has
    done so by then; before the first ``iter()`` it is what the loaders said when it was built.
    Every rank receives one batch per global step, also a rank whose own loader is
    done; a step at which no rank has a sample (every rank's batch empty) is skipped, so only
    such steps make an epoch shorter. With ``balance=False`` or in one process it is
    ``len()`` of the rank's own loader. A rank's loader without ``len()`` makes ``len()`` a
    ``TypeError`` naming the rank.

    What the loader keeps of the user's: nothing after a batch is taken -- each batch is
    copied as the training loop's thread takes it from the rank's loader (one copy per field
    of each sample), so a loader may reuse or overwrite its arrays for its next batch.

    ``options`` holds the options as resolved (:class:`~.options.ResolvedOptions`, read only),
    ``where`` the public name they were given to, which the loader's errors name.
    """

    def __init__(self, loader, token_fields: Sequence[str] = DEFAULT_TOKEN_FIELDS, place=None, group=None, **options):
        self._build(loader, resolve_options(options, "distributed.BalancedLoader"), token_fields, place, group)

    @classmethod
    def from_options(
        cls,
        loader,
        options: ResolvedOptions,
        token_fields: Sequence[str] = DEFAULT_TOKEN_FIELDS,
        place=None,
        group=None,
    ) -> "BalancedLoader":
        """The loader of options a public entry resolved where the user gave them
        (``fleet.distributed_loader``, ``UnpadTrainer``): they are not checked again, and the
        loader's errors name that entry (``options.where``)."""
        if not isinstance(options, ResolvedOptions) or options.scope != EXCHANGE:
            raise TypeError(
                f"paddle_unpad.distributed.BalancedLoader.from_options: options must be the exchange's options as paddle_unpad.distributed.options.resolve() returns them, got {options!r}"
            )
        self = cls.__new__(cls)
        self._build(loader, options, token_fields, place, group)
        return self

    def _build(self, loader, o: ResolvedOptions, token_fields, place, group):
        where = o.where
        self.loader, self.options, self.place, self.where = loader, o, place, where
        self.token_fields = check_token_fields(token_fields, where)
        self.cost, self.counts, self.tol, self.max_seqlen = o["cost"], o["counts"], o["tol"], o["max_seqlen"]
        self.prefetch, self.timeout, self.close_timeout = o["prefetch"], float(o["timeout"]), float(o["close_timeout"])
        self.check_plan = o["check_plan"]
        self.plan_key, self.plan_desc = wire.plan_settings(self.cost, self.counts, self.tol)
        # launched as one of N ranks but built before fleet.init: refused, not packed alone
        self.rank, self.world = groups.checked_job(where, ExchangeError)
        self.distributed = o["balance"] and self.world > 1
        if self.distributed:  # a list of counts needs one per rank: refused here, not at the first step
            check_counts_per_rank(o, where, self.world)
        if self.distributed and group is not None:
            _check_group_spans_job(group, self.world, where)  # before any rank waits for another
        self._lens = [_own_len(loader)] * self.world  # every rank's (len, why unknown); agreed below
        self.group = None
        own_group = None
        with _store_host_named(self.rank):
            if self.world > 1:
                self._agree_settings(group)
            if self.distributed:
                if group is None:
                    self.group = own_group = groups.new_group("sample exchange", groups.HOST)
                else:
                    self.group = group if isinstance(group, groups.Group) else groups.wrap_host_group(group, where)
                groups.use_for_exit_order(self.group)
        self._pipeline = Pipeline(self.token_fields, self.max_seqlen, place)
        self._settings = Settings(self.group, self.rank, self.world, o, self._pipeline, self.plan_key, self.plan_desc)
        self._live = _Live(self.close_timeout, own_group)
        self._epochs, self.closed = 0, False
        weakref.finalize(self, self._live.shutdown)  # the loader dropped: its epoch stops, its group goes
        self.stats = {"steps": 0, "thread_cpu_s": 0.0, "moved_in": 0, "moved_bytes": 0, "wire_bytes": 0}

    def _agree_settings(self, group):
        # the planner's settings compare by their fingerprint (a cost name and the CostModel it
        # stands for plan alike) and are named by their description; the lengths of the ranks'
        # loaders travel along (they may differ), for len()
        mine = {k: self.options[k] for k in _AGREED if k not in ("counts", "tol")}
        # a group passed on some ranks only would leave the others in a group creation alone
        mine.update(
            planner=self.plan_key,
            token_fields=list(self.token_fields),
            group="passed in" if group is not None else "its own",
        )
        text = json.dumps(
            {"compared": mine, "planner": self.plan_desc, "len": self._lens[self.rank]}, sort_keys=True, default=repr
        )
        values, missing = groups.agree("balanced-loader", text, self.timeout)
        if missing:
            waited = max(self.timeout, groups.AGREE_MIN_S)
            raise ExchangeError(
                f"paddle_unpad.distributed: exchange: rank(s) {missing} did not build this balanced loader within {waited:g} s (this is rank {self.rank}): {_BUILD_ALIKE}"
            )
        if values is not None:
            got = [json.loads(v) for v in values]
            self._lens = [tuple(g["len"]) for g in got]

            def shown(g, k):
                return g["planner"] if k == "planner" else repr(g["compared"][k])

            diff = [
                f"{'planner settings' if k == 'planner' else k}: "
                + ", ".join(f"rank {r} {shown(g, k)}" for r, g in enumerate(got))
                for k in sorted(mine)
                if len({json.dumps(g["compared"][k], sort_keys=True) for g in got}) > 1
            ]
            if diff:  # (descriptions alone may differ: a cost name and the CostModel it stands for)
                raise ExchangeError(
                    f"paddle_unpad.distributed: exchange: the ranks built their balanced loaders with different settings ({'; '.join(diff)}); every rank must pass the same (this is rank {self.rank})"
                )

    def __len__(self):
        """The number of batches an epoch gives this rank (see the class docstring)."""
        lens = self._lens if self.distributed else [_own_len(self.loader)]
        unknown = [r for r, (n, _) in enumerate(lens) if n is None]
        if unknown:
            if not self.distributed:
                raise TypeError(
                    f"paddle_unpad.{self.where}: len() is not known: the loader has no len() ({lens[0][1]})"
                )
            why = lens[unknown[0]][1]
            raise TypeError(
                f"paddle_unpad.{self.where}: len() is not known: the loader of rank(s) {unknown} has no len() ({why}); {_LEN_OF_ALL}"
            )
        return max(n for n, _ in lens)

    def _agree_epoch_lengths(self):
        """Every rank's len() for the epoch that starts (a sampler may change it between epochs),
        through the job's store: no collective, so a rank that does not start the epoch is a
        named error within ``timeout``, never a hang."""
        mine = _own_len(self.loader)
        values, missing = groups.agree("balanced-loader-epoch", json.dumps(mine), self.timeout)
        if missing:
            waited = max(self.timeout, groups.AGREE_MIN_S)
            raise ExchangeError(
                f"paddle_unpad.distributed: exchange: rank(s) {missing} did not start epoch {self._epochs} of this balanced loader within {waited:g} s (this is rank {self.rank}): {_ITERATE_ALIKE}"
            )
        self._lens = [mine] * self.world if values is None else [tuple(json.loads(v)) for v in values]

    def __iter__(self):
        if self.closed:
            raise ValueError(
                f"paddle_unpad.{self.where}: iterating a closed loader: close() released its process group; build a new loader (on every rank) for another epoch"
            )
        if not self._live.close():
            limit = self.close_timeout
            raise ExchangeError(
                f"paddle_unpad.distributed: exchange on rank {self.rank}: the previous epoch's exchange thread did not stop within {limit:g} s ({_THREAD_STUCK}); its group cannot carry another epoch"
            )
        if not self.distributed:
            return self._local_iter()
        src = Source(self.loader, self.where)
        try:
            src.prime()  # the first batch drawn first: a sampler sizing itself as its iteration starts has done so
            with _store_host_named(self.rank):
                self._agree_epoch_lengths()
        except BaseException:
            src.close()
            raise
        self._epochs += 1
        epoch = Epoch(self._settings, src)
        self.stats = epoch.stats
        it = EpochIterator(self, epoch, self.timeout, self.close_timeout)
        self._live.set(epoch)
        return it

    def _local_iter(self):
        # read through a Source: a DataLoader whose loading thread dies (Paddle's default collate
        # on samples of different lengths) is an error here too, not a next() that never returns
        src = Source(self.loader, self.where, copy=False)  # packed at once: pack_samples copies
        try:
            for step in itertools.count():
                kind, batch = src.take()
                if kind == "end":
                    return
                if kind == "error":
                    raise batch
                yield self._pipeline.local(batch, self.rank, step)
        finally:
            src.close()

    def close(self):
        """Stop the current epoch's exchange thread (waiting up to ``close_timeout``) and release
        the process group the loader created (not one passed in); the loader cannot be
        iterated again."""
        self.closed = True
        self._live.shutdown()


@contextlib.contextmanager
def _store_host_named(rank):
    """The job's store gone (rank 0 has left the job) as the loader's error."""
    try:
        yield
    except StoreHostLeft as e:
        raise ExchangeError(f"paddle_unpad.distributed: exchange: {groups.reason(e)} (this is rank {rank})") from e


def _own_len(loader):
    """``(len(loader), "")``, or ``(None, why)`` for a loader without a length (an iterable,
    a DataLoader over an IterableDataset)."""
    try:
        return int(len(loader)), ""
    except (TypeError, ValueError, NotImplementedError) as e:
        return None, f"{type(e).__name__}: {e}"[:200]


def _check_group_spans_job(group, world, where):
    """The exchange plans over every rank, indexed by rank: a group over a subset (or in another
    order) is refused. Decided from the group's rank list, which every rank sees alike (a rank
    outside a subset has no process group of it at all)."""
    ranks = getattr(group, "ranks", None)
    if ranks is None:
        raise TypeError(
            f"paddle_unpad.{where}: group must be a process group from paddle.distributed.new_group(list(range({world})), backend='gloo'), got {type(group).__name__}"
        )
    if list(ranks) != list(range(world)):
        raise ValueError(
            f"paddle_unpad.{where}: group must span every rank of the job in order (ranks {list(range(world))}: the exchange balances over all of them), got a group over ranks {list(ranks)}"
        )
    if getattr(group, "released", False):
        raise ValueError(f"paddle_unpad.{where}: group {group!r} was released (its owner was closed)")


class _Live:
    """The loader's current epoch and the group it created (held by the loader, not by the
    exchange thread)."""

    def __init__(self, close_timeout, own_group=None):
        self.epoch, self.close_timeout, self.own_group = None, close_timeout, own_group

    def set(self, epoch):
        self.epoch = epoch

    def close(self) -> bool:
        epoch, self.epoch = self.epoch, None
        return True if epoch is None else epoch.close(self.close_timeout)

    def shutdown(self):
        """The loader's end (close() or its finalizer): its epoch stops, then its own group is
        released -- only once no thread of it can be inside a collective on that group."""
        if self.close():
            group, self.own_group = self.own_group, None
            groups.release(group)


class EpochIterator:
    """One pass over a balanced loader (what ``iter(loader)`` returns). Releasing it -- the end
    of a ``for`` loop, a ``break``, ``del`` -- stops its exchange thread there."""

    def __init__(self, loader: BalancedLoader, epoch: Epoch, timeout: float, close_timeout: float):
        # the loader lives as long as its iterator (``for b in distributed_loader(dl):`` holds only this)
        self.loader = loader
        self._epoch, self.timeout, self.close_timeout = epoch, timeout, close_timeout
        self.finished = False
        self.steps_done = 0
        self._finalizer = weakref.finalize(self, epoch.close, close_timeout)

    @property
    def stats(self):
        return self._epoch.stats

    def __iter__(self):
        return self

    def __next__(self):
        if self.finished:
            raise StopIteration
        try:
            item = self._epoch.next(self.timeout, self.steps_done)
        except ExchangeTimeout:
            self.finished = True  # the thread was told to stop; the finalizer joins it
            raise
        except BaseException:  # the thread's error, or Ctrl-C / SystemExit inside the user's loader
            self.close()
            raise
        if item is None:
            self.close()
            raise StopIteration
        self.steps_done += 1
        return item

    def close(self):
        """Stop the exchange thread (idempotent)."""
        self.finished = True
        self._finalizer()

"""Asynchronous sample exchange: balanced, packed batches one or more steps ahead.

The rank's own loader is iterated on the thread that iterates the :class:`BalancedLoader`
(the training loop's thread: ``paddle.io.DataLoader`` with ``num_workers > 0`` may only be
iterated there); each batch is handed to an exchange thread, which, per step, on a
process group of its own (``paddle.distributed.new_group``)

1. checks the batch (:func:`paddle_unpad.data.normalize_batch`: every sample has the same
   fields, dtypes, numbers of dimensions and trailing shapes as the batch's first one),
2. all-gathers a small int64 header ``[status, step, count, schema hash, planner settings
   fingerprint, message]`` (status: ok / loader exhausted / loader raised / closing), so
   that every rank learns at the same collective that a peer failed, finished or is
   shutting down, or plans with other settings (cost, counts, tol),
3. all-gathers ``(length, sample id)`` of every sample (int64, padded to the largest count),
4. computes the same plan on every rank (:func:`paddle_unpad.balance.plan_dest`; optionally
   all-gathers its hash to prove it),
5. sends only the samples that change rank, by ``isend``/``irecv`` posted in rank order
   (gloo has no alltoall; on gloo each pair of ranks uses a 2-rank group of its own, see
   ``_Comm``): one int64 buffer per (source, destination) pair holding the
   raw bytes of every field of those samples -- never pickled objects; the receiver
   knows every size from the gathered lengths and the agreed field schema,
6. packs its samples (in (source rank, index) order) with the packing collator and hands
   the batch, already converted to paddle tensors, to the training loop through a
   queue of ``prefetch`` batches.

Failures (see docs/distributed.md for what a user sees on each):

* a bad sample or a loader that raises on one rank: that rank raises its own exception,
  every other rank :class:`ExchangeError` naming the rank and the message, at the same
  step (the header carries them), before any sample is sent;
* ranks that plan with different settings (a cost model fitted on each rank, say):
  every rank raises :class:`ExchangeError` at the first step, before any sample is sent;
* a peer that dies: the next collective fails at once, and every survivor raises
  :class:`ExchangeError`;
* a peer that stalls (or is stopped): the training loop waits at most ``timeout``
  seconds for a batch, then raises :class:`ExchangeTimeout`;
* closing an iterator (end of the ``for`` loop, ``break``, an exception, Ctrl-C,
  interpreter exit) stops the thread; a thread stopped mid-epoch sends a last "closing"
  header, so that peers still waiting fail at once with a clear message, and a later
  epoch starts in step.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import queue
import re
import threading
import time
import weakref
from typing import Dict, List, Sequence

import numpy as np

from .. import _paddle_compat as _compat
from ..data.collate import (DEFAULT_TOKEN_FIELDS, SampleError, check_lengths, normalize_batch, pack_samples,
                            to_paddle)
from .options import resolve as resolve_options
from .cost import CostModel, as_cost_fn
from .planner import plan_dest

__all__ = ["BalancedLoader", "ExchangeError", "ExchangeTimeout"]

log = logging.getLogger("paddle_unpad.balance")

OK, END, ERROR, ABORT = 0, 1, 2, 3
_MSG_WORDS = 48  # 384 bytes of message text in the header
_HDR = 8 + _MSG_WORDS
_STATUS_TEXT = {END: "finished its epoch", ERROR: "failed", ABORT: "closed its loader"}


class ExchangeError(RuntimeError):
    """The sample exchange cannot go on (a peer failed, stopped, or disagrees)."""


class ExchangeTimeout(ExchangeError, TimeoutError):
    """No balanced batch arrived within the configured timeout."""


_LIVE = weakref.WeakSet()


@atexit.register
def _close_all():  # interpreter exit (also after Ctrl-C): stop the exchange threads
    for it in list(_LIVE):
        try:
            it.close()
        except Exception:  # pragma: no cover
            pass


# ----------------------------------------------------------------------------- schema
def _schema(samples, token_fields, rank):
    """Field layout of a batch: tuple of (name, 't'|'s', dtype str, shape tail).

    ``samples`` come from :func:`normalize_batch`, which has checked that each one has
    the layout of the first: that layout is the batch's."""
    first = samples[0]
    sch = []
    for name in sorted(first):
        a = first[name]
        if np.dtype(a.dtype).hasobject:
            raise SampleError(f"rank {rank}: field {name!r} is not numeric (dtype {a.dtype})")
        if name in token_fields and a.ndim >= 1:
            sch.append((name, "t", a.dtype.str, tuple(a.shape[1:])))
        else:
            sch.append((name, "s", a.dtype.str, tuple(a.shape)))
    return tuple(sch)


def _describe_schema_difference(schemas) -> str:
    """First difference between the ranks' batch layouts, in words."""
    def fields(sch):
        return {name: (("per-token" if kind == "t" else "per-sample"), np.dtype(dt).name,
                       (["s"] if kind == "t" else []) + list(tail)) for name, kind, dt, tail in sch}

    ranks = [r for r, sch in enumerate(schemas) if sch is not None]
    r0 = ranks[0]
    f0 = fields(schemas[r0])
    for r in ranks[1:]:
        fr = fields(schemas[r])
        for name in sorted(set(f0) | set(fr)):
            if name not in fr:
                return f"rank {r0} has field {name!r}, rank {r} has not"
            if name not in f0:
                return f"rank {r} has field {name!r}, rank {r0} has not"
            if f0[name] != fr[name]:
                def say(v):
                    return f"{v[0]}, dtype {v[1]}, shape [{', '.join(str(d) for d in v[2])}]"
                return f"field {name!r} is {say(f0[name])} on rank {r0} but {say(fr[name])} on rank {r}"
    return "the layouts differ"


def _schema_hash(sch) -> int:
    h = hashlib.blake2b(repr(sch).encode(), digest_size=8).digest()
    return (int.from_bytes(h, "little") & ((1 << 62) - 1)) | 1


def _field_nbytes(kind, dt, tail, s):
    n = int(np.prod(tail, dtype=np.int64)) if tail else 1
    if kind == "t":
        n *= s
    nb = n * np.dtype(dt).itemsize
    return nb, (nb + 7) // 8 * 8


def _encode(samples, lengths, schema) -> np.ndarray:
    """Raw bytes of every field of ``samples``, 8-byte aligned, as one int64 buffer.

    The receiver sizes its buffer from the gathered lengths and the agreed schema: a field
    of any other dtype or shape would arrive as the wrong bytes (or, larger, abort the
    receiver inside gloo).  ``normalize_batch`` and the schema agreement rule that out
    before the header; this is the last check before the wire."""
    parts = []
    for smp, s in zip(samples, lengths):
        for name, kind, dt, tail in schema:
            a = smp[name]
            shape = ((int(s),) + tuple(tail)) if kind == "t" else tuple(tail)
            if a.dtype.str != dt or tuple(a.shape) != shape:
                raise ExchangeError(f"paddle_unpad exchange: field {name!r} of a sample to send has dtype "
                                    f"{a.dtype} and shape {list(a.shape)}, the agreed layout is "
                                    f"{np.dtype(dt).name} {list(shape)}")
            b = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
            parts.append(b)
            pad = (-b.size) % 8
            if pad:
                parts.append(np.zeros(pad, dtype=np.uint8))
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(parts).view(np.int64)


def _words(lengths, schema) -> int:
    total = 0
    for s in lengths:
        for _, kind, dt, tail in schema:
            total += _field_nbytes(kind, dt, tail, int(s))[1]
    return total // 8


def _decode(buf: np.ndarray, lengths, schema) -> List[Dict[str, np.ndarray]]:
    want = _words(lengths, schema)
    if buf.size != want:
        raise ExchangeError(f"paddle_unpad exchange: received {buf.size} words, expected {want}")
    raw = buf.view(np.uint8)
    out, off = [], 0
    for s in lengths:
        smp = {}
        for name, kind, dt, tail in schema:
            nb, padded = _field_nbytes(kind, dt, tail, int(s))
            shape = ((int(s),) + tuple(tail)) if kind == "t" else tuple(tail)
            smp[name] = raw[off:off + nb].view(dt).reshape(shape).copy()
            off += padded
        out.append(smp)
    return out


def _summary(exc, limit=8 * _MSG_WORDS) -> str:
    """``Type: message`` for the header; of a multi-line message (a DataLoader worker's
    carries a traceback) the first and the last line, where the cause is."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = " ... ".join([lines[0], lines[-1]]) if len(lines) > 1 else (lines[0] if lines else "")
    out = f"{type(exc).__name__}: {text}"
    b = out.encode("utf-8", "replace")
    return out if len(b) <= limit else b[: limit - 3].decode("utf-8", "ignore") + "..."


# ----------------------------------------------------------------------------- comm
def _comm_error(rank, what, exc) -> "ExchangeError":
    text = f"{type(exc).__name__}: {exc}".strip()
    m = re.search(r"pair_rank = (\d+)", text)
    peer = f" with rank {m.group(1)}" if m else ""
    return ExchangeError(
        f"paddle_unpad exchange on rank {rank}: {what} failed{peer} -- a peer died, was stopped, or did "
        f"not reach this step within the communication backend's own timeout ({text.splitlines()[0][:300]})")


class _Comm:
    """int64 collectives and point-to-point transfers for the exchange.

    ``group`` (all ranks) carries the collectives.  Point-to-point: paddle's gloo process
    group numbers its send/recv operations with a per-group counter on each rank, so a
    send and its receive only match when both ranks have done the same number of
    point-to-point operations on that group (with 3+ ranks and uneven traffic they do
    not, and the transfer hangs).  On gloo every pair of ranks therefore gets a
    two-rank group of its own (``pair_groups``; with 2 ranks that is ``group`` itself);
    NCCL matches by peer, and uses ``group``.

    A failed transfer (gloo: the peer's connection closed, or its own timeout passed)
    raises :class:`ExchangeError` saying which operation failed.
    """

    def __init__(self, group, rank, world, pair_groups=None):
        import paddle

        self.paddle = paddle
        self.dist = paddle.distributed
        self.group, self.rank, self.world = group, rank, world
        self.pair_groups = pair_groups or {}
        self.what = "the exchange"  # set by the exchange thread: the step and the operation
        if paddle.is_compiled_with_cuda() and paddle.device.get_device().startswith("gpu"):
            self.place = paddle.CUDAPlace(paddle.distributed.ParallelEnv().device_id)
        else:
            self.place = paddle.CPUPlace()

    @staticmethod
    def make_pair_groups(world, group):
        """Create the per-pair groups (collective: call on every rank, same order)."""
        import paddle

        if paddle.is_compiled_with_cuda() and paddle.device.get_device().startswith("gpu"):
            return {}
        if world == 2:
            return {(0, 1): group}
        out = {}
        for a in range(world):
            for b in range(a + 1, world):
                out[(a, b)] = paddle.distributed.new_group([a, b])
        return out

    def _p2p_group(self, peer):
        return self.pair_groups.get((min(self.rank, peer), max(self.rank, peer)), self.group)

    def all_gather(self, arr: np.ndarray) -> np.ndarray:
        t = self.paddle.to_tensor(np.ascontiguousarray(arr, dtype=np.int64), place=self.place)
        outs = []
        try:
            self.dist.all_gather(outs, t, group=self.group)
        except Exception as e:  # noqa: BLE001 - gloo/NCCL errors come as RuntimeError/OSError
            raise _comm_error(self.rank, self.what, e) from e
        return np.stack([o.numpy() for o in outs])

    def all_gather_object(self, obj):
        outs = []
        try:
            self.dist.all_gather_object(outs, obj, group=self.group)
        except Exception as e:  # noqa: BLE001
            raise _comm_error(self.rank, self.what, e) from e
        return outs

    def exchange(self, sends: Dict[int, np.ndarray], recv_words: Dict[int, int]) -> Dict[int, np.ndarray]:
        """Uneven all-to-all: isend/irecv posted in rank order, then waited on."""
        tasks, keep, bufs = [], [], {}
        try:
            for peer in range(self.world):
                if peer == self.rank:
                    continue
                g = self._p2p_group(peer)
                # the lower rank of a pair sends first, the higher one receives first
                ops = ("send", "recv") if self.rank < peer else ("recv", "send")
                for op in ops:
                    if op == "send" and peer in sends:
                        t = self.paddle.to_tensor(sends[peer], place=self.place)
                        keep.append(t)
                        tasks.append(self.dist.isend(t, peer, group=g))
                    elif op == "recv" and peer in recv_words:
                        t = self.paddle.to_tensor(np.empty(recv_words[peer], dtype=np.int64), place=self.place)
                        bufs[peer] = t
                        tasks.append(self.dist.irecv(t, peer, group=g))
            for task in tasks:
                if task is not None:
                    task.wait()
        except Exception as e:  # noqa: BLE001
            raise _comm_error(self.rank, self.what, e) from e
        return {p: t.numpy() for p, t in bufs.items()}


# ----------------------------------------------------------------------------- source
_WATCH_LOCK = threading.Lock()
_WATCHED: Dict[threading.Thread, "_Source"] = {}
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


class _Source:
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


# ----------------------------------------------------------------------------- loader
class BalancedLoader:
    """Iterable of balanced, packed batches over a rank's own loader.

    ``loader`` yields, per step, a list of samples (see :mod:`paddle_unpad.data`); every
    rank must iterate its loader in step with the others (as with
    ``DistributedBatchSampler``).  It is iterated on the thread that iterates this
    object, so any ``paddle.io.DataLoader`` works, ``num_workers > 0`` included.  In a
    single process (or with ``balance=False``) the batches are packed as they are,
    synchronously.  See :func:`paddle_unpad.fleet.distributed_loader`.

    Args:
        options: the balancer's options (:data:`paddle_unpad.balance.options.OPTIONS`; the
            defaults where not given): ``balance`` (False: pack each rank's own batches),
            ``cost``, ``counts``, ``tol`` (the planner's, :func:`paddle_unpad.balance.plan`),
            ``prefetch``, ``timeout`` (seconds the training loop waits for a batch before
            :class:`ExchangeTimeout`), ``max_seqlen`` (longer or empty samples raise
            :class:`~paddle_unpad.data.SampleError` naming the sample id and rank),
            ``check_plan``, ``close_timeout``.
        token_fields: per-token fields of a sample (packed along the tokens).
        place: where the packed tensors go (default: Paddle's current place).
        group: a process group to use (default: a new one over all ranks, created here --
            call this at the same point of the program on every rank).  On gloo with more
            than 2 ranks, one 2-rank group per pair of ranks is created as well (see
            ``_Comm``).
    """

    def __init__(self, loader, token_fields: Sequence[str] = DEFAULT_TOKEN_FIELDS, place=None, group=None,
                 **options):
        o = resolve_options(options, "BalancedLoader")
        self.loader = loader
        self.options = o
        self.cost, self.counts, self.tol = o["cost"], o["counts"], o["tol"]
        self.prefetch, self.timeout, self.close_timeout = o["prefetch"], float(o["timeout"]), float(o["close_timeout"])
        self.max_seqlen = o["max_seqlen"]
        self.token_fields = tuple(token_fields)
        self.check_plan = o["check_plan"]
        self.plan_key, self.plan_desc = _plan_settings(self.cost, self.counts, self.tol)
        self.place = place
        import paddle.distributed as dist

        initialized = dist.is_initialized()
        self.world = dist.get_world_size() if initialized else 1
        self.rank = dist.get_rank() if initialized else 0
        self.distributed = o["balance"] and self.world > 1
        self.group, self.pair_groups = None, {}
        if self.distributed:
            self.group = group if group is not None else dist.new_group(list(range(self.world)))
            self.pair_groups = _Comm.make_pair_groups(self.world, self.group)
            _compat.order_rank_exit(self.rank,  # rank 0 leaves a clean job last
                                    {b: g for (a, b), g in self.pair_groups.items() if a == 0})
        self._active = None
        self.stats = {"steps": 0, "thread_cpu_s": 0.0, "moved_in": 0}  # of the latest epoch
        self._schema_state = {"hash": 0, "schema": None}  # agreed across ranks, kept over epochs

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        if self._active is not None:
            self._active.close()
            self._active = None
        if not self.distributed:
            return self._local_iter()
        it = _ExchangeIterator(self)
        self._active = it
        return it

    def _local_iter(self):
        for step, batch in enumerate(self.loader):
            samples, lengths, ids = normalize_batch(batch, self.rank, step, self.token_fields)
            check_lengths(lengths, ids, self.rank, self.max_seqlen)
            packed = pack_samples(samples, lengths, ids, self.token_fields)
            packed["step"] = step
            yield to_paddle(packed, self.place)

    def close(self):
        if self._active is not None:
            self._active.close()
            self._active = None


_END_ITEM = object()
_POLL_S = 0.05  # how often blocked waits look at the stop flag / feed the exchange thread


class _ExchangeIterator:
    def __init__(self, owner: BalancedLoader):
        self.o = owner
        self.q: "queue.Queue" = queue.Queue(maxsize=owner.prefetch)  # packed batches, to the loop
        self.inq: "queue.Queue" = queue.Queue(maxsize=owner.prefetch)  # the loader's batches, to the thread
        self.stop = threading.Event()
        self.finished = False
        self.steps_done = 0
        self.phase = "starting"  # what the exchange thread waits for (named in timeouts)
        # exchange-thread CPU seconds (time.thread_time: waits in collectives and in the
        # queue do not count) and steps produced; see BalancedLoader.stats
        self.stats = {"steps": 0, "thread_cpu_s": 0.0, "moved_in": 0}
        owner.stats = self.stats
        self.comm = _Comm(owner.group, owner.rank, owner.world, owner.pair_groups)
        # created here, on the loop's thread (Paddle creates DataLoader workers only on the main thread)
        self.src = _Source(owner.loader)
        self.thread = threading.Thread(target=self._run, name=f"paddle_unpad-exchange-r{owner.rank}",
                                       daemon=True)
        _LIVE.add(self)
        self.thread.start()

    # ---------------------------------------------------------------- training loop side
    def __iter__(self):
        return self

    def _feed(self):
        """Hand the loader's next batches to the exchange thread, up to ``prefetch`` ahead."""
        src = self.src
        try:
            while src is not None and not src.done and not self.inq.full() and not self.stop.is_set():
                self.inq.put_nowait(src.take())
        except BaseException:  # Ctrl-C / SystemExit inside the loader: this rank leaves
            self.close(wait=False)
            raise

    def __next__(self):
        if self.finished:
            raise StopIteration
        deadline = time.monotonic() + self.o.timeout
        while True:
            self._feed()
            left = deadline - time.monotonic()
            try:
                item = self.q.get(timeout=max(0.0, min(_POLL_S, left)))
                break
            except queue.Empty:
                if left <= 0:
                    phase = self.phase
                    self.close(wait=False)
                    raise ExchangeTimeout(
                        f"paddle_unpad exchange on rank {self.o.rank}: no balanced batch within "
                        f"{self.o.timeout:g} s after step {self.steps_done}; the exchange thread is {phase} "
                        "(a rank stalled, died, or its loader is slower than the timeout; set "
                        "unpad_configs['timeout'])") from None
        if item is _END_ITEM:
            self._finish()
            raise StopIteration
        if isinstance(item, BaseException):
            self._finish()
            raise item
        self.steps_done += 1
        self._feed()
        return item

    def _finish(self):
        self.finished = True
        self.thread.join(self.o.close_timeout)
        self._release_source()
        _LIVE.discard(self)

    def _release_source(self):
        src, self.src = self.src, None
        if src is not None:
            src.close()

    def close(self, wait: bool = True):
        """Stop the exchange thread (idempotent)."""
        self.finished = True
        self.stop.set()
        if wait and self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(self.o.close_timeout)
            if self.thread.is_alive():
                log.warning("paddle_unpad: exchange thread of rank %d did not stop within %.1f s "
                            "(blocked in a collective with a peer that is gone?); abandoning it",
                            self.o.rank, self.o.close_timeout)
        self._release_source()
        _LIVE.discard(self)

    def __del__(self):
        try:
            self.close(wait=True)
        except Exception:  # pragma: no cover
            pass

    # ---------------------------------------------------------------- exchange thread
    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _take(self):
        """The loader's next item, or None once the iterator is being closed."""
        while not self.stop.is_set():
            try:
                return self.inq.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        return None

    def _at(self, step, what):
        self.phase = f"{what} at step {step}"
        self.comm.what = f"{what} at step {step}"

    def _run(self):
        """The exchange thread: one global step per pass, each in the named steps below. Every
        rank takes the same branches, decided from the gathered headers, so the collectives
        always match up."""
        step, exhausted = 0, False
        try:
            while True:
                cpu0 = time.thread_time()
                local = self._local_batch(step, exhausted)
                cpu0 += local.pop("waited_s")
                exhausted = local["exhausted"]
                H = self._share_headers(step, local)
                if local["status"] == ABORT:
                    return  # peers learn it from this header; nothing more to do
                verdict = self._read_headers(H, local, step)
                if verdict == "end":
                    self._put(_END_ITEM)
                    return
                counts = np.where(H[:, 0] == END, 0, H[:, 2])
                if int(counts.sum()) == 0:  # nobody has a sample this step: every rank skips it
                    step += 1
                    continue
                self._agree_schema(H, local["schema"], self.comm, step)
                lens, gids = self._share_lengths(step, local, counts)
                dest, starts, phash = self._plan(step, lens, counts)
                out = self._exchange_and_pack(step, local, dest, starts, phash, lens, gids, counts)
                self.stats["thread_cpu_s"] += time.thread_time() - cpu0
                self.stats["steps"] += 1
                step += 1
                self.phase = f"waiting for the training loop to take the batch of step {step - 1}"
                if not self._put(out):
                    continue  # closing: the loop top sends the ABORT header
        except BaseException as e:  # noqa: BLE001 - handed to the training loop
            self.phase = f"stopped by {type(e).__name__}"
            self._put(e)

    def _local_batch(self, step, exhausted):
        """This rank's batch of ``step`` from the training loop, read and checked: its status
        (OK / END / ERROR / ABORT), samples, lengths, ids and layout."""
        o = self.o
        local = {"status": OK, "msg": "", "exc": None, "samples": [], "lengths": np.zeros(0, np.int64),
                 "ids": np.zeros(0, np.int64), "schema": None, "exhausted": exhausted, "waited_s": 0.0}
        if exhausted:  # never ask a finished loader again
            item = ("end", None)
        else:
            self.phase = f"waiting for its loader's batch of step {step} (the training loop hands it over)"
            t_wait = time.thread_time()
            item = self._take()
            local["waited_s"] = time.thread_time() - t_wait
        if item is None or self.stop.is_set():
            local.update(status=ABORT, msg="its training loop stopped iterating (break, exception or Ctrl-C)")
        elif item[0] == "end":
            local.update(status=END, exhausted=True)
        elif item[0] == "error":
            local.update(status=ERROR, exc=item[1], exhausted=True)
        else:
            try:
                samples, lengths, ids = normalize_batch(item[1], o.rank, step, o.token_fields)
                local.update(samples=samples, lengths=lengths, ids=ids,
                             schema=_schema(samples, o.token_fields, o.rank) if samples else None)
            except BaseException as e:  # noqa: BLE001 - reported to every rank
                local.update(status=ERROR, exc=e)  # the update above built its values first: local is as it was
        if local["exc"] is not None:
            local["msg"] = _summary(local["exc"])
        return local

    def _share_headers(self, step, local):
        """All-gather every rank's header: status, step, sample count, layout hash, message."""
        sch = local["schema"]
        hdr = np.zeros(_HDR, dtype=np.int64)
        hdr[0], hdr[1], hdr[2] = local["status"], step, len(local["samples"])
        hdr[3] = _schema_hash(sch) if sch is not None else 0
        hdr[4] = self.o.plan_key
        mb = local["msg"].encode("utf-8", "replace")[: 8 * _MSG_WORDS]
        hdr[8:] = np.frombuffer(mb.ljust(8 * _MSG_WORDS, b"\0"), dtype=np.int64)
        self._at(step, "waiting for every rank's header (all-gather)")
        return self.comm.all_gather(hdr)

    def _read_headers(self, H, local, step):
        """Raise the first rank's failure on every rank, or say whether every rank has ended."""
        failed = [r for r in range(self.o.world) if H[r, 0] in (ERROR, ABORT)]
        if failed:
            if local["exc"] is not None:
                raise local["exc"]
            r = failed[0]
            text = H[r, 8:].tobytes().rstrip(b"\0").decode("utf-8", "replace")
            raise ExchangeError(f"paddle_unpad exchange: rank {r} {_STATUS_TEXT[int(H[r, 0])]} at "
                                f"step {int(H[r, 1])}: {text} (this is rank {self.o.rank})")
        if np.any(H[:, 4] != H[0, 4]):  # before any plan: different settings give different plans
            groups = {}
            for r in range(self.o.world):
                groups.setdefault(int(H[r, 4]), []).append(r)
            raise ExchangeError(
                "paddle_unpad exchange: the ranks balance with different planner settings (cost, counts or tol), "
                "so they would compute different plans (ranks with the same settings: "
                f"{' / '.join(str(g) for g in groups.values())}); pass the same settings on every rank (a calibrated "
                f"cost model: fit it on one rank and share its coefficients) -- this is rank {self.o.rank}: "
                f"{self.o.plan_desc}")
        if np.all(H[:, 0] == END):
            return "end"
        if np.any(H[:, 1] != step):
            raise ExchangeError(f"paddle_unpad exchange: ranks are out of step: {H[:, 1].tolist()}")
        return "go"

    def _share_lengths(self, step, local, counts):
        """All-gather every rank's sample lengths and ids; check them the same way on every rank."""
        o, n = self.o, len(local["samples"])
        maxn = int(counts.max())
        rows = np.zeros((maxn, 2), dtype=np.int64)
        rows[:n, 0] = local["lengths"]
        rows[:n, 1] = local["ids"]
        self._at(step, "waiting for every rank's sample lengths (all-gather)")
        G = self.comm.all_gather(rows.reshape(-1)).reshape(o.world, maxn, 2)
        lens = [G[r, : counts[r], 0] for r in range(o.world)]
        gids = [G[r, : counts[r], 1] for r in range(o.world)]
        for r in range(o.world):  # same check, same message, on every rank
            check_lengths(lens[r], gids[r], r, o.max_seqlen)
        return lens, gids

    def _plan(self, step, lens, counts):
        """The same plan on every rank: each sample's destination, the ranks' offsets, its hash."""
        o = self.o
        self._at(step, "planning")
        dest, _ = plan_dest(lens, o.cost, o.counts, o.tol)
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        phash = _plan_hash(dest)
        if o.check_plan:
            self._at(step, "comparing plan hashes (all-gather)")
            hs = self.comm.all_gather(np.array([phash], dtype=np.int64)).reshape(-1)
            if np.any(hs != hs[0]):
                raise ExchangeError(f"paddle_unpad exchange: ranks computed different plans at step "
                                    f"{step}: hashes {hs.tolist()}")
        return dest, starts, phash

    def _exchange_and_pack(self, step, local, dest, starts, phash, lens, gids, counts):
        """Send the samples that leave, receive those that arrive, pack this rank's batch."""
        o, me = self.o, self.o.rank
        samples, lengths = local["samples"], local["lengths"]
        schema = o._schema_state["schema"]
        my_dest = dest[starts[me]:starts[me + 1]]
        sends = {}
        for d in range(o.world):
            if d != me:
                sel = np.nonzero(my_dest == d)[0]
                if sel.size:
                    sends[d] = _encode([samples[k] for k in sel], lengths[sel], schema)
        recv_words, recv_sel = {}, {}
        for r in range(o.world):
            if r != me:
                sel = np.nonzero(dest[starts[r]:starts[r + 1]] == me)[0]
                if sel.size:
                    recv_sel[r] = sel
                    recv_words[r] = _words(lens[r][sel], schema)
        self._at(step, "sending and receiving samples (isend/irecv)")
        got = self.comm.exchange(sends, recv_words) if (sends or recv_words) else {}
        mine, mlens, mids = [], [], []
        for r in range(o.world):
            if r == me:
                sel = np.nonzero(my_dest == me)[0]
                mine.extend(samples[k] for k in sel)
            elif r in recv_sel:
                sel = recv_sel[r]
                mine.extend(_decode(got[r], lens[r][sel], schema))
            else:
                continue
            mlens.append(lens[r][sel])
            mids.append(gids[r][sel])
        mlens = np.concatenate(mlens) if mlens else np.zeros(0, np.int64)
        mids = np.concatenate(mids) if mids else np.zeros(0, np.int64)
        packed = pack_samples(mine, mlens, mids, o.token_fields, global_num_samples=int(counts.sum()),
                              schema=schema)
        packed["step"] = step
        packed["plan_hash"] = phash
        packed["moved_in"] = int(sum(len(x) for x in recv_sel.values()))
        self.stats["moved_in"] += packed["moved_in"]
        return to_paddle(packed, o.place)

    def _agree_schema(self, H, sch, comm, step):
        st = self.o._schema_state
        hashes = sorted(set(int(h) for h in H[:, 3] if h != 0))
        if len(hashes) > 1 or (hashes and hashes[0] != st["hash"]):
            # not the hot path: once per epoch start, field change or mismatch; every rank
            # decides the same from the gathered headers, so the collective matches up
            self._at(step, "agreeing on the batch layout (all-gather)")
            schemas = comm.all_gather_object(sch)
            if len(hashes) > 1:
                raise SampleError(f"paddle_unpad exchange: the ranks' batches of step {step} have different "
                                  f"layouts: {_describe_schema_difference(schemas)} (every sample of a global "
                                  "batch needs the same fields, dtypes and trailing shapes)")
            st["hash"], st["schema"] = hashes[0], next(s for s in schemas if s is not None)


# lengths at which a cost is evaluated to tell cost models apart (0, 1, odd, powers of two +-1)
_COST_PROBES = np.array([0, 1, 2, 3, 7, 31, 63, 64, 65, 127, 128, 129, 255, 256, 384, 511, 512, 513, 1024, 4096],
                        dtype=np.int64)


def _plan_settings(cost, counts, tol):
    """A fingerprint (int) of the settings the plan depends on, identical on ranks that plan alike,
    and their description. A cost is fingerprinted by its values at fixed lengths, so a name, a
    CostModel and a callable that give the same costs agree."""
    try:
        values = np.asarray(as_cost_fn(cost)(_COST_PROBES), dtype=np.float64)
        cost_part = values.tobytes()
    except Exception as e:  # noqa: BLE001 -- a callable that refuses some probe lengths: compare that instead
        cost_part = f"raises {type(e).__name__} on probe lengths".encode()
    counts_part = repr(list(counts) if isinstance(counts, (list, tuple)) else counts).encode()
    tol_part = repr(float(tol)).encode()
    h = hashlib.blake2b(cost_part + b"|" + counts_part + b"|" + tol_part, digest_size=8).digest()
    desc = f"cost={_describe_cost(cost)}, counts={counts!r}, tol={float(tol):g}"
    return int.from_bytes(h, "little") & ((1 << 62) - 1), desc


def _describe_cost(cost):
    if cost is None or isinstance(cost, str) or isinstance(cost, CostModel):
        return repr(cost)
    return getattr(cost, "__qualname__", type(cost).__name__)


def _plan_hash(dest: np.ndarray) -> int:
    h = hashlib.blake2b(np.ascontiguousarray(dest, dtype=np.int32).tobytes(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 62) - 1)

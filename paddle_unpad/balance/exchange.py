"""Asynchronous sample exchange: balanced, packed batches one or more steps ahead.

Per step, on a process group of its own (``paddle.distributed.new_group``), the exchange
thread of every rank

1. takes the next batch (a list of samples) from the rank's own loader,
2. all-gathers a small int64 header ``[status, step, count, schema hash, message]``
   (status: ok / loader exhausted / loader raised / closing), so that every rank learns
   at the same collective that a peer failed, finished or is shutting down,
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

The training loop (main thread) waits at most ``timeout`` seconds for a batch, then
raises :class:`ExchangeTimeout` (a peer stalled or died).  A rank whose loader raises
reports it in its header: every rank raises (the failing one its own exception, the
others :class:`ExchangeError` naming the rank and the message).  Closing an iterator
(end of the ``for`` loop, ``break``, an exception, Ctrl-C, interpreter exit) stops the
thread; a thread stopped mid-epoch sends a last "closing" header, so that peers still
waiting fail at once with a clear message, and a later epoch starts in step.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import queue
import threading
import time
import weakref
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..data.collate import (DEFAULT_TOKEN_FIELDS, SampleError, check_lengths, normalize_batch,
                            pack_samples, to_paddle)
from .planner import DEFAULT_TOL, plan_dest

__all__ = ["BalancedLoader", "ExchangeError", "ExchangeTimeout"]

log = logging.getLogger("paddle_unpad.balance")

OK, END, ERROR, ABORT = 0, 1, 2, 3
_MSG_WORDS = 16  # 128 bytes of message text in the header
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
    """Field layout of a batch: tuple of (name, 't'|'s', dtype str, shape tail)."""
    first = samples[0]
    sch = []
    for name in sorted(first):
        a = first[name]
        if name in token_fields and a.ndim >= 1:
            sch.append((name, "t", a.dtype.str, tuple(a.shape[1:])))
        else:
            sch.append((name, "s", a.dtype.str, tuple(a.shape)))
    sch = tuple(sch)
    names = [x[0] for x in sch]
    for smp in samples[1:]:
        if sorted(smp) != names:
            raise SampleError(f"rank {rank}: samples of one batch have different fields: "
                              f"{names} vs {sorted(smp)}")
    for name, kind, dt, tail in sch:
        if np.dtype(dt).hasobject:
            raise SampleError(f"rank {rank}: field {name!r} is not numeric (dtype {dt})")
    return sch


def _schema_hash(sch) -> int:
    h = hashlib.blake2b(repr(sch).encode(), digest_size=8).digest()
    return (int.from_bytes(h, "little") & ((1 << 62) - 1)) | 1


def _field_nbytes(kind, dt, tail, s):
    n = int(np.prod(tail, dtype=np.int64)) if tail else 1
    if kind == "t":
        n *= s
    nb = n * np.dtype(dt).itemsize
    return nb, (nb + 7) // 8 * 8


def _encode(samples, schema) -> np.ndarray:
    parts = []
    for smp in samples:
        for name, kind, dt, tail in schema:
            a = smp[name]
            if a.dtype.str != dt:
                a = a.astype(dt)
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


# ----------------------------------------------------------------------------- comm
class _Comm:
    """int64 collectives and point-to-point transfers for the exchange.

    ``group`` (all ranks) carries the collectives.  Point-to-point: paddle's gloo process
    group numbers its send/recv operations with a per-group counter on each rank, so a
    send and its receive only match when both ranks have done the same number of
    point-to-point operations on that group (with 3+ ranks and uneven traffic they do
    not, and the transfer hangs).  On gloo every pair of ranks therefore gets a
    two-rank group of its own (``pair_groups``; with 2 ranks that is ``group`` itself);
    NCCL matches by peer, and uses ``group``.
    """

    def __init__(self, group, rank, world, pair_groups=None):
        import paddle

        self.paddle = paddle
        self.dist = paddle.distributed
        self.group, self.rank, self.world = group, rank, world
        self.pair_groups = pair_groups or {}
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
        self.dist.all_gather(outs, t, group=self.group)
        return np.stack([o.numpy() for o in outs])

    def all_gather_object(self, obj):
        outs = []
        self.dist.all_gather_object(outs, obj, group=self.group)
        return outs

    def exchange(self, sends: Dict[int, np.ndarray], recv_words: Dict[int, int]) -> Dict[int, np.ndarray]:
        """Uneven all-to-all: isend/irecv posted in rank order, then waited on."""
        tasks, keep, bufs = [], [], {}
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
        return {p: t.numpy() for p, t in bufs.items()}


# ----------------------------------------------------------------------------- loader
class BalancedLoader:
    """Iterable of balanced, packed batches over a rank's own loader.

    ``loader`` yields, per step, a list of samples (see :mod:`paddle_unpad.data`); every
    rank must iterate its loader in step with the others (as with
    ``DistributedBatchSampler``).  In a single process (or ``enabled=False``) it packs
    the batches as they are, synchronously.  See :func:`paddle_unpad.fleet.distributed_loader`.

    Args:
        cost, counts, tol: passed to the planner (:func:`paddle_unpad.balance.plan`).
        prefetch: batches prepared ahead of the training loop (>= 1).
        timeout: seconds the training loop waits for a batch before
            :class:`ExchangeTimeout` (a peer stalled or died).
        max_seqlen: longest legal sample (None: no limit); longer or empty samples raise
            :class:`~paddle_unpad.data.SampleError` naming the sample id and rank.
        check_plan: all-gather a hash of each step's plan and fail if ranks disagree
            (an extra tiny collective per step; meant for tests).
        close_timeout: seconds ``close()`` waits for the exchange thread.
        group: a process group to use (default: a new one over all ranks, created here --
            call this at the same point of the program on every rank).  On gloo with more
            than 2 ranks, one 2-rank group per pair of ranks is created as well (see
            ``_Comm``).
    """

    def __init__(self, loader, cost=None, counts="equal", tol: float = DEFAULT_TOL, prefetch: int = 2,
                 timeout: float = 300.0, max_seqlen: Optional[int] = 512,
                 token_fields: Sequence[str] = DEFAULT_TOKEN_FIELDS, check_plan: bool = False,
                 close_timeout: float = 10.0, place=None, group=None, enabled: bool = True):
        if prefetch < 1:
            raise ValueError("prefetch must be >= 1")
        if timeout <= 0:
            raise ValueError("timeout must be > 0")
        self.loader = loader
        self.cost, self.counts, self.tol = cost, counts, tol
        self.prefetch, self.timeout, self.close_timeout = int(prefetch), float(timeout), float(close_timeout)
        self.max_seqlen = max_seqlen
        self.token_fields = tuple(token_fields)
        self.check_plan = bool(check_plan)
        self.place = place
        import paddle.distributed as dist

        initialized = dist.is_initialized()
        self.world = dist.get_world_size() if initialized else 1
        self.rank = dist.get_rank() if initialized else 0
        self.distributed = bool(enabled) and self.world > 1
        self.group, self.pair_groups = None, {}
        if self.distributed:
            self.group = group if group is not None else dist.new_group(list(range(self.world)))
            self.pair_groups = _Comm.make_pair_groups(self.world, self.group)
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


class _ExchangeIterator:
    def __init__(self, owner: BalancedLoader):
        self.o = owner
        self.q: "queue.Queue" = queue.Queue(maxsize=owner.prefetch)
        self.stop = threading.Event()
        self.finished = False
        self.steps_done = 0
        # exchange-thread CPU seconds (time.thread_time: waits in collectives and in the
        # queue do not count) and steps produced; see BalancedLoader.stats
        self.stats = {"steps": 0, "thread_cpu_s": 0.0, "moved_in": 0}
        owner.stats = self.stats
        self.comm = _Comm(owner.group, owner.rank, owner.world, owner.pair_groups)
        self.thread = threading.Thread(target=self._run, name=f"paddle_unpad-exchange-r{owner.rank}",
                                       daemon=True)
        _LIVE.add(self)
        self.thread.start()

    # ---------------------------------------------------------------- main thread side
    def __iter__(self):
        return self

    def __next__(self):
        if self.finished:
            raise StopIteration
        try:
            item = self.q.get(timeout=self.o.timeout)
        except queue.Empty:
            self.close(wait=False)
            raise ExchangeTimeout(
                f"paddle_unpad exchange on rank {self.o.rank}: no balanced batch within "
                f"{self.o.timeout:g} s after step {self.steps_done} (a rank stalled, died, or its loader "
                "is slower than the timeout; set unpad_configs['timeout'])") from None
        if item is _END_ITEM:
            self.finished = True
            self.thread.join(self.o.close_timeout)
            _LIVE.discard(self)
            raise StopIteration
        if isinstance(item, BaseException):
            self.finished = True
            self.thread.join(self.o.close_timeout)
            _LIVE.discard(self)
            raise item
        self.steps_done += 1
        return item

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
                self.q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self):
        o, comm = self.o, self.comm
        R, me = o.world, o.rank
        step = 0
        it = None
        exhausted = False
        try:
            try:
                it = iter(o.loader)
            except BaseException as e:  # the header reports it
                it_exc = e
            else:
                it_exc = None
            while True:
                cpu0 = time.thread_time()
                status, msg, local_exc = OK, "", None
                samples, lengths, ids, sch = [], np.zeros(0, np.int64), np.zeros(0, np.int64), None
                if self.stop.is_set():
                    status, msg = ABORT, "its training loop stopped iterating (break, exception or Ctrl-C)"
                elif it_exc is not None:
                    status, local_exc = ERROR, it_exc
                elif exhausted:  # never call next() again on a finished iterator
                    status = END
                else:
                    try:
                        batch = next(it)
                        samples, lengths, ids = normalize_batch(batch, me, step, o.token_fields)
                        if samples:
                            sch = _schema(samples, o.token_fields, me)
                    except StopIteration:
                        status, exhausted = END, True
                    except BaseException as e:  # noqa: BLE001 - reported to every rank
                        status, local_exc = ERROR, e
                if local_exc is not None:
                    msg = f"{type(local_exc).__name__}: {local_exc}"
                hdr = np.zeros(_HDR, dtype=np.int64)
                hdr[0], hdr[1], hdr[2] = status, step, len(samples)
                hdr[3] = _schema_hash(sch) if sch is not None else 0
                mb = msg.encode("utf-8", "replace")[: 8 * _MSG_WORDS]
                hdr[8:] = np.frombuffer(mb.ljust(8 * _MSG_WORDS, b"\0"), dtype=np.int64)
                H = comm.all_gather(hdr)
                if status == ABORT:
                    return  # peers learn it from this header; nothing more to do
                failed = [r for r in range(R) if H[r, 0] in (ERROR, ABORT)]
                if failed:
                    if local_exc is not None:
                        raise local_exc
                    r = failed[0]
                    text = H[r, 8:].tobytes().rstrip(b"\0").decode("utf-8", "replace")
                    raise ExchangeError(f"paddle_unpad exchange: rank {r} {_STATUS_TEXT[int(H[r, 0])]} at "
                                        f"step {int(H[r, 1])}: {text} (this is rank {me})")
                if np.all(H[:, 0] == END):
                    self._put(_END_ITEM)
                    return
                if np.any(H[:, 1] != step):
                    raise ExchangeError(f"paddle_unpad exchange: ranks are out of step: {H[:, 1].tolist()}")
                counts = np.where(H[:, 0] == END, 0, H[:, 2])
                N = int(counts.sum())
                if N == 0:  # nobody has a sample this step: every rank skips it
                    step += 1
                    continue
                self._agree_schema(H, sch, comm)
                maxn = int(counts.max())
                rows = np.zeros((maxn, 2), dtype=np.int64)
                rows[: len(samples), 0] = lengths
                rows[: len(samples), 1] = ids
                G = comm.all_gather(rows.reshape(-1)).reshape(R, maxn, 2)
                lens = [G[r, : counts[r], 0] for r in range(R)]
                gids = [G[r, : counts[r], 1] for r in range(R)]
                for r in range(R):  # same check, same message, on every rank
                    check_lengths(lens[r], gids[r], r, o.max_seqlen)
                dest, _ = plan_dest([x.tolist() for x in lens], o.cost, o.counts, o.tol)
                starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
                phash = _plan_hash(dest)
                if o.check_plan:
                    hs = comm.all_gather(np.array([phash], dtype=np.int64)).reshape(-1)
                    if np.any(hs != hs[0]):
                        raise ExchangeError(f"paddle_unpad exchange: ranks computed different plans at step "
                                            f"{step}: hashes {hs.tolist()}")
                schema = o._schema_state["schema"]
                my_dest = dest[starts[me]:starts[me + 1]]
                sends = {}
                for d in range(R):
                    if d != me:
                        sel = np.nonzero(my_dest == d)[0]
                        if sel.size:
                            sends[d] = _encode([samples[k] for k in sel], schema)
                recv_words, recv_sel = {}, {}
                for r in range(R):
                    if r != me:
                        sel = np.nonzero(dest[starts[r]:starts[r + 1]] == me)[0]
                        if sel.size:
                            recv_sel[r] = sel
                            recv_words[r] = _words(lens[r][sel], schema)
                got = comm.exchange(sends, recv_words) if (sends or recv_words) else {}
                mine, mlens, mids = [], [], []
                for r in range(R):
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
                packed = pack_samples(mine, mlens, mids, o.token_fields, global_num_samples=N, schema=schema)
                packed["step"] = step
                packed["plan_hash"] = phash
                packed["moved_in"] = int(sum(len(s) for s in recv_sel.values()))
                out = to_paddle(packed, o.place)
                self.stats["thread_cpu_s"] += time.thread_time() - cpu0
                self.stats["steps"] += 1
                self.stats["moved_in"] += packed["moved_in"]
                step += 1
                if not self._put(out):
                    continue  # closing: the loop top sends the ABORT header
        except BaseException as e:  # noqa: BLE001 - handed to the training loop
            self._put(e)
        finally:
            it = None

    def _agree_schema(self, H, sch, comm):
        st = self.o._schema_state
        hashes = sorted(set(int(h) for h in H[:, 3] if h != 0))
        if len(hashes) > 1:
            raise SampleError("paddle_unpad exchange: ranks' samples have different fields or dtypes "
                              f"(schema hashes per rank: {H[:, 3].tolist()})")
        if hashes and hashes[0] != st["hash"]:
            # not the hot path: once per epoch start or field change; every rank decides
            # the same from the gathered headers, so the collective matches up
            schemas = comm.all_gather_object(sch)
            agreed = next(s for s in schemas if s is not None)
            st["hash"], st["schema"] = hashes[0], agreed


def _plan_hash(dest: np.ndarray) -> int:
    h = hashlib.blake2b(np.ascontiguousarray(dest, dtype=np.int32).tobytes(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 62) - 1)

"""One epoch of the sample exchange: a background thread that turns every rank's batches into
balanced, packed batches, one global step per pass, on the loader's host (gloo) group.

Per step, every rank takes the same branches, decided from gathered values, so the
collectives always match up:

1. **local batch** -- the training loop's thread hands the rank's next batch (or its end, or
   its error) over, as a copy (:func:`.source.own_batch`: the user's loader may overwrite its
   arrays while this thread still holds the batch); it is read
   (:meth:`.pipeline.Pipeline.read`);
2. **headers** -- all-gather of every rank's header (:mod:`.wire`): a rank that failed, ended,
   stopped iterating, plans with other settings or is at another step is known to every rank
   at the same collective, before any sample moves;
3. **layout** -- agreed across ranks when it changes (all-gather of the field layouts);
4. **lengths** -- all-gather of every sample's ``(length, id)``; checked alike on every rank
   (:meth:`.pipeline.Pipeline.check`);
5. **plan** -- the same on every rank (:func:`paddle_unpad.balance.plan_dest`);
6. **transfer** -- the samples that move, as one all-gather of each rank's outgoing bytes,
   padded to the largest rank's (:func:`transfer`): every rank receives every moved sample
   and keeps those addressed to it. One collective on one group whatever the number of ranks;
   gloo has no all-to-all, and its point-to-point messages are matched by a per-group counter
   that uneven traffic between 3+ ranks puts out of step (docs/distributed.md, *At scale*);
7. **pack** -- the rank's samples, in (source rank, index) order, packed and converted to
   paddle tensors (:meth:`.pipeline.Pipeline.pack`), queued for the training loop
   (``prefetch`` ahead).
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time

import numpy as np

from ..balance.planner import plan_dest, plan_hash
from ..data.collate import SampleError
from . import groups, wire, workarounds
from .errors import ExchangeError, ExchangeTimeout
from .wire import ABORT, END, ERROR, MSG_BYTES, OK, STATUS_TEXT, Header, Headers

log = logging.getLogger("paddle_unpad.distributed")
END_ITEM = object()
POLL_S = 0.05  # how often blocked waits look at the stop flag / feed the exchange thread


_PEER_GONE = "a peer died, was stopped, or did not reach this step within the communication backend's own timeout"


def comm_error(rank, what, exc) -> ExchangeError:
    text = f"{type(exc).__name__}: {exc}".strip()
    m = re.search(r"pair_rank = (\d+)", text)
    peer = f" with rank {m.group(1)}" if m else ""
    return ExchangeError(
        f"paddle_unpad.distributed: exchange on rank {rank}: {what} failed{peer} -- {_PEER_GONE} ({text.splitlines()[0][:300]})"
    )


class Settings:
    """What every epoch of one loader shares: its group, options, sample pipeline and the layout
    agreed so far. Holds no reference to the loader itself (dropping the loader stops its epochs)."""

    def __init__(self, group, rank, world, options, pipeline, plan_key, plan_desc):
        self.group, self.rank, self.world = group, rank, world
        self.o, self.pipeline = options, pipeline
        self.plan_key, self.plan_desc = plan_key, plan_desc
        self.schema = {"hash": 0, "schema": None}  # agreed across ranks, kept over epochs


_PLANS_DIFFER = (
    "the ranks balance with different planner settings (cost, counts or tol), so they would compute different plans"
)
_SAME_PLANNER = (
    "pass the same settings on every rank (a calibrated cost model: fit it on one rank and share its coefficients)"
)
_SAME_LAYOUT = "every sample of a global batch needs the same fields, dtypes and trailing shapes"
_STALLED = "a rank stalled, died, or its loader is slower than the timeout; set unpad_configs['timeout']"


class Epoch:
    """One pass over the loader: its exchange thread, the two queues between that thread and
    the training loop, and the :class:`~paddle_unpad.distributed.source.Source` it reads.

    The training loop's side is three calls: :meth:`feed` (hand the source's next batches to
    the thread), :meth:`next` (the next packed batch, with a timeout) and :meth:`close`
    (stop the thread, close the source). ``stats`` counts what the thread did."""

    def __init__(self, settings: Settings, source):
        self.s, self.src = settings, source  # the Epoch owns the source from here on: close() closes it
        prefetch = settings.o["prefetch"]
        self.q: "queue.Queue" = queue.Queue(maxsize=prefetch)  # packed batches, to the loop
        self.inq: "queue.Queue" = queue.Queue(maxsize=prefetch)  # the loader's batches, to the thread
        self.stop = threading.Event()
        self.phase = "starting"  # what the exchange thread waits for (named in timeouts)
        self.what = "the exchange"  # the step and the operation, for errors of a collective
        # exchange-thread CPU seconds (time.thread_time: waits in collectives and in the queue
        # do not count), steps produced, samples received, bytes of the sample transfers
        self.stats = {"steps": 0, "thread_cpu_s": 0.0, "moved_in": 0, "moved_bytes": 0, "wire_bytes": 0}
        self.thread = threading.Thread(target=self._run, name=f"paddle_unpad-exchange-r{settings.rank}", daemon=True)
        workarounds.register_thread(self.thread, self.stop.set)
        self.thread.start()

    # ---------------------------------------------------------------- the thread's queues
    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _take(self):
        """The loader's next item, or None once the epoch is being closed."""
        while not self.stop.is_set():
            try:
                return self.inq.get(timeout=POLL_S)
            except queue.Empty:
                continue
        return None

    def _at(self, step, what):
        self.phase = self.what = f"{what} at step {step}"

    def _all_gather(self, arr):
        try:
            return groups.all_gather_array(self.s.group, arr)
        except Exception as e:  # noqa: BLE001 - gloo errors come as RuntimeError/OSError
            raise comm_error(self.s.rank, self.what, e) from e

    # ---------------------------------------------------------------- the thread
    def _run(self):
        """One global step per pass, in the named steps below."""
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
                if self._read_headers(H, local, step) == "end":
                    self._put(END_ITEM)
                    return
                counts = np.where(H.status == END, 0, H.count)
                if int(counts.sum()) == 0:  # nobody has a sample this step: every rank skips it
                    step += 1
                    continue
                self._agree_schema(H, local["schema"], step)
                lens, gids = self._share_lengths(step, local, counts)
                dest, starts, phash = self._plan(step, lens, counts)
                out = self._transfer_and_pack(step, local, dest, starts, phash, lens, gids, counts)
                self.stats["thread_cpu_s"] += time.thread_time() - cpu0
                self.stats["steps"] += 1
                step += 1
                self.phase = f"waiting for the training loop to take the batch of step {step - 1}"
                if not self._put(out):
                    continue  # closing: the loop top sends the ABORT header
        except BaseException as e:  # noqa: BLE001 - handed to the training loop
            self.phase = f"stopped by {type(e).__name__}"
            self._put(e)
        finally:
            workarounds.unregister_thread(self.thread)

    def _local_batch(self, step, exhausted):
        """This rank's batch of ``step`` from the training loop, read and checked: its status
        (OK / END / ERROR / ABORT), samples, lengths, ids and layout."""
        s = self.s
        local = {
            "status": OK,
            "msg": "",
            "exc": None,
            "samples": [],
            "lengths": np.zeros(0, np.int64),
            "ids": np.zeros(0, np.int64),
            "schema": None,
            "exhausted": exhausted,
            "waited_s": 0.0,
        }
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
                samples, lengths, ids = s.pipeline.read(item[1], s.rank, step)
                local.update(
                    samples=samples,
                    lengths=lengths,
                    ids=ids,
                    schema=wire.schema(samples, s.pipeline.token_fields, s.rank) if samples else None,
                )
            except BaseException as e:  # noqa: BLE001 - reported to every rank
                local.update(status=ERROR, exc=e)  # the update above built its values first: local is as it was
        if local["exc"] is not None:
            local["msg"] = wire.summary(local["exc"])
        return local

    def _share_headers(self, step, local) -> Headers:
        """All-gather every rank's :class:`~.wire.Header`."""
        sch = local["schema"]
        # the message slot carries the error text, or (status OK) the batch's layout when it fits:
        # the layout then needs no collective of its own
        text = local["msg"] if local["status"] != OK else wire.schema_text(sch, MSG_BYTES)
        hdr = Header(
            status=local["status"],
            step=step,
            count=len(local["samples"]),
            schema_hash=wire.schema_hash(sch) if sch is not None else 0,
            plan_key=self.s.plan_key,
            message=text,
        )
        self._at(step, "waiting for every rank's header (all-gather)")
        return Headers.decode(self._all_gather(hdr.encode()))

    def _read_headers(self, H, local, step):
        """Raise the first rank's failure on every rank, or say whether every rank has ended."""
        s = self.s
        failed = [r for r in range(s.world) if H.status[r] in (ERROR, ABORT)]
        if failed:
            if local["exc"] is not None:
                raise local["exc"]
            r = failed[0]
            raise ExchangeError(
                f"paddle_unpad.distributed: exchange: rank {r} {STATUS_TEXT[int(H.status[r])]} at step {int(H.step[r])}: {H.message(r)} (this is rank {s.rank})"
            )
        if np.any(H.plan_key != H.plan_key[0]):  # before any plan: different settings give different plans
            by_key = {}
            for r in range(s.world):
                by_key.setdefault(int(H.plan_key[r]), []).append(r)
            alike = " / ".join(str(g) for g in by_key.values())
            raise ExchangeError(
                f"paddle_unpad.distributed: exchange: {_PLANS_DIFFER} (ranks with the same settings: {alike}); {_SAME_PLANNER} -- this is rank {s.rank}: {s.plan_desc}"
            )
        if np.all(H.status == END):
            return "end"
        if np.any(H.step != step):
            raise ExchangeError(f"paddle_unpad.distributed: exchange: ranks are out of step: {H.step.tolist()}")
        return "go"

    def _agree_schema(self, H, sch, step):
        st = self.s.schema
        hashes = sorted(set(int(h) for h in H.schema_hash if h != 0))
        if len(hashes) > 1 or (hashes and hashes[0] != st["hash"]):
            # not the hot path: once per epoch start, field change or mismatch; every rank
            # decides the same from the gathered headers, so a collective (when a layout did
            # not fit its header) matches up
            schemas = [wire.schema_from_text(H.message(r)) if H.schema_hash[r] else None for r in range(self.s.world)]
            if any(H.schema_hash[r] and schemas[r] is None for r in range(self.s.world)):
                self._at(step, "agreeing on the batch layout (all-gather)")
                try:
                    schemas = groups.all_gather_object(self.s.group, sch)
                except Exception as e:  # noqa: BLE001
                    raise comm_error(self.s.rank, self.what, e) from e
            if len(hashes) > 1:
                raise SampleError(
                    f"paddle_unpad.distributed: exchange: the ranks' batches of step {step} have different layouts: {wire.describe_schema_difference(schemas)} ({_SAME_LAYOUT})"
                )
            st["hash"], st["schema"] = hashes[0], next(x for x in schemas if x is not None)

    def _share_lengths(self, step, local, counts):
        """All-gather every rank's sample lengths and ids; check them the same way on every rank."""
        s, n = self.s, len(local["samples"])
        maxn = int(counts.max())
        rows = np.zeros((maxn, 2), dtype=np.int64)
        rows[:n, 0] = local["lengths"]
        rows[:n, 1] = local["ids"]
        self._at(step, "waiting for every rank's sample lengths (all-gather)")
        G = self._all_gather(rows.reshape(-1)).reshape(s.world, maxn, 2)
        lens = [G[r, : counts[r], 0] for r in range(s.world)]
        gids = [G[r, : counts[r], 1] for r in range(s.world)]
        for r in range(s.world):  # same check, same message, on every rank
            s.pipeline.check(lens[r], gids[r], r)
        return lens, gids

    def _plan(self, step, lens, counts):
        """The same plan on every rank: each sample's destination, the ranks' offsets, its hash."""
        o = self.s.o
        self._at(step, "planning")
        dest, _ = plan_dest(lens, o["cost"], o["counts"], o["tol"])
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        phash = plan_hash(dest)
        if o["check_plan"]:
            self._at(step, "comparing plan hashes (all-gather)")
            hs = self._all_gather(np.array([phash], dtype=np.int64)).reshape(-1)
            if np.any(hs != hs[0]):
                raise ExchangeError(
                    f"paddle_unpad.distributed: exchange: ranks computed different plans at step {step}: hashes {hs.tolist()}"
                )
        return dest, starts, phash

    def _transfer_and_pack(self, step, local, dest, starts, phash, lens, gids, counts):
        """Send the samples that leave, receive those that arrive, pack this rank's batch."""
        s, me = self.s, self.s.rank
        schema = s.schema["schema"]
        W = wire.transfer_words(dest, starts, lens, schema, s.world)
        self._at(step, "transferring the samples that move (all-gather)")
        got, received = transfer(
            self._all_gather, local["samples"], local["lengths"], dest[starts[me] : starts[me + 1]], W, me, schema
        )
        self.stats["moved_bytes"] += 8 * int(W.sum())
        self.stats["wire_bytes"] += 8 * received
        mine, mlens, mids, moved_in = [], [], [], 0
        for r in range(s.world):  # (source rank, index) order
            sel = np.nonzero(dest[starts[r] : starts[r + 1]] == me)[0]
            if not sel.size:
                continue
            if r == me:
                mine.extend(local["samples"][k] for k in sel)
            else:
                mine.extend(wire.decode(got[r], lens[r][sel], schema))
                moved_in += int(sel.size)
            mlens.append(lens[r][sel])
            mids.append(gids[r][sel])
        mlens = np.concatenate(mlens) if mlens else np.zeros(0, np.int64)
        mids = np.concatenate(mids) if mids else np.zeros(0, np.int64)
        self.stats["moved_in"] += moved_in
        return s.pipeline.pack(
            mine,
            mlens,
            mids,
            step,
            global_num_samples=int(counts.sum()),
            schema=schema,
            plan_hash=phash,
            moved_in=moved_in,
        )

    # ---------------------------------------------------------------- the training loop's side
    def feed(self):
        """Hand the source's next batches to the exchange thread, up to ``prefetch`` ahead.

        Runs on the training thread: a user's loader (and its workers) is read where the user
        iterates it, so a Ctrl-C or an error inside it reaches the training loop."""
        src = self.src
        while src is not None and not src.done and not self.inq.full() and not self.stop.is_set():
            self.inq.put_nowait(src.take())

    def next(self, timeout: float, steps_done: int):
        """The next packed batch (a dict of tensors), or None at the end of the epoch.

        Raises what the exchange thread raised, or :class:`ExchangeTimeout` when no batch came
        within ``timeout`` seconds (the thread is then told to stop; ``steps_done`` -- batches
        the loop has taken -- is named in the message)."""
        deadline = time.monotonic() + timeout
        while True:
            self.feed()
            left = deadline - time.monotonic()
            try:
                item = self.q.get(timeout=max(0.0, min(POLL_S, left)))
                break
            except queue.Empty:
                if left <= 0:
                    phase = self.phase
                    self.stop.set()  # the thread leaves when its collective returns (at the latest gloo's timeout)
                    raise ExchangeTimeout(
                        f"paddle_unpad.distributed: exchange on rank {self.s.rank}: no balanced batch within {timeout:g} s after step {steps_done}; the exchange thread is {phase} ({_STALLED})"
                    ) from None
        if item is END_ITEM:
            return None
        if isinstance(item, BaseException):
            raise item
        self.feed()
        return item

    def close(self, timeout: float) -> bool:
        """Stop the thread (idempotent), wait up to ``timeout`` s and close the source; True
        once the thread has ended (one still inside a collective is joined at exit)."""
        self.stop.set()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
        stopped = not self.thread.is_alive()
        if not stopped:
            log.warning(
                "paddle_unpad: exchange thread of rank %d did not stop within %.1f s (blocked in a collective with a peer that is gone?); it is joined at exit",
                self.s.rank,
                timeout,
            )
        src, self.src = self.src, None
        if src is not None:
            src.close()
        return stopped


def transfer(all_gather, samples, lengths, my_dest, W, me, schema):
    """The uneven all-to-all of one step as one all-gather: each rank contributes its outgoing
    samples, destination by destination (``W[me, d]`` words for rank ``d``), padded to the
    largest rank's total; every rank keeps the segments addressed to it. Returns
    ``({source: int64 words}, words this rank received)``. Nothing is sent when nothing moves
    (every rank sees it in ``W``)."""
    width = int(W.sum(axis=1).max()) if W.size else 0
    if width == 0:
        return {}, 0
    out = np.zeros(width, dtype=np.int64)
    off = 0
    for d in range(W.shape[0]):
        if W[me, d]:
            sel = np.nonzero(my_dest == d)[0]
            out[off : off + W[me, d]] = wire.encode([samples[k] for k in sel], lengths[sel], schema)
            off += int(W[me, d])
    G = all_gather(out)
    got = {}
    for r in range(W.shape[0]):
        if W[r, me]:
            start = int(W[r, :me].sum())
            got[r] = G[r, start : start + int(W[r, me])]
    return got, int(G.size)

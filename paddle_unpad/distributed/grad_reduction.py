"""How each pass's buckets of a :class:`~paddle_unpad.distributed.grad_sync.GradientAllReduce`
are reduced: on which groups, from which thread, in which order.

Every rank reduces the buckets in plan order, so that the ranks issue the same collectives in
the same order whatever the order their backward completed them in.

* **CPU jobs** (gloo): a communication thread, ``paddle_unpad-grad-allreduce``, reduces each
  bucket as soon as it is complete, while the backward goes on, then checks the step trailer;
  ``wait()`` waits for it within ``timeout`` (a thread blocked in gloo cannot be interrupted).
* **GPU jobs** (NCCL): no thread. Each bucket's all-reduce is issued asynchronously by the
  backward hook that completes it, on the training thread, in bucket order (NCCL's rule: one
  thread, the same order on every rank); ``wait()`` waits for the tasks, then the trailer.

The pass's state of completion (which gradients are in, the trailer's flags) belongs to the
all-reduce, which tells this object when a pass opens, is sealed and ends.
"""

from __future__ import annotations

import queue
import threading
from typing import Optional

from . import grad_buckets, grad_rows, groups, workarounds


class Reduction:
    """The groups of one all-reduce and the reduction of its buckets, pass after pass.

    ``grad(p)``: the gradient of ``p`` that takes part in the pass; ``trailer()``: the pass's
    trailer check, run after its buckets (it raises on every rank alike); ``stats``: the
    all-reduce's, whose ``tables_unproven`` this counts. The groups are made here, over
    ``ranks``: a device group for the gradients and, where that is not gloo, a host group for
    the control messages (the trailer, the rows of by-rows tables)."""

    def __init__(self, ranks, buckets, gpu, scale, dense_fraction, grad, trailer, stats):
        self.buckets, self.gpu, self.scale, self.dense_fraction = buckets, gpu, scale, dense_fraction
        self.world = len(ranks)
        self.grad, self.trailer, self.stats = grad, trailer, stats
        self.bytes = 0  # sent this pass
        self.sealed = threading.Event()  # the pass has ended on the training thread: no hook of it comes later
        self.done = threading.Event()  # CPU jobs: the thread has finished the pass
        self.error: Optional[BaseException] = None  # of the thread's pass, raised by wait()
        self.closed = False
        self.thread: Optional[threading.Thread] = None
        self._work: "queue.Queue" = queue.Queue()
        self._next, self._tasks = 0, []
        self.group = self.control = None
        try:
            self.group = groups.new_group("gradient all-reduce", groups.DEVICE, ranks)
            # the step header and the rows of by-rows tables are host values: on a gloo group
            # (NCCL jobs: one of its own, used by the training thread only)
            self.control = (
                self.group
                if self.group.backend == "gloo"
                else groups.new_group("gradient all-reduce control", groups.HOST, ranks)
            )
        except BaseException:
            self.release_groups()
            raise

    def release_groups(self):
        groups.release(self.group)
        groups.release(self.control)

    # ------------------------------------------------------------------ one pass

    def open(self):
        """The pass's first gradient is complete (under the all-reduce's lock)."""
        self.bytes = 0
        self.done.clear()
        self.sealed.clear()
        if not self.gpu:
            self._work.put(True)

    def end(self):
        """The pass is over (under the all-reduce's lock): every bucket waits for its gradients again."""
        self._next, self._tasks = 0, []
        for b in self.buckets:
            b.pending = len(b.params)
            b.ready.clear()

    def _reduce_rows(self, b):
        sent, unproven = grad_rows.reduce_rows(
            self.grad(b.params[0]), b.table, self.group, self.control, self.world, self.scale, self.dense_fraction
        )
        self.stats["tables_unproven"] += unproven
        self.bytes += sent

    def _start_dense(self, b):
        return grad_buckets.start_dense(self.group, [self.grad(p) for p in b.params], not self.gpu, self.scale)

    # ------------------------------------------------------------------ GPU jobs: issued on the training thread

    def issue_ready(self):
        """Issue, in bucket order, every bucket that is complete and not issued yet."""
        while self._next < len(self.buckets) and self.buckets[self._next].ready.is_set():
            b = self.buckets[self._next]
            self._next += 1
            if b.table is not None:
                self._reduce_rows(b)
            else:
                self._tasks.append(self._start_dense(b))

    def finish_issued(self):
        """Wait for the issued all-reduces, then check the trailer."""
        tasks, self._tasks = self._tasks, []
        for task, finish in tasks:
            task.wait()  # NCCL: the compute stream waits for the communication stream
            self.bytes += finish()
        self.trailer()

    # ------------------------------------------------------------------ CPU jobs: the communication thread

    def start_thread(self, stop_at_exit):
        """Start the communication thread; ``stop_at_exit()`` ends it at interpreter exit."""
        self.thread = threading.Thread(target=self._serve, name="paddle_unpad-grad-allreduce", daemon=True)
        workarounds.register_thread(self.thread, stop_at_exit)
        self.thread.start()

    def leave(self):
        """Ask the thread to leave after the pass it has (without blocking)."""
        self._work.put(None)

    def close_thread(self, join_s):
        """Close: the thread leaves after its pass; the groups are released now if it has left
        within ``join_s``, else by the thread on its way out (one still in a collective is joined
        at exit)."""
        self.closed = True
        self.leave()
        self.thread.join(timeout=join_s)
        if not self.thread.is_alive():
            workarounds.unregister_thread(self.thread)
            self.release_groups()

    def _serve(self):
        while True:
            if self._work.get() is None:
                break
            try:
                self._reduce_all()
                self.sealed.wait()  # wait() has set the pass's step by then
                self.trailer()
            except BaseException as e:  # noqa: BLE001 -- raised in the training thread by wait()
                self.error = e
            finally:
                self.done.set()
        if self.closed:
            self.release_groups()

    def _reduce_all(self):
        for b in self.buckets:  # the same order on every rank
            b.ready.wait()
            if b.table is not None:
                self._reduce_rows(b)
            else:
                task, finish = self._start_dense(b)
                task.wait()
                self.bytes += finish()

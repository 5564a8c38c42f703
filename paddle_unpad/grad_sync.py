"""Gradient all-reduce with only the necessary bytes, overlapped with the backward where that helps.

::

    sync = pu.fleet.GradientAllReduce(model)     # on every rank, at the same point
    for batch in loader:
        loss = ...
        loss.backward()
        sync.wait()              # gradients are now averaged over the ranks
        opt.step(); opt.clear_grad()

What it does, compared with reducing one flat copy of every gradient after the backward:

* **Embedding tables by rows.** A lookup table's gradient is zero outside the rows the step
  looked up. The rows each rank used are recorded by a forward pre-hook on the model's
  ``nn.Embedding`` layers (host-side ids: no device read-back); the ranks exchange these
  row lists and all-reduce only their union -- the other rows are zero on every rank and
  stay zero, so the result is the dense all-reduce's. A table whose weight is also a
  parameter of another layer (a tied output projection, as in PaddleNLP's masked-LM heads)
  has a dense gradient and is reduced whole; so is a table when the union covers most of
  it. On a 30522 x 384 vocabulary and 2 x 1,500 tokens that is ~4 MB instead of 47 MB.
* **In place.** A gradient of at least ``bucket_mb`` is all-reduced in its own memory; only
  the small ones (biases, LayerNorm) are packed into buckets (one copy in, one out).
* **Overlap** (the default): a hook on every parameter marks its gradient complete; a
  communication thread on its own process group reduces each bucket as soon as all of its
  gradients are complete, while the backward goes on. Buckets follow the reverse
  registration order (the order the backward completes them) and are always reduced in
  that order on every rank; :meth:`GradientAllReduce.wait` marks parameters without a
  gradient this step as complete (reduced as zeros, so every rank issues the same
  collectives) and waits for the last buckets. On CPU ranks that already keep every core
  busy the thread shares the cores with the compute; ``benchmarks/bench_e2e.py`` measures
  what it still saves there (``overlap=False`` reduces in ``wait``, after the backward).

Dygraph only; one :meth:`~GradientAllReduce.wait` per optimizer step. With gradient
accumulation use ``overlap=False`` and call ``wait`` after the last backward only: with
overlap, a bucket is reduced as soon as the first micro-batch completes it.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Dict, List, Optional

import numpy as np
import paddle
import paddle.distributed as dist

from . import _paddle_compat as compat

__all__ = ["GradientAllReduce", "GradientSyncError"]


class GradientSyncError(RuntimeError):
    """The gradient all-reduce failed or did not finish within its timeout."""


def _nbytes(p):
    return int(np.prod(p.shape)) * p.element_size()


class _Bucket:
    __slots__ = ("params", "table", "pending", "ready", "nbytes")

    def __init__(self, params, table=None):
        self.params, self.table = list(params), table  # table: the _Table of a by-rows bucket
        self.nbytes = sum(_nbytes(p) for p in self.params)
        self.pending = len(self.params)
        self.ready = threading.Event()


class _Table:
    """The rows of one embedding table looked up since the last step."""

    def __init__(self, layer):
        self.rows = int(layer.weight.shape[0])
        self.ids: List[np.ndarray] = []
        self.hook = layer.register_forward_pre_hook(self._record)

    def _record(self, layer, inputs):
        ids = inputs[0]
        if isinstance(ids, paddle.Tensor):
            self.ids.append(np.unique(ids.numpy()).astype(np.int64))

    def take(self):
        got, self.ids = self.ids, []
        return np.unique(np.concatenate(got)) if got else np.zeros(0, np.int64)


def _embedding_tables(model):
    """{id(weight): Embedding layer} for tables whose weight belongs to no other layer."""
    layers = model.sublayers(include_self=True)
    owners: Dict[int, int] = {}
    for layer in layers:
        for _, p in layer.named_parameters(include_sublayers=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {id(m.weight): m for m in layers if isinstance(m, paddle.nn.Embedding)
            and not m.weight.stop_gradient and owners.get(id(m.weight), 0) == 1}


def _positive(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v <= 0:
        raise ValueError(f"GradientAllReduce: {name} must be a finite number > 0, got {v!r}")


class GradientAllReduce:
    """Averages (or sums) the gradients of ``model``'s trainable parameters over the ranks.

    Args:
        model: a ``paddle.nn.Layer`` (its ``nn.Embedding`` tables can be reduced by rows), or
            a list of parameters (then every gradient is reduced whole).
        bucket_mb: a gradient of at least this size (MiB) is all-reduced on its own, in place;
            smaller ones are packed into buckets of about this size.
        average: divide the sum by the number of ranks (``False``: keep the sum).
        row_sparse_embeddings: reduce embedding tables of at least ``bucket_mb`` by rows
            (module docstring). Default: on CPU (on GPU, reading the ids back to the host
            would make the step wait).
        dense_fraction: reduce a table whole once the union of its used rows exceeds this
            share of its rows.
        overlap: reduce while the backward runs (``True``, the default), or from
            :meth:`wait` on, after the backward (``False``). Either way the communication
            thread does the work, so that :meth:`wait` can give up after ``timeout``.
        timeout: seconds :meth:`wait` waits before raising :class:`GradientSyncError` (a
            peer that died or stopped; the process should then end: the stuck collective
            cannot be cancelled).
        group: the ranks to reduce over (default: all). The reduction runs on a new group
            of the same ranks, created here: construct on every rank, in the same order
            relative to other groups.
    """

    def __init__(self, model, bucket_mb: float = 1.0, average: bool = True,
                 row_sparse_embeddings: Optional[bool] = None, dense_fraction: float = 0.5,
                 overlap: Optional[bool] = None, timeout: float = 300.0, group=None):
        is_layer = isinstance(model, paddle.nn.Layer)
        params = [p for p in (model.parameters() if is_layer else model) if not p.stop_gradient]
        if not params:
            raise ValueError("GradientAllReduce: model has no trainable parameters")
        _positive("bucket_mb", bucket_mb)
        _positive("timeout", timeout)
        if isinstance(dense_fraction, bool) or not isinstance(dense_fraction, (int, float)) \
                or not 0.0 <= dense_fraction <= 1.0:
            raise ValueError(f"GradientAllReduce: dense_fraction must be in [0, 1], got {dense_fraction!r}")
        on_cpu = params[0].place.is_cpu_place()
        self.overlap = True if overlap is None else bool(overlap)
        by_rows = on_cpu if row_sparse_embeddings is None else bool(row_sparse_embeddings)
        self.average, self.dense_fraction, self.timeout = bool(average), float(dense_fraction), float(timeout)
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._group = None
        if self.world > 1:
            self._group = dist.new_group(group.ranks if group is not None else list(range(dist.get_world_size())))
        limit = float(bucket_mb) * (1 << 20)
        tables = _embedding_tables(model) if (is_layer and by_rows and self.world > 1) else {}
        self._buckets: List[_Bucket] = []
        small, small_bytes = [], 0
        for p in reversed(params):  # the order the backward completes them
            size = _nbytes(p)
            if id(p) in tables and size >= limit:
                self._buckets.append(_Bucket([p], _Table(tables[id(p)])))
            elif size >= limit:
                self._buckets.append(_Bucket([p]))
            else:
                small.append(p)
                small_bytes += size
                if small_bytes >= limit:
                    self._buckets.append(_Bucket(small))
                    small, small_bytes = [], 0
        if small:
            self._buckets.append(_Bucket(small))
        self._params = params
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._lock = threading.Lock()
        self._fired = set()
        self._step_open = False
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._closed = False
        self._step_bytes = 0
        self.stats = {"steps": 0, "exposed_s": 0.0, "bytes": 0, "last_bytes": 0, "buckets": len(self._buckets),
                      "dense_bytes": sum(b.nbytes for b in self._buckets),
                      "tables_by_rows": sum(b.table is not None for b in self._buckets)}
        self._work: "queue.Queue" = queue.Queue()
        self._thread = None
        if self.world > 1:
            if self.overlap:
                for p in params:
                    compat.register_grad_ready_hook(p, self._hook_for(id(p)))
            # without overlap the thread still does the work, so that wait() can time out
            self._thread = threading.Thread(target=self._serve, name="paddle_unpad-grad-allreduce", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ readiness (overlap)

    def _hook_for(self, key):
        def hook():
            if not self._closed:
                self._mark_ready(key)

        return hook

    def _mark_ready(self, key):
        with self._lock:
            if key in self._fired:
                return
            if not self._step_open:  # the step's first complete gradient starts the thread's pass
                self._step_open = True
                self._done.clear()
                self._work.put("step")
            self._fired.add(key)
            b = self._bucket_of[key]
            b.pending -= 1
            if b.pending == 0:
                b.ready.set()

    def _serve(self):
        while self._work.get() is not None:
            try:
                self._reduce_all()
            except BaseException as e:  # noqa: BLE001 -- raised in the training thread by wait()
                self._error = e
            finally:
                self._done.set()

    # ------------------------------------------------------------------ the reduction

    def _reduce_all(self):
        self._step_bytes = 0
        for b in self._buckets:  # the same order on every rank
            b.ready.wait()
            if self._closed:
                return
            self._step_bytes += self._reduce_rows(b) if b.table is not None else self._reduce_dense(b)

    def _grad(self, p):
        if p.grad is None:  # no gradient on this rank this step: it takes part with zeros
            compat.set_grad(p, paddle.zeros(p.shape, dtype=p.dtype))
        return p.grad.detach()  # shares the gradient's memory

    def _reduce_dense(self, b):
        grads = [self._grad(p) for p in b.params]
        if len(grads) == 1:
            self._all_reduce_in_place(grads[0])
            return b.nbytes
        flat = paddle.concat([g.reshape([-1]) for g in grads])
        self._all_reduce_in_place(flat)
        for g, part in zip(grads, paddle.split(flat, [int(np.prod(g.shape)) for g in grads])):
            g.set_value(part.reshape(g.shape))
        return b.nbytes

    def _all_reduce_in_place(self, t):
        dist.all_reduce(t, group=self._group)
        if self.average:
            t.scale_(1.0 / self.world)

    def _reduce_rows(self, b):
        g = self._grad(b.params[0])
        mine = b.table.take()
        counts = []
        dist.all_gather(counts, paddle.to_tensor([len(mine)], dtype="int64"), group=self._group)
        counts = [int(c.numpy()[0]) for c in counts]
        width = max(counts)
        union = None
        if width <= self.dense_fraction * b.table.rows:
            padded = np.zeros(width, dtype=np.int64)  # equal shapes: what gloo's all_gather needs
            padded[: len(mine)] = mine
            gathered = []
            dist.all_gather(gathered, paddle.to_tensor(padded), group=self._group)
            union = np.unique(np.concatenate([t.numpy()[:c] for t, c in zip(gathered, counts)]))
        sent = 8 * self.world * (1 + (width if union is not None else 0))  # the counts, the ids if sent
        if union is None or len(union) > self.dense_fraction * b.table.rows:
            self._all_reduce_in_place(g)
            return sent + b.nbytes
        if len(union) == 0:  # no rank looked anything up: the gradient is zero everywhere
            return sent
        index = paddle.to_tensor(union)
        rows = paddle.gather(g, index)
        self._all_reduce_in_place(rows)
        paddle.scatter_(g, index, rows, overwrite=True)
        return sent + _nbytes(rows)

    # ------------------------------------------------------------------ the training thread

    def wait(self):
        """Finish this step's all-reduce: call after the backward, before the optimizer step.
        Returns the seconds spent here (the communication the step waits for)."""
        t0 = time.perf_counter()
        if self.world == 1:
            return 0.0
        for p in self._params:  # without overlap: all of them; with it: those without a gradient
            self._mark_ready(id(p))
        if not self._done.wait(self.timeout):
            raise GradientSyncError(
                f"GradientAllReduce: the gradient all-reduce did not finish within {self.timeout:g} s "
                "(a rank died or stopped, or the ranks ran different backward passes)")
        err, self._error = self._error, None
        with self._lock:
            self._fired.clear()
            self._step_open = False
            for b in self._buckets:
                b.pending = len(b.params)
                b.ready.clear()
        if err is not None:
            raise GradientSyncError(f"GradientAllReduce: the gradient all-reduce failed: {err}") from err
        return self._account(t0)

    def _account(self, t0):
        dt = time.perf_counter() - t0
        self.stats["steps"] += 1
        self.stats["exposed_s"] += dt
        self.stats["bytes"] += self._step_bytes
        self.stats["last_bytes"] = self._step_bytes
        return dt

    def close(self):
        """Stop the communication thread and remove the embedding lookups' hooks; the
        gradient hooks then do nothing."""
        self._closed = True
        for b in self._buckets:
            b.ready.set()
            if b.table is not None:
                b.table.hook.remove()
        if self._thread is not None:
            self._work.put(None)
            self._thread.join(timeout=10)

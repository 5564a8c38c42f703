"""Gradient all-reduce with only the necessary bytes, overlapped with the backward where that helps.

::

    sync = pu.fleet.GradientAllReduce(model)     # on every rank, at the same point
    for batch in loader:
        loss = ...
        loss.backward()
        sync.wait(step=batch["step"])  # gradients are now averaged over the ranks
        opt.step(); opt.clear_grad()

What it does, compared with reducing one flat copy of every gradient after the backward:

* **Embedding tables by rows** (CPU jobs by default). A lookup table's gradient is zero
  outside the rows the step looked up. The rows each rank used are recorded by a forward
  pre-hook on the model's ``nn.Embedding`` layers (host-side ids, positional or ``x=``); the
  ranks exchange these row lists and all-reduce only their union -- the other rows are zero
  on every rank and stay zero, so the result is the dense all-reduce's. The recorded rows are
  a hint, not a promise: before sending its count each rank checks that its gradient has no
  nonzero row outside them (one read of the table), and sends -1 when it has -- the weight was
  also used elsewhere (a tied ``matmul`` output projection, ``F.embedding``) -- so that every
  rank reduces that table whole that step. A table whose weight is also a parameter of another
  layer (a tied output layer, as in PaddleNLP's masked-LM heads) is reduced whole from the
  start; so is a table when the union covers most of it. ``nn.Embedding(sparse=True)`` (a
  SelectedRows gradient) is refused at construction, or, in a list of parameters, at the
  first :meth:`~GradientAllReduce.wait`.
* **In place.** A gradient of at least ``bucket_mb`` is all-reduced in its own memory; only
  the small ones (biases, LayerNorm) are packed into buckets (one copy in, one out).
* **Overlap** (the default): a hook on every parameter marks its gradient complete; buckets
  follow the reverse registration order (the order the backward completes them) and are
  always reduced in that order on every rank. :meth:`GradientAllReduce.wait` marks parameters
  without a gradient this step as complete (reduced as zeros, so every rank issues the same
  collectives) and finishes the last buckets. A second gradient of a parameter before
  ``wait()`` (two backward passes: gradient accumulation) cannot be reduced right -- its bucket
  may be reduced already, or being reduced -- so it is a :class:`GradientSyncError` on every
  rank at that ``wait()``, whatever the timing: accumulate with ``overlap=False``.

  - **CPU jobs** (gloo): a communication thread on its own group reduces each bucket as soon
    as it is complete, while the backward goes on.
  - **GPU jobs** (NCCL): no thread. Each bucket's all-reduce is issued asynchronously by the
    backward hook that completes it -- on the training thread, in bucket order, so every rank
    issues the same NCCL operations in the same order from one thread (NCCL's rule; the
    sample exchange uses gloo and no NCCL at all) -- and ``wait()`` waits for them.

**Agreement.** At construction the ranks compare their layouts (parameter count, shapes,
dtypes, bucket plan, options) through the job's store, within ``timeout``: models that differ
are a :class:`GradientSyncError` on every rank, never a collective of mismatched sizes (which
aborts inside gloo); a process launched as one of several ranks that builds it before
``fleet.init`` is a :class:`GradientSyncError` too (it would see one rank). Each step's
reduction ends with a small trailer that every rank all-gathers: the step -- ``wait(step=)``,
the global step of the batch (``batch["step"]`` from a balanced loader), else the count of
reductions, which cannot tell a rank that skipped a batch -- and what went wrong on that rank in the pass (a second backward, a parameter
frozen or unfrozen since construction, a trainable parameter of the model that was not one of its
parameters at construction or changed shape, a sparse gradient, the rank leaving). Any of these on
any rank is the same named error on every rank at that ``wait()``: a rank that skipped a step,
or accumulated, never steps with gradients paired with another step's or another rank's
unreduced ones. A rank that leaves with a pass open (an exception between the backward and
``wait()``, or :meth:`~GradientAllReduce.close`) still issues that pass's collectives, with
its closing mark, so that the peers' ``wait()`` names it at once instead of waiting for
gloo's own timeout. One all-reduce per parameter at a time: a second one on the same
parameters raises until the first is closed.

A collective that fails because a peer has left the job (its process ended: each rank records
that in the job's store at exit) names it ("rank(s) [1] left the job"), and "rank 0 has left the
job" when the job's store, which rank 0's process serves, is gone with it.

Dygraph only; one :meth:`~GradientAllReduce.wait` per optimizer step. The set of trainable
parameters is fixed at construction and checked at every ``wait()`` by identity and shape (for
a model given as a layer, whose layers are walked: about 0.5 ms for BERT-base's 201 parameters):
after changing ``stop_gradient``, replacing or adding a layer (``model.head = nn.Linear(...)``,
``add_sublayer``), re-assigning a weight or resizing an embedding, ``close()`` the all-reduce
and build a new one. With gradient accumulation use ``overlap=False`` and call ``wait`` after
the last backward only.
"""
from __future__ import annotations

import json
import numbers
import queue
import threading
import time
import weakref
from typing import Dict, List, Optional

import numpy as np
import paddle

from .._runtime import paddle_compat as compat
from . import groups, workarounds
from .errors import GradientSyncError, StoreHostLeft
from .options import ALLREDUCE
from .options import resolve as resolve_options

__all__ = ["GradientAllReduce", "GradientSyncError"]

_OWNERS: Dict[int, "weakref.ref"] = {}  # id(parameter) -> the live all-reduce that reduces it
_CLOSE_JOIN_S = 5.0  # close() with a pass open waits this long for the peers' share of it, then leaves it to exit


_TRAILER_WORDS = 6  # step, closing, second gradient, frozen/unfrozen, sparse, new/resized parameter
_TEXT_WORDS = 16  # then the new or resized parameter, described in up to 128 bytes
_TRAILER = "the step trailer all-gather"
_NEW_PARAMETER = "is not one of the parameters it was built with (a layer replaced or added, a weight re-assigned, an embedding resized)"


def _words(text: str) -> np.ndarray:
    raw = text.encode("utf-8")[: 8 * _TEXT_WORDS]
    return np.frombuffer(raw.ljust(8 * _TEXT_WORDS, b"\0"), dtype=np.int64)


def _text(words) -> str:
    return np.ascontiguousarray(words, dtype=np.int64).tobytes().rstrip(b"\0").decode("utf-8", "replace")


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
    """The rows of one embedding table looked up through its layer since the last step. Only
    a hint: the reduction proves that the gradient has no other nonzero row (:func:`_only_rows`)."""

    def __init__(self, layer):
        self.rows = int(layer.weight.shape[0])
        self.ids: List[np.ndarray] = []
        try:
            self.hook = layer.register_forward_pre_hook(self._record, with_kwargs=True)
        except TypeError:  # Paddle 2.6: positional inputs only; a keyword call fails the proof instead
            self.hook = layer.register_forward_pre_hook(self._record)

    def _record(self, layer, args, kwargs=None):
        ids = args[0] if args else (kwargs or {}).get("x")
        if isinstance(ids, paddle.Tensor):
            self.ids.append(np.unique(ids.numpy()).astype(np.int64))

    def take(self):
        got, self.ids = self.ids, []
        return np.unique(np.concatenate(got)) if got else np.zeros(0, np.int64)


def _bits(g) -> Optional[np.ndarray]:
    """``g`` as a zero-copy ``[rows, words]`` array of unsigned integers (so -0.0 and NaN count
    as set: at worst one whole reduction more), or None where numpy cannot view it (a GPU
    tensor, bfloat16)."""
    a = compat.host_view(g)
    if a is None:
        return None
    flat = np.ascontiguousarray(a).reshape(a.shape[0], -1).view(np.uint8)
    unit = next(u for u in (8, 4, 2, 1) if flat.shape[1] % u == 0)
    return flat.view(f"u{unit}")


def _only_rows(g, ids) -> bool:
    """Whether every nonzero element of the table gradient ``g`` lies in the rows ``ids``
    (unique): then reducing those rows is exact. On CPU, set words are counted over the whole
    table and over those rows -- one vectorised read, about half the time of a per-row test
    (3 ms for 30522 x 384 fp32)."""
    ids = ids[(ids >= 0) & (ids < int(g.shape[0]))]
    words = _bits(g)
    if words is not None:
        return int(np.count_nonzero(words)) == int(np.count_nonzero(words[ids]))
    used = paddle.any(g != 0, axis=1).numpy()
    used[ids] = False
    return not used.any()


def _embedding_tables(model):
    """{id(weight): Embedding layer} for tables whose weight belongs to no other layer."""
    layers = model.sublayers(include_self=True)
    owners: Dict[int, int] = {}
    for layer in layers:
        for _, p in layer.named_parameters(include_sublayers=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {id(m.weight): m for m in layers if isinstance(m, paddle.nn.Embedding)
            and not m.weight.stop_gradient and owners.get(id(m.weight), 0) == 1}


def _trainable(model, is_layer):
    params = list(model.parameters() if is_layer else model)
    seen = {}
    for i, p in enumerate(params):
        if not isinstance(p, paddle.Tensor):
            raise TypeError(f"paddle_unpad.distributed.GradientAllReduce: model must be a paddle.nn.Layer or a list of parameters, item {i} is a {type(p).__name__}")
        if id(p) in seen:
            raise ValueError(f"paddle_unpad.distributed.GradientAllReduce: parameter {p.name!r} is listed twice (items {seen[id(p)]} and {i}); each would be reduced twice and the ranks' collectives would not match")
        seen[id(p)] = i
    params = [p for p in params if not p.stop_gradient]
    if not params:
        raise ValueError("paddle_unpad.distributed.GradientAllReduce: model has no trainable parameters")
    return params


def _refuse_sparse_tables(model):
    """A sparse embedding's gradient is a SelectedRows, which no collective here can take."""
    for name, layer in model.named_sublayers(include_self=True):
        if isinstance(layer, paddle.nn.Embedding) and compat.embedding_is_sparse(layer) \
                and not layer.weight.stop_gradient:
            raise ValueError(
                f"paddle_unpad.distributed.GradientAllReduce: model has a sparse embedding (layer {name or 'model'!r}, nn.Embedding(sparse=True), weight {layer.weight.name!r}); its gradient is a SelectedRows, which the all-reduce cannot reduce: build it with sparse=False (on CPU jobs the table is reduced by the rows the step used anyway)")


class GradientAllReduce:
    """Averages (or sums) the gradients of ``model``'s trainable parameters over the ranks.

    Args:
        model: a ``paddle.nn.Layer`` (its ``nn.Embedding`` tables can be reduced by rows), or
            a list of parameters (then every gradient is reduced whole; none listed twice).
        bucket_mb, average, row_sparse_embeddings, dense_fraction, overlap, timeout: rows of
            the options table (:data:`paddle_unpad.distributed.options.OPTIONS`, scope
            ``allreduce``); None takes the table's default. ``timeout``: seconds the ranks
            wait for each other's layouts at construction, and :meth:`wait` for the reduction
            on CPU jobs, before :class:`GradientSyncError` (a peer that died or stopped; the
            process should then end).
        group: the ranks to reduce over (default: all). The reduction runs on groups of its
            own over the same ranks, created here: construct on every rank of ``group``, in
            the same order relative to other groups.

    Raises at construction: ``ValueError`` for a trainable ``nn.Embedding(sparse=True)``, and on
    a rank that is not a member of ``group``; :class:`GradientSyncError` in a process launched
    as one of several ranks before the job is initialized (``fleet.init``), when the ranks'
    layouts differ, or when rank 0 has left the job (its store is gone). ``stats``:
    ``tables_unproven`` counts the by-rows reductions that went whole because a rank's table
    gradient had rows it had not looked up through the layer.
    """

    def __init__(self, model, bucket_mb: Optional[float] = None, average: Optional[bool] = None,
                 row_sparse_embeddings: Optional[bool] = None, dense_fraction: Optional[float] = None,
                 overlap: Optional[bool] = None, timeout: Optional[float] = None, group=None):
        given = dict(bucket_mb=bucket_mb, average=average, dense_fraction=dense_fraction, timeout=timeout)
        o = resolve_options({k: v for k, v in given.items() if v is not None} | dict(
            row_sparse_embeddings=row_sparse_embeddings, overlap=overlap), "distributed.GradientAllReduce",
            scope=ALLREDUCE)
        is_layer = isinstance(model, paddle.nn.Layer)
        params = _trainable(model, is_layer)
        if is_layer:
            _refuse_sparse_tables(model)
        rank, world = groups.checked_job("distributed.GradientAllReduce", GradientSyncError)
        self.gpu = groups.job_uses_gpu()
        self.overlap = True if o["overlap"] is None else o["overlap"]
        by_rows = (not self.gpu) if o["row_sparse_embeddings"] is None else o["row_sparse_embeddings"]
        self.average, self.dense_fraction, self.timeout = o["average"], float(o["dense_fraction"]), float(o["timeout"])
        self.options = o
        ranks = list(group.ranks) if group is not None else list(range(world))
        if world > 1:  # before any rank waits: a rank outside the group would wait for ranks that never come
            groups.check_member(ranks, "distributed.GradientAllReduce", "the all-reduce (group=)", rank)
        self.world = len(ranks) if world > 1 else 1
        self._ranks = ranks
        limit = float(o["bucket_mb"]) * (1 << 20)
        tables = _embedding_tables(model) if (is_layer and by_rows and self.world > 1) else {}
        self._buckets = self._plan_buckets(params, tables, limit)
        self._params = params
        self._index = {id(p): i for i, p in enumerate(params)}
        self._known = list(model.parameters() if is_layer else model)  # frozen ones too: checked at wait()
        # the model, to see at wait() a parameter that is not one of these (a layer replaced or
        # added, a weight re-assigned) or that changed shape: ids stay unique while _known holds them
        self._model = model if is_layer else None
        self._shapes = {id(p): list(p.shape) for p in self._known}
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._claim(params)
        self._lock = threading.Lock()
        self._fired = set()
        self._step_open = False
        self._sealed = threading.Event()  # wait() or close() has ended the pass: no hook of it comes later
        self._closing = False
        self._again = self._sparse = -1  # this pass: a parameter's second hook; a SelectedRows gradient
        self._changed = 0  # this pass: +-(index in _known + 1) of a parameter unfrozen / frozen since
        self._replaced = (0, "")  # this pass: (1 new / 2 resized trainable parameter, its description)
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._timed_out: Optional[str] = None
        self._closed = False
        self._step_bytes = 0
        self._passes = 0
        self._next_bucket, self._tasks, self._pass_step = 0, [], None
        self.stats = {"steps": 0, "exposed_s": 0.0, "bytes": 0, "last_bytes": 0, "buckets": len(self._buckets),
                      "dense_bytes": sum(b.nbytes for b in self._buckets),
                      "tables_by_rows": sum(b.table is not None for b in self._buckets), "tables_unproven": 0}
        self._work: "queue.Queue" = queue.Queue()
        self._thread = self._group = self._control = None
        if self.world == 1:
            return
        try:
            self._agree_layout(ranks)
            self._group = groups.new_group("gradient all-reduce", groups.DEVICE, ranks)
            # the step header and the rows of by-rows tables are host values: on a gloo group
            # (NCCL jobs: one of its own, used by the training thread only)
            self._control = self._group if self._group.backend == "gloo" else groups.new_group(
                "gradient all-reduce control", groups.HOST, ranks)
        except BaseException as e:
            self._release()
            self._release_groups()
            if isinstance(e, StoreHostLeft):
                raise GradientSyncError(f"paddle_unpad.distributed.GradientAllReduce: {groups.reason(e)} (this is rank {rank})") from e
            raise
        groups.use_for_exit_order(self._control)
        if self.overlap:
            for p in params:
                compat.register_grad_ready_hook(p, self._hook_for(id(p)))
        if not self.gpu:  # the thread does the work, so that wait() can give up after `timeout`
            self._thread = threading.Thread(target=self._serve, name="paddle_unpad-grad-allreduce", daemon=True)
            workarounds.register_thread(self._thread, self._stop_thread)
            self._thread.start()

    @staticmethod
    def _plan_buckets(params, tables, limit):
        buckets, small, small_bytes = [], [], 0
        for p in reversed(params):  # the order the backward completes them
            size = _nbytes(p)
            if id(p) in tables and size >= limit:
                buckets.append(_Bucket([p], _Table(tables[id(p)])))
            elif size >= limit:
                buckets.append(_Bucket([p]))
            else:
                small.append(p)
                small_bytes += size
                if small_bytes >= limit:
                    buckets.append(_Bucket(small))
                    small, small_bytes = [], 0
        if small:
            buckets.append(_Bucket(small))
        return buckets

    # ------------------------------------------------------------------ one all-reduce per parameter

    def _claim(self, params):
        for p in params:
            ref = _OWNERS.get(id(p))
            other = ref() if ref is not None else None
            if other is not None and other is not self and not other._closed:
                raise GradientSyncError(
                    f"paddle_unpad.distributed.GradientAllReduce: parameter {p.name!r} is already reduced by a live GradientAllReduce ({other!r}); close() that one first (two would reduce every gradient twice, and their hooks and threads would interleave)")
        me = weakref.ref(self)
        for p in params:
            _OWNERS[id(p)] = me

    def _release(self):
        for p in self._params:
            ref = _OWNERS.get(id(p))
            if ref is not None and ref() is self:
                del _OWNERS[id(p)]

    def __repr__(self):
        return (f"GradientAllReduce({len(self._params)} parameters, {len(self._buckets)} buckets, overlap={self.overlap}{', closed' if self._closed else ''})")

    # ------------------------------------------------------------------ agreement

    def _layout(self):
        return {"ranks": self.world, "options": {k: v for k, v in self.options.items() if k != "timeout"},
                "parameters": [[list(p.shape), str(p.dtype).replace("paddle.", "")] for p in self._params],
                "buckets": [[len(b.params), b.nbytes, b.table is not None] for b in self._buckets]}

    def _agree_layout(self, ranks):
        mine = self._layout()
        values, missing = groups.agree("gradient-all-reduce", json.dumps(mine, sort_keys=True), self.timeout, ranks)
        me = ranks.index(groups.job()[0])
        if missing:
            raise GradientSyncError(
                f"paddle_unpad.distributed.GradientAllReduce: rank(s) {[ranks[i] for i in missing]} did not build their GradientAllReduce within {max(self.timeout, groups.AGREE_MIN_S):g} s (this is rank {ranks[me]}): build it at the same point on every rank")
        if values is not None:
            got = [json.loads(v) for v in values]
            raise GradientSyncError(f"paddle_unpad.distributed.GradientAllReduce: the ranks' models or options differ -- {_first_difference(got, ranks)}; every rank must reduce the same parameters with the same options (this is rank {ranks[me]})")

    # ------------------------------------------------------------------ readiness (overlap)

    def _hook_for(self, key):
        def hook():
            if not self._closed:
                self._mark_ready(key, from_hook=True)

        return hook

    def _mark_ready(self, key, from_hook=False):
        with self._lock:
            if self._timed_out is not None:
                return
            if key in self._fired:
                # a second backward before wait() (gradient accumulation): the bucket may already
                # be reduced, or be in a collective while this gradient is added to it -- the
                # trailer makes it an error on every rank, whichever came first
                if from_hook and self._again < 0:
                    self._again = self._index[key]
                return
            if not self._step_open:  # the step's first complete gradient opens its pass
                self._step_open = True
                self._step_bytes = 0
                self._done.clear()
                self._sealed.clear()
                self._pass_step = self._passes  # until wait(step=) names the batch's step
                if not self.gpu:
                    self._work.put(True)
            self._fired.add(key)
            b = self._bucket_of[key]
            b.pending -= 1
            if b.pending == 0:
                b.ready.set()
        if self.gpu:
            self._issue_ready()

    def _seal(self, closing=False, step=None):
        """End the open pass: parameters without a gradient are marked complete (reduced as
        zeros). ``closing``: this rank leaves; it still issues the pass's collectives, so that
        the peers' ones return, and its trailer tells them the step was not reduced."""
        if closing:
            if not self._step_open:
                return
            self._closing = True
        for p in self._params:  # without overlap: all of them; with it: those without a gradient
            self._mark_ready(id(p))
        if step is not None:  # the pass is open now; its trailer is read after _sealed
            self._pass_step = step
        self._sealed.set()

    def _check_trainable(self):
        """Note (for the trailer) a parameter frozen or unfrozen since construction, and a trainable
        parameter of the model that was not one of its parameters then (a layer replaced or added,
        a weight re-assigned, a resized embedding) or that changed shape: by identity and shape."""
        for i, p in enumerate(self._known):
            reduced = id(p) in self._index
            if reduced and p.stop_gradient:
                self._changed = -(i + 1)
                return
            if not reduced and not p.stop_gradient and p.grad is not None:
                self._changed = i + 1
                return
        if self._model is None:
            return
        for name, p in self._model.named_parameters():
            if p.stop_gradient:
                continue
            then = self._shapes.get(id(p))
            if then is None:
                self._replaced = (1, f"{name!r} ({p.name}, shape {list(p.shape)})")
                return
            if then != list(p.shape):
                self._replaced = (2, f"{name!r} ({p.name}: shape {then} then, {list(p.shape)} now)")
                return

    # ------------------------------------------------------------------ CPU jobs: the communication thread

    def _serve(self):
        while True:
            if self._work.get() is None:
                break
            try:
                self._reduce_all()
                self._sealed.wait()  # wait() has set the pass's step by then
                self._check_trailer(self._pass_step)
            except BaseException as e:  # noqa: BLE001 -- raised in the training thread by wait()
                self._error = e
            finally:
                self._done.set()
        if self._closed:
            self._release_groups()

    def _stop_thread(self):
        """At interpreter exit: a pass left open (an exception between backward() and wait())
        is finished with the closing mark, so the peers' wait() names this rank at once."""
        self._seal(closing=True)
        self._work.put(None)

    def _reduce_all(self):
        for b in self._buckets:  # the same order on every rank
            b.ready.wait()
            if b.table is not None:
                self._step_bytes += self._reduce_rows(b)
            else:
                task, finish = self._start_dense(b)
                task.wait()
                finish()

    def _check_trailer(self, step):
        """All-gather every rank's step and report on its pass (the trailer of a pass); raise on
        every rank alike when any rank's is not right."""
        mine = np.zeros(_TRAILER_WORDS + _TEXT_WORDS, np.int64)
        mine[:_TRAILER_WORDS] = [step, self._closing, self._again + 1, self._changed, self._sparse + 1,
                                 self._replaced[0]]
        mine[_TRAILER_WORDS:] = _words(self._replaced[1])
        try:
            rows = groups.all_gather_array(self._control, mine)
        except Exception as e:  # noqa: BLE001
            raise self._failed(_TRAILER, e) from e
        problem = self._problem(rows)
        if problem is not None:
            raise GradientSyncError(f"paddle_unpad.distributed.GradientAllReduce: {problem} (this is rank {groups.job()[0]})")

    def _failed(self, what, exc) -> GradientSyncError:
        """The error of a collective of a pass that failed: the peers that left the job named (rank 0
        when the job's store is gone with it), else the backend's own words."""
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        left = groups.who_left(self._ranks)
        if left:
            return GradientSyncError(f"paddle_unpad.distributed.GradientAllReduce: {left}, so {what} of step {self._pass_step} failed and its gradients are not reduced (this is rank {groups.job()[0]}; {type(exc).__name__}: {first})")
        if what == _TRAILER:
            return GradientSyncError(f"paddle_unpad.distributed.GradientAllReduce: {what} failed -- a peer died or stopped ({type(exc).__name__}: {first})")
        return GradientSyncError(f"paddle_unpad.distributed.GradientAllReduce: {what} failed: {exc}")

    def _name(self, params, index):
        return repr(params[index].name) if 0 <= index < len(params) else f"#{index}"

    def _problem(self, rows) -> Optional[str]:
        """The first thing wrong with the pass, in words, from every rank's trailer (None: nothing)."""
        ranks = self._ranks
        closing = [ranks[i] for i, r in enumerate(rows) if r[1]]
        if closing:
            return (f"rank(s) {closing} closed the all-reduce with the reduction of step {int(rows[0][0])} open (an exception or exit between backward() and wait(), or close() before wait()); this step's gradients are not reduced on any rank")
        if np.any(rows[:, 0] != rows[0, 0]):
            steps = ", ".join(f"rank {ranks[i]} step {int(r[0])}" for i, r in enumerate(rows))
            return f"the ranks are reducing the gradients of different steps ({steps}): a rank skipped a step's backward or wait(), or ran an extra one; every rank must reduce every step"
        return self._flagged(rows)

    def _flagged(self, rows) -> Optional[str]:
        """What a rank flagged in its trailer: a sparse gradient, a second backward, a change of
        the trainable set (the parameter named from this rank's own list)."""
        ranks = self._ranks
        for i, r in enumerate(rows):
            if r[4]:
                return (f"parameter {self._name(self._params, int(r[4]) - 1)} has a sparse (SelectedRows) gradient on rank {ranks[i]} (nn.Embedding(sparse=True)); the all-reduce reduces dense gradients only: build the embedding with sparse=False")
        for i, r in enumerate(rows):
            if r[2]:
                return (f"parameter {self._name(self._params, int(r[2]) - 1)} got a second gradient before wait() on rank {ranks[i]} (two backward passes in one step): gradient accumulation needs GradientAllReduce(overlap=False), with wait() after the last backward only -- with overlap a bucket is reduced as soon as the first backward completes it")
        for i, r in enumerate(rows):
            if r[5]:
                what = _text(r[_TRAILER_WORDS:])
                how = _NEW_PARAMETER if r[5] == 1 else "changed shape since it was built"
                return (f"a trainable parameter of the model on rank {ranks[i]}, {what}, {how}: its gradient would not be reduced like the others (the all-reduce keeps the parameters it saw at construction); after changing the model's layers, close() the all-reduce and build a new GradientAllReduce on every rank")
        for i, r in enumerate(rows):
            if r[3]:
                k = abs(int(r[3])) - 1
                now = "trainable now (stop_gradient=False)" if r[3] > 0 else "frozen now (stop_gradient=True)"
                was = "frozen" if r[3] > 0 else "trainable"
                return (f"parameter {self._name(self._known, k)} is {now} on rank {ranks[i]} but was {was} when this GradientAllReduce was built, so its gradient would not be averaged like the others: after changing stop_gradient, close() the all-reduce and build a new GradientAllReduce")
        return None

    # ------------------------------------------------------------------ the reduction of a bucket

    def _grad(self, p):
        g = p.grad
        if g is None:  # no gradient on this rank this step: it takes part with zeros
            if p.stop_gradient:  # frozen since construction: left alone, named by the trailer
                return paddle.zeros(p.shape, dtype=p.dtype)
            compat.set_grad(p, paddle.zeros(p.shape, dtype=p.dtype))
            return p.grad.detach()  # shares the gradient's memory
        if g.is_selected_rows():  # zeros instead, so that the ranks' collectives still match
            if self._sparse < 0:
                self._sparse = self._index[id(p)]
            return paddle.zeros(p.shape, dtype=p.dtype)
        return g.detach()

    def _start_dense(self, b):
        """Issue the all-reduce of a dense bucket: ``(task, finish)``; ``finish()`` after the task
        scales and (packed buckets) copies the sums back into the gradients."""
        grads = [self._grad(p) for p in b.params]
        flat = grads[0] if len(grads) == 1 else paddle.concat([g.reshape([-1]) for g in grads])
        task = groups.all_reduce(self._group, flat, sync_op=not self.gpu)

        def finish():
            if self.average:
                flat.scale_(1.0 / self.world)
            if len(grads) > 1:
                for g, part in zip(grads, paddle.split(flat, [int(np.prod(g.shape)) for g in grads])):
                    g.set_value(part.reshape(g.shape))
            self._step_bytes += b.nbytes

        return task, finish

    def _reduce_rows(self, b):
        """A by-rows table: the union of the rows the ranks looked up (host values, on the control
        group), then its rows all-reduced in place -- or the whole table when the union is large,
        or when a rank's gradient has a nonzero row it did not look up through the layer (the
        weight used elsewhere: a tied matmul, ``F.embedding``). Each rank proves its own rows;
        the count it sends is -1 when it cannot, so every rank takes the same branch."""
        g = self._grad(b.params[0])
        mine = b.table.take()
        count = len(mine) if _only_rows(g, mine) else -1
        counts = [int(c) for c in groups.all_gather_array(self._control, np.array([count], np.int64)).reshape(-1)]
        width = max(counts)
        union = None
        if min(counts) < 0:
            self.stats["tables_unproven"] += 1
        elif width == 0:  # gloo's all_gather of nothing dies of SIGFPE
            union = mine
        elif width <= self.dense_fraction * b.table.rows:
            padded = np.zeros(width, dtype=np.int64)  # equal shapes: what gloo's all_gather needs
            padded[: len(mine)] = mine
            gathered = groups.all_gather_array(self._control, padded)
            union = np.unique(np.concatenate([row[:c] for row, c in zip(gathered, counts)]))
        sent = 8 * self.world * (1 + (width if union is not None else 0))  # the counts, the ids if sent
        if union is None or len(union) > self.dense_fraction * b.table.rows:
            groups.all_reduce(self._group, g).wait()
            if self.average:
                g.scale_(1.0 / self.world)
            return sent + b.nbytes
        if len(union) == 0:  # no rank looked anything up: the gradient is zero everywhere
            return sent
        index = paddle.to_tensor(union, place=g.place)
        rows = paddle.gather(g, index)
        groups.all_reduce(self._group, rows).wait()
        if self.average:
            rows.scale_(1.0 / self.world)
        paddle.scatter_(g, index, rows, overwrite=True)
        return sent + _nbytes(rows)

    # ------------------------------------------------------------------ GPU jobs: issued on the training thread

    def _issue_ready(self):
        """Issue, in bucket order, every bucket that is complete and not issued yet."""
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].ready.is_set():
            b = self._buckets[self._next_bucket]
            self._next_bucket += 1
            if b.table is not None:
                self._step_bytes += self._reduce_rows(b)
            else:
                self._tasks.append(self._start_dense(b))

    # ------------------------------------------------------------------ the training thread

    def wait(self, step: Optional[int] = None):
        """Finish this step's all-reduce: call after the backward, before the optimizer step.
        ``step``: the global step of the batch (``batch["step"]`` from a balanced loader),
        compared across the ranks so that a rank that skipped a batch is an error on every rank;
        without it the ranks compare how many reductions they ran. Returns the seconds spent
        here (the communication the step waits for)."""
        t0 = time.perf_counter()
        if step is not None:
            if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
                raise TypeError(f"paddle_unpad.distributed.GradientAllReduce.wait: step must be a non-negative int (the batch's global step, batch['step']), got {step!r}")
            step = int(step)
        if self._closed:  # one process too: the same program fails the same way on more ranks
            raise GradientSyncError(f"paddle_unpad.distributed.GradientAllReduce: wait() after close() ({self!r})")
        if self._timed_out is not None:
            raise GradientSyncError(f"paddle_unpad.distributed.GradientAllReduce: an earlier wait() failed ({self._timed_out}); its gradients were never reduced: close() this all-reduce")
        if self.world == 1:
            return 0.0
        self._check_trainable()
        self._seal(step=step)
        if not self.gpu and not self._done.wait(self.timeout):
            # The thread keeps this complete pass: with every peer alive it finishes it (the ranks
            # issue the same collectives and none waits for gloo's own timeout at exit); with a
            # stopped peer it leaves when gloo gives up. No later pass starts.
            self._timed_out = f"it did not finish within {self.timeout:g} s"
            raise GradientSyncError(
                f"paddle_unpad.distributed.GradientAllReduce: the gradient all-reduce did not finish within {self.timeout:g} s (a rank died or stopped, or the ranks ran different backward passes)")
        try:
            if self.gpu:
                self._finish_on_gpu()
            err, self._error = self._error, None
            if isinstance(err, GradientSyncError):
                raise err
            if err is not None:
                raise self._failed("the gradient all-reduce", err) from err
        finally:
            self._end_pass()
        return self._account(t0)

    def _finish_on_gpu(self):
        tasks, self._tasks = self._tasks, []
        for task, finish in tasks:
            task.wait()  # NCCL: the compute stream waits for the communication stream
            finish()
        self._check_trailer(self._pass_step)

    def _end_pass(self):
        with self._lock:
            self._fired.clear()
            self._step_open = False
            self._again = self._sparse = -1
            self._changed = 0
            self._replaced = (0, "")
            self._next_bucket, self._tasks = 0, []
            for b in self._buckets:
                b.pending = len(b.params)
                b.ready.clear()
        self._passes += 1

    def _account(self, t0):
        dt = time.perf_counter() - t0
        self.stats["steps"] += 1
        self.stats["exposed_s"] += dt
        self.stats["bytes"] += self._step_bytes
        self.stats["last_bytes"] = self._step_bytes
        return dt

    def close(self):
        """End this all-reduce: a pass left open (a backward without its wait()) is finished with
        a mark that makes the peers' wait() fail, naming this rank; the communication thread
        stops, the embedding lookups' hooks are removed, the gradient hooks then do nothing, and
        the groups are released. Idempotent. Another GradientAllReduce may then take the model."""
        if self._closed:
            return
        self._closed = True
        self._release()
        for b in self._buckets:
            if b.table is not None:
                b.table.hook.remove()
        if self.gpu and self.world > 1:
            self._close_on_gpu()
        if self._thread is None:
            self._release_groups()
            return
        self._seal(closing=True)
        self._work.put(None)
        self._thread.join(timeout=_CLOSE_JOIN_S)  # one still inside a collective is joined at exit
        if not self._thread.is_alive():
            workarounds.unregister_thread(self._thread)
            self._release_groups()  # else the thread does, on its way out

    def _close_on_gpu(self):
        if not self._step_open:
            return
        try:
            self._seal(closing=True)
            self._finish_on_gpu()
        except GradientSyncError:  # this rank's own closing mark: the peers report it
            pass
        finally:
            self._end_pass()

    def _release_groups(self):
        groups.release(self._group)
        groups.release(self._control)


def _first_difference(layouts, ranks) -> str:
    """The first way the ranks' layouts differ, in words."""
    ref = layouts[0]
    for i, lay in enumerate(layouts[1:], 1):
        if lay is None:
            continue
        a, b = ranks[0], ranks[i]
        if len(lay["parameters"]) != len(ref["parameters"]):
            return (f"rank {a} has {len(ref['parameters'])} trainable parameters, rank {b} {len(lay['parameters'])}")
        for k, (p, q) in enumerate(zip(ref["parameters"], lay["parameters"])):
            if p != q:
                return f"parameter {k} is {p[1]} {p[0]} on rank {a} but {q[1]} {q[0]} on rank {b}"
        for key in sorted(set(ref["options"]) | set(lay["options"])):
            if ref["options"].get(key) != lay["options"].get(key):
                return f"option {key} is {ref['options'].get(key)!r} on rank {a} but {lay['options'].get(key)!r} on rank {b}"
        if lay != ref:
            return f"the bucket plans differ between rank {a} and rank {b}"
    return "the layouts differ"

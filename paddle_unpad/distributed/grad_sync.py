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

**Agreement.** At construction the ranks compare their layouts (parameter count, shapes, dtypes,
bucket plan, options) through the job's store, within ``timeout``: models that differ are a
:class:`GradientSyncError` on every rank, never a collective of mismatched sizes (which aborts
inside gloo); a process launched as one of several ranks that builds it before ``fleet.init`` is
a :class:`GradientSyncError` too (it would see one rank). Each step's reduction ends with a
small trailer that every rank all-gathers: the step -- ``wait(step=)``, the global step of the
batch (``batch["step"]`` from a balanced loader), else the count of reductions, which cannot
tell a rank that skipped a batch -- and what went wrong on that rank in the pass (a second
backward, a parameter frozen or unfrozen since construction, a trainable parameter of the model
that was not one of its parameters at construction or changed shape, a sparse gradient, the rank
leaving). Any of these on any rank is the same named error on every rank at that ``wait()``: a
rank that skipped a step, or accumulated, never steps with gradients paired with another step's
or another rank's unreduced ones. A rank that leaves with a pass open (an exception between the
backward and ``wait()``, or :meth:`~GradientAllReduce.close`) still issues that pass's
collectives, with its closing mark, so that the peers' ``wait()`` names it at once instead of
waiting for gloo's own timeout. One all-reduce per parameter at a time: a second one on the same
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

import threading
import time
from typing import Optional

import paddle

from .._runtime import paddle_compat as compat
from . import grad_buckets, grad_layout, grad_params, grad_reduction, grad_rows, groups, step_trailer
from .errors import GradientSyncError, StoreHostLeft
from .options import ALLREDUCE
from .options import resolve as resolve_options

__all__ = ["GradientAllReduce", "GradientSyncError"]

_CLOSE_JOIN_S = 5.0  # close() with a pass open waits this long for the peers' share of it, then leaves it to exit


def _options(bucket_mb, average, row_sparse_embeddings, dense_fraction, overlap, timeout):
    """The all-reduce's options, checked (None: the default, or for two of them: decided later)."""
    given = dict(bucket_mb=bucket_mb, average=average, dense_fraction=dense_fraction, timeout=timeout)
    return resolve_options(
        {k: v for k, v in given.items() if v is not None}
        | dict(row_sparse_embeddings=row_sparse_embeddings, overlap=overlap),
        "distributed.GradientAllReduce",
        scope=ALLREDUCE,
    )


def _start_reduction(sync, o, ranks, rank):
    """The ranks agree on the layout, then the reduction's groups (and thread) are made."""
    try:
        grad_layout.agree(grad_layout.layout(sync.world, o, sync._params, sync._buckets), ranks, sync.timeout)
        return grad_reduction.Reduction(
            ranks,
            sync._buckets,
            sync.gpu,
            1.0 / sync.world if sync.average else None,
            sync.dense_fraction,
            sync._grad,
            sync._check_trailer,
            sync.stats,
        )
    except StoreHostLeft as e:
        raise GradientSyncError(
            f"paddle_unpad.distributed.GradientAllReduce: {groups.reason(e)} (this is rank {rank})"
        ) from e


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

    def __init__(
        self,
        model,
        bucket_mb: Optional[float] = None,
        average: Optional[bool] = None,
        row_sparse_embeddings: Optional[bool] = None,
        dense_fraction: Optional[float] = None,
        overlap: Optional[bool] = None,
        timeout: Optional[float] = None,
        group=None,
    ):
        o = _options(bucket_mb, average, row_sparse_embeddings, dense_fraction, overlap, timeout)
        is_layer = isinstance(model, paddle.nn.Layer)
        params = grad_params.trainable(model, is_layer)
        if is_layer:
            grad_params.refuse_sparse_tables(model)
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
        tables = grad_rows.embedding_tables(model) if (is_layer and by_rows and self.world > 1) else {}
        self._buckets = grad_buckets.plan(
            params,
            float(o["bucket_mb"]) * (1 << 20),
            lambda p: grad_rows.Table(tables[id(p)]) if id(p) in tables else None,
        )
        self._params = params
        self._index = {id(p): i for i, p in enumerate(params)}
        self._trainable = grad_params.TrainableSet(model, is_layer, self._index)
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._closed = False
        grad_params.claim(params, self)
        self._lock = threading.Lock()
        self._closing = False
        self._timed_out: Optional[str] = None
        self._passes, self._pass_step = 0, None
        self._reset_flags()
        self.stats = grad_buckets.initial_stats(self._buckets)
        self._reduction = self._group = None
        if self.world == 1:
            return
        try:
            self._reduction = _start_reduction(self, o, ranks, rank)
        except BaseException:
            grad_params.release(params, self)
            raise
        self._group = self._reduction.group
        groups.use_for_exit_order(self._reduction.control)
        if self.overlap:
            for p in params:
                compat.register_grad_ready_hook(p, self._hook_for(id(p)))
        if not self.gpu:  # the thread does the work, so that wait() can give up after `timeout`
            self._reduction.start_thread(self._stop_thread)

    def _reset_flags(self):
        """No gradient of the next pass complete yet, nothing of it flagged for the trailer."""
        self._fired, self._step_open = set(), False
        self._again = self._sparse = -1  # this pass: a parameter's second hook; a SelectedRows gradient
        self._changed = 0  # this pass: +-(index in the trainable set + 1) of one unfrozen / frozen since
        self._replaced = (0, "")  # this pass: (1 new / 2 resized trainable parameter, its description)

    def __repr__(self):
        return f"GradientAllReduce({len(self._params)} parameters, {len(self._buckets)} buckets, overlap={self.overlap}{', closed' if self._closed else ''})"

    # ------------------------------------------------------------------ the pass: hooks, seal, trailer

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
                self._pass_step = self._passes  # until wait(step=) names the batch's step
                self._reduction.open()
            self._fired.add(key)
            b = self._bucket_of[key]
            b.pending -= 1
            if b.pending == 0:
                b.ready.set()
        if self.gpu:
            self._reduction.issue_ready()

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
        if step is not None:  # the pass is open now; its trailer is read after sealed
            self._pass_step = step
        self._reduction.sealed.set()

    def _grad(self, p):
        g, sparse = grad_buckets.gradient_of(p)
        if sparse and self._sparse < 0:  # for the trailer
            self._sparse = self._index[id(p)]
        return g

    def _check_trainable(self):
        """Note (for the trailer) a change of the trainable set since construction."""
        self._changed, self._replaced = self._trainable.change()

    def _check_trailer(self):
        mine = step_trailer.pack(
            self._pass_step, self._closing, self._again, self._changed, self._sparse, self._replaced
        )
        step_trailer.check(
            self._reduction.control, mine, self._ranks, self._params, self._trainable.known, self._pass_step
        )

    # ------------------------------------------------------------------ the training thread

    def wait(self, step: Optional[int] = None):
        """Finish this step's all-reduce: call after the backward, before the optimizer step.
        ``step``: the global step of the batch (``batch["step"]`` from a balanced loader),
        compared across the ranks so that a rank that skipped a batch is an error on every rank;
        without it the ranks compare how many reductions they ran. Returns the seconds spent
        here (the communication the step waits for)."""
        t0 = time.perf_counter()
        step = step_trailer.checked_step(step)
        if self._closed:  # one process too: the same program fails the same way on more ranks
            raise GradientSyncError(f"paddle_unpad.distributed.GradientAllReduce: wait() after close() ({self!r})")
        if self._timed_out is not None:
            raise GradientSyncError(
                f"paddle_unpad.distributed.GradientAllReduce: an earlier wait() failed ({self._timed_out}); its gradients were never reduced: close() this all-reduce"
            )
        if self.world == 1:
            return 0.0
        self._check_trainable()
        self._seal(step=step)
        r = self._reduction
        if not self.gpu and not r.done.wait(self.timeout):
            # The thread keeps this complete pass: with every peer alive it finishes it (the ranks
            # issue the same collectives and none waits for gloo's own timeout at exit); with a
            # stopped peer it leaves when gloo gives up. No later pass starts.
            self._timed_out = f"it did not finish within {self.timeout:g} s"
            raise GradientSyncError(
                f"paddle_unpad.distributed.GradientAllReduce: the gradient all-reduce did not finish within {self.timeout:g} s (a rank died or stopped, or the ranks ran different backward passes)"
            )
        try:
            if self.gpu:
                r.finish_issued()
            err, r.error = r.error, None
            if isinstance(err, GradientSyncError):
                raise err
            if err is not None:
                raise step_trailer.failed("the gradient all-reduce", err, self._ranks, self._pass_step) from err
        finally:
            self._end_pass()
        return grad_buckets.count_step(self.stats, time.perf_counter() - t0, r.bytes)

    def _end_pass(self):
        with self._lock:
            self._reset_flags()
            self._reduction.end()
        self._passes += 1

    def close(self):
        """End this all-reduce: a pass left open (a backward without its wait()) is finished with
        a mark that makes the peers' wait() fail, naming this rank; the communication thread
        stops, the embedding lookups' hooks are removed, the gradient hooks then do nothing, and
        the groups are released. Idempotent. Another GradientAllReduce may then take the model."""
        if self._closed:
            return
        self._closed = True
        grad_params.release(self._params, self)
        for b in self._buckets:
            if b.table is not None:
                b.table.hook.remove()
        r = self._reduction
        if r is None:
            return
        if self.gpu:
            self._close_on_gpu()
        if r.thread is None:
            r.release_groups()
            return
        self._seal(closing=True)
        r.close_thread(_CLOSE_JOIN_S)

    def _close_on_gpu(self):
        if not self._step_open:
            return
        try:
            self._seal(closing=True)
            self._reduction.finish_issued()
        except GradientSyncError:  # this rank's own closing mark: the peers report it
            pass
        finally:
            self._end_pass()

    def _stop_thread(self):
        """At interpreter exit: a pass left open (an exception between backward() and wait())
        is finished with the closing mark, so the peers' wait() names this rank at once."""
        self._seal(closing=True)
        self._reduction.leave()

"""Process groups, agreement and every collective of the plugin: the one place that talks
between ranks.

**Two kinds of group.**

* A **host group** is gloo in every job (``paddle.distributed.new_group(ranks,
  backend="gloo")``: Paddle 2.6 and 3.x create a ``ProcessGroupGloo`` for it whatever the
  job's default backend) and carries CPU tensors only. The sample exchange runs on one, in
  its background thread, as Baidu's MLPerf BERT ran its exchange among CPU processes: token
  buffers never go through GPU memory, and nothing of it touches NCCL.
* A **device group** carries the gradient all-reduce: NCCL in GPU jobs, gloo in CPU jobs. In
  a GPU job its collectives are issued only by the thread that created it (the training
  thread), in the same order on every rank -- NCCL's rule ("Using multiple NCCL communicators
  concurrently": operations from several threads on one device are not safe, and their order
  must be the same on every rank); :func:`issue` refuses any other thread.

Groups per rank do not depend on the number of ranks: one host group per balanced loader, one
device group (plus, in GPU jobs, one small host group for its control messages) per gradient
all-reduce. No pair groups, no per-pair stores.

**Lifetime.** A group is made by its members only (:func:`new_group`; they agree on its id
through the job's store, so groups over some ranks never shift the ids of later groups) and
released by its owner's ``close()`` (:func:`release`). Paddle cannot free a process group, so
a released group of the plugin is handed out again to the next owner over the same ranks,
when every member offers it in the same state: open files and threads stay flat however many
loaders and all-reduces a job makes and closes one after the other.

**Workarounds of Paddle** (per-group rendezvous stores, TCP_NODELAY on store connections,
threads and the exit handler) live in :mod:`paddle_unpad.distributed.workarounds`; they are
applied when the first group of the plugin is made (or :func:`paddle_unpad.fleet.DistributedStrategy`
is built, so that ``fleet.init``'s own groups get the first one too). The exit handler calls
back here for what talks to the other ranks: :func:`mark_left`, then :func:`leave_in_order`
(rank 0 leaves last, waiting on the group of :func:`use_for_exit_order`).

**Agreement.** :func:`agree` compares a value across ranks through the job's TCP store with
a bounded wait, before any group or collective that the value decides on: settings that
differ, or a rank that never arrives, are a named error on every rank, never a hang. The store
is served by rank 0's process: a request that fails says that rank 0 has left the job
(:class:`~paddle_unpad.distributed.errors.StoreHostLeft`). At exit each rank records there that
it has left (:func:`mark_left`), so that a peer whose collective then fails names it
(:func:`who_left`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import threading
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import paddle
import paddle.distributed as dist

from .._runtime import paddle_compat as _compat
from .. import config
from . import workarounds
from .errors import StoreHostLeft
from .workarounds import GLOO_OWN_TIMEOUT_S  # noqa: F401 - the fault tests' bound

log = logging.getLogger("paddle_unpad.distributed")

HOST, DEVICE = "host", "device"


# ----------------------------------------------------------------------------- the job


def job_uses_gpu() -> bool:
    """Whether this process trains on a GPU (an NCCL job): Paddle built with CUDA, its device a GPU."""
    return paddle.is_compiled_with_cuda() and paddle.device.get_device().startswith("gpu")


def device_backend() -> str:
    """The backend of device groups: NCCL in GPU jobs, gloo in CPU jobs."""
    return "nccl" if job_uses_gpu() else "gloo"


def job() -> tuple:
    """``(rank, world size)``; ``(0, 1)`` outside an initialized multi-process job."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def launched_world() -> int:
    """The number of ranks the launcher started this process among (1 when not launched)."""
    for name in ("PADDLE_TRAINERS_NUM", "PADDLE_GLOBAL_SIZE"):
        text = os.environ.get(name, "").strip()
        if text.isdigit() and int(text) > 0:
            return int(text)
    return 1


_NOT_INITIALIZED = "but paddle.distributed is not initialized yet, so it would see 1 rank and never reach the others"
_INIT_FIRST = "call fleet.init(is_collective=True, ...) or paddle.distributed.init_parallel_env() first"


def checked_job(where: str, error=RuntimeError) -> tuple:
    """:func:`job`, refusing a process that the launcher started as one of several ranks but
    that has not joined the job yet: built there, an object would see one rank and never
    talk to the others (each rank would train alone, silently). ``where``: the public name
    after ``paddle_unpad.``; ``error``: the exception type to raise."""
    rank, world = job()
    launched = launched_world()
    if world == 1 and launched > 1:
        raise error(
            f"paddle_unpad.{where}: built before the job was initialized: this process was launched as one of {launched} ranks (PADDLE_TRAINERS_NUM={launched}), {_NOT_INITIALIZED}; {_INIT_FIRST}"
        )
    return rank, world


# ----------------------------------------------------------------------------- groups


def check_member(ranks: List[int], where: str, what: str, rank: Optional[int] = None):
    """Refuse (``ValueError``) ``what`` over ``ranks`` on a rank that is not one of them: only the
    members of a group build what runs over it (the others would wait for it, or agree with ranks
    that never come). ``where``: the public name after ``paddle_unpad.``."""
    rank = job()[0] if rank is None else rank
    if rank not in ranks:
        raise ValueError(
            f"paddle_unpad.{where}: {what} over ranks {list(ranks)} was built on rank {rank}, which is not one of them: build it on the members of its group only"
        )


class Group:
    """A process group of the plugin: ``role`` host or device, its backend, what it is for.

    ``owned``: made by :func:`new_group` (the plugin may reuse it after :func:`release`); a
    group the user passed in (:func:`wrap_host_group`) is never reused nor destroyed.
    ``gid``: Paddle's id of the group, the same on every member."""

    def __init__(self, pg, role: str, backend: str, purpose: str, owned: bool = False, conn=None):
        self.pg, self.role, self.backend, self.purpose = pg, role, backend, purpose
        self.ranks = list(pg.ranks)
        self.nranks, self.rank = len(self.ranks), pg.rank
        self.gid = getattr(pg, "id", None)
        self.owned, self.released = owned, False
        # what the process group has seen, shared by every Group that wraps it in turn:
        # collectives issued, collectives in progress, whether one failed
        self.conn = conn if conn is not None else {"ops": 0, "busy": 0, "failed": False}
        # NCCL: every collective from the creating (training) thread; gloo: any one thread
        self.owner = threading.get_ident() if backend == "nccl" else None

    def __repr__(self):
        return f"Group({self.purpose!r}, {self.role}, {self.backend}, ranks={self.ranks}{', released' if self.released else ''})"


CREATED: List[Group] = []  # every process group this process made through the layer (reuses not counted)
REUSED = {"count": 0}  # groups handed out again from the released ones (tests and benchmarks)
GROUP_MEET_S = 300.0  # how long the members of a new group wait for each other (a missing one: named error)
_GID_BASE = 1 << 20  # the plugin's groups take ids from here up: never one Paddle's own counter gives
_GID_KEY = "paddle_unpad/group_ids"
_MEET_KEY = "paddle_unpad/group_meet"
_free: Dict[tuple, List[Group]] = {}  # (backend, ranks) -> released groups of the plugin, idle, oldest first
_meetings: Dict[tuple, "itertools.count"] = {}  # (backend, ranks) -> groups made over them so far
_lock = threading.Lock()


_CREATE_ALIKE = (
    "every member must create it at the same point (groups of the plugin over the same ranks in the same order)"
)


def new_group(purpose: str, role: str = HOST, ranks: Optional[List[int]] = None) -> Group:
    """A group over ``ranks`` (default: all). Called by every member of the group, and only by
    them, in the same order relative to the other groups of the plugin over the same ranks
    (groups over other ranks, and groups made by Paddle or the user, do not count).

    The members first meet through the job's store (bounded by ``GROUP_MEET_S``: a member that
    never comes is a named error, not a hang). A group released earlier over the same ranks and
    backend, idle and in the same state on every member, is handed out again (Paddle cannot free
    a process group: see :func:`release`); otherwise a new one is made, with a group id the
    members agree on (taken from a counter in the job's store), so that groups made by some
    ranks only never shift the ids -- and store keys -- of later groups."""
    install_group_stores()
    workarounds.ensure_exit_handler(mark_left, leave_in_order)
    rank, world = job()
    backend = "gloo" if role == HOST else device_backend()
    ranks = list(range(world)) if ranks is None else sorted(set(int(r) for r in ranks))
    check_member(ranks, "distributed", f"the {purpose} group", rank)
    pool_key = (backend, tuple(ranks))
    n = next(_meetings.setdefault(pool_key, itertools.count()))
    with _lock:
        pool = list(_free.get(pool_key, []))
    offer = json.dumps(sorted([g.gid, g.conn["ops"]] for g in pool))
    values, missing = agree(f"group/{backend}", offer, GROUP_MEET_S, ranks)  # per rank set (see agree)
    if missing:
        late = [ranks[i] for i in missing]
        raise RuntimeError(
            f"paddle_unpad.distributed: rank(s) {late} did not come to create the {purpose} group over ranks {ranks} within {GROUP_MEET_S:g} s (this is rank {rank}): {_CREATE_ALIKE}"
        )
    offers = [offer] if values is None else values
    common = set.intersection(*({tuple(x) for x in json.loads(o)} for o in offers))
    if common:  # the same idle group on every member: hand it out again
        gid = min(common)[0]
        with _lock:
            old = next(g for g in _free[pool_key] if g.gid == gid)
            _free[pool_key].remove(old)
        REUSED["count"] += 1
        return Group(old.pg, role, backend, purpose, owned=True, conn=old.conn)
    gid = _agreed_gid(ranks, backend, n, purpose) if _compat.can_choose_group_id() else None
    with _compat.chosen_group_id(gid):
        pg = _paddle_group(ranks, backend)
    g = Group(pg, role, backend, purpose, owned=True)
    CREATED.append(g)
    return g


def _agreed_gid(ranks, backend, n, purpose) -> int:
    """The id of the ``n``-th new group over ``ranks``: the first member takes it from the job's
    counter (unique in the job) and publishes it, the others read it (bounded)."""
    store = _job_store()
    key = f"{_MEET_KEY}/{backend}/{'-'.join(map(str, ranks))}/{n}"
    if job()[0] == ranks[0]:
        gid = _GID_BASE + int(store.add(_GID_KEY, 1))
        store.set(key, str(gid).encode())
        store.add(key + "/ready", 1)
        return gid
    deadline = time.monotonic() + GROUP_MEET_S
    while store.add(key + "/ready", 0) == 0:  # add 0: a read that never blocks
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"paddle_unpad.distributed: rank {ranks[0]} did not publish the id of the {purpose} group over ranks {ranks} within {GROUP_MEET_S:g} s (this is rank {job()[0]})"
            )
        time.sleep(0.005)
    return int(store.get(key).decode())


def _paddle_group(ranks, backend):
    """Paddle's group (one function, so that a test can stand a gloo group in for NCCL)."""
    return dist.new_group(ranks, backend=backend)


def release(group: Optional[Group]):
    """Give back what ``group`` holds. Idempotent; None is ignored. Called by the owner's
    ``close()``: after it, no collective may be issued on the group (:func:`issue` refuses).
    Local: no collective, no wait, so ranks may release at different times.

    Paddle 2.6 and 3.x cannot free a process group: its C++ registries
    (``ProcessGroupIdMap``, ``CommContextManager``) keep every group -- its gloo contexts,
    their sockets and loop threads, and the store it met through -- until the process ends
    (measured on Paddle 3.3.1: ``destroy_process_group`` and dropping every Python reference
    free none of them). So a group the plugin made goes back to a pool instead, and the next
    group over the same ranks and backend takes it when every member offers it in the same
    state (:func:`new_group`): a job that makes and closes loaders or all-reduces one after the
    other holds as many groups as it ever had open at once. A group with a collective still in
    progress (a thread that did not stop) or that failed is not reused; a group the user passed
    in is only marked released."""
    if group is None or group.released:
        return
    group.released = True
    if not group.owned:
        return
    reusable = group.conn["busy"] == 0 and not group.conn["failed"]
    if reusable:
        with _lock:
            _free.setdefault((group.backend, tuple(group.ranks)), []).append(group)
    else:
        log.warning(
            "paddle_unpad: the %s group is released with a collective in progress or failed; it is not reused",
            group.purpose,
        )
    if _exit_order["group"] is group and not reusable:
        _exit_order["group"] = None
        with _lock:
            idle = [g for gs in _free.values() for g in gs]
        for g in idle:  # an idle group over every rank keeps the exit ordering
            use_for_exit_order(g)


def wrap_host_group(pg, purpose: str) -> Group:
    """A group the user made, for a host role: it must be gloo (the exchange runs on the CPU).
    ``purpose``: the public name the group was given to, after ``paddle_unpad.``."""
    backend = "gloo" if "gloo" in type(pg.process_group).__name__.lower() else type(pg.process_group).__name__
    if backend != "gloo":
        raise ValueError(
            f"paddle_unpad.{purpose}: group must be a gloo group (the exchange sends CPU buffers: paddle.distributed.new_group(ranks, backend='gloo')), got a {backend} group"
        )
    workarounds.ensure_exit_handler(mark_left, leave_in_order)
    return Group(pg, HOST, "gloo", purpose, owned=False)


# ----------------------------------------------------------------------------- collectives

#: tests: ``callable(op, group)`` called before every collective the plugin issues (on the
#: issuing thread), to check which group and thread each one uses
RECORDER: Optional[Callable] = None


_NCCL_THREAD = "the plugin issues NCCL collectives from the training thread only, in the same order on every rank"


def issue(op: str, group: Group):
    """Every collective passes here: none on a released group, NCCL ones only from their group's
    owner thread. Counts the group's collectives (a released group is reused only where every
    member counted the same)."""
    if group.released:
        raise RuntimeError(
            f"paddle_unpad.distributed: {op} on the {group.purpose} group after it was released (its owner was closed)"
        )
    if group.owner is not None and threading.get_ident() != group.owner:
        raise RuntimeError(
            f"paddle_unpad.distributed: {op} on the {group.purpose} group (NCCL) from thread {threading.current_thread().name!r}, not the thread that created the group: {_NCCL_THREAD}"
        )
    if RECORDER is not None:
        RECORDER(op, group)
    group.conn["ops"] += 1


@contextlib.contextmanager
def _running(op: str, group: Group):
    """A collective in progress on ``group`` (a group released meanwhile is not reused)."""
    issue(op, group)
    group.conn["busy"] += 1
    try:
        yield
    except BaseException:
        group.conn["failed"] = True
        raise
    finally:
        group.conn["busy"] -= 1


def all_gather_array(group: Group, arr) -> np.ndarray:
    """``[nranks, *arr.shape]`` int64 from every rank's ``arr`` (same shape on every rank), on CPU."""
    t = paddle.to_tensor(np.ascontiguousarray(arr, dtype=np.int64), place=paddle.CPUPlace())
    outs = []
    with _running("all_gather", group):
        dist.all_gather(outs, t, group=group.pg)
    return np.stack([o.numpy() for o in outs])


def all_gather_object(group: Group, obj) -> list:
    outs = []
    with _running("all_gather_object", group):
        dist.all_gather_object(outs, obj, group=group.pg)
    return outs


def all_reduce(group: Group, tensor, sync_op: bool = True):
    """Sum ``tensor`` over the group, in place; returns the task (``sync_op=False``: wait on it)."""
    with _running("all_reduce", group):
        return dist.all_reduce(tensor, group=group.pg, sync_op=sync_op)


# ----------------------------------------------------------------------------- agreement through the store

_agree_seq: Dict[tuple, "itertools.count"] = {}


_STORE_GONE = "the job's store, which rank 0's process serves, cannot be reached any more"


class _Store:
    """The job's TCP store, whose requests fail only when its server is gone: rank 0's process
    serves it (Paddle 2.6 and 3.x), so a failed request means rank 0 has left the job, and says so
    (:class:`~paddle_unpad.distributed.errors.StoreHostLeft`) instead of the TCP error."""

    def __init__(self, store):
        self.store = store

    def _call(self, op, *args):
        try:
            return getattr(self.store, op)(*args)
        except Exception as e:  # noqa: BLE001 - Paddle raises ValueError/RuntimeError/OSError for these
            text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            raise StoreHostLeft(
                f"paddle_unpad.distributed: rank 0 has left the job: {_STORE_GONE} ({type(e).__name__}: {text}); this rank cannot meet the others: end it, then restart the job"
            ) from e

    def set(self, key, value):
        return self._call("set", key, value)

    def get(self, key):
        return self._call("get", key)

    def add(self, key, n):
        return self._call("add", key, n)


_wrapped: List[_Store] = []  # the job's store, wrapped once


def _job_store() -> _Store:
    store = workarounds.job_store()
    if not _wrapped or _wrapped[0].store is not store:
        _wrapped[:] = [_Store(store)]
    return _wrapped[0]


def reason(exc) -> str:
    """A message of the package without its ``paddle_unpad.<name>: `` prefix (to be raised again
    under another name)."""
    text = str(exc)
    return text.partition(": ")[2] if text.startswith("paddle_unpad") else text


_LEFT_KEY = "paddle_unpad/left"


def mark_left():
    """At interpreter exit, once the plugin's threads are joined (:mod:`.workarounds` calls it):
    this rank tells the job's store that it has left, so that a peer whose collective fails then
    names it ("rank 1 left the job") instead of gloo's words for a closed connection."""
    rank, world = job()
    if world <= 1:
        return
    try:
        _job_store().add(f"{_LEFT_KEY}/{rank}", 1)
    except StoreHostLeft:  # rank 0 has gone before: nobody to tell
        pass


def who_left(ranks: List[int]) -> str:
    """Why a collective over ``ranks`` failed, when a member has left the job: ``"rank(s) [1] left
    the job (their process ended)"``, the store's :class:`StoreHostLeft` text when rank 0 has left,
    or ``""`` when no member has left (a peer died or stopped without a word)."""
    me = job()[0]
    try:
        store = _job_store()
        gone = [r for r in ranks if r != me and store.add(f"{_LEFT_KEY}/{r}", 0) > 0]  # add 0: never blocks
    except StoreHostLeft as e:
        return reason(e)
    return f"rank(s) {gone} left the job (their process ended)" if gone else ""


AGREE_MIN_S = 10.0  # ranks reach the same construction seconds apart: never wait less than this for them


def agree(kind: str, value: str, timeout: float, ranks: Optional[List[int]] = None, _job=None):
    """Compare this rank's ``value`` for the ``n``-th agreement of ``kind`` over ``ranks`` in this
    process with the other ``ranks``' (default: all), through the job's TCP store, waiting at
    most ``timeout`` seconds (at least ``AGREE_MIN_S``). ``n`` counts per rank set: agreements
    among some ranks only do not shift the others'. ``_job``: ``(rank, world)`` before the job is
    initialized (from the launcher's environment).

    Returns ``(values, missing)``: ``values`` is None when every rank holds the same value,
    else every rank's value in the order of ``ranks`` (None for a rank that did not arrive);
    ``missing`` lists the positions in ``ranks`` that did not arrive in time. No collective
    is involved, so a rank that never comes cannot make the others hang; each rank compares
    with the first rank's value and counts itself in, so the store serves O(1) requests per
    rank unless something differs."""
    rank, world = job() if _job is None else _job
    ranks = list(range(world)) if ranks is None else list(ranks)
    check_member(ranks, "distributed", f"the agreement on {kind}", rank)
    me, n_ranks = ranks.index(rank), len(ranks)
    n = next(_agree_seq.setdefault((kind, tuple(ranks)), itertools.count()))
    prefix = f"paddle_unpad/agree/{kind}/{'-'.join(map(str, ranks)) if n_ranks < world else 'all'}/{n}"
    store = _job_store()
    store.set(f"{prefix}/value/{me}", value.encode("utf-8"))
    store.add(f"{prefix}/in/{me}", 1)
    deadline = time.monotonic() + max(timeout, AGREE_MIN_S)

    def arrived(i):
        return i == me or store.add(f"{prefix}/in/{i}", 0) > 0  # add 0: a read that never blocks

    pause = min(0.1, 0.01 * max(1.0, n_ranks / 64))  # the store serves every rank's polls: keep it near 20k/s

    def poll(done):
        while not done():
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
        return True

    if poll(lambda: arrived(0)):
        same = store.get(f"{prefix}/value/0").decode("utf-8") == value
        store.add(f"{prefix}/{'same' if same else 'differ'}", 1)
        if poll(lambda: store.add(f"{prefix}/same", 0) + store.add(f"{prefix}/differ", 0) >= n_ranks):
            if store.add(f"{prefix}/differ", 0) == 0:
                return None, []
    present = [i for i in range(n_ranks) if arrived(i)]
    values = [store.get(f"{prefix}/value/{i}").decode("utf-8") if i in present else None for i in range(n_ranks)]
    missing = [i for i in range(n_ranks) if i not in present]
    if not missing and all(v == value for v in values):  # all came, just after the deadline
        return None, []
    return values, missing


SETTINGS_AGREE_S = 900.0  # as long as Paddle's own store waits for a rank (FLAGS_stop_check_timeout)
_settings = {"checked": False}


_SET_ALIKE = "they decide how the ranks meet, so set them alike on every machine (or on none)"


def check_settings_agree():
    """Compare the settings that must be equal on every rank (``agree`` in
    :data:`paddle_unpad.config.VARIABLES`) across the ranks of a launched job, once per process,
    through the job's store (bounded, no collective): before ``fleet.init`` when called from
    :func:`paddle_unpad.fleet.DistributedStrategy` (the store is made from the launcher's
    environment, and ``fleet.init`` takes the same one), else at the plugin's first group.
    Settings that differ raise :class:`paddle_unpad.config.ConfigError` on every rank, naming
    each rank's value; a rank that does not come within ``SETTINGS_AGREE_S`` is named too. A
    process that was not launched as one of several ranks checks nothing."""
    if _settings["checked"]:
        return
    rank, world = job()
    if world == 1:  # not initialized yet: the launcher's environment says who this is
        world = launched_world()
        text = os.environ.get("PADDLE_TRAINER_ID", "").strip()
        has_store = os.environ.get("PADDLE_MASTER") or os.environ.get("PADDLE_TRAINER_ENDPOINTS")
        if world == 1 or not text.isdigit() or not has_store:
            return
        rank = int(text)
    _settings["checked"] = True
    mine = config.agreed_settings()
    values, missing = agree("settings", json.dumps(mine, sort_keys=True), SETTINGS_AGREE_S, _job=(rank, world))
    if values is None:
        return
    got = [json.loads(v) if v is not None else None for v in values]
    diff = [
        f"{name}: " + ", ".join(f"rank {r} {g[name]}" for r, g in enumerate(got) if g is not None)
        for name in sorted(mine)
        if len({g[name] for g in got if g is not None}) > 1
    ]
    if missing:
        diff.append(f"rank(s) {missing} did not compare theirs within {SETTINGS_AGREE_S:g} s")
    raise config.ConfigError(
        f"paddle_unpad.config: the ranks of this job have different settings that must be equal on every rank ({'; '.join(diff)}; this is rank {rank}): {_SET_ALIKE}"
    )


def install_group_stores(enabled=None, check=True):
    """Give every gloo process group after the default one a rendezvous store of its own
    (Paddle 2.6 and 3.x; :func:`paddle_unpad.distributed.workarounds.install_group_stores`
    says why). Idempotent; returns whether the rendezvous is isolated. ``enabled`` None: the
    ``GLOO_GROUP_STORES`` setting decides.

    Without ``enabled``, the settings that must be equal on every rank are compared
    (:func:`check_settings_agree`): the ranks of a job that disagree on this one would meet
    through different keys and wait for each other for ever. ``check`` True compares them here
    (a training job starts: :func:`paddle_unpad.fleet.DistributedStrategy`); False leaves it to
    the first gloo group after the default one (``UnpadTrainer``: a job that balances nothing
    may make none, and need not wait for the other ranks)."""
    if enabled is None and check:
        check_settings_agree()
    return workarounds.install_group_stores(enabled, before_first_group=check_settings_agree)


# ----------------------------------------------------------------------------- exit order

_exit_order = {"group": None}  # the host group over every rank that rank 0 waits on at exit
_EXIT_KEY = "paddle_unpad/ranks_leaving"
_EXIT_COUNT_WAIT_S = 5.0  # how long rank 0 waits for its peers to count themselves out


def use_for_exit_order(group: Group):
    """A host group over every rank that rank 0 can wait on at exit (the first one offered)."""
    if _exit_order["group"] is None and group.role == HOST and group.nranks == job()[1] > 1:
        _exit_order["group"] = group


def leave_in_order():
    """Rank 0 leaves a multi-rank job after its peers (Paddle 3.x), whether the job ends cleanly or
    of an exception. Called at interpreter exit by :mod:`.workarounds`, once every thread of the
    plugin has ended.

    Rank 0 hosts the job's TCP store (and the plugin's groups' stores); in Paddle 3.x a libuv
    thread serves them, and when a peer's connection closes while rank 0 is already in its C++
    teardown (the static destructors after ``exit()``), that thread aborts rank 0 -- SIGABRT or
    SIGSEGV, no message, after the work or the named error (seen in about one of 15 two-rank
    Trainer runs on a loaded 2-core host; the core dump shows ``LibUVClient::readCallback`` under
    ``LibUVMasterDaemon::run``; a job whose ranks all raise the same named error at once hits it
    too, as they all hang up together). So at exit each peer counts itself out in the store, and
    rank 0, once all have, waits on the host group of :func:`use_for_exit_order` until every
    peer's process is gone (a receive from a peer fails when its sockets close) before its own
    teardown. When a peer has not counted itself out within a few seconds (it is still working,
    stopped or killed), rank 0 leaves without waiting more: it never holds up its peers' errors
    for longer than that."""
    group = _exit_order["group"]
    if _compat.PADDLE_VERSION < (3, 0) or group is None:
        return  # Paddle 2.6's store has no libuv thread; or no group
    try:
        store = workarounds.job_store()
        if group.rank != 0:
            store.add(_EXIT_KEY, 1)
            return
        deadline = time.monotonic() + _EXIT_COUNT_WAIT_S
        while store.add(_EXIT_KEY, 0) < group.nranks - 1:
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        buf = paddle.to_tensor([0], dtype="int64", place=paddle.CPUPlace())
        for peer in range(1, group.nranks):
            try:  # nobody sends: this returns when the peer's connection closes
                dist.irecv(buf, peer, group=group.pg).wait()
            except Exception:  # noqa: BLE001 - the expected end of the wait
                pass
        time.sleep(0.1)  # the store's thread takes the peers' hang-ups while rank 0 is whole
    except Exception:  # noqa: BLE001 - ordering is best effort; never fail an exit
        return

"""Process groups, stores, exit rules and every collective of the plugin: the one place that
talks between ranks.

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

**Workarounds of Paddle, and the versions they are for** -- applied when the first group of
the plugin is made (or :func:`paddle_unpad.fleet.DistributedStrategy` is built, so that
``fleet.init``'s own groups get the first one too):

* per-group rendezvous stores (Paddle 2.6 and 3.x, gloo): :func:`install_group_stores`;
* rank 0 leaves a clean job last (Paddle 3.x, whose TCP store runs on libuv): :func:`_at_exit`.

**Exit.** Every background thread of the plugin registers here (:func:`register_thread`). At
interpreter exit they are all told to stop first, then joined -- a thread blocked in a gloo
collective with a stopped peer leaves it when gloo's own timeout (``GLOO_OWN_TIMEOUT_S``)
fails the call -- so that no thread of the plugin is inside native code when the interpreter
finalizes (a thread left there aborts the process: "terminate called without an active
exception").

**Agreement.** :func:`agree` compares a value across ranks through the job's TCP store with
a bounded wait, before any group or collective that the value decides on: settings that
differ, or a rank that never arrives, are a named error on every rank, never a hang.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import paddle
import paddle.distributed as dist

from .. import _paddle_compat as _compat
from .. import config

log = logging.getLogger("paddle_unpad.distributed")

GLOO_OWN_TIMEOUT_S = 30.0  # a gloo collective that waits longer fails by itself (Paddle 2.6 and 3.x, CPU)
_EXIT_JOIN_S = GLOO_OWN_TIMEOUT_S + 10.0  # how long exit waits for the plugin's threads, all together
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


def checked_job(where: str, error=RuntimeError) -> tuple:
    """:func:`job`, refusing a process that the launcher started as one of several ranks but
    that has not joined the job yet: built there, an object would see one rank and never
    talk to the others (each rank would train alone, silently). ``where``: the public name
    after ``paddle_unpad.``; ``error``: the exception type to raise."""
    rank, world = job()
    launched = launched_world()
    if world == 1 and launched > 1:
        raise error(f"paddle_unpad.{where}: built before the job was initialized: this process was launched as one of {launched} ranks (PADDLE_TRAINERS_NUM={launched}), but paddle.distributed is not initialized yet, so it would see 1 rank and never reach the others; call fleet.init(is_collective=True, ...) or paddle.distributed.init_parallel_env() first")
    return rank, world


# ----------------------------------------------------------------------------- groups


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
        return (f"Group({self.purpose!r}, {self.role}, {self.backend}, ranks={self.ranks}{', released' if self.released else ''})")


CREATED: List[Group] = []  # every process group this process made through the layer (reuses not counted)
REUSED = {"count": 0}  # groups handed out again from the released ones (tests and benchmarks)
GROUP_MEET_S = 300.0  # how long the members of a new group wait for each other (a missing one: named error)
_GID_BASE = 1 << 20  # the plugin's groups take ids from here up: never one Paddle's own counter gives
_GID_KEY = "paddle_unpad/group_ids"
_MEET_KEY = "paddle_unpad/group_meet"
_free: Dict[tuple, List[Group]] = {}  # (backend, ranks) -> released groups of the plugin, idle, oldest first
_meetings: Dict[tuple, "itertools.count"] = {}  # (backend, ranks) -> groups made over them so far
_lock = threading.Lock()


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
    _ensure_exit_handler()
    rank, world = job()
    backend = "gloo" if role == HOST else device_backend()
    ranks = list(range(world)) if ranks is None else sorted(set(int(r) for r in ranks))
    if rank not in ranks:
        raise ValueError(f"paddle_unpad.distributed: the {purpose} group over ranks {ranks} was asked for on rank {rank}, which is not one of them: only the members of a group create it")
    pool_key = (backend, tuple(ranks))
    n = next(_meetings.setdefault(pool_key, itertools.count()))
    with _lock:
        pool = list(_free.get(pool_key, []))
    offer = json.dumps(sorted([g.gid, g.conn["ops"]] for g in pool))
    values, missing = agree(f"group/{backend}", offer, GROUP_MEET_S, ranks)  # per rank set (see agree)
    if missing:
        raise RuntimeError(
            f"paddle_unpad.distributed: rank(s) {[ranks[i] for i in missing]} did not come to create the {purpose} group over ranks {ranks} within {GROUP_MEET_S:g} s (this is rank {rank}): every member must create it at the same point (groups of the plugin over the same ranks in the same order)")
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
            raise RuntimeError(f"paddle_unpad.distributed: rank {ranks[0]} did not publish the id of the {purpose} group over ranks {ranks} within {GROUP_MEET_S:g} s (this is rank {job()[0]})")
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
        log.warning("paddle_unpad: the %s group is released with a collective in progress or failed; it is not reused",
                    group.purpose)
    if _exit["order_group"] is group and not reusable:
        _exit["order_group"] = None
        with _lock:
            idle = [g for gs in _free.values() for g in gs]
        for g in idle:  # an idle group over every rank keeps the exit ordering
            use_for_exit_order(g)


def wrap_host_group(pg, purpose: str) -> Group:
    """A group the user made, for a host role: it must be gloo (the exchange runs on the CPU).
    ``purpose``: the public name the group was given to, after ``paddle_unpad.``."""
    backend = "gloo" if "gloo" in type(pg.process_group).__name__.lower() else type(pg.process_group).__name__
    if backend != "gloo":
        raise ValueError(f"paddle_unpad.{purpose}: group must be a gloo group (the exchange sends CPU buffers: paddle.distributed.new_group(ranks, backend='gloo')), got a {backend} group")
    _ensure_exit_handler()
    return Group(pg, HOST, "gloo", purpose, owned=False)


# ----------------------------------------------------------------------------- collectives

#: tests: ``callable(op, group)`` called before every collective the plugin issues (on the
#: issuing thread), to check which group and thread each one uses
RECORDER: Optional[Callable] = None


def issue(op: str, group: Group):
    """Every collective passes here: none on a released group, NCCL ones only from their group's
    owner thread. Counts the group's collectives (a released group is reused only where every
    member counted the same)."""
    if group.released:
        raise RuntimeError(f"paddle_unpad.distributed: {op} on the {group.purpose} group after it was released (its owner was closed)")
    if group.owner is not None and threading.get_ident() != group.owner:
        raise RuntimeError(
            f"paddle_unpad.distributed: {op} on the {group.purpose} group (NCCL) from thread {threading.current_thread().name!r}, not the thread that created the group: the plugin issues NCCL collectives from the training thread only, in the same order on every rank")
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


def _job_store():
    store = _compat.job_store()
    quick_store_requests()
    return store


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


# ----------------------------------------------------------------------------- the training step

_batch_step = {"step": None}


def note_batch_step(step: int):
    """The balanced loaders call this with each batch's global step as the training loop takes
    it; the gradient all-reduce compares it across ranks (a rank that skipped a step)."""
    _batch_step["step"] = int(step)


def batch_step():
    return _batch_step["step"]


# ----------------------------------------------------------------------------- per-group rendezvous stores

_GROUP_STORE_KEY = "paddle_unpad/gloo_group_store"
_group_stores = []  # each group's own store, alive as long as the process (its group holds it too)
_group_store_uses = {}  # gid -> groups created with it so far (a reused custom gid gets a new key)


def install_group_stores(enabled=None, check=True):
    """Give every gloo process group after the default one a rendezvous store of its own
    (Paddle 2.6 and 3.x). Idempotent; returns whether the rendezvous is isolated.

    Why: ``ProcessGroupGloo.create`` connects the group's gloo context through the job's TCP
    store under the keys ``"0"`` .. ``"n-1"``, with no per-group prefix, so each new group
    overwrites the keys of the one before. A rank that reads a peer's key before the peer
    has rewritten it gets the peer's address in an earlier group and fails: ``pair.cc ...
    connect ...: Connection refused`` (that listener is closed), or ``address.cc ... 136 vs
    68`` when the two groups differ in size (Paddle 2.6 hangs instead). It hits ``fleet.init``
    (its data-parallel group follows the default one) and any job that creates groups one
    after the other, more often the more loaded the machine.

    With this, ``paddle.distributed.new_group`` on gloo gives the group a TCP store served by
    its first member (address passed through the job's store under a key unique to the
    group), so no key it reads can be stale. The default group (gid 0) and other backends
    are left as they are. The ``GLOO_GROUP_STORES`` setting off leaves Paddle as it ships.

    Without ``enabled`` (the setting decides), the settings that must be equal on every rank
    are compared (:func:`check_settings_agree`): the ranks of a job that disagree on this one
    would meet through different keys and wait for each other for ever. ``check`` True
    compares them here (a training job starts: :func:`paddle_unpad.fleet.DistributedStrategy`);
    False leaves it to the first gloo group after the default one (an import must not wait
    for the other ranks)."""
    if enabled is None and check:
        check_settings_agree()
    enabled = config.get("GLOO_GROUP_STORES") if enabled is None else enabled
    quick = config.get("STORE_NODELAY")
    impl = _compat.process_group_factory()
    if impl is None:  # a Paddle without this hook: leave it alone
        return False
    original = getattr(impl, "_paddle_unpad_original", impl)
    if not (enabled or quick):
        _compat.set_process_group_factory(original)
        return False
    if impl is not original and getattr(impl, "_paddle_unpad_rules", None) == (enabled, quick):
        return enabled

    @functools.wraps(original)
    def new_process_group_impl(backend, store, rank, world_size, group_name, pg_options, group_id=0,
                               *args, **kwargs):
        if quick:  # the job's store exists by now (fleet.init / init_parallel_env made it)
            quick_store_requests()
        if backend == "gloo" and group_id != 0 and world_size > 1:
            check_settings_agree()  # once per process, before the first rendezvous they decide
        if enabled and backend == "gloo" and group_id != 0 and world_size > 1:
            store = _group_store(store, rank, world_size, group_id)
        return original(backend, store, rank, world_size, group_name, pg_options, group_id, *args, **kwargs)

    new_process_group_impl._paddle_unpad_original = original
    new_process_group_impl._paddle_unpad_rules = (enabled, quick)
    _compat.set_process_group_factory(new_process_group_impl)
    return enabled


SETTINGS_AGREE_S = 900.0  # as long as Paddle's own store waits for a rank (FLAGS_stop_check_timeout)
_settings = {"checked": False}


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
    diff = [f"{name}: " + ", ".join(f"rank {r} {g[name]}" for r, g in enumerate(got) if g is not None)
            for name in sorted(mine) if len({g[name] for g in got if g is not None}) > 1]
    if missing:
        diff.append(f"rank(s) {missing} did not compare theirs within {SETTINGS_AGREE_S:g} s")
    raise config.ConfigError(
        f"paddle_unpad.config: the ranks of this job have different settings that must be equal on every rank ({'; '.join(diff)}; this is rank {rank}): they decide how the ranks meet, so set them alike on every machine (or on none)")


_store_ports = set()  # ports of the TCP stores this process talks to besides the job's
_nodelay_fds = set()  # descriptors of the store connections given TCP_NODELAY (paddle_unpad.info())


def _job_store_ports():
    """The ports Paddle may have taken the job's store from (its Python and C++ sides read
    different variables first: MASTER_ADDR/MASTER_PORT, PADDLE_MASTER, the first trainer)."""
    ports = set()
    for text in (os.environ.get("MASTER_PORT", ""), os.environ.get("PADDLE_MASTER", "").rpartition(":")[2],
                 os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",")[0].rpartition(":")[2]):
        if text.strip().isdigit():
            ports.add(int(text))
    return ports


def quick_store_requests() -> int:
    """Set ``TCP_NODELAY`` on this process's connections to Paddle's TCP stores (the job's and
    the groups' own); returns how many connections it set.

    Why: the store client writes a request in several small pieces (command, key length, key)
    and the server answers in several too; with Nagle's algorithm on, each piece after the
    first waits for the ACK of the one before, which the peer delays by up to 40 ms. Measured
    on Paddle 3.3: a ``get`` takes 88 ms, an ``add`` 44 ms on loopback, 0.1 ms with this. Gloo
    connects a group with a wait and a get per peer, so without it creating one 16-rank group
    spends about 2.6 s in delays alone, a 1,024-rank one about 3 minutes. Only the client side
    needs it (each process sets its own). The ``STORE_NODELAY`` setting off leaves the
    connections as Paddle opens them."""
    if not config.get("STORE_NODELAY"):
        return 0
    ports = _job_store_ports() | _store_ports
    done = 0
    try:
        fds = [int(f) for f in os.listdir("/proc/self/fd")]
    except OSError:  # not Linux: Paddle's collective jobs run on Linux only
        return 0
    for fd in fds:
        try:
            s = socket.socket(fileno=fd)
        except OSError:  # not a socket (or closed since the listing)
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                if s.getpeername()[1] in ports:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    done += 1
                    _nodelay_fds.add(fd)
        except OSError:  # not connected (a listener) or gone
            pass
        finally:
            s.detach()  # the descriptor stays Paddle's
    return done


def _group_store(job_store, rank, size, gid):
    """The fresh TCP store of group ``gid``: served by its rank 0, joined by the others. (The
    plugin's own groups have ids unique in the job, agreed by their members; Paddle's and the
    user's groups take the ids of Paddle's counter, equal on every rank by Paddle's rule.)"""
    uses = _group_store_uses.get(gid, 0)
    _group_store_uses[gid] = uses + 1
    key = f"{_GROUP_STORE_KEY}/{gid}/{uses}"
    timeout = 900  # seconds, Paddle's default for its own store
    if rank == 0:
        # the address the other members reach this process at: the launcher's endpoint
        host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "").rpartition(":")[0] or "127.0.0.1"
        error = None
        for _ in range(5):  # the port is picked free, but another process could take it first
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            try:
                own = _compat.tcp_store(host, port, True, timeout)  # 0 workers: returns at once
                break
            except Exception as e:  # noqa: BLE001 - retried on another port, then reported
                error = e
        else:
            job_store.set(key, f"error: {error}".encode())
            raise RuntimeError(f"paddle_unpad.distributed: could not start the rendezvous store of gloo group {gid}: {error}")
        job_store.set(key, f"{host}:{port}".encode())
    else:
        value = job_store.get(key).decode()  # waits for the key (2.6 and 3.x)
        if value.startswith("error: "):
            raise RuntimeError(f"paddle_unpad.distributed: the first member of gloo group {gid} could not start its rendezvous store ({value[7:]})")
        host, _, port = value.rpartition(":")
        own = _compat.tcp_store(host, port, False, timeout)
    _group_stores.append(own)
    _store_ports.add(int(port))
    quick_store_requests()
    return own


# ----------------------------------------------------------------------------- threads and exit

_threads_lock = threading.Lock()
_threads: Dict[threading.Thread, Callable] = {}  # live background threads -> how to ask them to stop
_exit = {"installed": False, "order_group": None}


def register_thread(thread: threading.Thread, stop: Callable[[], None]):
    """A background thread of the plugin: ``stop()`` asks it to leave (without blocking); it is
    stopped and joined at interpreter exit unless it ended before."""
    _ensure_exit_handler()
    with _threads_lock:
        _threads[thread] = stop


def unregister_thread(thread: threading.Thread):
    with _threads_lock:
        _threads.pop(thread, None)


def stop_and_join(items, timeout: float) -> List[threading.Thread]:
    """Ask every ``(thread, stop)`` to stop, then join them all within ``timeout`` seconds in
    total (asking all first: no thread's close handshake waits for another's). Returns the
    threads still alive."""
    for _, stop in items:
        try:
            stop()
        except Exception:  # noqa: BLE001 - one thread's failure must not keep the others running
            log.debug("paddle_unpad: stopping a thread failed", exc_info=True)
    deadline = time.monotonic() + timeout
    alive = []
    for th, _ in items:
        if th is threading.current_thread():
            continue
        th.join(max(0.0, deadline - time.monotonic()))
        if th.is_alive():
            alive.append(th)
    return alive


def use_for_exit_order(group: Group):
    """A host group over every rank that rank 0 can wait on at exit (the first one offered)."""
    if _exit["order_group"] is None and group.role == HOST and group.nranks == job()[1] > 1:
        _exit["order_group"] = group


def _ensure_exit_handler():
    if not _exit["installed"]:
        _exit["installed"] = True
        atexit.register(_at_exit)  # runs before atexit handlers registered earlier (Paddle's)


_EXIT_KEY = "paddle_unpad/ranks_leaving"
_EXIT_COUNT_WAIT_S = 5.0  # how long rank 0 waits for its peers to count themselves out


def _at_exit():
    with _threads_lock:
        items = list(_threads.items())
    alive = stop_and_join(items, _EXIT_JOIN_S)
    if alive:
        log.warning("paddle_unpad: %d background thread(s) still inside a collective at exit after %.0f s",
                    len(alive), _EXIT_JOIN_S)
        return  # their group is in use: no exit ordering on it
    if _compat.PADDLE_VERSION >= (3, 0):
        _leave_in_order()


def _leave_in_order():
    """Rank 0 leaves a clean multi-rank job after its peers (Paddle 3.x).

    Rank 0 hosts the job's TCP store (and the plugin's groups' stores); in Paddle 3.x a libuv
    thread serves them, and when a peer's connection closes while rank 0 is already in its C++
    teardown (the static destructors after ``exit()``), that thread aborts rank 0 -- SIGABRT, no
    message, the job's work done, the launcher reporting a failed job (seen in about one of 15
    two-rank Trainer runs on a loaded 2-core host; the core dump shows
    ``LibUVClient::readCallback`` under ``LibUVMasterDaemon::run``). So at exit each peer counts
    itself out in the store, and rank 0, once all have, waits on a host group until every
    peer's process is gone (a receive from a peer fails when its sockets close) before its own
    teardown. Skipped in a process that dies of an exception, and when a peer has not counted
    itself out within a few seconds (a failed job: rank 0 must not hold up its peers' errors)."""
    group = _exit["order_group"]
    if group is None or getattr(sys, "last_value", None) is not None:  # no group, or dying of an exception
        return
    try:
        store = _job_store()
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

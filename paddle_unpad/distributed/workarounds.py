"""The plugin's changes to the process around Paddle's distributed runtime, each with the
versions it is for.

Everything here changes Paddle's or the interpreter's process-wide behaviour, is applied on
first use, never at import, and reports itself to ``paddle_unpad.info()``
(:func:`paddle_unpad._runtime.process_changes.record`, where each one is declared):

* **per-group rendezvous stores** (Paddle 2.6 and 3.x, gloo): :func:`install_group_stores`
  wraps Paddle's process-group factory so that each gloo group meets through a TCP store of
  its own;
* **TCP_NODELAY on store connections** (Paddle 2.6 and 3.x): :func:`quick_store_requests`;
* **threads and exit order** (the ``atexit`` handler): every background thread of the plugin
  registers here (:func:`register_thread`). At interpreter exit they are all told to stop
  first, then joined -- a thread blocked in a gloo collective with a stopped peer leaves it
  when gloo's own timeout (``GLOO_OWN_TIMEOUT_S``) fails the call -- so that no thread of the
  plugin is inside native code when the interpreter finalizes (a thread left there aborts the
  process: "terminate called without an active exception"); then the rank records that it has
  left, and rank 0 leaves after its peers, clean job or failed: the steps :mod:`paddle_unpad.distributed.groups`
  gives :func:`ensure_exit_handler` (``mark_left``, ``leave_in_order``: it issues every
  collective of the plugin, these included);
* **DataLoader threads that die** (Paddle 3.3.1's single-process DataLoader): the
  ``threading.excepthook`` of :func:`catch_thread_deaths` wakes the reader a dead loader
  thread would leave blocked (:func:`watch_thread`).

Groups, collectives and agreement live in :mod:`paddle_unpad.distributed.groups`, which
applies the first three when it makes the plugin's first group; the balanced loader's
:class:`~paddle_unpad.distributed.source.Source` applies the last. Besides
:mod:`paddle_unpad._runtime.paddle_compat`, this is the one module that may touch Paddle's
internals (tests/test_paddle_internals.py walks the source to keep it so).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import socket
import threading
import time
import weakref
from typing import Callable, Dict, List, Optional

from .._runtime import paddle_compat as _compat
from .._runtime import process_changes
from .. import config

log = logging.getLogger("paddle_unpad.distributed")

GLOO_OWN_TIMEOUT_S = 30.0  # a gloo collective that waits longer fails by itself (Paddle 2.6 and 3.x, CPU)
_EXIT_JOIN_S = GLOO_OWN_TIMEOUT_S + 10.0  # how long exit waits for the plugin's threads, all together


def job_store():
    """The job's TCP store, its connections given TCP_NODELAY (:func:`quick_store_requests`)."""
    store = _compat.job_store()
    quick_store_requests()
    return store


# ----------------------------------------------------------------------------- per-group rendezvous stores

_GROUP_STORE_KEY = "paddle_unpad/gloo_group_store"
_group_stores = []  # each group's own store, alive as long as the process (its group holds it too)
_group_store_uses = {}  # gid -> groups created with it so far (a reused custom gid gets a new key)


def install_group_stores(enabled=None, before_first_group: Optional[Callable[[], None]] = None):
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

    ``before_first_group``: called before each gloo group after the default one is created
    (:func:`paddle_unpad.distributed.groups.check_settings_agree`, which runs once per
    process: the ranks of a job that disagree on this setting would meet through different
    keys and wait for each other for ever)."""
    enabled = config.get("GLOO_GROUP_STORES") if enabled is None else enabled
    quick = config.get("STORE_NODELAY")
    impl = _compat.process_group_factory()
    if impl is None:  # a Paddle without this hook: leave it alone
        return False
    process_changes.record("process-group factory", applied=_factory_wrapped, reason=_factory_rules)
    original = getattr(impl, "_paddle_unpad_original", impl)
    if not (enabled or quick):
        _compat.set_process_group_factory(original)
        return False
    if impl is not original and getattr(impl, "_paddle_unpad_rules", None) == (enabled, quick):
        return enabled

    @functools.wraps(original)
    def new_process_group_impl(backend, store, rank, world_size, group_name, pg_options, group_id=0, *args, **kwargs):
        if quick:  # the job's store exists by now (fleet.init / init_parallel_env made it)
            quick_store_requests()
        if before_first_group is not None and backend == "gloo" and group_id != 0 and world_size > 1:
            before_first_group()  # before the first rendezvous the settings decide
        if enabled and backend == "gloo" and group_id != 0 and world_size > 1:
            store = _group_store(store, rank, world_size, group_id)
        return original(backend, store, rank, world_size, group_name, pg_options, group_id, *args, **kwargs)

    new_process_group_impl._paddle_unpad_original = original
    new_process_group_impl._paddle_unpad_rules = (enabled, quick)
    _compat.set_process_group_factory(new_process_group_impl)
    return enabled


def _factory_wrapped() -> bool:
    return getattr(_compat.process_group_factory(), "_paddle_unpad_rules", None) is not None


def _factory_rules():
    """What the wrapped factory in place does (``paddle_unpad.info()``); None: Paddle's own is."""
    rules = getattr(_compat.process_group_factory(), "_paddle_unpad_rules", None)
    return None if rules is None else f"group stores {rules[0]}, TCP_NODELAY {rules[1]}"


_store_ports = set()  # ports of the TCP stores this process talks to besides the job's
_nodelay_fds = set()  # descriptors of the store connections given TCP_NODELAY (paddle_unpad.info())


def _job_store_ports():
    """The ports Paddle may have taken the job's store from (its Python and C++ sides read
    different variables first: MASTER_ADDR/MASTER_PORT, PADDLE_MASTER, the first trainer)."""
    ports = set()
    for text in (
        os.environ.get("MASTER_PORT", ""),
        os.environ.get("PADDLE_MASTER", "").rpartition(":")[2],
        os.environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",")[0].rpartition(":")[2],
    ):
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
    process_changes.record("TCP_NODELAY", applied=bool(_nodelay_fds), connections=len(_nodelay_fds))
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
            raise RuntimeError(
                f"paddle_unpad.distributed: could not start the rendezvous store of gloo group {gid}: {error}"
            )
        job_store.set(key, f"{host}:{port}".encode())
    else:
        value = job_store.get(key).decode()  # waits for the key (2.6 and 3.x)
        if value.startswith("error: "):
            raise RuntimeError(
                f"paddle_unpad.distributed: the first member of gloo group {gid} could not start its rendezvous store ({value[7:]})"
            )
        host, _, port = value.rpartition(":")
        own = _compat.tcp_store(host, port, False, timeout)
    _group_stores.append(own)
    _store_ports.add(int(port))
    quick_store_requests()
    return own


# ----------------------------------------------------------------------------- threads and exit

_threads_lock = threading.Lock()
_threads: Dict[threading.Thread, Callable] = {}  # live background threads -> how to ask them to stop
_exit = {"installed": False}
_on_leave: List[Callable[[], None]] = []  # called at exit once the threads are joined
_leave_last: List[Callable[[], None]] = []  # then, when no thread is left inside a collective


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


def ensure_exit_handler(on_leave: Optional[Callable[[], None]] = None, leave_last: Optional[Callable[[], None]] = None):
    """Install the exit handler (idempotent): before the plugin's first group or thread. Each
    function is called once at exit, however often given:

    * ``on_leave``: after the plugin's threads are joined (no collective of the plugin runs any
      more), even when one did not end;
    * ``leave_last``: after those, only when every thread ended (a group a thread is still
      inside is not free for the exit ordering: :func:`paddle_unpad.distributed.groups.leave_in_order`)."""
    _ensure_exit_handler()
    for fn, fns in ((on_leave, _on_leave), (leave_last, _leave_last)):
        if fn is not None and fn not in fns:
            fns.append(fn)


def _ensure_exit_handler():
    if not _exit["installed"]:
        _exit["installed"] = True
        atexit.register(_at_exit)  # runs before atexit handlers registered earlier (Paddle's)
        process_changes.record("atexit handler", applied=True)


def _call_each(fns):
    for fn in list(fns):
        try:
            fn()
        except Exception:  # noqa: BLE001 - never fail an exit
            log.debug("paddle_unpad: an exit step failed", exc_info=True)


def _at_exit():
    with _threads_lock:
        items = list(_threads.items())
    alive = stop_and_join(items, _EXIT_JOIN_S)
    _call_each(_on_leave)
    if alive:
        log.warning(
            "paddle_unpad: %d background thread(s) still inside a collective at exit after %.0f s",
            len(alive),
            _EXIT_JOIN_S,
        )
        return  # their group is in use: no exit ordering on it
    _call_each(_leave_last)


# ----------------------------------------------------------------------------- DataLoader threads that die

_hook_lock = threading.Lock()
_watched: Dict[threading.Thread, Callable[[], None]] = {}  # DataLoader thread -> who to wake when it dies
_thread_exc: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # thread -> what ended it
_previous_hook = {"hook": None}  # threading.excepthook before the plugin's


def _excepthook(args):
    """``threading.excepthook`` once an exchange has iterated a loader.

    Paddle's single-process DataLoader (3.3.1) runs the dataset and ``collate_fn`` on a
    thread of its own; when they raise, that thread dies without waking the reader, and
    ``next()`` on the loader blocks for ever (and a process left blocked there aborts at
    exit).  This records the exception of every thread that dies of one, and wakes the
    reader that watches the thread (:func:`watch_thread`), so the error reaches every rank instead."""
    on_death = None
    if args.thread is not None:
        with _hook_lock:
            _thread_exc[args.thread] = args.exc_value
            on_death = _watched.pop(args.thread, None)
    if on_death is not None:
        on_death()
    (_previous_hook["hook"] or threading.__excepthook__)(args)


def catch_thread_deaths():
    """Install :func:`_excepthook` (idempotent; it calls the hook it replaces): before a
    DataLoader is first iterated, whose thread may fail at once."""
    with _hook_lock:
        if threading.excepthook is not _excepthook:
            _previous_hook["hook"] = threading.excepthook
            threading.excepthook = _excepthook
    process_changes.record("threading.excepthook", applied=lambda: threading.excepthook is _excepthook)


def watch_thread(thread: threading.Thread, on_death: Callable[[], None]):
    """Call ``on_death()`` when ``thread`` dies of an exception (at once if it has already)."""
    with _hook_lock:
        died = thread in _thread_exc
        if not died:
            _watched[thread] = on_death
    if died:
        on_death()


def unwatch_thread(thread: threading.Thread, on_death: Callable[[], None]):
    """Stop watching ``thread`` for ``on_death`` (another watcher's call is left)."""
    with _hook_lock:
        if _watched.get(thread) == on_death:
            del _watched[thread]


def thread_exception(thread: threading.Thread):
    """The exception ``thread`` died of; None while it has not."""
    return _thread_exc.get(thread)

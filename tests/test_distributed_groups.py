"""paddle_unpad.distributed.groups in one process: the per-group rendezvous stores and the store
connections without Nagle's delay. (When they are installed: tests/test_process_changes.py;
several ranks: tests/test_distributed_rules.py, test_distributed_faults.py,
test_distributed_nodes.py.)"""

import pytest

from launch_util import free_port
from paddle_unpad.distributed import groups, workarounds


def test_gloo_groups_get_their_own_store_and_nothing_else_changes(monkeypatch):
    """The rendezvous wrapper is installed once; it hands a gloo group after the default one a
    fresh store (published under the group's key), passes every other call through
    untouched, and switching it off restores Paddle's function."""
    from paddle.base import core
    from paddle.distributed import collective

    groups.install_group_stores(True)
    installed = collective._new_process_group_impl
    original = installed._paddle_unpad_original
    calls = []

    def fake(backend, store, rank, world_size, group_name, pg_options, group_id=0, **kw):
        calls.append((backend, store, rank, world_size, group_id, kw))
        return "pg"

    monkeypatch.setattr(collective, "_new_process_group_impl", fake)
    monkeypatch.setattr(workarounds, "_group_stores", [])
    monkeypatch.setattr(workarounds, "_group_store_uses", {})
    assert groups.install_group_stores(True)
    wrapper = collective._new_process_group_impl
    assert wrapper is not fake and wrapper._paddle_unpad_original is fake
    assert groups.install_group_stores(True) and collective._new_process_group_impl is wrapper  # once

    port = free_port()
    job = core.TCPStore("127.0.0.1", port, True, 0, 30)
    assert wrapper("nccl", job, 0, 2, "g", None, group_id=7, nccl_config=None) == "pg"
    assert wrapper("gloo", job, 0, 2, "g", None, group_id=0) == "pg"  # the default group
    assert wrapper("gloo", job, 0, 1, "g", None, group_id=8) == "pg"  # one rank: nothing to meet
    assert [c[1] is job for c in calls] == [True, True, True] and calls[0][5] == {"nccl_config": None}
    monkeypatch.setenv("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:6170")
    wrapper("gloo", job, 0, 3, "g", None, group_id=9)
    own = calls[-1][1]
    assert own is not job and calls[-1][2:5] == (0, 3, 9) and workarounds._group_stores == [own]
    host, _, own_port = job.get("paddle_unpad/gloo_group_store/9/0").decode().rpartition(":")
    assert host == "127.0.0.1" and int(own_port) not in (port, 6170)
    peer = core.TCPStore(host, int(own_port), False, 0, 30)  # what another member joins
    own.set("probe", b"seen")
    assert peer.get("probe") == b"seen"
    wrapper("gloo", job, 0, 3, "g", None, group_id=9)  # the same gid again: a key of its own
    assert job.get("paddle_unpad/gloo_group_store/9/1")

    # group stores off: gloo groups keep the job's store (the store-latency rule stays on)
    assert not groups.install_group_stores(False)
    kept = collective._new_process_group_impl
    assert kept is not wrapper and kept._paddle_unpad_original is fake
    kept("gloo", job, 0, 3, "g", None, group_id=10)
    assert calls[-1][1] is job
    monkeypatch.setenv("PADDLE_UNPAD_STORE_NODELAY", "0")  # both off: Paddle's function as it ships
    assert not groups.install_group_stores(False) and collective._new_process_group_impl is fake
    monkeypatch.setattr(collective, "_new_process_group_impl", installed)
    assert original is not installed


def _nodelay_of_connections_to(port):
    import os
    import socket

    seen = []
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if s.family == socket.AF_INET and s.type == socket.SOCK_STREAM and s.getpeername()[1] == port:
                seen.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        except OSError:
            pass
        finally:
            s.detach()
    return seen


def test_store_connections_send_without_nagles_delay(monkeypatch):
    """The job store's client connections (found by the port the launcher names) get
    TCP_NODELAY; other connections and the setting off leave them as Paddle opened them."""
    from paddle.base import core

    port, other = free_port(), free_port()
    server = core.TCPStore("127.0.0.1", port, True, 1, 30)
    client = core.TCPStore("127.0.0.1", port, False, 1, 30)
    unrelated_server = core.TCPStore("127.0.0.1", other, True, 1, 30)
    unrelated = core.TCPStore("127.0.0.1", other, False, 1, 30)
    client.set("k", b"v")
    unrelated.set("k", b"v")
    before = _nodelay_of_connections_to(port)
    assert before and not any(before), "Paddle's store opened its connections with TCP_NODELAY already"
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("PADDLE_TRAINER_ENDPOINTS", raising=False)
    monkeypatch.setenv("PADDLE_MASTER", f"127.0.0.1:{port}")
    monkeypatch.setenv("PADDLE_UNPAD_STORE_NODELAY", "0")
    assert workarounds.quick_store_requests() == 0 and not any(_nodelay_of_connections_to(port))
    monkeypatch.delenv("PADDLE_UNPAD_STORE_NODELAY")
    assert workarounds.quick_store_requests() == len(before)
    assert all(_nodelay_of_connections_to(port)) and not any(_nodelay_of_connections_to(other))
    assert client.get("k") == b"v" and unrelated.get("k") == b"v"  # the connections still work
    del server, unrelated_server


class _FakePG:
    def __init__(self, gid, ranks=(0, 1, 2), rank=0):
        self.id, self.ranks, self.rank = gid, list(ranks), rank


def test_released_groups_go_back_to_the_pool_unless_busy_failed_or_the_users(monkeypatch):
    """What :func:`groups.release` keeps for reuse (Paddle cannot free a process group), and that
    nothing is issued on a released group."""
    monkeypatch.setattr(groups, "_free", {})
    monkeypatch.setattr(groups, "_exit_order", {"group": None})
    mine = groups.Group(_FakePG(1 << 20), groups.HOST, "gloo", "sample exchange", owned=True)
    groups.issue("all_gather", mine)
    assert mine.conn["ops"] == 1
    groups._exit_order["group"] = mine
    groups.release(mine)
    groups.release(mine)  # idempotent
    groups.release(None)
    assert groups._free == {("gloo", (0, 1, 2)): [mine]} and groups._exit_order["group"] is mine  # idle: still fine
    with pytest.raises(RuntimeError, match="all_reduce on the sample exchange group after it was released"):
        groups.issue("all_reduce", mine)
    busy = groups.Group(_FakePG((1 << 20) + 1), groups.HOST, "gloo", "x", owned=True)
    busy.conn["busy"] = 1  # a thread still inside a collective
    failed = groups.Group(_FakePG((1 << 20) + 2), groups.HOST, "gloo", "x", owned=True)
    failed.conn["failed"] = True
    users = groups.Group(_FakePG(12), groups.HOST, "gloo", "x", owned=False)
    groups._exit_order["group"] = busy
    for g in (busy, failed, users):
        groups.release(g)
        assert g.released
    assert groups._free == {("gloo", (0, 1, 2)): [mine]}
    assert groups._exit_order["group"] is None  # the busy one is not waited on at exit; no idle one spans the job
    # outside a job (world 1) no group spans every rank; the idle pooled one would be taken in a 3-rank job
    monkeypatch.setattr(groups, "job", lambda: (0, 3))
    groups._exit_order["group"] = busy
    busy.released = False
    groups.release(busy)
    assert groups._exit_order["group"] is mine


def test_a_collective_that_fails_marks_its_group_not_reusable():
    g = groups.Group(_FakePG((1 << 20) + 3), groups.HOST, "gloo", "x", owned=True)
    with pytest.raises(ValueError):
        with groups._running("all_gather", g):
            assert g.conn["busy"] == 1
            raise ValueError("gloo failed")
    assert g.conn == {"ops": 1, "busy": 0, "failed": True}


class _GoneStore:
    def add(self, key, n):
        raise ValueError("(InvalidArgument) TCP receive error. Details: Connection reset by peer.")

    set = get = add


def test_a_store_that_cannot_be_reached_means_rank_0_has_left(monkeypatch):
    """The job's store is served by rank 0's process: a request that fails is "rank 0 has left the
    job", for the owners to raise as their own error; and a group's non-member is refused before
    it waits for anyone."""
    from paddle_unpad.distributed.errors import StoreHostLeft

    monkeypatch.setattr(workarounds, "job_store", lambda: _GoneStore())
    monkeypatch.setattr(groups, "job", lambda: (1, 2))
    with pytest.raises(
        StoreHostLeft,
        match=r"^paddle_unpad\.distributed: rank 0 has left the job: the job's store, "
        r"which rank 0's process serves, cannot be reached any more \(ValueError: "
        r"\(InvalidArgument\) TCP receive error",
    ):
        groups.agree("x", "1", 1.0)
    assert groups.who_left([0, 1]).startswith("rank 0 has left the job")
    groups.mark_left()  # at exit with rank 0 gone: nothing to tell, no error
    with pytest.raises(
        ValueError,
        match=r"^paddle_unpad\.distributed: the agreement on x over ranks \[0\] was built "
        r"on rank 1, which is not one of them",
    ):
        groups.agree("x", "1", 1.0, ranks=[0])


def test_a_rank_that_left_is_named_by_its_peers(monkeypatch):
    """At exit each rank counts itself out in the job's store; a peer whose collective then fails
    names it."""
    from paddle.base import core

    server = core.TCPStore("127.0.0.1", free_port(), True, 1, 30)
    monkeypatch.setattr(workarounds, "job_store", lambda: server)
    monkeypatch.setattr(groups, "job", lambda: (0, 3))
    assert groups.who_left([0, 1, 2]) == ""
    monkeypatch.setattr(groups, "job", lambda: (2, 3))
    groups.mark_left()  # rank 2 leaves
    monkeypatch.setattr(groups, "job", lambda: (0, 3))
    assert groups.who_left([0, 1, 2]) == "rank(s) [2] left the job (their process ended)"
    assert groups.who_left([0, 1]) == ""  # a group without it

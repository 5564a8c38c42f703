"""The measured inputs of the at-scale model in ``bench_exchange_scale.py``, each timed on this
host in the benchmark's run:

* ``store_request_s`` -- one request to Paddle's TCP store, as the plugin leaves the
  connection (``TCP_NODELAY``), and ``store_request_nagle_s`` as Paddle opens it;
* ``store_server_s`` -- the store server's time per request under load (several client
  processes at once: total requests / elapsed), what bounds a rendezvous that every rank
  talks to at once;
* ``connect_s`` / ``hop_s`` / ``bytes_per_s`` -- a TCP connect, a one-way small message
  (half a ping-pong) and bulk throughput, on loopback with Python sockets (gloo's C++ is
  faster: these are upper bounds on its costs here);
* ``planner_s`` -- ``balance.plan_dest`` for ``N`` ranks x 32 samples of BERT pre-training
  lengths, by ``N``.
"""

import os
import socket
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CLIENT = """
import os, sys, time
from paddle.base import core
from paddle_unpad.distributed import workarounds
port, me, clients, each = map(int, sys.argv[1:5])
store = core.TCPStore("127.0.0.1", port, False, 0, 60)
workarounds.quick_store_requests()  # PADDLE_MASTER names this store
store.add("ready", 1)
while store.add("ready", 0) < clients:
    time.sleep(0.001)
t0 = time.time()
for _ in range(each):
    store.get("k")
store.set(f"span/{me}", f"{t0},{time.time()}".encode())
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def store_costs(clients=4, each=2000):
    from paddle.base import core

    from paddle_unpad.distributed import workarounds

    port = _free_port()
    old = os.environ.get("PADDLE_MASTER")
    os.environ["PADDLE_MASTER"] = f"127.0.0.1:{port}"
    try:
        server = core.TCPStore("127.0.0.1", port, True, 0, 60)
        client = core.TCPStore("127.0.0.1", port, False, 0, 60)
        client.set("k", b"x" * 64)
        t = time.perf_counter()
        for _ in range(10):
            client.get("k")
        nagle = (time.perf_counter() - t) / 10
        workarounds.quick_store_requests()
        t = time.perf_counter()
        for _ in range(1000):
            client.get("k")
        quick = (time.perf_counter() - t) / 1000
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _CLIENT, str(port), str(i), str(clients), str(each)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for i in range(clients)
        ]
        for p in procs:
            if p.wait(timeout=300) != 0:
                raise RuntimeError(f"a store client exited with {p.returncode}")
        spans = [tuple(map(float, client.get(f"span/{i}").decode().split(","))) for i in range(clients)]
        server_s = (max(e for _, e in spans) - min(s for s, _ in spans)) / (clients * each)
        del server
    finally:
        if old is None:
            os.environ.pop("PADDLE_MASTER", None)
        else:
            os.environ["PADDLE_MASTER"] = old
    return {
        "store_request_s": quick,
        "store_request_nagle_s": nagle,
        "store_server_s": server_s,
        "store_clients": clients,
    }


def socket_costs(connects=300, pings=2000, bulk_mb=256):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(512)
    port = listener.getsockname()[1]
    mode = {"what": "connect"}

    def serve():
        while True:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if mode["what"] == "connect":
                conn.close()
            elif mode["what"] == "ping":
                for _ in range(pings):
                    conn.sendall(conn.recv(8))
                conn.close()
            else:
                buf, left = bytearray(1 << 20), bulk_mb << 20
                while left > 0:
                    left -= conn.recv_into(buf)
                conn.sendall(b"k")
                conn.close()
                return

    threading.Thread(target=serve, daemon=True).start()
    times = []
    for _ in range(connects):
        t = time.perf_counter()
        c = socket.create_connection(("127.0.0.1", port))
        times.append(time.perf_counter() - t)
        c.close()
    connect = statistics.median(times)
    mode["what"] = "ping"
    c = socket.create_connection(("127.0.0.1", port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = time.perf_counter()
    for _ in range(pings):
        c.sendall(b"12345678")
        c.recv(8)
    hop = (time.perf_counter() - t) / pings / 2
    c.close()
    mode["what"] = "bulk"
    c = socket.create_connection(("127.0.0.1", port))
    chunk = bytes(1 << 20)
    t = time.perf_counter()
    for _ in range(bulk_mb):
        c.sendall(chunk)
    c.recv(1)
    bw = (bulk_mb << 20) / (time.perf_counter() - t)
    c.close()
    listener.close()
    return {"connect_s": connect, "hop_s": hop, "bytes_per_s": bw}


def planner_costs(worlds, samples_per_rank=32, repeats=5):
    import numpy as np

    from paddle_unpad.balance import bert_pretraining_lengths, native_available, plan_dest

    out = {}
    for n in worlds:
        lengths = bert_pretraining_lengths(n * samples_per_rank, 512, seed=n).reshape(n, samples_per_rank)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            plan_dest(lengths)
            times.append(time.perf_counter() - t)
        out[str(n)] = statistics.median(times)
    return {
        "planner_s": out,
        "planner_native": bool(native_available()),
        "planner_lengths": f"bert_pretraining_lengths, {samples_per_rank} per rank",
        "np": np.__version__,
    }


def measure(worlds, quick=False):
    """Every input; ``quick``: fewer repetitions (a smoke run, noisier figures)."""
    res = {}
    res.update(store_costs(clients=2, each=200) if quick else store_costs())
    res.update(socket_costs(connects=30, pings=200, bulk_mb=16) if quick else socket_costs())
    res.update(planner_costs(worlds, repeats=1 if quick else 5))
    return res

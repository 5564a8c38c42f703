"""Two nodes on one host: two launchers started side by side (``--nnodes 2 --master
127.0.0.1:PORT --rank R``, Paddle 3.x's spelling; 2 ranks each), running balanced fine-tuning
with the gradient all-reduce, give the same per-step losses and parameters, rank by rank, as
one node of 4 ranks (tests/dist/nodes_worker.py)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from launch_util import descendants, free_port, job_env, kill_tree, worker_logs

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "dist", "nodes_worker.py")
BOUND_S = 150

pytestmark = pytest.mark.dist


def _results(log_dirs):
    out = {}
    for d in log_dirs:
        for name, text in worker_logs(d).items():
            for line in text.splitlines():
                if line.startswith("RESULT "):
                    res = json.loads(line[len("RESULT ") :])
                    out[res["rank"]] = res
    return out


def _launch(args_list, log_dirs):
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "paddle.distributed.launch", *args, "--log_dir", str(d), WORKER],
            cwd=ROOT,
            env=job_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for args, d in zip(args_list, log_dirs)
    ]
    rcs = []
    for p in procs:
        try:
            p.communicate(timeout=BOUND_S)
            rcs.append(p.returncode)
        except subprocess.TimeoutExpired:
            for q in procs:
                kill_tree(q.pid)
            rcs.append("timeout")
    return rcs


def test_two_nodes_on_one_host_match_one_node_of_four(tmp_path):
    one = [tmp_path / "one"]
    assert _launch([["--nproc_per_node", "4"]], one) == [0], worker_logs(one[0])
    master = f"127.0.0.1:{free_port()}"
    two = [tmp_path / "node0", tmp_path / "node1"]
    rcs = _launch(
        [["--master", master, "--nnodes", "2", "--rank", str(r), "--nproc_per_node", "2"] for r in (0, 1)], two
    )
    assert rcs == [0, 0], (rcs, {str(d): worker_logs(d) for d in two})
    a, b = _results(one), _results(two)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3], (a, b)
    assert all(b[r]["nnodes"] == 2 and a[r]["nnodes"] == 1 for r in range(4))
    for r in range(4):
        assert len(a[r]["losses"]) == 4, a[r]
        assert b[r]["losses"] == pytest.approx(a[r]["losses"], rel=1e-6), (r, a[r], b[r])
        assert b[r]["checksum"] == pytest.approx(a[r]["checksum"], rel=1e-6), (r, a[r], b[r])


def test_missing_node_waits_before_any_worker_and_a_signal_ends_it(tmp_path):
    """With a node missing, the launcher of the present one waits in Paddle's peer sync (no
    deadline of its own) before starting any worker; a TERM, as ``timeout N`` sends it,
    ends it at once, with nothing left running: the bound docs/distributed.md gives."""
    log_dir = tmp_path / "alone"
    cmd = [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        "--master",
        f"127.0.0.1:{free_port()}",
        "--nnodes",
        "2",
        "--rank",
        "0",
        "--nproc_per_node",
        "1",
        "--log_dir",
        str(log_dir),
        WORKER,
    ]
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    seen, t0 = [], time.monotonic()
    try:
        for line in p.stdout:  # the launcher says it waits, then keeps polling the master
            seen.append(line)
            if "Waiting peer start" in line or time.monotonic() - t0 > 60:
                break
        assert any("Waiting peer start" in s for s in seen), "".join(seen[-30:])
        time.sleep(3)  # still waiting: no worker was started
        assert p.poll() is None and worker_logs(log_dir) == {}, (p.poll(), worker_logs(log_dir))
        kids = descendants(p.pid)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            kill_tree(p.pid)
    assert p.returncode not in (None, 0), p.returncode
    assert [k for k in kids if _running(k)] == [], kids


def _running(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except OSError:
        return False

"""Starting the ranks of a CPU (gloo) job directly, each with the environment
``paddle.distributed.launch`` gives its workers, so that every rank's own exit code, output
and exit time are seen (the launcher stops the others about a second after one fails, which
hides what they would have done). Bounded: every process is killed at the end.

A worker prints ``RESULT {json}`` lines; :attr:`Rank.results` parses them.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from launch_util import ROOT, free_port

ABORT_MARKS = (
    "terminate called",
    "SIGABRT",
    "Process abort signal",
    "Aborted (core dumped)",
    "core dumped",
    "Segmentation fault",
    "SIGSEGV",
)


def rank_env(rank, world, master, endpoints, **extra):
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",  # a crash prints every thread's Python stack into the rank's output
            "PADDLE_MASTER": master,
            "PADDLE_TRAINER_ID": str(rank),
            "PADDLE_GLOBAL_RANK": str(rank),
            "PADDLE_LOCAL_RANK": str(rank),
            "PADDLE_RANK_IN_NODE": str(rank),
            "PADDLE_TRAINERS_NUM": str(world),
            "PADDLE_GLOBAL_SIZE": str(world),
            "PADDLE_LOCAL_SIZE": str(world),
            "PADDLE_NNODES": "1",
            "PADDLE_DISTRI_BACKEND": "gloo",
            "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
            "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
        },
        **extra,
    )
    return env


class Rank:
    def __init__(self, rank, proc, log):
        self.rank, self.proc, self.log = rank, proc, log
        self.rc, self.out, self.exit_s = None, "", None

    @property
    def results(self):
        return [json.loads(line[len("RESULT ") :]) for line in self.out.splitlines() if line.startswith("RESULT ")]

    def __repr__(self):
        return f"rank {self.rank}: rc={self.rc} after {self.exit_s}s\n{self.out[-4000:]}"


def run_ranks(worker, args, world, bound=75.0, kill_after_exit_of=None, env=None):
    """Start ``world`` ranks of ``python worker *args``; wait (at most ``bound`` seconds) for
    them to exit. ``kill_after_exit_of``: ranks whose exit makes the runner SIGKILL the ranks
    still alive (a stopped peer never exits by itself). A rank still alive at ``bound`` fails the
    caller's test (AssertionError)."""
    with tempfile.TemporaryDirectory() as tmp:
        master = f"127.0.0.1:{free_port()}"
        endpoints = [f"127.0.0.1:{free_port()}" for _ in range(world)]
        t0 = time.monotonic()
        ranks = []
        try:
            for r in range(world):
                log = open(os.path.join(tmp, f"{r}.log"), "wb")
                p = subprocess.Popen(
                    [sys.executable, worker, *args],
                    cwd=ROOT,
                    env=rank_env(r, world, master, endpoints, **(env or {})),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                ranks.append(Rank(r, p, log))
            while time.monotonic() - t0 < bound:
                for rk in ranks:
                    if rk.exit_s is None and rk.proc.poll() is not None:
                        rk.exit_s = round(time.monotonic() - t0, 2)
                done = [rk for rk in ranks if rk.exit_s is not None]
                if len(done) == len(ranks):
                    break
                if kill_after_exit_of is not None and all(ranks[r].exit_s is not None for r in kill_after_exit_of):
                    for rk in ranks:
                        if rk.proc.poll() is None:
                            os.killpg(rk.proc.pid, signal.SIGKILL)
                time.sleep(0.05)
        finally:
            for rk in ranks:
                if rk.proc.poll() is None:
                    os.killpg(rk.proc.pid, signal.SIGKILL)
                rk.rc = rk.proc.wait()
                rk.log.close()
                with open(rk.log.name, errors="replace") as f:
                    rk.out = f.read()
        stuck = [rk for rk in ranks if rk.exit_s is None]
        assert not stuck, f"still running after {bound} s (killed): {stuck}"
    return ranks


def assert_no_abort(ranks):
    for rk in ranks:
        assert rk.rc not in (-signal.SIGABRT, 128 + signal.SIGABRT, -signal.SIGSEGV), rk
        for mark in ABORT_MARKS:
            assert mark not in rk.out, f"{mark!r} in the output of {rk}"


def one_failure(rk):
    res = [r for r in rk.results if "exc" in r]
    assert len(res) == 1, rk
    return res[0]

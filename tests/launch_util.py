"""Running ``python -m paddle.distributed.launch`` from a test, bounded: on timeout the
launcher and every process under it are killed (the launcher starts each worker in a
session of its own, so killing the launcher alone would leave them running)."""

import os
import signal
import socket
import subprocess
import sys


def descendants(pid):
    """Every process below ``pid`` (children first), from /proc."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def kill_tree(pid):
    for p in descendants(pid) + [pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_bounded(cmd, timeout, **kw):
    """``(returncode, output)``; returncode is ``"timeout"`` when the command (and all of
    its processes, killed then) outlived ``timeout`` seconds."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, **kw)
    try:
        out, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        out, _ = p.communicate()
        rc = "timeout"
    return rc, out.decode(errors="replace")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = [sys.executable, "-m", "paddle.distributed.launch"]


def free_port():
    """A TCP port free on 127.0.0.1 at the time of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra):
    """The environment of a test's job: one math thread per process, this checkout first on
    the path, no endpoints inherited from an enclosing job; ``extra`` added."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("PADDLE_TRAINER_ENDPOINTS", None)
    return env


def worker_logs(log_dir):
    """``{"workerlog.N": text}`` of a launch's log folder (empty when there is none)."""
    log_dir = str(log_dir)
    if not os.path.isdir(log_dir):
        return {}
    out = {}
    for name in sorted(os.listdir(log_dir)):
        if name.startswith("workerlog."):
            with open(os.path.join(log_dir, name), errors="replace") as f:
                out[name] = f.read()
    return out


def launch_cmd(script_args, nproc, log_dir):
    """The command line ``python -m paddle.distributed.launch --nproc_per_node nproc`` of ``script_args``."""
    return LAUNCHER + ["--nproc_per_node", str(nproc), "--log_dir", str(log_dir), *script_args]


def launch_job(script_args, nproc, log_dir, timeout, cwd=ROOT, env=None):
    """:func:`launch_cmd` bounded (:func:`run_bounded`): ``(returncode, launcher output, worker_logs(log_dir))``."""
    cmd = launch_cmd(script_args, nproc, log_dir)
    rc, out = run_bounded(cmd, timeout, cwd=cwd, env=job_env() if env is None else env)
    return rc, out, worker_logs(log_dir)

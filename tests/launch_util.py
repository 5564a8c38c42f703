"""Running ``python -m paddle.distributed.launch`` from a test, bounded: on timeout the
launcher and every process under it are killed (the launcher starts each worker in a
session of its own, so killing the launcher alone would leave them running)."""
import os
import signal
import subprocess


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

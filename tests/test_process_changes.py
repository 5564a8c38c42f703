"""import paddle_unpad changes nothing in the process but MKL's kernel choice, the operators'
registration and the finder of the modules' old names; every other process-wide change waits for
the feature that needs it, and paddle_unpad.info() says which, from what the code that makes each
change reported."""

import ast
import ctypes
import importlib
import inspect
import json
import os
import platform
import subprocess
import sys
import threading

import pytest

from paddle_unpad import config
from paddle_unpad._runtime import process_changes

# One fresh process: the state before and after the import, then after a DistributedStrategy.
PROBE = r"""
import atexit, csv, ctypes, json, sys, tempfile, threading
import paddle
from paddle.distributed import collective

libc = ctypes.CDLL("libc.so.6")
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def mmapped(n=64 << 20):
    # glibc's default serves a block this large by mmap; after the plugin's mallopt, from the heap
    before = libc.mallinfo2().hblkhd
    p = libc.malloc(n)
    grown = libc.mallinfo2().hblkhd - before
    libc.free(p)
    return grown >= n

def state():
    return {"mmapped": mmapped(), "factory": id(collective._new_process_group_impl),
            "atexit": atexit._ncallbacks(), "excepthook": id(threading.excepthook),
            "csv_field_limit": csv.field_size_limit(), "meta_path": [type(f).__qualname__ for f in sys.meta_path]}

out = {"before": state()}
with_paddle = set(sys.modules)
import paddle_unpad as pu
out["imported"], out["info_imported"] = state(), pu.info()
out["modules_imported"] = sorted(set(sys.modules) - with_paddle)
with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
    f.write("text,label\n" + "x" * 200000 + ",1\n")  # a field over csv's default limit
from paddle_unpad.data import files
out["wide_row"] = len(files.read_table(f.name)[0][1]["text"])
out["after_csv"] = state()
import paddle_unpad.trainer  # the Trainer's groups get their stores when an UnpadTrainer is built
out["trainer_imported"], out["info_trainer"] = state(), pu.info()
pu.fleet.DistributedStrategy()
out["strategy"], out["info_strategy"] = state(), pu.info()
print(json.dumps(out))
"""


def _glibc_with_mallinfo2():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="the malloc probe reads glibc's mallinfo2 (glibc >= 2.33)")
def test_import_changes_nothing_and_a_strategy_applies_the_group_and_malloc_changes():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", config.PREFIX))}
    env.pop("GLIBC_TUNABLES", None)
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    before, imported, strategy = got["before"], got["imported"], got["strategy"]
    assert before["mmapped"], "glibc's default should map a 64 MiB block: the probe cannot see a change"
    # the one import-time change outside os.environ and Paddle's op registry: the finder of old names
    assert imported == dict(before, meta_path=before["meta_path"] + ["_Finder"])
    # inference pays for no distributed code: nothing of it loads beyond what `import paddle` loaded
    assert [
        m
        for m in got["modules_imported"]
        if m.startswith(
            (
                "paddle_unpad.distributed",
                "paddle.distributed",
                "paddle_unpad.fleet",
                "paddle_unpad.trainer",
                "paddle_unpad.models",
                "paddlenlp",
            )
        )
    ] == []
    # a csv file with a long field is read, and csv's process-wide limit is the user's again after
    assert got["wide_row"] == 200000 and got["after_csv"]["csv_field_limit"] == before["csv_field_limit"]
    assert {name: c["applied"] for name, c in got["info_imported"].items()} == {
        "MKL_DEBUG_CPU_TYPE": got["info_imported"]["MKL_DEBUG_CPU_TYPE"]["applied"],
        "operator library": got["info_imported"]["operator library"]["path"] is not None,
        "module aliases": True,
        "mallopt": False,
        "process-group factory": False,
        "atexit handler": False,
        "threading.excepthook": False,
        "TCP_NODELAY": False,
    }
    # importing the Trainer's module changes nothing either (what it imports may register atexit
    # handlers of its own: datasets, pyarrow)
    trainer = got["trainer_imported"]
    assert (trainer["factory"], trainer["excepthook"], trainer["mmapped"]) == (
        before["factory"],
        before["excepthook"],
        True,
    )
    assert got["info_trainer"] == got["info_imported"]
    # the strategy starts a training job: the group fix and the malloc setting apply now
    assert strategy["factory"] != before["factory"] and not strategy["mmapped"]
    assert (strategy["atexit"], strategy["excepthook"]) == (trainer["atexit"], before["excepthook"])
    info = got["info_strategy"]
    assert info["process-group factory"]["applied"] and info["mallopt"]["applied"]
    assert info["mallopt"]["when"] == "first use: paddle_unpad.fleet.DistributedStrategy"


def _recorded(source):
    """The change names a module's source passes to record() (first argument, a literal)."""
    return {
        n.args[0].value
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Call)
        and getattr(n.func, "attr", getattr(n.func, "id", None)) == "record"
        and n.args
        and isinstance(n.args[0], ast.Constant)
    }


def test_every_change_is_reported_by_the_function_its_declaration_names():
    """Each declared change names the function that makes it, and its module reports it:
    pu.info() is built from those reports, never by reading another module's state."""
    for name, change in process_changes.CHANGES.items():
        module_name, _, function = change.by.rpartition(".")
        module = importlib.import_module(f"paddle_unpad.{module_name}")
        assert callable(getattr(module, function, None)), f"{name!r}: no function {change.by}"
        assert name in _recorded(inspect.getsource(module)), f"{module_name} does not report {name!r}"
    source = inspect.getsource(process_changes)
    ours = [
        (n.level, n.module, [a.name for a in n.names])
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.ImportFrom) and n.level
    ]
    assert ours == [(2, None, ["config"])] and "sys.modules" not in source  # no other module of the plugin read


def test_a_change_describes_what_was_last_reported():
    change = process_changes.Change(
        "probe", "tests.nothing", "at the probe", "it is a probe", reason="not yet", count=0
    )
    assert change.describe() == {"applied": False, "when": "at the probe", "why": "not yet; it is a probe", "count": 0}
    state = {"on": True}
    change.report(lambda: state["on"], when="now", reason="asked", count=lambda: 3)
    assert change.describe() == {"applied": True, "when": "now", "why": "asked; it is a probe", "count": 3}
    state["on"] = False  # undone since: a reported function is read at each describe()
    assert change.describe()["applied"] is False
    with pytest.raises(ValueError, match=r"'probe' change has no field\(s\) \['size'\]"):
        change.report(True, size=1)
    with pytest.raises(ValueError, match="no process change named 'probe'"):
        process_changes.record("probe")


def test_the_loader_thread_hook_reports_itself_and_wakes_the_watcher(monkeypatch):
    from paddle_unpad.distributed import workarounds

    seen = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(("previous", args.exc_value)))
    monkeypatch.setattr(workarounds, "_previous_hook", {"hook": None})
    workarounds.catch_thread_deaths()
    assert process_changes.info()["threading.excepthook"]["applied"]
    error = ValueError("the dataset failed")

    def fail():
        raise error

    th = threading.Thread(target=fail)
    workarounds.watch_thread(th, lambda: seen.append("woken"))
    th.start()
    th.join()
    assert seen == ["woken", ("previous", error)] and workarounds.thread_exception(th) is error
    workarounds.watch_thread(th, lambda: seen.append("late"))  # watched after it died: woken at once
    assert seen[-1] == "late"
    # another hook in its place (the process's own, whatever an earlier test left): no longer applied
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    assert not process_changes.info()["threading.excepthook"]["applied"]

"""import paddle_unpad changes nothing in the process but MKL's kernel choice, the operators'
registration and the finder of the modules' old names; every other process-wide change waits for
the feature that needs it, and paddle_unpad.info() says which."""
import ctypes
import json
import os
import platform
import subprocess
import sys

import pytest

from paddle_unpad import config

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
    assert [m for m in got["modules_imported"] if m.startswith(("paddle_unpad.distributed", "paddle.distributed",
            "paddle_unpad.fleet", "paddle_unpad.trainer", "paddle_unpad.models", "paddlenlp"))] == []
    # a csv file with a long field is read, and csv's process-wide limit is the user's again after
    assert got["wide_row"] == 200000 and got["after_csv"]["csv_field_limit"] == before["csv_field_limit"]
    assert {name: c["applied"] for name, c in got["info_imported"].items()} == {
        "MKL_DEBUG_CPU_TYPE": got["info_imported"]["MKL_DEBUG_CPU_TYPE"]["applied"],
        "operator library": got["info_imported"]["operator library"]["path"] is not None, "module aliases": True,
        "mallopt": False,
        "process-group factory": False, "atexit handler": False, "threading.excepthook": False,
        "TCP_NODELAY": False}
    # the strategy starts a training job: the group fix and the malloc setting apply now
    assert strategy["factory"] != before["factory"] and not strategy["mmapped"]
    assert (strategy["atexit"], strategy["excepthook"]) == (before["atexit"], before["excepthook"])
    info = got["info_strategy"]
    assert info["process-group factory"]["applied"] and info["mallopt"]["applied"]
    assert info["mallopt"]["when"] == "first use: paddle_unpad.fleet.DistributedStrategy"

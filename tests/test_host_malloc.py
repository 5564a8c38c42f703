"""paddle_unpad._runtime.host_malloc: freed host memory is kept for reuse, not faulted in again."""

import json
import os
import platform
import subprocess
import sys

import pytest

from paddle_unpad import config
from paddle_unpad._runtime import host_malloc

pytestmark = pytest.mark.paddle_gpu_stage

ENV = config.variable("HOST_MALLOC").env
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# One process: allocate and free a 64 MiB tensor (above glibc's largest adaptive mmap
# threshold, 32 MiB), then count the minor page faults of allocating and filling another.
PROBE = r"""
import json, resource
import paddle_unpad as pu
import paddle
from paddle_unpad.layers import UnpadTransformerEncoderLayer

UnpadTransformerEncoderLayer(8, 2, 16)  # the first use of a training feature applies the setting

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

n = 16 << 20
for _ in range(2):
    x = paddle.full([n], 1.0, dtype="float32")
    del x
f0 = faults()
y = paddle.full([n], 2.0, dtype="float32")
got = faults() - f0
print(json.dumps({"faults": got, "pages": n * 4 // 4096, "info": pu._runtime.host_malloc.info(), "sum": float(y[:4].sum())}))
"""


def _probe(**env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != ENV}
    full.update(env, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the setting acts through glibc's mallopt; this C library is not glibc")
def test_retained_memory_is_reused_without_page_faults():
    kept = _probe()
    assert kept["info"]["action"] == "retain", kept["info"]
    assert kept["sum"] == 8.0
    # the 64 MiB tensor reuses freed heap memory: (almost) none of its 16384 pages fault
    assert kept["faults"] < kept["pages"] // 20, kept
    default = _probe(**{ENV: "off"})
    assert default["info"] == {
        "action": "unchanged",
        "why": f"{ENV}=off",
        "when": "first use: UnpadTransformerEncoderLayer built",
    }
    # glibc's default maps it fresh, and every page faults on the first write (fewer with
    # transparent huge pages, which fault 2 MiB at a time)
    assert default["faults"] > 8 * kept["faults"] + 20, (default, kept)


def test_nothing_changes_when_off_bad_or_tuned_by_the_user(monkeypatch):
    saved = host_malloc.info()
    try:
        host_malloc.configure({ENV: "off"})
        assert host_malloc.info() == {"action": "unchanged", "why": f"{ENV}=off", "when": None}
        with pytest.raises(config.ConfigError, match=f"{ENV}='sometimes'.*retain, off"):
            host_malloc.configure({ENV: "sometimes"})
        assert host_malloc.info() == {"action": "unchanged", "why": f"{ENV}=off", "when": None}
        host_malloc.configure({"MALLOC_TRIM_THRESHOLD_": "1000000"})
        assert host_malloc.info() == {
            "action": "unchanged",
            "when": None,
            "why": "malloc tuned by the user (MALLOC_TRIM_THRESHOLD_)",
        }
        host_malloc.configure({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"})
        assert host_malloc.info()["why"] == "malloc tuned by the user (GLIBC_TUNABLES)"
        # an arena limit is not about returning memory: the setting still applies
        monkeypatch.setattr(host_malloc, "_glibc", lambda: (None, "not glibc here"))
        host_malloc.configure({"MALLOC_ARENA_MAX": "2"})
        assert host_malloc.info() == {"action": "unchanged", "why": "not glibc here", "when": None}
    finally:
        host_malloc._state.update(saved)

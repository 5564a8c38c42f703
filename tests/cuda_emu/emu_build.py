"""Builds the CUDA kernels for the CPU emulation (tests/cuda_emu/emu.h) into one shared
library: every custom_ops/kernels/cuda/*.cu, the C-ABI harness (custom_ops/harness) and the
single-instruction probes of tests/cuda_emu/isa_probes.cu, compiled by g++ with

  - `#include "emu.h"` in front of each source (emulated threads, barriers, shuffles; it
    defines PU_CUDA_EMULATION, which makes cuda_common.cuh take the emulated
    instructions of emu_isa.h instead of inline PTX);
  - kernel launches `k<<<grid, block, smem, stream>>>(args);` rewritten to
    `emu::launch(k, grid, block, smem, stream, args);`
  - `extern __shared__ T name[];` rewritten to the block's emulated dynamic shared memory.

The library is built once per process (the test modules share it).
"""

import atexit
import ctypes
import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import testutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "gpu"))
import pu_harness  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))
OPS = os.path.join(ROOT, "custom_ops")
FLAGS = ["-std=c++20", "-O1", "-fPIC", "-pthread", "-Wno-deprecated-declarations"]

_LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^;{}]*?>)?)<<<(.+?)>>>\((.*?)\);", re.S)
_DYN_SMEM = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w:]+(?:\s+[\w:]+)*?)\s+(\w+)\[\];")


class Unavailable(Exception):
    """The emulation cannot be built on this machine (no g++ / CUDA headers)."""


def sources():
    cuda = sorted(glob.glob(os.path.join(OPS, "kernels", "cuda", "*.cu")))
    return cuda + [os.path.join(OPS, "harness", "pu_cuda_harness.cu"), os.path.join(HERE, "isa_probes.cu")]


def rewrite(text, header=False):
    """CUDA source -> the C++ the emulation compiles."""
    text = _DYN_SMEM.sub(lambda m: f"{m[1]}* {m[2]} = reinterpret_cast<{m[1]}*>(emu::dynamic_smem());", text)
    text = _LAUNCH.sub(lambda m: f"emu::launch({m[1]}, {m[2]}, {m[3]});", text)
    assert "<<<" not in text, "a kernel launch the emulation build cannot rewrite"
    return text if header else '#include "emu.h"\n' + text


def cuda_include():
    from paddle_unpad._runtime import build_config as cfg

    nvcc = cfg.find_nvcc()
    for home in (
        os.environ.get("CUDA_HOME"),
        os.environ.get("CUDA_PATH"),
        nvcc and os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
        "/usr/local/cuda",
    ):
        if home and os.path.exists(os.path.join(home, "include", "cuda_fp16.h")):
            return os.path.join(home, "include")
    return None


def _run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


@functools.lru_cache(maxsize=None)
def build():
    """Path of the emulated library; raises Unavailable when it cannot be built here."""
    inc = cuda_include()
    if shutil.which("g++") is None or inc is None:
        raise Unavailable("g++ or the CUDA headers (cuda_fp16.h) not found")
    out = tempfile.mkdtemp(prefix="pu_cuda_emu_")
    atexit.register(shutil.rmtree, out, True)
    # Kernels live in headers too: rewritten copies of kernels/cuda/*.cuh shadow the
    # originals (the output folder comes first on the include path).
    flags = FLAGS + ["-I" + out, "-I" + HERE, "-I" + OPS, "-isystem", inc]
    os.makedirs(os.path.join(out, "kernels", "cuda"))
    for path in glob.glob(os.path.join(OPS, "kernels", "cuda", "*.cuh")):
        with open(path) as f:
            text = rewrite(f.read(), header=True)
        with open(os.path.join(out, "kernels", "cuda", os.path.basename(path)), "w") as f:
            f.write(text)
    cmds = []
    for path in sources():
        with open(path) as f:
            text = rewrite(f.read())
        src = os.path.join(out, os.path.basename(path) + ".cpp")
        with open(src, "w") as f:
            f.write(text)
        cmds.append(["g++", *flags, "-c", src, "-o", src + ".o"])
    cmds.append(["g++", *flags, "-c", os.path.join(HERE, "runtime_stubs.cpp"), "-o", os.path.join(out, "stubs.o")])
    # Largest translation units first, so the two cores finish together.
    order = sorted(range(len(cmds)), key=lambda i: -os.path.getsize(cmds[i][-3]))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        procs = dict(zip(order, pool.map(_run, [cmds[i] for i in order])))
    failed = [procs[i] for i in sorted(procs) if procs[i].returncode != 0]
    if failed and "ucontext.h" in failed[0].stderr and "No such file" in failed[0].stderr:
        raise Unavailable("no <ucontext.h> (fibers of the emulation)")
    assert not failed, failed[0].stderr[-4000:]
    so = os.path.join(out, "libpu_cuda_emulated.so")
    link = _run(["g++", "-shared", "-pthread", *[c[-1] for c in cmds], "-o", so])
    assert link.returncode == 0, link.stderr[-4000:]
    return so


def load(pytest):
    """ctypes library, its harness functions typed as the GPU build's (tests/gpu/pu_harness.py);
    skips locally / fails under CI when the emulation cannot be built (it is native code: CI
    must not pass on a row of skips)."""
    try:
        so = build()
    except Unavailable as e:
        msg = f"CUDA emulation not built: {e}"
        if testutil.in_ci():
            pytest.fail("CI=true: " + msg)
        pytest.skip(msg)
    lib = pu_harness.declare_abi(ctypes.CDLL(so))
    lib.emu_probe_last_error.restype = ctypes.c_char_p
    return lib

"""CI compile check of every CUDA source (no GPU needed, only nvcc).

* Framework-free kernels (``custom_ops/kernels/cuda/*.cu``) and the C-ABI harness
  (``custom_ops/harness/*.cu``) are compiled with CUDA headers only: no Paddle include
  path, so a Paddle type sneaking into them fails here.
* The Paddle glue (``custom_ops/paddle/*.cu``) is compiled with the flags of the real
  build (``paddle_unpad._runtime.build_config.nvcc_flags()``, see docs/gpu.md).
* The C++ glue (``custom_ops/paddle/*.cc``) is syntax-checked with ``PADDLE_WITH_CUDA``
  defined, so the GPU branches of the op registrations are compiled too.

Strictness: host code ``-Wall -Wextra -Werror``, nvcc ``-Werror all-warnings``, and any
output at all from a compile counts as a failure. One diagnostic is suppressed for the
Paddle glue only: #20012-D, which Paddle's own header ``paddle/common/dim.h`` triggers.

Archs: ``PADDLE_UNPAD_CUDA_ARCHS`` (default "80;90", as the build). Sources compile in
parallel (``PADDLE_UNPAD_BUILD_JOBS``, default all cores). Skips only when nvcc is absent.
"""

import glob
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = os.path.join(ROOT, "custom_ops")
sys.path.insert(0, ROOT)

from paddle_unpad._runtime import build_config as cfg  # noqa: E402  (stdlib + lazy paddle only)

NVCC = cfg.find_nvcc()
pytestmark = [
    pytest.mark.build,
    pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA_HOME, CUDA_PATH, PATH): CUDA compile check skipped"),
]

FREE_GLOBS = ["harness/*.cu"]  # kernels/cuda/*.cu: the shared build (conftest's cuda_kernel_build)
GLUE_GLOBS = ["paddle/*.cu"]
STRICT = ["-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror"]
GLUE_SUPPRESS = ["-diag-suppress", "20012"]  # Paddle's phi/common/dim.h, not our code


def _rel(p):
    return os.path.relpath(p, OPS)


def _sources(globs):
    out = []
    for g in globs:
        out += sorted(glob.glob(os.path.join(OPS, g)))
    return out


def _gencode():
    flags = []
    for a in cfg.cuda_archs():
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    return flags


def _cuda_include():
    """The toolkit's include folder (nvcc may be a wrapper script outside the toolkit)."""
    homes = [
        os.environ.get("CUDA_HOME"),
        os.environ.get("CUDA_PATH"),
        os.path.dirname(os.path.dirname(os.path.realpath(NVCC))),
        "/usr/local/cuda",
    ]
    for h in homes:
        if h and os.path.exists(os.path.join(h, "include", "cuda_runtime.h")):
            return os.path.join(h, "include")
    return os.path.join(homes[2], "include")


def _commands(tmp):
    cmds = {}
    free_flags = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-I" + OPS, *_gencode(), *STRICT]
    for src in _sources(FREE_GLOBS):
        obj = os.path.join(tmp, _rel(src).replace(os.sep, "_") + ".o")
        cmds[_rel(src)] = [NVCC, *free_flags, "-c", src, "-o", obj]
    glue = _sources(GLUE_GLOBS)
    cc = sorted(glob.glob(os.path.join(OPS, "paddle", "*.cc")))
    if glue or cc:
        nflags = cfg.nvcc_flags()  # -gencode of cuda_archs(), Paddle include paths
        for src in glue:
            obj = os.path.join(tmp, _rel(src).replace(os.sep, "_") + ".o")
            cmds[_rel(src)] = [NVCC, *nflags, *STRICT, *GLUE_SUPPRESS, "-c", src, "-o", obj]
        # The .cc glue with the CUDA branches on (PADDLE_NO_PYTHON: the toolkit may have
        # no cuBLAS headers, which Paddle's Python-binding headers pull in).
        inc = _cuda_include()
        cxx = os.environ.get("CXX", "g++")
        for src in cc:
            cmds[_rel(src) + " [PADDLE_WITH_CUDA]"] = [
                cxx,
                *cfg.cxx_flags(True),
                "-DPADDLE_NO_PYTHON",
                "-Werror",
                "-isystem",
                inc,
                "-isystem",
                os.path.join(inc, "cccl"),
                "-fsyntax-only",
                src,
            ]
    return cmds


@pytest.fixture(scope="module")
def compiled(cuda_kernel_build):
    """Compile everything once, in parallel; {unit: (returncode, output, seconds, command)}. The
    kernel units come from the session's one build, which benchmarks/kernel_static.py reads too."""
    with tempfile.TemporaryDirectory(prefix="pu_cuda_compile_") as tmp:
        cmds = _commands(tmp)
        jobs = int(os.environ.get("PADDLE_UNPAD_BUILD_JOBS", "0")) or (os.cpu_count() or 1)

        def run(item):
            name, cmd = item
            t = time.time()
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            return name, (proc.returncode, proc.stdout, time.time() - t, " ".join(cmd))

        t0 = time.time()
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            results = dict(pool.map(run, sorted(cmds.items())))
        wall = time.time() - t0
    assert cuda_kernel_build is not None, "nvcc was found here but not by the shared build"
    for b in cuda_kernel_build["built"].values():
        results[_rel(b.unit)] = (b.returncode, b.output, b.seconds, b.command)
    print(f"\nCUDA compile check: {len(results)} units, archs {cfg.cuda_archs()}, {jobs} jobs, {wall:.1f} s wall")
    for name, (rc, _, secs, _) in sorted(results.items()):
        print(f"  {secs:6.1f} s  rc={rc}  {name}")
    return results


def test_every_cuda_source_is_compiled(compiled):
    every = sorted(_rel(p) for p in glob.glob(os.path.join(OPS, "**", "*.cu"), recursive=True))
    assert every, "no .cu sources found under custom_ops"
    missing = [p for p in every if p not in compiled]
    assert not missing, f"CUDA sources not covered by the compile check: {missing}"


def test_cuda_sources_compile_without_warnings(compiled):
    bad = []
    for name, (rc, out, _, cmd) in sorted(compiled.items()):
        if rc != 0 or out.strip():
            bad.append(f"--- {name} (rc={rc})\n$ {cmd}\n{out.strip()[-4000:]}")
    assert not bad, "\n".join(bad)


def test_framework_free_kernels_include_no_paddle():
    pat = re.compile(r'#\s*include\s*[<"](paddle/|phi/|glog|gflags)')
    offenders = []
    for src in _sources(["kernels/cuda/*.cu", "kernels/cuda/*.cuh", "harness/*.cu"]):
        with open(src) as f:
            for i, line in enumerate(f, 1):
                if pat.search(line):
                    offenders.append(f"{_rel(src)}:{i}: {line.strip()}")
    assert not offenders, offenders

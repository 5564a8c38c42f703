"""How the custom-operator library is compiled: sources, flags, the compile loop.

Used by ``setup.py`` (install) and by ``paddle_unpad._runtime.native`` (JIT fallback from a
source checkout), so both builds are the same build. Only the standard library and
paddle are imported here; the module must not import the rest of the package.
"""

import glob
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(HERE)
ROOT = os.path.dirname(PACKAGE)

try:
    from . import paddle_compat as compat
    from .. import config
except ImportError:  # setup.py loads this file as a top-level module, before the package exists
    sys.path[:0] = [HERE, PACKAGE]
    import config
    import paddle_compat as compat

    del sys.path[:2]
CUSTOM_OPS = os.path.join(ROOT, "custom_ops")

# Framework-free kernels plus the Paddle glue. The CPU kernels are compiled for
# several ISAs inside their own files (``#pragma GCC target``) and picked at run time,
# so the default build runs on any x86-64 and still uses AVX-512 where it exists.
CPU_GLOBS = ["kernels/common/*.cc", "kernels/cpu/*.cc", "paddle/*.cc"]
CUDA_GLOBS = ["kernels/cuda/*.cu", "paddle/*.cu"]


def library_tag():
    """Names the operator library after the Paddle it is built against (e.g. ``p33cpu``,
    ``p26gpu``): the C++ ABI differs between Paddle versions and between its CPU and GPU
    builds, and one checkout may serve several virtual environments (``make setup`` and
    ``make setup PADDLE=gpu``), each of which must find its own library."""
    major, minor = compat.PADDLE_VERSION
    return f"p{major}{minor}{'gpu' if compat.paddle_has_cuda() else 'cpu'}"


def library_stem():
    return "_ops_lib_" + library_tag()


def find_installed_library(folder):
    """The library in ``folder`` built for the running Paddle, or None (libraries built for
    another Paddle are left alone: registering them would abort the process)."""
    found = sorted(
        glob.glob(os.path.join(folder, library_stem() + ".*so"))
        + glob.glob(os.path.join(folder, library_stem() + ".so"))
    )
    return found[0] if found else None


def ops_sources(with_cuda, root=CUSTOM_OPS):
    globs = CPU_GLOBS + (CUDA_GLOBS if with_cuda else [])
    out = []
    for g in globs:
        out += sorted(glob.glob(os.path.join(root, g)))
    return [os.path.relpath(p, ROOT) if root == CUSTOM_OPS else p for p in out]


def headers(root=CUSTOM_OPS):
    return sorted(p for ext in ("h", "cuh") for p in glob.glob(os.path.join(root, "**", f"*.{ext}"), recursive=True))


class CudaToolkit(NamedTuple):
    nvcc: str
    include_dirs: Tuple[str, ...]  # incl. include/cccl (thrust, cub) where the toolkit keeps them there
    library_dirs: Tuple[str, ...]  # where libcudart is
    found_by: str  # how it was found, for messages


def _ask_nvcc(nvcc, found_by):
    """The toolkit ``nvcc`` belongs to, from nvcc's own account (``--dryrun``) of the
    include and library folders it passes on. ``realpath(nvcc)`` is not enough: ``nvcc``
    on PATH may be a wrapper script outside the toolkit."""
    try:
        proc = subprocess.run(
            [nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    incs, libs = [], []
    for line in proc.stdout.splitlines():
        line = line.lstrip("#$ ").strip()
        key, _, value = line.partition("=")
        if key in ("INCLUDES", "SYSTEM_INCLUDES", "LIBRARIES"):
            words = shlex.split(value)
            for i, w in enumerate(words):
                if w.startswith("-I") and len(w) > 2:
                    incs.append(w[2:])
                elif w == "-isystem" and i + 1 < len(words):
                    incs.append(words[i + 1])
                elif w.startswith("-L") and len(w) > 2:
                    libs.append(w[2:])
    incs = [os.path.normpath(d) for d in incs if os.path.isdir(d)]
    libs = [os.path.normpath(d) for d in libs if os.path.isdir(d) and glob.glob(os.path.join(d, "libcudart.so*"))]
    if not any(os.path.exists(os.path.join(d, "cuda_runtime.h")) for d in incs) or not libs:
        return None
    return CudaToolkit(nvcc, tuple(dict.fromkeys(incs)), tuple(dict.fromkeys(libs)), found_by)


def _nvcc_in(home):
    nvcc = os.path.join(home, "bin", "nvcc")
    return nvcc if os.path.isfile(nvcc) and os.access(nvcc, os.X_OK) else None


def find_cuda():
    """The CUDA toolkit to build with, found the way Paddle users expect, or None.

    1. ``CUDA_HOME`` / ``CUDA_PATH`` (an error when set to a folder without ``bin/nvcc``:
       the user asked for that toolkit);
    2. what ``paddle.utils.cpp_extension`` finds (used only when it holds ``bin/nvcc``
       and the CUDA headers: it guesses from ``which nvcc``, which may be a wrapper);
    3. ``nvcc`` on PATH, asked where its toolkit is.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var, "").strip()
        if home:
            nvcc = _nvcc_in(home)
            if nvcc is None:
                raise RuntimeError(
                    f"paddle_unpad: {var}={home!r} has no bin/nvcc: point it at a CUDA toolkit, or unset it"
                )
            found = _ask_nvcc(nvcc, f"${var}")
            if found is None:
                raise RuntimeError(
                    f"paddle_unpad: {var}={home!r}: {nvcc} does not report the CUDA headers and libcudart"
                )
            return found
    home = compat.paddle_cuda_home()
    if home and _nvcc_in(home) and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
        found = _ask_nvcc(_nvcc_in(home), "paddle.utils.cpp_extension")
        if found is not None:
            return found
    nvcc = shutil.which("nvcc")
    return _ask_nvcc(nvcc, "nvcc on PATH") if nvcc else None


def find_nvcc():
    cuda = find_cuda()
    return cuda.nvcc if cuda else None


def cuda_plan():
    """(build the CUDA kernels?, one line saying why not or None).

    Raises when the ``REQUIRE_CUDA`` setting is on and they cannot be built, so that a GPU
    set-up never passes as a CPU-only build.
    """
    import paddle

    reason = None
    if config.get("SKIP_CUDA"):
        reason = f"{config.variable('SKIP_CUDA').env} is set"
    elif not paddle.is_compiled_with_cuda():
        reason = f"Paddle {paddle.__version__} is a CPU build"
    elif find_cuda() is None:
        reason = f"Paddle {paddle.__version__} has CUDA, but no CUDA toolkit was found ($CUDA_HOME, $CUDA_PATH, paddle.utils.cpp_extension, nvcc on PATH); set CUDA_HOME to build the CUDA kernels"
    if reason and config.get("REQUIRE_CUDA"):
        raise RuntimeError(
            f"paddle_unpad: {config.variable('REQUIRE_CUDA').env} is set but the CUDA kernels cannot be built: {reason}"
        )
    return reason is None, reason


def cuda_wanted():
    """CUDA sources are compiled when Paddle has CUDA, a toolkit is found and no env var says no."""
    return cuda_plan()[0]


def cuda_archs():
    """The SM versions to compile for (checked by :mod:`paddle_unpad.config`)."""
    return config.sm_versions(config.get("CUDA_ARCHS"))


def _paddle_paths():
    incs, libs, core, _ = compat.extension_build_paths(use_cuda=False)
    return incs, libs, core


def cxx_flags(with_cuda):
    incs, _, _ = _paddle_paths()
    flags = [
        "-std=c++17",
        "-O3",
        "-fPIC",
        "-pthread",
        # no errno / trap semantics: lets exp/max loops vectorise; results stay IEEE
        "-fno-math-errno",
        "-fno-trapping-math",
        "-ffp-contract=fast",  # FMA where the ISA has it (ISO mode turns contraction off)
        "-Wall",
        "-Wno-unused-function",
        "-D_GLIBCXX_USE_CXX11_ABI=1",
        "-DPADDLE_WITH_CUSTOM_KERNEL",
        "-DPADDLE_EXTENSION_NAME=paddle_unpad_ops",
        "-I" + CUSTOM_OPS,
    ]
    if with_cuda:
        # Paddle's headers include cuda_runtime.h and thrust once PADDLE_WITH_CUDA is set
        flags.append("-DPADDLE_WITH_CUDA")
        flags += ["-isystem" + d for d in find_cuda().include_dirs]
    if config.get("NATIVE_ARCH"):
        flags.append("-march=native")
    flags += ["-isystem" + i for i in incs]
    return flags


def nvcc_flags():
    incs, _, _ = _paddle_paths()
    flags = [
        "-std=c++17",
        "-O3",
        "-Xcompiler",
        "-fPIC",
        "--expt-relaxed-constexpr",
        "-diag-suppress=20012",  # Paddle's own headers: __host__ __device__ on defaulted members
        "-DPADDLE_WITH_CUDA",
        "-DEIGEN_USE_GPU",
        "-DPADDLE_WITH_CUSTOM_KERNEL",
        "-DPADDLE_NO_PYTHON",
        "-D_GLIBCXX_USE_CXX11_ABI=1",
        "-DPADDLE_EXTENSION_NAME=paddle_unpad_ops",
        "-I" + CUSTOM_OPS,
    ]
    for a in cuda_archs():
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    for i in incs:  # nvcc wants "-isystem DIR" as two arguments
        flags += ["-isystem", i]
    return flags


def link_flags(with_cuda):
    _, libdirs, core = _paddle_paths()
    flags = ["-shared", "-pthread"]
    for d in libdirs:
        flags += ["-L" + d, "-Wl,-rpath," + d]
    # libpaddle must be linked even though only headers are "used" by the glue
    flags += ["-Wl,--no-as-needed", "-l:" + core, "-Wl,--as-needed"]
    if with_cuda:
        for d in find_cuda().library_dirs:
            flags += ["-L" + d, "-Wl,-rpath," + d]
        flags.append("-lcudart")
    return flags


def build_fingerprint(with_cuda):
    """Hash of every input of the build: sources, headers, flags. Names the JIT cache folder."""
    h = hashlib.sha256()
    for p in [os.path.join(ROOT, s) for s in ops_sources(with_cuda)] + headers():
        h.update(p.encode())
        with open(p, "rb") as f:
            h.update(f.read())
    h.update(" ".join(cxx_flags(with_cuda)).encode())
    if with_cuda:
        h.update(" ".join([find_nvcc(), *nvcc_flags(), *link_flags(True)]).encode())
    h.update(library_tag().encode())
    h.update(__file__.encode())
    return h.hexdigest()[:16]


def _run(cmd, verbose):
    if verbose:
        print(" ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"paddle_unpad: command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}")
    if proc.stdout.strip() and verbose:
        print(proc.stdout, flush=True)


def build_ops_library(out_path, tmp_dir, verbose=False, with_cuda=None):
    """Compile every op source (in parallel) into ``tmp_dir`` and link ``out_path``."""
    if with_cuda is None:
        with_cuda, why_not = cuda_plan()
        if why_not and compat.paddle_has_cuda():
            print(f"paddle_unpad: building the CPU operators only: {why_not}", file=sys.stderr, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    srcs = [os.path.join(ROOT, s) for s in ops_sources(with_cuda)]
    newest_header = max([os.path.getmtime(h) for h in headers()] + [0.0])
    cxx = os.environ.get("CXX", "g++")
    cflags = cxx_flags(with_cuda)
    nflags = nvcc_flags() if with_cuda else []
    # Objects are reused by mtime, so they must never be shared between flag sets
    # (another Paddle, CUDA on/off, other archs): one folder per set.
    flag_set = hashlib.sha256(" ".join([library_tag(), cxx, *cflags, *nflags]).encode()).hexdigest()[:12]
    tmp_dir = os.path.join(tmp_dir, flag_set)
    os.makedirs(tmp_dir, exist_ok=True)

    def obj_of(src):
        rel = os.path.relpath(src, CUSTOM_OPS).replace(os.sep, "_")
        return os.path.join(tmp_dir, rel + ".o")

    def compile_one(src):
        obj = obj_of(src)
        if os.path.exists(obj) and os.path.getmtime(obj) >= max(os.path.getmtime(src), newest_header):
            return obj
        if src.endswith(".cu"):
            cmd = [find_nvcc(), *nflags, "-c", src, "-o", obj]
        else:
            cmd = [cxx, *cflags, "-c", src, "-o", obj]
        _run(cmd, verbose)
        return obj

    # Our own compile loop instead of paddle.utils.cpp_extension.setup: that one compiles
    # the units one after another and takes a single Extension; here g++ and nvcc units
    # run side by side (measured in docs/gpu.md), and objects are reused when unchanged.
    jobs = config.get("BUILD_JOBS") or (os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        objs = list(pool.map(compile_one, srcs))
    tmp_out = out_path + ".tmp"
    _run([cxx, *objs, "-o", tmp_out, *link_flags(with_cuda)], verbose)
    os.replace(tmp_out, out_path)  # atomic: a concurrent loader never sees half a library
    return out_path


if __name__ == "__main__":  # python paddle_unpad/_runtime/build_config.py [OUT.so [OBJ_DIR]]
    import sysconfig

    # the name setup.py gives it: the loader takes the first match by name, so a plain ".so" beside an
    # older tagged one would not be the one loaded
    default_out = os.path.join(PACKAGE, library_stem() + sysconfig.get_config_var("EXT_SUFFIX"))
    out = sys.argv[1] if len(sys.argv) > 1 else default_out
    objs = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "build", "paddle_unpad_ops")
    build_ops_library(out, objs, verbose=True)

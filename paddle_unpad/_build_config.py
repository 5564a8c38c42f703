"""How the custom-operator library is compiled: sources, flags, the compile loop.

Used by ``setup.py`` (install) and by ``paddle_unpad._native`` (JIT fallback from a
source checkout), so both builds are the same build. Only the standard library and
paddle are imported here; the module must not import the rest of the package.
"""
import glob
import hashlib
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CUSTOM_OPS = os.path.join(ROOT, "custom_ops")

# Framework-free kernels plus the Paddle glue. The CPU kernels are compiled for
# several ISAs inside their own files (``#pragma GCC target``) and picked at run time,
# so the default build runs on any x86-64 and still uses AVX-512 where it exists.
CPU_GLOBS = ["kernels/cpu/*.cc", "paddle/*.cc"]
CUDA_GLOBS = ["kernels/cuda/*.cu", "paddle/*.cu"]


def _env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def ops_sources(with_cuda, root=CUSTOM_OPS):
    globs = CPU_GLOBS + (CUDA_GLOBS if with_cuda else [])
    out = []
    for g in globs:
        out += sorted(glob.glob(os.path.join(root, g)))
    return [os.path.relpath(p, ROOT) if root == CUSTOM_OPS else p for p in out]


def headers(root=CUSTOM_OPS):
    return sorted(
        p
        for ext in ("h", "cuh")
        for p in glob.glob(os.path.join(root, "**", f"*.{ext}"), recursive=True)
    )


def cuda_wanted():
    """CUDA sources are compiled when Paddle has CUDA, nvcc exists and no env var says no."""
    if _env_flag("PADDLE_UNPAD_SKIP_CUDA"):
        return False
    import paddle

    return bool(paddle.is_compiled_with_cuda()) and find_nvcc() is not None


def find_nvcc():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def cuda_archs():
    raw = os.environ.get("PADDLE_UNPAD_CUDA_ARCHS", "80;90")
    archs = [a.strip() for a in raw.replace(",", ";").replace(" ", ";").split(";") if a.strip()]
    for a in archs:
        if not a.isdigit() or int(a) < 80:
            raise ValueError(
                f"PADDLE_UNPAD_CUDA_ARCHS: {a!r} is not a supported SM version (need 80 or newer, e.g. '80;90')"
            )
    return archs


def _paddle_paths():
    import warnings

    with warnings.catch_warnings():  # paddle warns about ccache on import; irrelevant here
        warnings.simplefilter("ignore")
        from paddle.utils.cpp_extension.extension_utils import (
            _get_core_name,
            find_paddle_includes,
            find_paddle_libraries,
            find_python_includes,
        )

    use_cuda = False
    try:
        import paddle

        use_cuda = bool(paddle.is_compiled_with_cuda())
    except Exception:
        pass
    incs = find_paddle_includes(use_cuda) + find_python_includes()
    return incs, find_paddle_libraries(use_cuda), _get_core_name()


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
        flags.append("-DPADDLE_WITH_CUDA")
    if _env_flag("PADDLE_UNPAD_NATIVE_ARCH"):
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
        nvcc = find_nvcc()
        cuda_lib = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "lib64")
        flags += ["-L" + cuda_lib, "-Wl,-rpath," + cuda_lib, "-lcudart"]
    return flags


def build_fingerprint(with_cuda):
    """Hash of every input of the build: sources, headers, flags. Names the JIT cache folder."""
    h = hashlib.sha256()
    for p in [os.path.join(ROOT, s) for s in ops_sources(with_cuda)] + headers():
        h.update(p.encode())
        with open(p, "rb") as f:
            h.update(f.read())
    h.update(" ".join(cxx_flags(with_cuda)).encode())
    h.update(__file__.encode())
    return h.hexdigest()[:16]


def _run(cmd, verbose):
    if verbose:
        print(" ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}")
    if proc.stdout.strip() and verbose:
        print(proc.stdout, flush=True)


def build_ops_library(out_path, tmp_dir, verbose=False, with_cuda=None):
    """Compile every op source (in parallel) into ``tmp_dir`` and link ``out_path``."""
    if with_cuda is None:
        with_cuda = cuda_wanted()
    os.makedirs(tmp_dir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    srcs = [os.path.join(ROOT, s) for s in ops_sources(with_cuda)]
    newest_header = max([os.path.getmtime(h) for h in headers()] + [0.0])
    cxx = os.environ.get("CXX", "g++")
    cflags = cxx_flags(with_cuda)
    nflags = nvcc_flags() if with_cuda else []

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

    jobs = int(os.environ.get("PADDLE_UNPAD_BUILD_JOBS", "0")) or (os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        objs = list(pool.map(compile_one, srcs))
    tmp_out = out_path + ".tmp"
    _run([cxx, *objs, "-o", tmp_out, *link_flags(with_cuda)], verbose)
    os.replace(tmp_out, out_path)  # atomic: a concurrent loader never sees half a library
    return out_path


if __name__ == "__main__":  # python paddle_unpad/_build_config.py OUT.so TMPDIR
    build_ops_library(sys.argv[1], sys.argv[2], verbose=True)

"""ctypes wrapper of custom_ops/harness/libpu_cuda_harness.so for torch CUDA tensors.

Used by tests/gpu and benchmarks/bench_gpu_fmha.py on a GPU machine (no Paddle needed).
``load()`` finds the library (env ``PU_CUDA_HARNESS``, else the harness build folder) and
builds it with ``make`` when it is missing and nvcc is available.
"""
import ctypes
import os
import shutil
import subprocess

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARNESS_DIR = os.path.join(ROOT, "custom_ops", "harness")
DEFAULT_LIB = os.path.join(HARNESS_DIR, "build", "libpu_cuda_harness.so")

_i64, _i32, _f32, _u64, _vp = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_uint64, ctypes.c_void_p
_PROBLEM = [_vp, _i64, _i64, _i64, _i64, _i32, _f32, _f32, _u64, _u64, _i32, _i32]


class HarnessError(RuntimeError):
    pass


def library_path():
    return os.environ.get("PU_CUDA_HARNESS") or DEFAULT_LIB


def build(arch=None):
    """make -C custom_ops/harness [ARCH=..]; returns the library path."""
    if shutil.which("make") is None or shutil.which("nvcc") is None:
        raise HarnessError("cannot build the harness: make or nvcc not on PATH")
    cmd = ["make", "-C", HARNESS_DIR, f"-j{os.cpu_count() or 1}"]
    if arch:
        cmd.append(f"ARCH={arch}")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise HarnessError("harness build failed:\n" + proc.stdout[-6000:])
    return DEFAULT_LIB


class Harness:
    def __init__(self, path):
        self.path = path
        lib = ctypes.CDLL(path)
        lib.pu_harness_last_error.restype = ctypes.c_char_p
        lib.pu_harness_abi_version.restype = _i32
        lib.pu_fmha_fwd.argtypes = _PROBLEM + [_vp] * 5 + [_vp]
        lib.pu_fmha_fwd.restype = _i32
        lib.pu_fmha_bwd.argtypes = _PROBLEM + [_vp] * 10 + [_vp]
        lib.pu_fmha_bwd.restype = _i32
        lib.pu_fmha_bwd_workspace_bytes.argtypes = [_i64, _i64]
        lib.pu_fmha_bwd_workspace_bytes.restype = _i64
        self.lib = lib
        assert lib.pu_harness_abi_version() == 1

    def _check(self, rc):
        if rc != 0:
            raise HarnessError(self.lib.pu_harness_last_error().decode())

    @staticmethod
    def _dtype_code(t):
        import torch

        if t.dtype == torch.float16:
            return 0
        if t.dtype == torch.bfloat16:
            return 1
        return 2

    @staticmethod
    def _ptr(t):
        return None if t is None else ctypes.c_void_p(t.data_ptr())

    def _problem(self, q, cu, scale, dropout, seed, offset, grouping, streams):
        cu = np.ascontiguousarray(cu, dtype=np.int32)
        T, H, D = q.shape
        return cu, [cu.ctypes.data_as(ctypes.c_void_p), cu.size - 1, T, H, D, self._dtype_code(q),
                    float(scale), float(dropout), int(seed) & 0xFFFFFFFFFFFFFFFF,
                    int(offset) & 0xFFFFFFFFFFFFFFFF, int(bool(grouping)), int(streams)]

    def fwd(self, q, k, v, cu, scale, dropout=0.0, seed=0, offset=0, grouping=True, streams=4,
            out=None, lse=None, stream=None):
        """out [T, H, D] (q's dtype), lse [T, H] fp32. Preallocated out/lse may be views."""
        import torch

        T, H, _ = q.shape
        out = torch.empty_like(q) if out is None else out
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device) if lse is None else lse
        keep, args = self._problem(q, cu, scale, dropout, seed, offset, grouping, streams)
        st = (stream or torch.cuda.current_stream()).cuda_stream
        self._check(self.lib.pu_fmha_fwd(*args, self._ptr(q), self._ptr(k), self._ptr(v),
                                         self._ptr(out), self._ptr(lse), ctypes.c_void_p(st)))
        del keep
        return out, lse

    def bwd(self, q, k, v, out, lse, dout, cu, scale, dropout=0.0, seed=0, offset=0, grouping=True,
            streams=4, dq=None, dk=None, dv=None, workspace=None, stream=None):
        import torch

        T, H, _ = q.shape
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(q) if dk is None else dk
        dv = torch.empty_like(q) if dv is None else dv
        if workspace is None:
            nbytes = self.lib.pu_fmha_bwd_workspace_bytes(T, H)
            workspace = torch.empty(nbytes // 4, dtype=torch.float32, device=q.device)
        keep, args = self._problem(q, cu, scale, dropout, seed, offset, grouping, streams)
        st = (stream or torch.cuda.current_stream()).cuda_stream
        self._check(self.lib.pu_fmha_bwd(*args, self._ptr(q), self._ptr(k), self._ptr(v),
                                         self._ptr(out), self._ptr(lse), self._ptr(dout),
                                         self._ptr(dq), self._ptr(dk), self._ptr(dv),
                                         self._ptr(workspace), ctypes.c_void_p(st)))
        del keep
        return dq, dk, dv


_loaded = {}


def load(build_if_missing=True):
    path = library_path()
    if path in _loaded:
        return _loaded[path]
    if not os.path.exists(path):
        if not build_if_missing or "PU_CUDA_HARNESS" in os.environ:
            raise HarnessError(f"harness library not found at {path}")
        path = build()
    _loaded[path] = Harness(path)
    return _loaded[path]

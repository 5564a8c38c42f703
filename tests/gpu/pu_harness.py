"""ctypes wrapper of custom_ops/harness/libpu_cuda_harness.so for torch CUDA tensors.

Used by tests/gpu, benchmarks/bench_gpu_fmha.py and benchmarks/bench_gpu_fused.py on a
GPU machine (no Paddle needed), and for its C ABI (:func:`declare_abi`, :func:`fmha_problem`)
by the CPU emulation's tests (tests/cuda_emu), which load the same harness.
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
_GELU = [_i64, _i64, _i32, _i32]  # rows, cols, dtype, path
# rows, cols, dtypes of x / residual / LayerNorm parameters, dropout, epsilon, seed, offset, path
_BDRLN = [_i64, _i64, _i32, _i32, _i32, _f32, _f32, _u64, _u64, _i32]
# The kernel entry points' arguments before the CUDA stream, which every one takes last.
ENTRY_POINTS = {
    "pu_fmha_fwd": _PROBLEM + [_vp] * 5,
    "pu_fmha_bwd": _PROBLEM + [_i32] + [_vp] * 10,  # _i32: deterministic
    "pu_bias_gelu_fwd": _GELU + [_vp] * 3,
    "pu_bias_gelu_bwd": _GELU + [_vp] * 6,
    "pu_bdrln_fwd": _BDRLN + [_vp] * 8,
    "pu_bdrln_bwd": _BDRLN + [_vp] * 13,
}
WORKSPACE_BYTES = {
    "pu_fmha_bwd_workspace_bytes": [_i64, _i64, _i64, _i32],  # T, H, D, deterministic
    "pu_bias_gelu_bwd_workspace_bytes": [_i64, _i64],  # rows, cols
    "pu_bdrln_bwd_workspace_bytes": [_i64, _i64],
}
ABI_VERSION = 4  # pu_harness_abi_version() of custom_ops/harness (4: fmha backward takes `deterministic`)
_U64 = 0xFFFFFFFFFFFFFFFF

# `path` of the fused-op entries: bit 0 = element-wise loads, bit 1 = general (wide) bdrln path.
PATH_DEFAULT, PATH_ELEMENTWISE, PATH_WIDE = 0, 1, 2


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


def declare_abi(lib):
    """Gives the harness's functions of a loaded library (the GPU build, or the CPU emulation's)
    their ctypes argument and result types; returns ``lib``."""
    for name, args in ENTRY_POINTS.items():
        fn = getattr(lib, name)
        fn.argtypes = args + [_vp]
        fn.restype = _i32
    for name, args in WORKSPACE_BYTES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = _i64
    lib.pu_harness_last_error.restype = ctypes.c_char_p
    lib.pu_harness_abi_version.restype = _i32
    return lib


def fmha_problem(cu, shape, dtype_code, scale, dropout=0.0, seed=0, offset=0, grouping=True, streams=4):
    """The arguments pu_fmha_fwd and pu_fmha_bwd start with, for q, k, v of ``shape`` [T, H, D]:
    ``(cu, args)``, cu_seqlens as the int32 array the first argument points into (the caller
    keeps it alive until the call returns)."""
    cu = np.ascontiguousarray(cu, dtype=np.int32)
    T, H, D = shape
    return cu, [
        cu.ctypes.data_as(ctypes.c_void_p),
        cu.size - 1,
        T,
        H,
        D,
        dtype_code,
        float(scale),
        float(dropout),
        int(seed) & _U64,
        int(offset) & _U64,
        int(bool(grouping)),
        int(streams),
    ]


class Harness:
    def __init__(self, path):
        self.path = path
        self.lib = declare_abi(ctypes.CDLL(path))
        version = self.lib.pu_harness_abi_version()
        if version != ABI_VERSION:
            raise HarnessError(
                f"{path}: harness ABI {version}, expected {ABI_VERSION} (rebuild it: "
                "make -C custom_ops/harness clean all)"
            )

    def _call(self, name, args, tensors, stream):
        """lib.<name>(*args, the tensors' pointers, the stream); a refusal raises HarnessError."""
        import torch

        ptrs = (None if t is None else ctypes.c_void_p(t.data_ptr()) for t in tensors)
        st = ctypes.c_void_p((stream or torch.cuda.current_stream()).cuda_stream)
        if getattr(self.lib, name)(*args, *ptrs, st) != 0:
            raise HarnessError(self.lib.pu_harness_last_error().decode())

    @staticmethod
    def _dtype_code(t):
        import torch

        if t.dtype == torch.float16:
            return 0
        if t.dtype == torch.bfloat16:
            return 1
        return 2

    def fwd(self, q, k, v, cu, scale, *problem, out=None, lse=None, stream=None, **problem_kw):
        """out [T, H, D] (q's dtype), lse [T, H] fp32. Preallocated out/lse may be views.
        problem / problem_kw: the rest of :func:`fmha_problem`'s arguments (dropout, seed, offset,
        grouping, streams), in that order or by name."""
        import torch

        T, H, _ = q.shape
        out = torch.empty_like(q) if out is None else out
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device) if lse is None else lse
        keep, args = fmha_problem(cu, q.shape, self._dtype_code(q), scale, *problem, **problem_kw)
        self._call("pu_fmha_fwd", args, (q, k, v, out, lse), stream)
        del keep
        return out, lse

    def bwd(
        self,
        q,
        k,
        v,
        out,
        lse,
        dout,
        cu,
        scale,
        *problem,
        dq=None,
        dk=None,
        dv=None,
        workspace=None,
        stream=None,
        deterministic=False,
        **problem_kw,
    ):
        """dq, dk, dv [T, H, D] (q's dtype). deterministic=False: the one-pass backward (dQ
        added with fp32 atomics); True: the two-kernel backward, bitwise on reruns. problem /
        problem_kw: as :meth:`fwd`'s."""
        import torch

        T, H, D = q.shape
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(q) if dk is None else dk
        dv = torch.empty_like(q) if dv is None else dv
        if workspace is None:
            nbytes = self.lib.pu_fmha_bwd_workspace_bytes(T, H, D, int(bool(deterministic)))
            workspace = torch.empty(nbytes // 4, dtype=torch.float32, device=q.device)
        keep, args = fmha_problem(cu, q.shape, self._dtype_code(q), scale, *problem, **problem_kw)
        tensors = (q, k, v, out, lse, dout, dq, dk, dv, workspace)
        self._call("pu_fmha_bwd", [*args, int(bool(deterministic))], tensors, stream)
        del keep
        return dq, dk, dv

    # ------------------------------------------------------------------------ fused ops
    # x, residual, dy, ...: [..., F] contiguous (views of a bigger buffer are fine);
    # vectors [F]; all one dtype (float16, bfloat16 or float32).

    @staticmethod
    def _fused_dtype_code(t):
        import torch

        codes = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
        if t.dtype not in codes:
            raise HarnessError(f"fused ops: dtype {t.dtype} has no harness code (float16, bfloat16, float32)")
        return codes[t.dtype]

    @staticmethod
    def _rows_cols(x):
        cols = x.shape[-1]
        return (x.numel() // cols if cols else 0), cols

    def _workspace(self, name, x):
        """The fp32 scratch buffer the backward entry of workspace-bytes function ``name`` needs for x."""
        import torch

        nbytes = getattr(self.lib, name)(*self._rows_cols(x))
        return torch.empty((nbytes + 3) // 4, dtype=torch.float32, device=x.device)

    def bias_gelu_fwd(self, x, bias, y=None, path=PATH_DEFAULT, stream=None):
        import torch

        y = torch.empty_like(x) if y is None else y
        args = [*self._rows_cols(x), self._fused_dtype_code(x), path]
        self._call("pu_bias_gelu_fwd", args, (x, bias, y), stream)
        return y

    def bias_gelu_bwd(self, x, bias, dy, dx=None, dbias=None, workspace=None, path=PATH_DEFAULT, stream=None):
        import torch

        dx = torch.empty_like(x) if dx is None else dx
        dbias = torch.empty_like(bias) if dbias is None else dbias
        if workspace is None:
            workspace = self._workspace("pu_bias_gelu_bwd_workspace_bytes", x)
        args = [*self._rows_cols(x), self._fused_dtype_code(x), path]
        self._call("pu_bias_gelu_bwd", args, (x, bias, dy, dx, dbias, workspace), stream)
        return dx, dbias

    def _bdrln_args(self, x, residual, ln_weight, path, dropout=0.0, epsilon=1e-12, seed=0, offset=0):
        codes = (self._fused_dtype_code(t) for t in (x, residual, ln_weight))
        seed, offset = int(seed) & _U64, int(offset) & _U64
        return [*self._rows_cols(x), *codes, float(dropout), float(epsilon), seed, offset, path]

    def bdrln_fwd(
        self,
        x,
        bias,
        residual,
        ln_weight,
        ln_bias,
        *op_args,
        y=None,
        mean=None,
        rstd=None,
        path=PATH_DEFAULT,
        stream=None,
        **op_kw,
    ):
        """y (the residual's dtype), mean, rstd ([rows] fp32). x and bias share a dtype; the
        residual and the LayerNorm parameters have x's or float32 (AMP's mixes).
        op_args / op_kw: dropout=0.0, epsilon=1e-12, seed=0, offset=0, in that order or by name."""
        import torch

        rows, _ = self._rows_cols(x)
        y = torch.empty_like(residual) if y is None else y
        mean = torch.empty(rows, dtype=torch.float32, device=x.device) if mean is None else mean
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device) if rstd is None else rstd
        args = self._bdrln_args(x, residual, ln_weight, path, *op_args, **op_kw)
        self._call("pu_bdrln_fwd", args, (x, bias, residual, ln_weight, ln_bias, y, mean, rstd), stream)
        return y, mean, rstd

    def bdrln_bwd(
        self,
        x,
        bias,
        residual,
        ln_weight,
        mean,
        rstd,
        dy,
        *op_args,
        dx=None,
        dresidual=None,
        dbias=None,
        dln_weight=None,
        dln_bias=None,
        workspace=None,
        path=PATH_DEFAULT,
        stream=None,
        **op_kw,
    ):
        """dx, dresidual, dbias, dln_weight, dln_bias. op_args / op_kw: as :meth:`bdrln_fwd`'s."""
        import torch

        dx = torch.empty_like(x) if dx is None else dx
        dresidual = torch.empty_like(residual) if dresidual is None else dresidual
        dbias = torch.empty_like(bias) if dbias is None else dbias
        dln_weight = torch.empty_like(ln_weight) if dln_weight is None else dln_weight
        dln_bias = torch.empty_like(ln_weight) if dln_bias is None else dln_bias
        if workspace is None:
            workspace = self._workspace("pu_bdrln_bwd_workspace_bytes", x)
        args = self._bdrln_args(x, residual, ln_weight, path, *op_args, **op_kw)
        grads = (dx, dresidual, dbias, dln_weight, dln_bias)
        self._call("pu_bdrln_bwd", args, (x, bias, residual, ln_weight, mean, rstd, dy, *grads, workspace), stream)
        return grads


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

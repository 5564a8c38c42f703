"""ctypes wrapper of custom_ops/harness/libpu_cuda_harness.so for torch CUDA tensors.

Used by tests/gpu, benchmarks/bench_gpu_fmha.py and benchmarks/bench_gpu_fused.py on a
GPU machine (no Paddle needed).
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
ABI_VERSION = 4  # pu_harness_abi_version() of custom_ops/harness (4: fmha backward takes `deterministic`)

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


class Harness:
    def __init__(self, path):
        self.path = path
        lib = ctypes.CDLL(path)
        lib.pu_harness_last_error.restype = ctypes.c_char_p
        lib.pu_harness_abi_version.restype = _i32
        lib.pu_fmha_fwd.argtypes = _PROBLEM + [_vp] * 5 + [_vp]
        lib.pu_fmha_fwd.restype = _i32
        lib.pu_fmha_bwd.argtypes = _PROBLEM + [_i32] + [_vp] * 10 + [_vp]
        lib.pu_fmha_bwd.restype = _i32
        lib.pu_fmha_bwd_workspace_bytes.argtypes = [_i64, _i64, _i64, _i32]
        lib.pu_fmha_bwd_workspace_bytes.restype = _i64
        version = lib.pu_harness_abi_version()
        if version != ABI_VERSION:
            raise HarnessError(
                f"{path}: harness ABI {version}, expected {ABI_VERSION} (rebuild it: "
                "make -C custom_ops/harness clean all)"
            )
        for name, args in (
            ("pu_bias_gelu_fwd", _GELU + [_vp] * 3),
            ("pu_bias_gelu_bwd", _GELU + [_vp] * 6),
            ("pu_bdrln_fwd", _BDRLN + [_vp] * 8),
            ("pu_bdrln_bwd", _BDRLN + [_vp] * 13),
        ):
            fn = getattr(lib, name)
            fn.argtypes = args + [_vp]  # + stream
            fn.restype = _i32
        for name in ("pu_bias_gelu_bwd_workspace_bytes", "pu_bdrln_bwd_workspace_bytes"):
            getattr(lib, name).argtypes = [_i64, _i64]
            getattr(lib, name).restype = _i64
        self.lib = lib

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
        return cu, [
            cu.ctypes.data_as(ctypes.c_void_p),
            cu.size - 1,
            T,
            H,
            D,
            self._dtype_code(q),
            float(scale),
            float(dropout),
            int(seed) & 0xFFFFFFFFFFFFFFFF,
            int(offset) & 0xFFFFFFFFFFFFFFFF,
            int(bool(grouping)),
            int(streams),
        ]

    def fwd(
        self,
        q,
        k,
        v,
        cu,
        scale,
        dropout=0.0,
        seed=0,
        offset=0,
        grouping=True,
        streams=4,
        out=None,
        lse=None,
        stream=None,
    ):
        """out [T, H, D] (q's dtype), lse [T, H] fp32. Preallocated out/lse may be views."""
        import torch

        T, H, _ = q.shape
        out = torch.empty_like(q) if out is None else out
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device) if lse is None else lse
        keep, args = self._problem(q, cu, scale, dropout, seed, offset, grouping, streams)
        st = (stream or torch.cuda.current_stream()).cuda_stream
        self._check(
            self.lib.pu_fmha_fwd(
                *args, self._ptr(q), self._ptr(k), self._ptr(v), self._ptr(out), self._ptr(lse), ctypes.c_void_p(st)
            )
        )
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
        dropout=0.0,
        seed=0,
        offset=0,
        grouping=True,
        streams=4,
        dq=None,
        dk=None,
        dv=None,
        workspace=None,
        stream=None,
        deterministic=False,
    ):
        """dq, dk, dv [T, H, D] (q's dtype). deterministic=False: the one-pass backward (dQ
        added with fp32 atomics); True: the two-kernel backward, bitwise on reruns."""
        import torch

        T, H, D = q.shape
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(q) if dk is None else dk
        dv = torch.empty_like(q) if dv is None else dv
        if workspace is None:
            nbytes = self.lib.pu_fmha_bwd_workspace_bytes(T, H, D, int(bool(deterministic)))
            workspace = torch.empty(nbytes // 4, dtype=torch.float32, device=q.device)
        keep, args = self._problem(q, cu, scale, dropout, seed, offset, grouping, streams)
        st = (stream or torch.cuda.current_stream()).cuda_stream
        self._check(
            self.lib.pu_fmha_bwd(
                *args,
                int(bool(deterministic)),
                self._ptr(q),
                self._ptr(k),
                self._ptr(v),
                self._ptr(out),
                self._ptr(lse),
                self._ptr(dout),
                self._ptr(dq),
                self._ptr(dk),
                self._ptr(dv),
                self._ptr(workspace),
                ctypes.c_void_p(st),
            )
        )
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

    @staticmethod
    def _stream(stream):
        import torch

        return ctypes.c_void_p((stream or torch.cuda.current_stream()).cuda_stream)

    def bias_gelu_fwd(self, x, bias, y=None, path=PATH_DEFAULT, stream=None):
        import torch

        rows, cols = self._rows_cols(x)
        y = torch.empty_like(x) if y is None else y
        self._check(
            self.lib.pu_bias_gelu_fwd(
                rows,
                cols,
                self._fused_dtype_code(x),
                path,
                self._ptr(x),
                self._ptr(bias),
                self._ptr(y),
                self._stream(stream),
            )
        )
        return y

    def bias_gelu_bwd(self, x, bias, dy, dx=None, dbias=None, workspace=None, path=PATH_DEFAULT, stream=None):
        import torch

        rows, cols = self._rows_cols(x)
        dx = torch.empty_like(x) if dx is None else dx
        dbias = torch.empty_like(bias) if dbias is None else dbias
        if workspace is None:
            nbytes = self.lib.pu_bias_gelu_bwd_workspace_bytes(rows, cols)
            workspace = torch.empty((nbytes + 3) // 4, dtype=torch.float32, device=x.device)
        self._check(
            self.lib.pu_bias_gelu_bwd(
                rows,
                cols,
                self._fused_dtype_code(x),
                path,
                self._ptr(x),
                self._ptr(bias),
                self._ptr(dy),
                self._ptr(dx),
                self._ptr(dbias),
                self._ptr(workspace),
                self._stream(stream),
            )
        )
        return dx, dbias

    def _bdrln_codes(self, x, residual, ln_weight):
        return (self._fused_dtype_code(x), self._fused_dtype_code(residual), self._fused_dtype_code(ln_weight))

    def bdrln_fwd(
        self,
        x,
        bias,
        residual,
        ln_weight,
        ln_bias,
        dropout=0.0,
        epsilon=1e-12,
        seed=0,
        offset=0,
        y=None,
        mean=None,
        rstd=None,
        path=PATH_DEFAULT,
        stream=None,
    ):
        """y (the residual's dtype), mean, rstd ([rows] fp32). x and bias share a dtype; the
        residual and the LayerNorm parameters have x's or float32 (AMP's mixes)."""
        import torch

        rows, cols = self._rows_cols(x)
        y = torch.empty_like(residual) if y is None else y
        mean = torch.empty(rows, dtype=torch.float32, device=x.device) if mean is None else mean
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device) if rstd is None else rstd
        self._check(
            self.lib.pu_bdrln_fwd(
                rows,
                cols,
                *self._bdrln_codes(x, residual, ln_weight),
                float(dropout),
                float(epsilon),
                int(seed) & 0xFFFFFFFFFFFFFFFF,
                int(offset) & 0xFFFFFFFFFFFFFFFF,
                path,
                *(self._ptr(t) for t in (x, bias, residual, ln_weight, ln_bias, y, mean, rstd)),
                self._stream(stream),
            )
        )
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
        dropout=0.0,
        epsilon=1e-12,
        seed=0,
        offset=0,
        dx=None,
        dresidual=None,
        dbias=None,
        dln_weight=None,
        dln_bias=None,
        workspace=None,
        path=PATH_DEFAULT,
        stream=None,
    ):
        """dx, dresidual, dbias, dln_weight, dln_bias."""
        import torch

        rows, cols = self._rows_cols(x)
        dx = torch.empty_like(x) if dx is None else dx
        dresidual = torch.empty_like(residual) if dresidual is None else dresidual
        dbias = torch.empty_like(bias) if dbias is None else dbias
        dln_weight = torch.empty_like(ln_weight) if dln_weight is None else dln_weight
        dln_bias = torch.empty_like(ln_weight) if dln_bias is None else dln_bias
        if workspace is None:
            nbytes = self.lib.pu_bdrln_bwd_workspace_bytes(rows, cols)
            workspace = torch.empty((nbytes + 3) // 4, dtype=torch.float32, device=x.device)
        self._check(
            self.lib.pu_bdrln_bwd(
                rows,
                cols,
                *self._bdrln_codes(x, residual, ln_weight),
                float(dropout),
                float(epsilon),
                int(seed) & 0xFFFFFFFFFFFFFFFF,
                int(offset) & 0xFFFFFFFFFFFFFFFF,
                path,
                *(
                    self._ptr(t)
                    for t in (
                        x,
                        bias,
                        residual,
                        ln_weight,
                        mean,
                        rstd,
                        dy,
                        dx,
                        dresidual,
                        dbias,
                        dln_weight,
                        dln_bias,
                        workspace,
                    )
                ),
                self._stream(stream),
            )
        )
        return dx, dresidual, dbias, dln_weight, dln_bias


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

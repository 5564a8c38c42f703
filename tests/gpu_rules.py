"""GPU rules on a CPU: paddle_unpad's own dispatch runs as on a GPU, with the CUDA kernels
(compiled for the CPU emulation of tests/cuda_emu) standing in for the device operators.

Inside ``gpu_rules()``:

* ``paddle_unpad.ops`` sees every tensor as off the CPU (``ops._call.on_cpu`` -> False) and a
  build with CUDA kernels (``_native.has_cuda_kernels`` -> True): the argument checks, dtype
  rules, casts and the choice between kernel and plain-Paddle fallback are the package's
  own code, unchanged.
* The registered operators it calls on the GPU branch (``pu_fmha``, ``pu_bias_gelu``,
  ``pu_bias_dropout_residual_layer_norm``) are served by the CUDA kernels themselves,
  through the C-ABI harness of the emulated build, wrapped in a PyLayer that gives the
  registered op's outputs and its gradient op's results. Every buffer they write sits
  between NaN guard rows, checked after each call. Any other operator on that branch fails
  the test (the GPU dispatch must not reach a CPU-only op).
* With ``amp_emulation.emulated_amp()`` around it, Paddle's AMP picks the dtypes as on a GPU.

``calls`` records (op, dtypes of its tensor inputs) for every stand-in call, so a test can
tell which kernel ran with what.
"""

import contextlib
import os
import sys

import numpy as np
import paddle
from paddle.autograd import PyLayer

import amp_emulation

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emu"))
import emu_build  # noqa: E402
import pu_harness  # noqa: E402  (tests/gpu, on the path by emu_build)
from host_buffers import Buffer, to_storage  # noqa: E402

CODE = {"float16": 0, "bfloat16": 1, "float32": 2}
PAD = 8  # NaN guard rows around every buffer a kernel writes
STREAMS = 4


def _dt(t):
    return str(t.dtype).replace("paddle.", "")


def _in(t):
    """A Paddle tensor's values in a NaN-guarded host buffer of its dtype's storage."""
    dt = _dt(t)
    storage, _ = to_storage(t.astype("float32").numpy(), dt)
    return Buffer(storage.shape, dt, PAD, storage)


def _out(buf, name):
    buf.check(name)
    return paddle.to_tensor(buf.values().astype(np.float32)).astype(buf.dt)


def _workspace(nbytes):
    return Buffer((max(int(nbytes) // 4 + 1, 1),), "float32", PAD)


def _rng(rng):
    if rng is None:
        return 0, 0
    seed, offset = (int(v) for v in rng.numpy())
    return seed & (2**64 - 1), offset


class _Kernels:
    def __init__(self, lib):
        self.lib = lib
        self.calls = []

    def check(self, rc, what):
        assert rc == 0, f"{what}: {self.lib.pu_harness_last_error().decode()}"


def _rows_cols(x):
    cols = x.shape[-1]
    return (int(np.prod(x.shape[:-1])) if cols else 0), cols


def _fmha_standin(k):
    class Fmha(PyLayer):
        @staticmethod
        def forward(ctx, q, kk, v, cu, rng, max_seqlen, scale, p, grouping, deterministic):
            T, H, D = q.shape
            problem = (scale, p, *_rng(rng), grouping, STREAMS)
            cu_host, head = pu_harness.fmha_problem(cu.numpy(), q.shape, CODE[_dt(q)], *problem)
            bq, bk, bv = _in(q), _in(kk), _in(v)
            out, lse = Buffer((T, H, D), _dt(q), PAD), Buffer((T, H), "float32", PAD)
            k.check(k.lib.pu_fmha_fwd(*head, bq.ptr, bk.ptr, bv.ptr, out.ptr, lse.ptr, None), "fmha forward")
            o, lse_out = _out(out, "out"), _out(lse, "lse")
            ctx.head, ctx.keep, ctx.deterministic = head, cu_host, int(deterministic)
            ctx.no_grads = 1 + (rng is not None)  # cu_seqlens (and rng_state): no gradient
            ctx.save_for_backward(q, kk, v, o, lse_out)
            ctx.mark_non_differentiable(lse_out)
            return o, lse_out

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, kk, v, o, lse_saved = ctx.saved_tensor()
            T, H, D = q.shape
            bufs = [_in(t) for t in (q, kk, v, o, lse_saved, dout)]
            grads = [Buffer((T, H, D), _dt(q), PAD) for _ in range(3)]
            ws = _workspace(k.lib.pu_fmha_bwd_workspace_bytes(T, H, D, ctx.deterministic))
            k.check(
                k.lib.pu_fmha_bwd(
                    *ctx.head, ctx.deterministic, *(b.ptr for b in bufs), *(g.ptr for g in grads), ws.ptr, None
                ),
                "fmha backward",
            )
            return tuple(_out(g, n) for g, n in zip(grads, ("dq", "dk", "dv"))) + (None,) * ctx.no_grads

    def call(q, kk, v, cu, rng, max_seqlen, scale, p, grouping, deterministic):
        k.calls.append(("pu_fmha", (_dt(q), _dt(kk), _dt(v))))
        return list(Fmha.apply(q, kk, v, cu, rng, max_seqlen, scale, p, grouping, deterministic))

    return call


def _gelu_standin(k):
    class BiasGelu(PyLayer):
        @staticmethod
        def forward(ctx, x, bias):
            rows, cols = _rows_cols(x)
            bx, bb = _in(x), _in(bias)
            y = Buffer(list(x.shape), _dt(x), PAD)
            k.check(
                k.lib.pu_bias_gelu_fwd(rows, cols, CODE[_dt(x)], 0, bx.ptr, bb.ptr, y.ptr, None), "bias_gelu forward"
            )
            ctx.save_for_backward(x, bias)
            return _out(y, "y")

        @staticmethod
        def backward(ctx, dy):
            x, bias = ctx.saved_tensor()
            rows, cols = _rows_cols(x)
            bx, bb, bdy = _in(x), _in(bias), _in(dy)
            dx, db = Buffer(list(x.shape), _dt(x), PAD), Buffer([cols], _dt(bias), PAD)
            ws = _workspace(k.lib.pu_bias_gelu_bwd_workspace_bytes(rows, cols))
            k.check(
                k.lib.pu_bias_gelu_bwd(
                    rows, cols, CODE[_dt(x)], 0, bx.ptr, bb.ptr, bdy.ptr, dx.ptr, db.ptr, ws.ptr, None
                ),
                "bias_gelu backward",
            )
            return _out(dx, "dx"), _out(db, "dbias")

    def call(x, bias):
        k.calls.append(("pu_bias_gelu", (_dt(x), _dt(bias))))
        return [BiasGelu.apply(x, bias)]

    return call


def _bdrln_standin(k):
    class Bdrln(PyLayer):
        @staticmethod
        def forward(ctx, x, bias, residual, w, b, rng, p, eps):
            rows, cols = _rows_cols(x)
            seed, offset = _rng(rng)
            head = (rows, cols, CODE[_dt(x)], CODE[_dt(residual)], CODE[_dt(w)], p, eps, seed, offset, 0)
            ins = [_in(t) for t in (x, bias, residual, w, b)]
            y = Buffer(list(x.shape), _dt(residual), PAD)
            mean, rstd = Buffer([rows], "float32", PAD), Buffer([rows], "float32", PAD)
            k.check(k.lib.pu_bdrln_fwd(*head, *(i.ptr for i in ins), y.ptr, mean.ptr, rstd.ptr, None), "bdrln forward")
            m, r = _out(mean, "mean"), _out(rstd, "rstd")
            ctx.head, ctx.no_grads = head, int(rng is not None)
            ctx.save_for_backward(x, bias, residual, w, m, r)
            ctx.mark_non_differentiable(m, r)
            return _out(y, "y"), m, r

        @staticmethod
        def backward(ctx, dy, _dm, _dr):
            x, bias, residual, w, m, r = ctx.saved_tensor()
            rows, cols = _rows_cols(x)
            ins = [_in(t) for t in (x, bias, residual, w, m, r, dy)]
            outs = [
                Buffer(list(x.shape), _dt(x), PAD),
                Buffer(list(x.shape), _dt(residual), PAD),
                Buffer([cols], _dt(bias), PAD),
                Buffer([cols], _dt(w), PAD),
                Buffer([cols], _dt(w), PAD),
            ]
            ws = _workspace(k.lib.pu_bdrln_bwd_workspace_bytes(rows, cols))
            k.check(
                k.lib.pu_bdrln_bwd(*ctx.head, *(i.ptr for i in ins), *(o.ptr for o in outs), ws.ptr, None),
                "bdrln backward",
            )
            dx, dres, db, dw, dlb = (_out(o, n) for o, n in zip(outs, ("dx", "dresidual", "dbias", "dw", "db")))
            return (dx, db, dres, dw, dlb) + (None,) * ctx.no_grads

    def call(x, bias, residual, w, b, rng, p, eps):
        k.calls.append(("pu_bias_dropout_residual_layer_norm", (_dt(x), _dt(bias), _dt(residual), _dt(w), _dt(b))))
        return list(Bdrln.apply(x, bias, residual, w, b, rng, p, eps))

    return call


@contextlib.contextmanager
def gpu_rules(pytest):
    """paddle_unpad dispatching as on a GPU, the emulated CUDA kernels serving its operators.
    Yields the list of recorded calls. Skips (locally) / fails (CI) when the emulation
    cannot be built, as the other emulated tests."""
    import paddle_unpad._runtime.native as native
    import paddle_unpad._runtime.paddle_compat as compat
    from paddle_unpad import ops

    k = _Kernels(emu_build.load(pytest))
    standins = {
        "pu_fmha": _fmha_standin(k),
        "pu_bias_gelu": _gelu_standin(k),
        "pu_bias_dropout_residual_layer_norm": _bdrln_standin(k),
    }

    def op_function(name):
        assert name in standins, f"the GPU dispatch called {name}, which has no GPU kernel"

        def call(*args):
            with amp_emulation.amp_off():  # custom operators are not auto-cast (Paddle's rule)
                return standins[name](*args)

        return call

    saved = [
        (ops._call, "on_cpu", ops._call.on_cpu),
        (native, "has_cuda_kernels", native.has_cuda_kernels),
        (compat, "custom_op_function", compat.custom_op_function),
    ]
    ops._call.on_cpu = lambda t: False
    native.has_cuda_kernels = lambda: True
    compat.custom_op_function = op_function
    try:
        yield k.calls
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)

"""Paddle's dygraph AMP for CPU tensors, so that a CPU test sees the dtypes a GPU run sees.

On a CPU, ``paddle.amp.auto_cast`` and ``paddle.amp.decorate`` do nothing (Paddle checks the
place), and the CPU build has no float16 / bfloat16 kernels for most ops. Inside
``emulated_amp()``:

* Paddle's own ``auto_cast`` / ``decorate`` / ``GradScaler`` run, through a tracer that reports
  a GPU place: the AMP level, dtype, white / black lists and promotion switch they set are
  Paddle's, O2 casts the parameters by Paddle's own rules (``need_keep_fp32``: float16 keeps
  LayerNorm float32, bfloat16 does not), and loss scaling is on as on a GPU.
* Every ``paddle._C_ops`` function and the tensor operators apply, while AMP is on, Paddle's
  eager rule for the dtype an op computes in (``GetAmpDestDtype`` / ``AmpAutoCast`` of
  paddle/fluid/imperative/amp_utils.h: white list -> AMP dtype, black list -> float32, else
  float32 if any float input is float32; norms decide by and cast only x), through the real
  ``cast`` op, so autograd records the casts as on a GPU.
* An op that gets float16 / bfloat16 CPU tensors computes in float32 and rounds its result to
  the half dtype (a GPU's half kernels also compute in float32 and round on store); in-place
  ops write the rounded result back.

Test infrastructure: the rules above are Paddle's, restated here only to drive CPU tensors;
tests/test_amp_emulation.py checks them against what they must give.
"""

import contextlib
import sys

import numpy as np
import paddle
from paddle.base import core, framework

HALF = (paddle.float16, paddle.bfloat16)
FLOATS = HALF + (paddle.float32,)
# phi op name -> the fluid name Paddle's AMP lists use (phi::TransToFluidOpName)
FLUID_NAMES = {
    "matmul": "matmul_v2",
    "embedding": "lookup_table_v2",
    "mean": "reduce_mean",
    "sum": "reduce_sum",
    "cross_entropy_with_softmax": "softmax_with_cross_entropy",
    "add": "elementwise_add",
    "subtract": "elementwise_sub",
    "multiply": "elementwise_mul",
    "divide": "elementwise_div",
    "maximum": "elementwise_max",
    "minimum": "elementwise_min",
    "elementwise_pow": "elementwise_pow",
}
# ops AMP decides by, and casts, x only (their float32 statistics stay float32)
ONLY_X = {"layer_norm": (1, 2), "batch_norm": (1, 2, 3, 4, 5), "sync_batch_norm": (1, 2, 3, 4, 5)}
# `linear` is matmul + add in one call: the GEMM is on the white list and its bias follows
AS_WHITE = {"linear"}
NOT_WRAPPED = {"cast", "cast_"}
TENSOR_OPERATORS = {
    "__add__": "add",
    "__radd__": "add",
    "__sub__": "subtract",
    "__rsub__": "subtract",
    "__mul__": "multiply",
    "__rmul__": "multiply",
    "__truediv__": "divide",
    "__rtruediv__": "divide",
    "__matmul__": "matmul",
    "__pow__": "elementwise_pow",
    "__rpow__": "elementwise_pow",
    "__neg__": "scale",
    "__getitem__": "slice",
    "__lt__": "less_than",
    "__le__": "less_equal",
    "__gt__": "greater_than",
    "__ge__": "greater_equal",
    "__eq__": "equal",
    "__ne__": "not_equal",
}


_RAW = {}  # the unwrapped paddle._C_ops functions, for this module's own use


def _tracer():
    return framework._dygraph_tracer()


def amp_state():
    """(dtype, level, white, black, use_promote) of Paddle's AMP now, or None when it is off."""
    t = _tracer()
    if t is None or t._amp_level not in (core.AmpLevel.O1, core.AmpLevel.O2):
        return None
    white, black = t._get_amp_op_list()
    promote = t._use_promote if t._amp_level == core.AmpLevel.O2 else True
    return (paddle.float16 if t._amp_dtype == "float16" else paddle.bfloat16, t._amp_level, white, black, promote)


def _listed(name, names):
    return name in names or FLUID_NAMES.get(name) in names


def dest_dtype(name, floats, amp):
    """The dtype Paddle's AMP runs op ``name`` in, for its float inputs ``floats`` (in order)."""
    dtype, level, white, black, promote = amp
    if name in AS_WHITE or _listed(name, white):
        return dtype
    if _listed(name, black):
        return paddle.float32
    if not promote:
        return dtype
    considered = floats[:1] if name in ONLY_X else floats
    return paddle.float32 if any(t.dtype == paddle.float32 for t in considered) else dtype


@contextlib.contextmanager
def amp_off():
    """Paddle's own AMP would cast half CPU tensors to float32 inside a call: not for ours."""
    t = _tracer()
    level = t._amp_level
    t._amp_level = core.AmpLevel.O0
    try:
        yield
    finally:
        t._amp_level = level


def _is_float(x):
    return isinstance(x, paddle.Tensor) and x.dtype in FLOATS


def _map(args, fn):
    """args with every float tensor t (also inside lists / tuples) replaced by fn(t, index)."""
    count = [0]

    def one(a):
        if _is_float(a):
            count[0] += 1
            return fn(a, count[0] - 1)
        if isinstance(a, (list, tuple)) and any(_is_float(x) for x in a):
            return type(a)(one(x) for x in a)
        return a

    return [one(a) for a in args]


def _floats(args):
    out = []
    _map(args, lambda t, i: out.append(t) or t)
    return out


def _as(t, dtype):
    return t if t.dtype == dtype else t.astype(dtype)


def run(name, fn, args, kwargs):
    """Op ``name`` (``fn``) on args as Paddle's AMP and a GPU's half kernels would run it."""
    keys = list(kwargs)
    flat = list(args) + [kwargs[k] for k in keys]
    floats = _floats(flat)
    amp = amp_state()
    if not floats or (amp is None and not any(t.dtype in HALF for t in floats)):
        return fn(*args, **kwargs)
    if amp is not None:  # AmpAutoCast: to the op's dtype (norms: x only)
        dest = dest_dtype(name, floats, amp)
        flat = _map(flat, lambda t, i: t if (name in ONLY_X and i > 0) else _as(t, dest))
        floats = _floats(flat)
    if not any(t.dtype in HALF for t in floats):
        return _call(fn, flat, keys, len(args))
    # the result's dtype: x's for norms, the inputs' one dtype, else float32 (promotion)
    one_dtype = len({t.dtype for t in floats}) == 1
    out_dtype = floats[0].dtype if (name in ONLY_X or one_dtype) else paddle.float32
    wide = _map(flat, lambda t, i: _as(t, paddle.float32))
    with amp_off():
        out = _call(fn, wide, keys, len(args))
    if name.endswith("_"):  # in place: write the float32 results back into the half tensors
        originals = {}
        for orig, new in zip(_floats(flat), _floats(wide)):
            if new is not orig:
                originals[id(new)] = orig
                with amp_off():
                    _RAW["assign_out_"](new.astype(orig.dtype), orig)
        if isinstance(out, (list, tuple)):
            return type(out)(originals.get(id(o), o) for o in out)
        return originals.get(id(out), out)
    keep32 = ONLY_X.get(name, ())

    def back(o, i=0):
        if isinstance(o, (list, tuple)):
            return type(o)(back(x, j) for j, x in enumerate(o))
        if isinstance(o, paddle.Tensor) and o.dtype == paddle.float32 and i not in keep32:
            return o.astype(out_dtype)
        return o

    return back(out)


def _call(fn, flat, keys, nargs):
    return fn(*flat[:nargs], **dict(zip(keys, flat[nargs:])))


def check_finite_and_unscale(grads, scale, outs, found_inf):
    """GradScaler's unscale (a GPU-only kernel): every gradient divided by the loss scale in
    place, found_inf set when any was not finite."""
    inv, found = 1.0 / float(scale.numpy().reshape(-1)[0]), False
    with amp_off():
        for g in grads:
            g32 = g.astype("float32")
            found = found or not bool(paddle.isfinite(g32).all())
            _RAW["assign_out_"]((g32 * inv).astype(g.dtype), g)
    found_inf.set_value(np.array([found]))


class _FakeGpuPlace:
    def is_gpu_place(self):
        return True

    def is_xpu_place(self):
        return False

    def is_custom_place(self):
        return False

    def get_device_id(self):
        return 0


class _TracerSaysGpu:
    """The real tracer, except that its expected place passes AMP's GPU checks."""

    def __getattr__(self, name):
        if name == "_expected_place":
            return _FakeGpuPlace()
        return getattr(_tracer(), name)

    def __setattr__(self, name, value):
        setattr(_tracer(), name, value)


@contextlib.contextmanager
def emulated_amp():
    """Paddle's AMP (``auto_cast``, ``decorate``) and half-precision compute on CPU tensors."""
    auto_cast_module = sys.modules["paddle.amp.auto_cast"]
    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    proxy = _TracerSaysGpu()
    patch(auto_cast_module, "_dygraph_tracer", lambda: proxy)
    patch(sys.modules["paddle.amp.grad_scaler"], "_dygraph_tracer", lambda: proxy)  # loss scaling on
    patch(paddle._legacy_C_ops, "check_finite_and_unscale", check_finite_and_unscale)  # GPU-only kernel
    patch(auto_cast_module, "_is_gpu_float16_supported", lambda: True)
    patch(auto_cast_module, "_is_gpu_bfloat16_supported", lambda: True)
    _RAW["assign_out_"] = paddle._C_ops.assign_out_
    for name, fn in list(vars(paddle._C_ops).items()):
        if callable(fn) and not name.startswith("_") and name not in NOT_WRAPPED:
            patch(paddle._C_ops, name, _wrapped(name, fn))
    for method, name in TENSOR_OPERATORS.items():
        if hasattr(paddle.Tensor, method):
            patch(paddle.Tensor, method, _wrapped_method(name, getattr(paddle.Tensor, method)))
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _wrapped(name, fn):
    def op(*args, **kwargs):
        return run(name, fn, args, kwargs)

    op.__name__ = name
    return op


def _wrapped_method(name, fn):
    def method(self, *args):
        return run(name, fn, (self,) + args, {})

    return method

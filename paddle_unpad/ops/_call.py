"""The path from a public op to its compiled operator, shared by the attention and fused ops.

Argument helpers that speak the ops' words (dtype names, size lists), the device test, the
Philox state handed to a kernel, the AMP dtype rule for a bias, and :func:`call_native`,
which calls a registered custom operator and hands its refusal to the user as the operator
wrote it (the C++ checks start their messages with the op's public name).
"""

import numbers

import numpy as np
import paddle

from .._runtime import native as _native
from .._runtime import paddle_compat as _compat
from ._names import MESSAGE_PREFIXES


class OpError(ValueError):
    """A compiled operator refused its input (the message is the operator's check)."""


is_tensor = _compat.is_tensor


def dtype_name(t):
    return str(t.dtype).replace("paddle.", "")


INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)

# Host-side Python (argument checks, dispatch) must not be rewritten by dy2static into
# graph control flow: it only reads static metadata (shapes, dtypes, Python numbers).
host_only = paddle.jit.not_to_static


def is_floating(t):
    return t.dtype in (paddle.float16, paddle.bfloat16, paddle.float32, paddle.float64)


def sizes_in_words(sizes):
    """A range as lo..hi, other sizes listed: the words of the C++ checks."""
    if isinstance(sizes, range):
        return f"{sizes.start}..{sizes.stop - 1}"
    return ", ".join(str(s) for s in sizes)


def on_cpu(t):
    """Whether t lives (or, in a traced program, will live) on the CPU."""
    if paddle.in_dynamic_mode():
        return t.place.is_cpu_place()
    return paddle.device.get_device().startswith("cpu")


@host_only
def native_ok(op, x):
    """Whether the registered operator `op` has a kernel for x's device."""
    return _native.has_op(op) and (on_cpu(x) or _native.has_cuda_kernels())


@host_only
def rng_state_tensor(rng_state, q, op):
    """[seed, offset] int64 on the CPU: given, or drawn from Paddle's generator. ``op``: the
    operator's name in messages (``"ops.fmha"``)."""
    if rng_state is None:
        if paddle.in_dynamic_mode():
            gen = _compat.default_generator(q.place)
            seed, offset = gen.random(), gen.random() & 0xFFFFFFFF
            return paddle.to_tensor([as_int64(seed), offset], dtype="int64", place=paddle.CPUPlace())
        # Traced programs draw a fresh state on every run (randint takes 32-bit bounds).
        return paddle.randint(0, 2**31 - 1, shape=[2], dtype="int64")
    if is_tensor(rng_state):
        if paddle.in_dynamic_mode() and (
            list(rng_state.shape) != [2] or rng_state.dtype != paddle.int64 or not rng_state.place.is_cpu_place()
        ):
            error = TypeError if rng_state.dtype != paddle.int64 else ValueError
            raise error(
                f"paddle_unpad.{op}: rng_state must be (seed, offset) ints or a [2] int64 CPU tensor, got a tensor of shape {list(rng_state.shape)}, dtype {dtype_name(rng_state)} on {rng_state.place}"
            )
        return rng_state
    if not isinstance(rng_state, (tuple, list)) or any(
        isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) for v in rng_state
    ):
        raise TypeError(
            f"paddle_unpad.{op}: rng_state must be a (seed, offset) pair of ints or a [2] int64 CPU tensor, got {rng_state!r}"
        )
    if len(rng_state) != 2:
        raise ValueError(
            f"paddle_unpad.{op}: rng_state must be a (seed, offset) pair of ints, got {len(rng_state)} values: {rng_state!r}"
        )
    seed, offset = rng_state
    return paddle.to_tensor([as_int64(seed), int(offset) & 0xFFFFFFFF], dtype="int64", place=paddle.CPUPlace())


def as_int64(seed):
    """The seed is a uint64 (all 64 bits key Philox); store its bits in an int64."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return s - (1 << 64) if s >= (1 << 63) else s


def call_native(name, *args):
    """Call the registered custom operator `name`; its refusal is raised as :class:`OpError`
    with the operator's own line (Paddle wraps it in an OSError with a C++ trace)."""
    try:
        return _compat.custom_op_function(name)(*args)
    except OSError as e:
        msg = str(e)
        hits = [msg.index(prefix) for prefix in MESSAGE_PREFIXES if prefix in msg]
        if hits:
            raise OpError(msg[min(hits) :].split("\n")[0].strip()) from None
        raise


def like_x(bias, x):
    """The bias in x's dtype, as AMP hands a GEMM's bias to its fused epilogue (and Paddle's own
    fused ops cast it): under O1 the parameter is float32 next to a half activation."""
    return bias if bias.dtype == x.dtype else bias.astype(x.dtype)


_MIXED_DTYPES = "mixed dtypes are lined up among float16, bfloat16 and float32, as AMP makes them; float64 only with every tensor float64"


def check_mixable(op, name, t, x, x_name="x"):
    """AMP mixes float16 / bfloat16 / float32; a float64 next to another dtype is a mistake
    (casting it would silently drop precision), refused here naming both."""
    if t is not None and t.dtype != x.dtype and paddle.float64 in (t.dtype, x.dtype):
        raise TypeError(
            f"paddle_unpad.{op}: {name} dtype {dtype_name(t)} differs from {x_name} dtype {dtype_name(x)} ({_MIXED_DTYPES})"
        )

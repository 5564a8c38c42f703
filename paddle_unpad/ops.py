"""One thin, documented function per custom operator, and its plain-Paddle reference.

Each public op calls the compiled operator when it is registered for the tensors'
device, and its ``*_reference`` twin otherwise (see ``ops_available()``). The
references are written for clarity, not speed; tests compare the two.
"""
import math
import numbers

import numpy as np
import paddle

from . import _native
from .philox import attention_keep_mask

__all__ = ["fmha", "fmha_reference", "ops_available", "FMHA_SUPPORT", "FMHA_TOLERANCE"]

# What the fmha kernels accept, as data (the checks below and the docs read it).
FMHA_SUPPORT = {
    "cpu": {"dtypes": ("float32",), "head_dim": (1, 256)},
    "gpu": {"dtypes": ("float16", "bfloat16"), "head_dim": (32, 64, 128)},
}
# Max abs error allowed against a float64 reference, relative to the reference's max abs.
FMHA_TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def ops_available():
    """Which native kernels are loaded, per op and device.

    Returns:
        dict, e.g. ``{"fmha": {"cpu": True, "gpu": False}}``. ``False`` means the op
        runs its plain-Paddle reference there. ``paddle_unpad._native.info()`` says why.
    """
    cpu = _native.has_op("pu_fmha")
    return {"fmha": {"cpu": cpu, "gpu": cpu and _native.has_cuda_kernels()}}


class _OpError(ValueError):
    pass


def _is_tensor(x):
    return isinstance(x, (paddle.Tensor, paddle.pir.Value)) if hasattr(paddle, "pir") else isinstance(x, paddle.Tensor)


def _dtype_name(t):
    return str(t.dtype).replace("paddle.", "")


# Host-side Python (argument checks, dispatch) must not be rewritten by dy2static into
# graph control flow: it only reads static metadata (shapes, dtypes, Python numbers).
_host_only = paddle.jit.not_to_static


@_host_only
def _check_fmha_args(q, k, v, cu_seqlens, max_seqlen, dropout, scale):
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        if not _is_tensor(t):
            raise TypeError(f"fmha: {name} must be a paddle.Tensor, got {type(t).__name__}")
    if len(q.shape) != 3:
        raise ValueError(f"fmha: q must be 3-D [total_tokens, heads, head_dim], got shape {list(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if list(t.shape) != list(q.shape):
            raise ValueError(f"fmha: {name} shape {list(t.shape)} differs from q shape {list(q.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"fmha: {name} dtype {_dtype_name(t)} differs from q dtype {_dtype_name(q)}")
    if cu_seqlens.dtype != paddle.int32:
        raise TypeError(f"fmha: cu_seqlens must be int32, got {_dtype_name(cu_seqlens)}")
    if len(cu_seqlens.shape) != 1:
        raise ValueError(f"fmha: cu_seqlens must be 1-D [batch + 1], got shape {list(cu_seqlens.shape)}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral):
        raise TypeError(
            f"fmha: max_seqlen must be a Python int (known on the host), got {type(max_seqlen).__name__}"
        )
    if max_seqlen < 0:
        raise ValueError(f"fmha: max_seqlen must be >= 0, got {max_seqlen}")
    if not (0.0 <= float(dropout) < 1.0):
        raise ValueError(f"fmha: dropout must be in [0, 1), got {dropout}")
    if scale is not None and not math.isfinite(float(scale)):
        raise ValueError(f"fmha: scale must be a finite number, got {scale}")
    d = q.shape[2]
    if d is not None and d > 0:
        lo, hi = FMHA_SUPPORT["cpu"]["head_dim"]
        if _on_cpu(q) and not (lo <= d <= hi):
            raise ValueError(f"fmha: head size (q.shape[2]) {d} is not supported on CPU: supported are {lo}..{hi}")
    if _on_cpu(q) and _dtype_name(q) not in FMHA_SUPPORT["cpu"]["dtypes"]:
        raise TypeError(
            f"fmha: q/k/v dtype {_dtype_name(q)} is not supported on CPU "
            f"(supported: {', '.join(FMHA_SUPPORT['cpu']['dtypes'])})"
        )


def _on_cpu(t):
    """Whether t lives (or, in a traced program, will live) on the CPU."""
    if paddle.in_dynamic_mode():
        return t.place.is_cpu_place()
    return paddle.device.get_device().startswith("cpu")


def _generator_for(place):
    core = paddle.framework.core
    if place.is_gpu_place():
        return core.default_cuda_generator(place.gpu_device_id())
    return core.default_cpu_generator()


@_host_only
def _rng_state_tensor(rng_state, q):
    """[seed, offset] int64 on the CPU: given, or drawn from Paddle's generator."""
    if rng_state is None:
        if paddle.in_dynamic_mode():
            gen = _generator_for(q.place)
            seed, offset = gen.random(), gen.random() & 0xFFFFFFFF
            return paddle.to_tensor([_as_int64(seed), offset], dtype="int64", place=paddle.CPUPlace())
        # Traced programs draw a fresh state on every run.
        return paddle.randint(0, 2**62, shape=[2], dtype="int64")
    if _is_tensor(rng_state):
        return rng_state
    seed, offset = rng_state
    return paddle.to_tensor(
        [_as_int64(seed), int(offset) & 0xFFFFFFFF], dtype="int64", place=paddle.CPUPlace()
    )


def _as_int64(seed):
    """The seed is a uint64 (all 64 bits key Philox); store its bits in an int64."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return s - (1 << 64) if s >= (1 << 63) else s


def _call_native(name, *args):
    try:
        return paddle._C_ops._run_custom_op(name, *args)
    except OSError as e:  # Paddle reports PD_CHECK failures of custom ops as OSError
        msg = str(e)
        if "fmha:" in msg:
            raise _OpError(msg[msg.index("fmha:"):].split("\n")[0].strip()) from None
        raise


@_host_only
def fmha(q, k, v, cu_seqlens, max_seqlen, dropout=0.0, scale=None, training=True, *, rng_state=None):
    """Fused multi-head attention over packed variable-length sequences.

    Each of the B sequences attends only to itself (no masking inside a sequence); no
    padding is stored or computed.

    Args:
        q, k, v: [T, H, D] float32 on CPU (float16/bfloat16 on GPU builds), the tokens
            of all sequences packed back to back; T = cu_seqlens[-1].
        cu_seqlens: [B + 1] int32 on the CPU: 0, then prefix sums of the lengths.
            Zero-length sequences are allowed and produce nothing.
        max_seqlen: Python int >= the longest sequence (a host value: no device sync).
        dropout: attention-probability dropout in [0, 1), applied when ``training``.
        scale: multiplier of q k^T; default 1/sqrt(D).
        training: dropout is applied only when True.
        rng_state: ``(seed, offset)`` ints or a [2] int64 CPU tensor fixing the Philox
            stream of the dropout mask; default: drawn from Paddle's generator, so
            ``paddle.seed(n)`` makes runs reproducible.
    Returns:
        out: [T, H, D], same dtype as q. Differentiable w.r.t. q, k and v.
    Raises:
        TypeError / ValueError naming the argument and value for bad input.
    """
    _check_fmha_args(q, k, v, cu_seqlens, max_seqlen, dropout, scale)
    d = q.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    p = float(dropout) if training else 0.0
    rng = _rng_state_tensor(rng_state, q) if p > 0.0 else None
    if _native.has_op("pu_fmha") and (_on_cpu(q) or _native.has_cuda_kernels()):
        out, _lse = _call_native("pu_fmha", q, k, v, cu_seqlens, rng, int(max_seqlen), scale, p)
        return out
    if not paddle.in_dynamic_mode():
        raise RuntimeError(
            "fmha: the compiled operator is needed inside paddle.jit.to_static (the reference "
            "implementation reads cu_seqlens on the host); see paddle_unpad._native.info()"
        )
    return _fmha_reference(q, k, v, cu_seqlens, max_seqlen, p, scale, rng)


def fmha_reference(q, k, v, cu_seqlens, max_seqlen, dropout=0.0, scale=None, training=True, *, rng_state=None):
    """Plain-Paddle ``fmha``: a loop over sequences of matmul-softmax-matmul.

    Same arguments, result and dropout mask as :func:`fmha` (the mask comes from the
    numpy Philox in ``paddle_unpad.philox``). Eager mode only.
    """
    _check_fmha_args(q, k, v, cu_seqlens, max_seqlen, dropout, scale)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    p = float(dropout) if training else 0.0
    rng = _rng_state_tensor(rng_state, q) if p > 0.0 else None
    return _fmha_reference(q, k, v, cu_seqlens, max_seqlen, p, scale, rng)


def _check_cu_values(cu, total, max_seqlen):
    if cu.size < 1:
        raise ValueError("fmha: cu_seqlens must have at least one element (0), got none")
    if cu[0] != 0:
        raise ValueError(f"fmha: cu_seqlens[0] must be 0, got {cu[0]}")
    bad = np.nonzero(np.diff(cu) < 0)[0]
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"fmha: cu_seqlens must be non-decreasing, but cu_seqlens[{b + 1}] = {cu[b + 1]} "
            f"< cu_seqlens[{b}] = {cu[b]}"
        )
    if cu[-1] != total:
        raise ValueError(
            f"fmha: cu_seqlens[-1] = {cu[-1]} must equal the number of packed tokens q.shape[0] = {total}"
        )
    longest = int(np.diff(cu).max()) if cu.size > 1 else 0
    if longest > max_seqlen:
        raise ValueError(
            f"fmha: max_seqlen = {max_seqlen} is smaller than the longest sequence in cu_seqlens ({longest})"
        )


def _fmha_reference(q, k, v, cu_seqlens, max_seqlen, p, scale, rng):
    cu = cu_seqlens.numpy().astype(np.int64)
    total, heads = q.shape[0], q.shape[1]
    _check_cu_values(cu, total, max_seqlen)
    if p > 0.0:
        seed, offset = (int(x) for x in rng.numpy())
    outs = []
    for b in range(cu.size - 1):
        t0, t1 = int(cu[b]), int(cu[b + 1])
        if t1 == t0:
            continue
        qb, kb, vb = (x[t0:t1].transpose([1, 0, 2]) for x in (q, k, v))  # [H, s, D]
        probs = paddle.nn.functional.softmax(paddle.matmul(qb, kb, transpose_y=True) * scale, axis=-1)
        if p > 0.0:
            keep = attention_keep_mask(seed, offset, p, t0, t1 - t0, heads)
            probs = probs * paddle.to_tensor(keep.astype(np.float32) / (1.0 - p), dtype=probs.dtype)
        outs.append(paddle.matmul(probs, vb).transpose([1, 0, 2]))
    if not outs:
        return q * 0.0
    return paddle.concat(outs, axis=0)

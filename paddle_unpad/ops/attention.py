"""Fused multi-head attention over packed variable-length sequences: :func:`fmha`,
:func:`fmha_qkvpacked` and their plain-Paddle references.

Off the CPU, without a CUDA kernel for the tensors' dtype or head size, :func:`fmha` runs
:func:`paddle_unpad.ops.bucketed_attention.bucketed_attention` and says why once.
"""

import math
import numbers

import numpy as np
import paddle

from .. import config
from .._runtime import host_malloc as _host_malloc
from .._runtime import native as _native
from .._runtime import paddle_compat as _compat
from .._runtime.warn import warn_once
from ._names import REGISTERED, WHERE
from ._rules import FMHA_SUPPORT
from .bucketed_attention import bucketed_attention
from .philox import attention_keep_mask
from ..varlen import check_cu_seqlens
from . import _call
from ._call import host_only

_FMHA, _FMHA_QKV = WHERE["fmha"], WHERE["fmha_qkvpacked"]


@host_only
def _check_fmha_args(q, k, v, cu_seqlens, max_seqlen, dropout, scale, op=_FMHA):
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        if not (_call.is_tensor(t) or isinstance(t, _ShapeOf)):
            raise TypeError(f"paddle_unpad.{op}: {name} must be a paddle.Tensor, got {type(t).__name__}")
    if len(q.shape) != 3:
        raise ValueError(f"paddle_unpad.{op}: q must be 3-D [total_tokens, heads, head_dim], got shape {list(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if list(t.shape) != list(q.shape):
            raise ValueError(f"paddle_unpad.{op}: {name} shape {list(t.shape)} differs from q shape {list(q.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(
                f"paddle_unpad.{op}: {name} dtype {_call.dtype_name(t)} differs from q dtype {_call.dtype_name(q)}"
            )
    if cu_seqlens.dtype != paddle.int32:
        raise TypeError(f"paddle_unpad.{op}: cu_seqlens must be int32, got {_call.dtype_name(cu_seqlens)}")
    if len(cu_seqlens.shape) != 1:
        raise ValueError(f"paddle_unpad.{op}: cu_seqlens must be 1-D [batch + 1], got shape {list(cu_seqlens.shape)}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral):
        raise TypeError(
            f"paddle_unpad.{op}: max_seqlen must be a Python int (known on the host), got {type(max_seqlen).__name__}"
        )
    if max_seqlen < 0:
        raise ValueError(f"paddle_unpad.{op}: max_seqlen must be >= 0, got {max_seqlen}")
    if max_seqlen > _call.INT32_MAX:  # cu_seqlens is int32: no sequence is longer
        raise ValueError(
            f"paddle_unpad.{op}: max_seqlen must be at most {_call.INT32_MAX} (cu_seqlens is int32), got {max_seqlen}"
        )
    for name, value in (("dropout", dropout), ("scale", scale)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TypeError(f"paddle_unpad.{op}: {name} must be a number, got {type(value).__name__} {value!r}")
    if not (0.0 <= float(dropout) < 1.0):
        raise ValueError(f"paddle_unpad.{op}: dropout must be in [0, 1), got {dropout}")
    if scale is not None and not (math.isfinite(float(scale)) and abs(float(scale)) <= _call.FLOAT32_MAX):
        # the kernels take scale as a float32: 1e39 would become inf and every output NaN
        raise ValueError(
            f"paddle_unpad.{op}: scale must be a finite float32 number (|scale| <= {_call.FLOAT32_MAX:.6g}), got {scale}"
        )
    d = q.shape[2]
    # fmha_qkvpacked checks its qkv through a q of the same shape: name what its caller passed
    in_name, hd_name = ("q/k/v", "q.shape[2]") if op == _FMHA else ("qkv", "qkv.shape[3]")
    if d is not None and d == 0:
        raise ValueError(f"paddle_unpad.{op}: head size {hd_name} must be >= 1, got {d}")
    if _call.on_cpu(q):  # the CPU kernel is the only CPU path: its rules are the op's rules there
        rules = FMHA_SUPPORT["cpu"]
        if d is not None and d > 0 and d not in rules["head_dim"]:
            raise ValueError(
                f"paddle_unpad.{op}: head size ({hd_name}) {d} is not supported on CPU: supported are {_call.sizes_in_words(rules['head_dim'])}"
            )
        if _call.dtype_name(q) not in rules["dtypes"]:
            raise TypeError(
                f"paddle_unpad.{op}: {in_name} dtype {_call.dtype_name(q)} is not supported on CPU (supported: {', '.join(rules['dtypes'])})"
            )
    elif not _call.is_floating(q):
        raise TypeError(f"paddle_unpad.{op}: {in_name} dtype {_call.dtype_name(q)} is not a floating-point dtype")
    # cu_seqlens' values are checked where they are read, by the same rules in the same words:
    # by the native op (C++), or by _fmha_reference. Reading them here as well would be one
    # more host read per call, which a model forward on packed inputs does not make.
    _compat.refuse_empty(op, "q", q)


def _fmha_gpu_kernel_refusal(q):
    """Off the CPU: None when the CUDA fmha kernel takes q, else why not (in words). Where it
    does not, fmha runs :func:`paddle_unpad.ops.bucketed_attention.bucketed_attention`."""
    if not _call.native_ok(REGISTERED["fmha"], q):
        return (
            "this build of paddle_unpad has no CUDA kernels"
            if _native.has_op(REGISTERED["fmha"])
            else "the compiled operators are not loaded"
        )
    rules, dtype, d = FMHA_SUPPORT["gpu"], _call.dtype_name(q), q.shape[2]
    if dtype not in rules["dtypes"]:
        return f"the CUDA kernel takes {' and '.join(rules['dtypes'])}, not {dtype} (AMP, e.g. paddle.amp.auto_cast(), is the fast path)"
    if d not in rules["head_dim"]:
        return f"the CUDA kernel takes head sizes {_call.sizes_in_words(rules['head_dim'])}, not {d}"
    return None


def _launch_flag(value, name, setting):
    """The explicit argument, else the setting (an argument always wins)."""
    value = config.resolve(value, setting)
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"paddle_unpad.{_FMHA}: {name} must be a bool or None, got {type(value).__name__} {value!r}")
    return bool(value)


def _grouping(grouping):
    return _launch_flag(grouping, "grouping", "FMHA_GROUPING")


def _deterministic(deterministic):
    return _launch_flag(deterministic, "deterministic", "FMHA_DETERMINISTIC")


def _scale_and_p(head_dim, dropout, scale, training):
    """The scale in effect (default 1/sqrt(head_dim)) and the dropout probability in effect."""
    return (1.0 / math.sqrt(head_dim) if scale is None else float(scale)), (float(dropout) if training else 0.0)


def _rng_if_dropping(rng_state, x, p, op=_FMHA):
    # drawn only where a mask is made: drawing moves Paddle's generator
    return _call.rng_state_tensor(rng_state, x, op) if p > 0.0 else None


@host_only
def fmha(q, k, v, cu_seqlens, max_seqlen, dropout=0.0, scale=None, training=True, *, rng_state=None,
         grouping=None, deterministic=None):  # fmt: skip
    """Fused multi-head attention over packed variable-length sequences.

    Each of the B sequences attends only to itself (no masking inside a sequence); no
    padding is stored or computed.

    Args:
        q, k, v: [T, H, D] of one dtype, the tokens of all sequences packed back to back;
            T = cu_seqlens[-1]. CPU: float32 (the CPU kernel). GPU: float16 / bfloat16 with
            head size 32, 64 or 128 run the CUDA kernel; anything else (float32 without AMP,
            other head sizes) runs :func:`paddle_unpad.ops.bucketed_attention.bucketed_attention`,
            plain Paddle ops over length buckets, with one warning saying why.
        cu_seqlens: [B + 1] int32 on the CPU: 0, then prefix sums of the lengths.
            Zero-length sequences are allowed and produce nothing.
        max_seqlen: Python int >= the longest sequence (a host value: no device sync).
        dropout: attention-probability dropout in [0, 1), applied when ``training``;
            resolved to 2**-16 (16 random bits per element, ``paddle_unpad.ops.philox``).
        scale: multiplier of q k^T; default 1/sqrt(D).
        training: dropout is applied only when True.
        rng_state: ``(seed, offset)`` ints or a [2] int64 CPU tensor fixing the Philox
            stream of the dropout mask; default: drawn from Paddle's generator, so
            ``paddle.seed(n)`` makes runs reproducible. (The plain-Paddle GPU path drops
            with ``paddle.nn.functional.dropout`` unless ``rng_state`` is given.)
        grouping: how the GPU kernels are launched (the CPU kernel ignores it). True:
            the sequences are bucketed by length and each bucket is launched with the
            tile configuration that suits it, on a small pool of CUDA streams joined back
            into the caller's stream (fewer padded tiles for ragged batches). False: one
            launch over the whole batch on the caller's stream. Both compute the same bits
            per row by design; only the speed differs. None (default): the
            ``FMHA_GROUPING`` setting (:mod:`paddle_unpad.config`; on unless set off), so
            a whole model can be switched for a comparison without editing it.
        deterministic: which GPU backward runs (the CPU backward is bitwise reproducible
            either way). False: one pass over each key block, dQ added in float32 with
            atomics (five matmuls per tile; dQ's last bits can differ between reruns, as
            with FlashAttention's default). True: dK/dV and dQ in two kernels without
            atomics (seven matmuls per tile), bitwise identical reruns. None (default): the
            ``FMHA_DETERMINISTIC`` setting (off unless set on).
    Returns:
        out: [T, H, D], same dtype as q. Differentiable w.r.t. q, k and v.
    Raises:
        TypeError / ValueError naming the argument and value for bad input.
    """
    _host_malloc.ensure(f"paddle_unpad.{_FMHA}")
    _check_fmha_args(q, k, v, cu_seqlens, max_seqlen, dropout, scale)
    grouping, deterministic = _grouping(grouping), _deterministic(deterministic)
    scale, p = _scale_and_p(q.shape[2], dropout, scale, training)
    on_cpu = _call.on_cpu(q)
    refusal = None if on_cpu else _fmha_gpu_kernel_refusal(q)
    if _call.native_ok(REGISTERED["fmha"], q) and refusal is None:
        rng = _rng_if_dropping(rng_state, q, p)
        out, _lse = _call.call_native(
            REGISTERED["fmha"], q, k, v, cu_seqlens, rng, int(max_seqlen), scale, p, grouping, deterministic
        )
        return out
    if not paddle.in_dynamic_mode():
        why = "" if refusal is None else f", and {refusal}"
        raise RuntimeError(
            f"paddle_unpad.{_FMHA}: the compiled operator is needed inside paddle.jit.to_static (the plain-Paddle attention reads cu_seqlens on the host){why}; see paddle_unpad._runtime.native.info()"
        )
    if on_cpu:
        rng = _rng_if_dropping(rng_state, q, p)
        return _fmha_reference(q, k, v, cu_seqlens, max_seqlen, p, scale, rng)
    warn_once(
        ("fmha", refusal),
        f"paddle_unpad.{_FMHA}: {refusal}; attention runs as plain Paddle ops over length buckets (paddle_unpad.ops.bucketed_attention, slower). This warning is shown once.",
        RuntimeWarning,
    )
    rng = _call.rng_state_tensor(rng_state, q, _FMHA) if p > 0.0 and rng_state is not None else None
    return bucketed_attention(q, k, v, cu_seqlens, max_seqlen, p, scale, rng)


def fmha_reference(q, k, v, cu_seqlens, max_seqlen, dropout=0.0, scale=None, training=True, *, rng_state=None,
                   grouping=None, deterministic=None):  # fmt: skip
    """Plain-Paddle ``fmha``: a loop over sequences of matmul-softmax-matmul.

    Same arguments, result and dropout mask as :func:`fmha` (the mask comes from the
    numpy Philox in ``paddle_unpad.ops.philox``; ``grouping`` and ``deterministic`` are accepted
    and have no effect). Eager mode only.
    """
    _check_fmha_args(q, k, v, cu_seqlens, max_seqlen, dropout, scale)
    _grouping(grouping)
    _deterministic(deterministic)
    scale, p = _scale_and_p(q.shape[2], dropout, scale, training)
    rng = _rng_if_dropping(rng_state, q, p)
    return _fmha_reference(q, k, v, cu_seqlens, max_seqlen, p, scale, rng)


def _fmha_reference(q, k, v, cu_seqlens, max_seqlen, p, scale, rng):
    cu = cu_seqlens.numpy().astype(np.int64)
    total, heads = q.shape[0], q.shape[1]
    check_cu_seqlens(cu, total, max_seqlen)
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


@host_only
def _check_qkvpacked_args(qkv, bias):
    if not _call.is_tensor(qkv):
        raise TypeError(f"paddle_unpad.{_FMHA_QKV}: qkv must be a paddle.Tensor, got {type(qkv).__name__}")
    if len(qkv.shape) != 4 or qkv.shape[1] != 3:
        raise ValueError(
            f"paddle_unpad.{_FMHA_QKV}: qkv must be 4-D [total_tokens, 3, heads, head_dim], got shape {list(qkv.shape)}"
        )
    if bias is not None:
        if not _call.is_tensor(bias):
            raise TypeError(
                f"paddle_unpad.{_FMHA_QKV}: bias must be a paddle.Tensor or None, got {type(bias).__name__}"
            )
        if list(bias.shape) != [3] + list(qkv.shape[2:]):
            raise ValueError(
                f"paddle_unpad.{_FMHA_QKV}: bias must have shape [3, heads, head_dim] = {[3] + list(qkv.shape[2:])}, got {list(bias.shape)}"
            )
        if not _call.is_floating(bias):
            raise TypeError(
                f"paddle_unpad.{_FMHA_QKV}: bias dtype {_call.dtype_name(bias)} is not a floating-point dtype"
            )
        _call.check_mixable(_FMHA_QKV, "bias", bias, qkv, "qkv")


def _split_qkv(qkv, bias):
    x = qkv if bias is None else qkv + _call.like_x(bias, qkv)
    return paddle.unbind(x, axis=1)


@host_only
def fmha_qkvpacked(qkv, cu_seqlens, max_seqlen, bias=None, dropout=0.0, scale=None, training=True, *,
                   rng_state=None, grouping=None, deterministic=None):  # fmt: skip
    """:func:`fmha` on the output of one QKV GEMM: ``q, k, v = unbind(qkv + bias, axis=1)``.

    On the CPU with the native kernels this is one operator that reads q, k and v in place
    and adds the bias as it reads them: no ``[T, 3, H, D]`` copies for the add and the
    split, and no concat of their gradients; the bias gradient is the column sum of the
    qkv gradient, taken in the operator. Its output and the gradient of ``qkv`` are bitwise
    those of :func:`fmha` on the split (same ``rng_state``, same mask). Elsewhere (GPU, no
    native library) it adds, splits and calls :func:`fmha`.

    Args:
        qkv: [T, 3, H, D] float32 on CPU (GPU: the dtypes of :func:`fmha`): the q, k and v
            of every token side by side, as ``x @ concat(Wq, Wk, Wv)`` reshaped.
        cu_seqlens, max_seqlen, dropout, scale, training, rng_state, grouping, deterministic:
            as for :func:`fmha` (the last two apply where the split path runs on a GPU).
        bias: [3, H, D] (bq, bk, bv), or None. A bias of another floating dtype (a float32
            parameter under AMP O1) is cast to qkv's dtype, as AMP casts a GEMM's bias.
    Returns:
        out: [T, H, D], same dtype as qkv. Differentiable w.r.t. qkv and bias.
    Raises:
        TypeError / ValueError naming the argument and value for bad input.
    """
    _host_malloc.ensure(f"paddle_unpad.{_FMHA_QKV}")
    _check_qkvpacked_args(qkv, bias)
    if not (_native.has_op(REGISTERED["fmha_qkvpacked"]) and _call.on_cpu(qkv) and paddle.in_dynamic_mode()):
        options = dict(rng_state=rng_state, grouping=grouping, deterministic=deterministic)
        return fmha(*_split_qkv(qkv, bias), cu_seqlens, max_seqlen, dropout, scale, training, **options)
    # the checks of fmha, on a q of the same shape (no copy is made: only shapes are read)
    q = _ShapeOf(qkv)
    _check_fmha_args(q, q, q, cu_seqlens, max_seqlen, dropout, scale, op=_FMHA_QKV)
    _grouping(grouping)
    _deterministic(deterministic)
    scale, p = _scale_and_p(qkv.shape[3], dropout, scale, training)
    rng = _rng_if_dropping(rng_state, qkv, p, _FMHA_QKV)
    bias = paddle.zeros([3] + list(qkv.shape[2:]), dtype=qkv.dtype) if bias is None else _call.like_x(bias, qkv)
    out, _lse = _call.call_native(REGISTERED["fmha_qkvpacked"], qkv, bias, cu_seqlens, rng, int(max_seqlen), scale, p)
    return out


def fmha_qkvpacked_reference(qkv, cu_seqlens, max_seqlen, bias=None, dropout=0.0, scale=None, training=True, *,
                             rng_state=None, grouping=None, deterministic=None):  # fmt: skip
    """Plain-Paddle :func:`fmha_qkvpacked`: add, split, :func:`fmha_reference`."""
    _check_qkvpacked_args(qkv, bias)
    options = dict(rng_state=rng_state, grouping=grouping, deterministic=deterministic)
    return fmha_reference(*_split_qkv(qkv, bias), cu_seqlens, max_seqlen, dropout, scale, training, **options)


class _ShapeOf:
    """Shape, dtype and place of q = qkv[:, i] for fmha's argument checks, without slicing qkv."""

    def __init__(self, qkv):
        self.shape = [qkv.shape[0]] + list(qkv.shape[2:])
        self.dtype, self.place = qkv.dtype, qkv.place

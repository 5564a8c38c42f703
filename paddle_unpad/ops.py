"""One thin, documented function per custom operator, and its plain-Paddle reference.

Each public op calls the compiled operator when it is registered for the tensors'
device, and its ``*_reference`` twin otherwise (see ``ops_available()``). The
references are written for clarity, not speed; tests compare the two.
"""
import math
import numbers

import numpy as np
import paddle

from . import _native, config
from . import _paddle_compat as _compat
from . import host_malloc as _host_malloc
from ._warn import warn_once
# The op rules as data, in a module without imports: tests/gpu read it where Paddle is missing.
from ._op_rules import (FMHA_GPU_TOLERANCE, FMHA_SUPPORT, FMHA_TOLERANCE, FUSED_OPS_GPU_TOLERANCE,
                        FUSED_OPS_SUPPORT, FUSED_OPS_TOLERANCE, MODEL_TOLERANCE)
from .bucketed_attention import bucketed_attention
from .philox import attention_keep_mask, rowwise_keep_mask
from .varlen import check_cu_seqlens

__all__ = ["fmha", "fmha_reference", "fmha_qkvpacked", "fmha_qkvpacked_reference", "ops_available", "FMHA_SUPPORT",
           "FMHA_TOLERANCE", "FMHA_GPU_TOLERANCE", "MODEL_TOLERANCE"]


def ops_available():
    """Which native kernels are loaded, per op and device.

    Returns:
        dict, e.g. ``{"fmha": {"cpu": True, "gpu": False}}``. ``False`` means the op
        runs its plain-Paddle reference there. ``paddle_unpad._native.info()`` says why.
    """
    cpu = _native.has_op("pu_fmha")
    return {"fmha": {"cpu": cpu, "gpu": cpu and _native.has_cuda_kernels()}, **_fused_ops_available()}


class _OpError(ValueError):
    pass


_is_tensor = _compat.is_tensor


def _dtype_name(t):
    return str(t.dtype).replace("paddle.", "")


_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = float(np.finfo(np.float32).max)

# Host-side Python (argument checks, dispatch) must not be rewritten by dy2static into
# graph control flow: it only reads static metadata (shapes, dtypes, Python numbers).
_host_only = paddle.jit.not_to_static


@_host_only
def _check_fmha_args(q, k, v, cu_seqlens, max_seqlen, dropout, scale, op="fmha"):
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        if not (_is_tensor(t) or isinstance(t, _ShapeOf)):
            raise TypeError(f"paddle_unpad.{op}: {name} must be a paddle.Tensor, got {type(t).__name__}")
    if len(q.shape) != 3:
        raise ValueError(f"paddle_unpad.{op}: q must be 3-D [total_tokens, heads, head_dim], got shape {list(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if list(t.shape) != list(q.shape):
            raise ValueError(f"paddle_unpad.{op}: {name} shape {list(t.shape)} differs from q shape {list(q.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"paddle_unpad.{op}: {name} dtype {_dtype_name(t)} differs from q dtype {_dtype_name(q)}")
    if cu_seqlens.dtype != paddle.int32:
        raise TypeError(f"paddle_unpad.{op}: cu_seqlens must be int32, got {_dtype_name(cu_seqlens)}")
    if len(cu_seqlens.shape) != 1:
        raise ValueError(f"paddle_unpad.{op}: cu_seqlens must be 1-D [batch + 1], got shape {list(cu_seqlens.shape)}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral):
        raise TypeError(
            f"paddle_unpad.{op}: max_seqlen must be a Python int (known on the host), got {type(max_seqlen).__name__}"
        )
    if max_seqlen < 0:
        raise ValueError(f"paddle_unpad.{op}: max_seqlen must be >= 0, got {max_seqlen}")
    if max_seqlen > _INT32_MAX:  # cu_seqlens is int32: no sequence is longer
        raise ValueError(f"paddle_unpad.{op}: max_seqlen must be at most {_INT32_MAX} (cu_seqlens is int32), got {max_seqlen}")
    for name, value in (("dropout", dropout), ("scale", scale)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TypeError(f"paddle_unpad.{op}: {name} must be a number, got {type(value).__name__} {value!r}")
    if not (0.0 <= float(dropout) < 1.0):
        raise ValueError(f"paddle_unpad.{op}: dropout must be in [0, 1), got {dropout}")
    if scale is not None and not (math.isfinite(float(scale)) and abs(float(scale)) <= _FLOAT32_MAX):
        # the kernels take scale as a float32: 1e39 would become inf and every output NaN
        raise ValueError(f"paddle_unpad.{op}: scale must be a finite float32 number (|scale| <= {_FLOAT32_MAX:.6g}), got {scale}")
    d = q.shape[2]
    # fmha_qkvpacked checks its qkv through a q of the same shape: name what its caller passed
    in_name, hd_name = ("q/k/v", "q.shape[2]") if op == "fmha" else ("qkv", "qkv.shape[3]")
    if d is not None and d == 0:
        raise ValueError(f"paddle_unpad.{op}: head size {hd_name} must be >= 1, got {d}")
    if _on_cpu(q):  # the CPU kernel is the only CPU path: its rules are the op's rules there
        rules = FMHA_SUPPORT["cpu"]
        if d is not None and d > 0 and d not in rules["head_dim"]:
            raise ValueError(f"paddle_unpad.{op}: head size ({hd_name}) {d} is not supported on CPU: supported are {_sizes_in_words(rules['head_dim'])}")
        if _dtype_name(q) not in rules["dtypes"]:
            raise TypeError(f"paddle_unpad.{op}: {in_name} dtype {_dtype_name(q)} is not supported on CPU (supported: {', '.join(rules['dtypes'])})")
    elif not _is_floating(q):
        raise TypeError(f"paddle_unpad.{op}: {in_name} dtype {_dtype_name(q)} is not a floating-point dtype")
    # cu_seqlens' values are checked where they are read, by the same rules in the same words:
    # by the native op (C++), or by _fmha_reference. Reading them here as well would be one
    # more host read per call, which a model forward on packed inputs does not make.
    _compat.refuse_empty(op, "q", q)


def _fmha_gpu_kernel_refusal(q):
    """Off the CPU: None when the CUDA fmha kernel takes q, else why not (in words). Where it
    does not, fmha runs :func:`paddle_unpad.bucketed_attention.bucketed_attention`."""
    if not _native_ok("pu_fmha", q):
        return "this build of paddle_unpad has no CUDA kernels" if _native.has_op("pu_fmha") else \
            "the compiled operators are not loaded"
    rules, dtype, d = FMHA_SUPPORT["gpu"], _dtype_name(q), q.shape[2]
    if dtype not in rules["dtypes"]:
        return (f"the CUDA kernel takes {' and '.join(rules['dtypes'])}, not {dtype} (AMP, e.g. paddle.amp.auto_cast(), is the fast path)")
    if d not in rules["head_dim"]:
        return f"the CUDA kernel takes head sizes {_sizes_in_words(rules['head_dim'])}, not {d}"
    return None


def _is_floating(t):
    return t.dtype in (paddle.float16, paddle.bfloat16, paddle.float32, paddle.float64)


def _sizes_in_words(sizes):
    """A range as lo..hi, other sizes listed: the words of the C++ checks."""
    if isinstance(sizes, range):
        return f"{sizes.start}..{sizes.stop - 1}"
    return ", ".join(str(s) for s in sizes)


def _on_cpu(t):
    """Whether t lives (or, in a traced program, will live) on the CPU."""
    if paddle.in_dynamic_mode():
        return t.place.is_cpu_place()
    return paddle.device.get_device().startswith("cpu")


_generator_for = _compat.default_generator


@_host_only
def _rng_state_tensor(rng_state, q):
    """[seed, offset] int64 on the CPU: given, or drawn from Paddle's generator."""
    if rng_state is None:
        if paddle.in_dynamic_mode():
            gen = _generator_for(q.place)
            seed, offset = gen.random(), gen.random() & 0xFFFFFFFF
            return paddle.to_tensor([_as_int64(seed), offset], dtype="int64", place=paddle.CPUPlace())
        # Traced programs draw a fresh state on every run (randint takes 32-bit bounds).
        return paddle.randint(0, 2**31 - 1, shape=[2], dtype="int64")
    if _is_tensor(rng_state):
        if paddle.in_dynamic_mode() and (list(rng_state.shape) != [2] or rng_state.dtype != paddle.int64
                                         or not rng_state.place.is_cpu_place()):
            error = TypeError if rng_state.dtype != paddle.int64 else ValueError
            raise error(f"paddle_unpad.ops: rng_state must be (seed, offset) ints or a [2] int64 CPU tensor, got a tensor of shape {list(rng_state.shape)}, dtype {_dtype_name(rng_state)} on {rng_state.place}")
        return rng_state
    if (not isinstance(rng_state, (tuple, list))
            or any(isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) for v in rng_state)):
        raise TypeError(f"paddle_unpad.ops: rng_state must be a (seed, offset) pair of ints or a [2] int64 CPU tensor, got {rng_state!r}")
    if len(rng_state) != 2:
        raise ValueError(f"paddle_unpad.ops: rng_state must be a (seed, offset) pair of ints, got {len(rng_state)} values: {rng_state!r}")
    seed, offset = rng_state
    return paddle.to_tensor(
        [_as_int64(seed), int(offset) & 0xFFFFFFFF], dtype="int64", place=paddle.CPUPlace()
    )


def _as_int64(seed):
    """The seed is a uint64 (all 64 bits key Philox); store its bits in an int64."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return s - (1 << 64) if s >= (1 << 63) else s


# PD_CHECK messages of the custom ops start with the op's public name.
_OP_ERROR_PREFIXES = ("fmha:", "fmha_qkvpacked:", "bias_gelu:", "bias_dropout_residual_layer_norm:")


def _call_native(name, *args):
    try:
        return _compat.custom_op_function(name)(*args)
    except OSError as e:  # Paddle reports PD_CHECK failures of custom ops as OSError
        msg = str(e)
        hits = [msg.index(prefix) for prefix in _OP_ERROR_PREFIXES if prefix in msg]
        if hits:
            text = msg[min(hits):].split("\n")[0].strip()
            raise _OpError(f"paddle_unpad.{'' if text.startswith('fmha') else 'ops.'}{text}") from None
        raise


def _grouping(grouping):
    """The explicit argument, else the FMHA_GROUPING setting (an argument always wins)."""
    grouping = config.resolve(grouping, "FMHA_GROUPING")
    if not isinstance(grouping, (bool, np.bool_)):
        raise TypeError(f"paddle_unpad.fmha: grouping must be a bool or None, got {type(grouping).__name__} {grouping!r}")
    return bool(grouping)


@_host_only
def fmha(q, k, v, cu_seqlens, max_seqlen, dropout=0.0, scale=None, training=True, *, rng_state=None,
         grouping=None):
    """Fused multi-head attention over packed variable-length sequences.

    Each of the B sequences attends only to itself (no masking inside a sequence); no
    padding is stored or computed.

    Args:
        q, k, v: [T, H, D] of one dtype, the tokens of all sequences packed back to back;
            T = cu_seqlens[-1]. CPU: float32 (the CPU kernel). GPU: float16 / bfloat16 with
            head size 32, 64 or 128 run the CUDA kernel; anything else (float32 without AMP,
            other head sizes) runs :func:`paddle_unpad.bucketed_attention.bucketed_attention`,
            plain Paddle ops over length buckets, with one warning saying why.
        cu_seqlens: [B + 1] int32 on the CPU: 0, then prefix sums of the lengths.
            Zero-length sequences are allowed and produce nothing.
        max_seqlen: Python int >= the longest sequence (a host value: no device sync).
        dropout: attention-probability dropout in [0, 1), applied when ``training``;
            resolved to 2**-16 (16 random bits per element, ``paddle_unpad.philox``).
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
    Returns:
        out: [T, H, D], same dtype as q. Differentiable w.r.t. q, k and v.
    Raises:
        TypeError / ValueError naming the argument and value for bad input.
    """
    _host_malloc.ensure("paddle_unpad.fmha")
    _check_fmha_args(q, k, v, cu_seqlens, max_seqlen, dropout, scale)
    grouping = _grouping(grouping)
    d = q.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    p = float(dropout) if training else 0.0
    on_cpu = _on_cpu(q)
    refusal = None if on_cpu else _fmha_gpu_kernel_refusal(q)
    if _native_ok("pu_fmha", q) and refusal is None:
        rng = _rng_state_tensor(rng_state, q) if p > 0.0 else None
        out, _lse = _call_native(
            "pu_fmha", q, k, v, cu_seqlens, rng, int(max_seqlen), scale, p, grouping
        )
        return out
    if not paddle.in_dynamic_mode():
        raise RuntimeError(
            f"paddle_unpad.fmha: the compiled operator is needed inside paddle.jit.to_static (the plain-Paddle attention reads cu_seqlens on the host){'' if refusal is None else ', and ' + refusal}; see paddle_unpad._native.info()"
        )
    if on_cpu:
        rng = _rng_state_tensor(rng_state, q) if p > 0.0 else None
        return _fmha_reference(q, k, v, cu_seqlens, max_seqlen, p, scale, rng)
    warn_once(("fmha", refusal), f"fmha: {refusal}; attention runs as plain Paddle ops over length buckets (paddle_unpad.bucketed_attention, slower). This warning is shown once.", RuntimeWarning)
    rng = _rng_state_tensor(rng_state, q) if p > 0.0 and rng_state is not None else None
    return bucketed_attention(q, k, v, cu_seqlens, max_seqlen, p, scale, rng)


def fmha_reference(q, k, v, cu_seqlens, max_seqlen, dropout=0.0, scale=None, training=True, *, rng_state=None,
                   grouping=None):
    """Plain-Paddle ``fmha``: a loop over sequences of matmul-softmax-matmul.

    Same arguments, result and dropout mask as :func:`fmha` (the mask comes from the
    numpy Philox in ``paddle_unpad.philox``; ``grouping`` is accepted and has no effect).
    Eager mode only.
    """
    _check_fmha_args(q, k, v, cu_seqlens, max_seqlen, dropout, scale)
    _grouping(grouping)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    p = float(dropout) if training else 0.0
    rng = _rng_state_tensor(rng_state, q) if p > 0.0 else None
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


@_host_only
def _check_qkvpacked_args(qkv, bias):
    if not _is_tensor(qkv):
        raise TypeError(f"paddle_unpad.fmha_qkvpacked: qkv must be a paddle.Tensor, got {type(qkv).__name__}")
    if len(qkv.shape) != 4 or qkv.shape[1] != 3:
        raise ValueError(f"paddle_unpad.fmha_qkvpacked: qkv must be 4-D [total_tokens, 3, heads, head_dim], got shape {list(qkv.shape)}")
    if bias is not None:
        if not _is_tensor(bias):
            raise TypeError(f"paddle_unpad.fmha_qkvpacked: bias must be a paddle.Tensor or None, got {type(bias).__name__}")
        if list(bias.shape) != [3] + list(qkv.shape[2:]):
            raise ValueError(f"paddle_unpad.fmha_qkvpacked: bias must have shape [3, heads, head_dim] = {[3] + list(qkv.shape[2:])}, got {list(bias.shape)}")
        if not _is_floating(bias):
            raise TypeError(f"paddle_unpad.fmha_qkvpacked: bias dtype {_dtype_name(bias)} is not a floating-point dtype")
        _check_mixable("fmha_qkvpacked", "bias", bias, qkv, "qkv")


def _split_qkv(qkv, bias):
    x = qkv if bias is None else qkv + _like_x(bias, qkv)
    return paddle.unbind(x, axis=1)


def _like_x(bias, x):
    """The bias in x's dtype, as AMP hands a GEMM's bias to its fused epilogue (and Paddle's own
    fused ops cast it): under O1 the parameter is float32 next to a half activation."""
    return bias if bias.dtype == x.dtype else bias.astype(x.dtype)


def _check_mixable(op, name, t, x, x_name="x"):
    """AMP mixes float16 / bfloat16 / float32; a float64 next to another dtype is a mistake
    (casting it would silently drop precision), refused here naming both."""
    if t is not None and t.dtype != x.dtype and paddle.float64 in (t.dtype, x.dtype):
        raise TypeError(f"paddle_unpad.{op}: {name} dtype {_dtype_name(t)} differs from {x_name} dtype {_dtype_name(x)} (mixed dtypes are lined up among float16, bfloat16 and float32, as AMP makes them; float64 only with every tensor float64)")


@_host_only
def fmha_qkvpacked(qkv, cu_seqlens, max_seqlen, bias=None, dropout=0.0, scale=None, training=True, *,
                   rng_state=None, grouping=None):
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
        cu_seqlens, max_seqlen, dropout, scale, training, rng_state, grouping: as for
            :func:`fmha` (``grouping`` applies where the split path runs on a GPU).
        bias: [3, H, D] (bq, bk, bv), or None. A bias of another floating dtype (a float32
            parameter under AMP O1) is cast to qkv's dtype, as AMP casts a GEMM's bias.
    Returns:
        out: [T, H, D], same dtype as qkv. Differentiable w.r.t. qkv and bias.
    Raises:
        TypeError / ValueError naming the argument and value for bad input.
    """
    _host_malloc.ensure("paddle_unpad.fmha_qkvpacked")
    _check_qkvpacked_args(qkv, bias)
    if not (_native.has_op("pu_fmha_qkv") and _on_cpu(qkv) and paddle.in_dynamic_mode()):
        q, k, v = _split_qkv(qkv, bias)
        return fmha(q, k, v, cu_seqlens, max_seqlen, dropout, scale, training, rng_state=rng_state,
                    grouping=grouping)
    # the checks of fmha, on a q of the same shape (no copy is made: only shapes are read)
    q = _ShapeOf(qkv)
    _check_fmha_args(q, q, q, cu_seqlens, max_seqlen, dropout, scale, op="fmha_qkvpacked")
    _grouping(grouping)
    d = qkv.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    p = float(dropout) if training else 0.0
    rng = _rng_state_tensor(rng_state, qkv) if p > 0.0 else None
    bias = paddle.zeros([3] + list(qkv.shape[2:]), dtype=qkv.dtype) if bias is None else _like_x(bias, qkv)
    out, _lse = _call_native("pu_fmha_qkv", qkv, bias, cu_seqlens, rng, int(max_seqlen), scale, p)
    return out


def fmha_qkvpacked_reference(qkv, cu_seqlens, max_seqlen, bias=None, dropout=0.0, scale=None, training=True, *,
                             rng_state=None, grouping=None):
    """Plain-Paddle :func:`fmha_qkvpacked`: add, split, :func:`fmha_reference`."""
    _check_qkvpacked_args(qkv, bias)
    q, k, v = _split_qkv(qkv, bias)
    return fmha_reference(q, k, v, cu_seqlens, max_seqlen, dropout, scale, training, rng_state=rng_state,
                          grouping=grouping)


class _ShapeOf:
    """Shape, dtype and place of q = qkv[:, i] for fmha's argument checks, without slicing qkv."""

    def __init__(self, qkv):
        self.shape = [qkv.shape[0]] + list(qkv.shape[2:])
        self.dtype, self.place = qkv.dtype, qkv.place


# ----------------------------------------------------------------------------- fused encoder ops
#
# bias_gelu and bias_dropout_residual_layer_norm: the element-/row-wise pieces of a BERT
# encoder layer between its GEMMs, one pass over memory each (native op), or the same
# math as a short sequence of plain Paddle ops (``*_reference``).

__all__ += [
    "bias_gelu",
    "bias_gelu_reference",
    "bias_dropout_residual_layer_norm",
    "bias_dropout_residual_layer_norm_reference",
    "FUSED_OPS_SUPPORT",
    "FUSED_OPS_TOLERANCE",
    "FUSED_OPS_GPU_TOLERANCE",
]

# Public op name -> registered custom op.
_FUSED_OPS = {
    "bias_gelu": "pu_bias_gelu",
    "bias_dropout_residual_layer_norm": "pu_bias_dropout_residual_layer_norm",
}


def _fused_ops_available():
    gpu = _native.has_cuda_kernels()
    out = {}
    for name, op in _FUSED_OPS.items():
        cpu = _native.has_op(op)
        out[name] = {"cpu": cpu, "gpu": cpu and gpu}
    return out


def _known(d):
    return d is not None and d >= 0


def _same_place(a, b):
    if not paddle.in_dynamic_mode():
        return True
    return str(a.place) == str(b.place)


@_host_only
def _check_feature_vector(op, name, t, x):
    """t must be a floating 1-D [F] tensor (F = x.shape[-1]) on x's place (its dtype is lined
    up with x's by :func:`_like_x` / :func:`_bdrln_dtypes`)."""
    if not _is_tensor(t):
        raise TypeError(f"paddle_unpad.{op}: {name} must be a paddle.Tensor or None, got {type(t).__name__}")
    f = x.shape[-1]
    if len(t.shape) != 1 or (_known(f) and _known(t.shape[0]) and t.shape[0] != f):
        raise ValueError(f"paddle_unpad.{op}: {name} must be 1-D [{f}] (F = x.shape[-1]), got shape {list(t.shape)}")
    if not _is_floating(t):
        raise TypeError(f"paddle_unpad.{op}: {name} dtype {_dtype_name(t)} is not a floating-point dtype")
    if not _same_place(t, x):
        raise ValueError(f"paddle_unpad.{op}: {name} is on {t.place} but x is on {x.place}")


@_host_only
def _check_x(op, x):
    if not _is_tensor(x):
        raise TypeError(f"paddle_unpad.{op}: x must be a paddle.Tensor, got {type(x).__name__}")
    if len(x.shape) < 1:
        raise ValueError(f"paddle_unpad.{op}: x must have at least 1 dimension [..., F], got shape {list(x.shape)}")
    if x.shape[-1] != 0:  # F = 0 is refused by each op's own check, in its own words
        _compat.refuse_empty(op, "x", x)
    device = "cpu" if _on_cpu(x) else "gpu"
    if device == "gpu" and not _native.has_cuda_kernels():
        return  # the plain-Paddle reference runs there: any dtype Paddle supports
    if _dtype_name(x) not in FUSED_OPS_SUPPORT[device]["dtypes"]:
        raise TypeError(
            f"paddle_unpad.{op}: x dtype {_dtype_name(x)} is not supported on {device.upper()} (supported: {', '.join(FUSED_OPS_SUPPORT[device]['dtypes'])})"
        )


@_host_only
def _filled_vector(x, value):
    """A [F] tensor of x's dtype and place holding `value` (stands in for a None vector)."""
    f = x.shape[-1]
    if not _known(f):
        raise ValueError("paddle_unpad.ops: the last dimension of x must be known to use a None bias / ln_weight / ln_bias")
    return paddle.full([f], value, dtype=x.dtype)


@_host_only
def _native_ok(op, x):
    return _native.has_op(op) and (_on_cpu(x) or _native.has_cuda_kernels())


@_host_only
def _check_bias_gelu_args(x, bias):
    _check_x("ops.bias_gelu", x)
    if bias is not None:
        _check_feature_vector("ops.bias_gelu", "bias", bias, x)
        _check_mixable("ops.bias_gelu", "bias", bias, x)


@_host_only
def bias_gelu(x, bias):
    """``gelu(x + bias)`` with the exact (erf) GELU that BERT uses, fused in one pass.

    ``gelu(u) = 0.5 * u * (1 + erf(u / sqrt(2)))``, as ``paddle.nn.functional.gelu(u,
    approximate=False)`` and PaddleNLP's ``hidden_act="gelu"``.

    Args:
        x: [..., F] float32 on CPU; float16, bfloat16 or float32 on GPU (builds with
            CUDA; fp32 arithmetic). Typically the packed ``[T, intermediate_size]``
            output of the first FFN GEMM, without its bias. ``T = 0`` is allowed.
        bias: [F] on x's device; ``None`` means no bias. Another floating dtype (a float32
            parameter under AMP O1) is cast to x's dtype, as AMP casts a linear layer's bias.
    Returns:
        y: same shape and dtype as x. Differentiable w.r.t. x and bias (the bias gradient
        is a column sum reduced in a fixed order: reruns and thread counts give
        bitwise-identical results).
    Raises:
        TypeError / ValueError naming the argument and value for bad input.
    """
    _host_malloc.ensure("paddle_unpad.ops.bias_gelu")
    _check_bias_gelu_args(x, bias)
    bias = _filled_vector(x, 0.0) if bias is None else _like_x(bias, x)
    if _native_ok("pu_bias_gelu", x):
        return _call_native("pu_bias_gelu", x, bias)[0]
    return _bias_gelu_reference(x, bias)


def bias_gelu_reference(x, bias):
    """Plain-Paddle ``bias_gelu``: ``paddle.nn.functional.gelu(x + bias, approximate=False)``,
    computed in float32 (float64 if x is) and rounded once to x's dtype, as the kernels do."""
    _check_bias_gelu_args(x, bias)
    bias = _filled_vector(x, 0.0) if bias is None else _like_x(bias, x)
    return _bias_gelu_reference(x, bias)


def _bias_gelu_reference(x, bias):
    wide = _wide_dtype(x)
    y = paddle.nn.functional.gelu(_as(x, wide) + _as(bias, wide), approximate=False)
    return _as(y, x.dtype)


def _wide_dtype(*ts):
    """float64 if any tensor is, else float32: the references' arithmetic, as the kernels'."""
    return paddle.float64 if any(t.dtype == paddle.float64 for t in ts) else paddle.float32


def _as(t, dtype):
    return t if t.dtype == dtype else t.astype(dtype)


@_host_only
def _check_bdrln_args(x, bias, residual, ln_weight, ln_bias, dropout, epsilon):
    op = "ops.bias_dropout_residual_layer_norm"
    _check_x(op, x)
    if not _is_tensor(residual):
        raise TypeError(f"paddle_unpad.{op}: residual must be a paddle.Tensor, got {type(residual).__name__}")
    rs, xs = list(residual.shape), list(x.shape)
    if len(rs) != len(xs) or any(_known(a) and _known(b) and a != b for a, b in zip(rs, xs)):
        raise ValueError(f"paddle_unpad.{op}: residual shape {rs} differs from x shape {xs}")
    if not _same_place(residual, x):
        raise ValueError(f"paddle_unpad.{op}: residual is on {residual.place} but x is on {x.place}")
    for name, t in (("bias", bias), ("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t is not None:
            _check_feature_vector(op, name, t, x)
    if _known(x.shape[-1]) and x.shape[-1] < 1:
        raise ValueError(f"paddle_unpad.{op}: the normalised size x.shape[-1] must be at least 1, got {x.shape[-1]}")
    for name, value in (("dropout", dropout), ("epsilon", epsilon)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"paddle_unpad.{op}: {name} must be a number, got {type(value).__name__} {value!r}")
    if not (0.0 <= float(dropout) < 1.0):
        raise ValueError(f"paddle_unpad.{op}: dropout must be a number in [0, 1), got {dropout!r}")
    if not (math.isfinite(float(epsilon)) and float(epsilon) > 0.0):
        raise ValueError(f"paddle_unpad.{op}: epsilon must be a finite number > 0, got {epsilon!r}")
    for name, t in (("residual", residual), ("bias", bias), ("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        _check_mixable(op, name, t, x)


@_host_only
def bias_dropout_residual_layer_norm(
    x, bias, residual, ln_weight, ln_bias, dropout=0.0, epsilon=1e-12, training=True, *, rng_state=None
):
    """Post-LN residual block of a BERT layer, fused in one pass over each row:

        y = LayerNorm(residual + dropout(x + bias)) * ln_weight + ln_bias

    over the last dimension (biased variance, ``epsilon`` inside the square root), i.e.
    ``norm(residual + dropout(linear(h)))`` of ``paddle.nn.TransformerEncoderLayer`` with
    ``normalize_before=False`` when x is the GEMM output without its bias. The mean and
    1/std of each row are saved for the backward pass; the dropout mask is not stored
    but regenerated from ``rng_state`` (Philox, the row-wise layout of
    ``paddle_unpad.philox.rowwise_keep_mask``).

    Args:
        x: [..., F] float32 on CPU; float16, bfloat16 or float32 on GPU (builds with
            CUDA; fp32 arithmetic, mean and 1/std kept in fp32). Typically ``[T, hidden]``.
            ``T = 0`` is allowed.
        bias: [F] or None (no bias), on x's device; cast to x's dtype when it differs (as
            AMP casts a linear layer's bias).
        residual: x's shape and device; x's dtype, or float32 next to a half x (AMP O1's
            float32 residual stream). A half residual next to a float32 x is cast up.
        ln_weight, ln_bias: [F] or None (ones / zeros), the LayerNorm affine parameters:
            x's dtype or float32 (AMP keeps them float32); any other is cast to float32.
        dropout: drop probability of ``x + bias`` in [0, 1), applied when ``training``;
            kept values are scaled by ``1 / (1 - dropout)`` (``upscale_in_train``).
        epsilon: > 0, added to the variance; PaddleNLP BERT uses 1e-12.
        training: dropout is applied only when True.
        rng_state: ``(seed, offset)`` ints or a [2] int64 CPU tensor fixing the dropout
            mask; default: drawn from Paddle's generator (``paddle.seed(n)`` makes runs
            reproducible), as for :func:`fmha`.
    Returns:
        y: x's shape; the residual's dtype after the rule above (x's, or float32 when the
        residual is float32 -- Paddle's promotion of ``residual + dropout(...)``). Differentiable
        w.r.t. x, bias, residual, ln_weight and ln_bias (vector gradients are column sums
        reduced in a fixed order).
    Raises:
        TypeError / ValueError naming the argument and value for bad input.
    """
    _host_malloc.ensure("paddle_unpad.ops.bias_dropout_residual_layer_norm")
    x, bias, residual, ln_weight, ln_bias, p, rng = _bdrln_prepare(
        x, bias, residual, ln_weight, ln_bias, dropout, epsilon, training, rng_state)
    if _native_ok("pu_bias_dropout_residual_layer_norm", x):
        y, _mean, _rstd = _call_native(
            "pu_bias_dropout_residual_layer_norm", x, bias, residual, ln_weight, ln_bias, rng, p, float(epsilon)
        )
        return y
    if p > 0.0 and not paddle.in_dynamic_mode():
        raise RuntimeError(
            "paddle_unpad.ops.bias_dropout_residual_layer_norm: the compiled operator is needed for dropout inside paddle.jit.to_static (the reference builds its mask on the host); see paddle_unpad._native.info()"
        )
    return _bdrln_reference(x, bias, residual, ln_weight, ln_bias, p, float(epsilon), rng)


def bias_dropout_residual_layer_norm_reference(
    x, bias, residual, ln_weight, ln_bias, dropout=0.0, epsilon=1e-12, training=True, *, rng_state=None
):
    """Plain-Paddle ``bias_dropout_residual_layer_norm``: add, dropout with the same Philox
    mask (built by numpy in ``paddle_unpad.philox``), add, LayerNorm from elementwise ops
    (mean, biased variance, ``rsqrt``, affine).

    Same arguments and result as :func:`bias_dropout_residual_layer_norm`. With dropout,
    eager mode only.
    """
    x, bias, residual, ln_weight, ln_bias, p, rng = _bdrln_prepare(
        x, bias, residual, ln_weight, ln_bias, dropout, epsilon, training, rng_state)
    return _bdrln_reference(x, bias, residual, ln_weight, ln_bias, p, float(epsilon), rng)


@_host_only
def _bdrln_prepare(x, bias, residual, ln_weight, ln_bias, dropout, epsilon, training, rng_state):
    """Checks, dtypes lined up (:func:`_bdrln_dtypes`), default vectors (None: zeros / ones /
    zeros), effective p and the Philox state."""
    _check_bdrln_args(x, bias, residual, ln_weight, ln_bias, dropout, epsilon)
    y_dtype, ln_dtype = _bdrln_dtypes(x, residual, ln_weight, ln_bias)
    residual = _as(residual, y_dtype)
    bias = _filled_vector(x, 0.0) if bias is None else _like_x(bias, x)
    ln_weight = paddle.full([x.shape[-1]], 1.0, dtype=ln_dtype) if ln_weight is None else _as(ln_weight, ln_dtype)
    ln_bias = paddle.full([x.shape[-1]], 0.0, dtype=ln_dtype) if ln_bias is None else _as(ln_bias, ln_dtype)
    p = float(dropout) if training else 0.0
    rng = _rng_state_tensor(rng_state, x) if p > 0.0 else None
    return x, bias, residual, ln_weight, ln_bias, p, rng


def _bdrln_dtypes(x, residual, ln_weight, ln_bias):
    """``(y dtype, LayerNorm parameter dtype)`` for the tensors AMP hands over, by Paddle's
    rules for the ops this one fuses:

    * y (and the residual) take x's dtype when the residual has it, else float32 -- Paddle's
      promotion of ``residual + dropout(linear(h))``: under O1 a half GEMM output meets the
      float32 residual stream, and LayerNorm keeps the sum's float32;
    * the LayerNorm parameters keep their dtype when it is x's or float32 (O1 and O2 leave
      them float32; LayerNorm takes float32 parameters next to a half input), else float32;
    * the bias takes x's dtype (as AMP casts a linear layer's bias; :func:`_like_x`).

    The kernels compute in float32 whatever the dtypes and round each output once. (float64
    mixes are refused by the argument checks.)
    """
    y_dtype = x.dtype if residual.dtype == x.dtype else paddle.float32
    given = [t.dtype for t in (ln_weight, ln_bias) if t is not None]
    if not given:
        return y_dtype, x.dtype  # ones / zeros stand in: exact in any dtype
    ln_dtype = given[0] if all(d == given[0] for d in given) else paddle.float32
    return y_dtype, ln_dtype if ln_dtype in (x.dtype, paddle.float32) else paddle.float32


def _bdrln_reference(x, bias, residual, ln_weight, ln_bias, p, epsilon, rng):
    y_dtype = residual.dtype
    wide = _wide_dtype(x, residual, ln_weight)
    x, bias, residual, ln_weight, ln_bias = (_as(t, wide) for t in (x, bias, residual, ln_weight, ln_bias))
    h = x + bias
    if p > 0.0:
        seed, offset = (int(v) for v in rng.numpy())
        f = x.shape[-1]
        rows = int(np.prod(x.shape[:-1], dtype=np.int64))
        keep = rowwise_keep_mask(seed, offset, p, rows, f).reshape(x.shape)
        h = h * paddle.to_tensor(keep.astype(np.float32) / np.float32(1.0 - p), dtype=h.dtype, place=x.place)
    # LayerNorm spelled out: paddle.nn.functional.layer_norm (3.3.1) returns a wrong input
    # gradient when ln_weight.stop_gradient is True, and this is the reference
    u = residual + h
    mean = u.mean(axis=-1, keepdim=True)
    centered = u - mean
    var = (centered * centered).mean(axis=-1, keepdim=True)  # biased, as LayerNorm
    return _as(centered * paddle.rsqrt(var + epsilon) * ln_weight + ln_bias, y_dtype)

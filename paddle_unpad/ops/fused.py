"""The fused encoder ops: bias_gelu and bias_dropout_residual_layer_norm.

The element- and row-wise pieces of a BERT encoder layer between its GEMMs, one pass over
memory each (native op), or the same math as a short sequence of plain Paddle ops
(``*_reference``).
"""

import math
import numbers

import numpy as np
import paddle

from .._runtime import host_malloc as _host_malloc
from .._runtime import native as _native
from .._runtime import paddle_compat as _compat
from ._names import REGISTERED, WHERE
from ._rules import FUSED_OPS_SUPPORT
from .philox import rowwise_keep_mask
from . import _call
from ._call import host_only

_GELU, _BDRLN = WHERE["bias_gelu"], WHERE["bias_dropout_residual_layer_norm"]


def _known(d):
    return d is not None and d >= 0


def _same_place(a, b):
    if not paddle.in_dynamic_mode():
        return True
    return str(a.place) == str(b.place)


@host_only
def _check_feature_vector(op, name, t, x):
    """t must be a floating 1-D [F] tensor (F = x.shape[-1]) on x's place (its dtype is lined
    up with x's by :func:`._call.like_x` / :func:`_bdrln_dtypes`)."""
    if not _call.is_tensor(t):
        raise TypeError(f"paddle_unpad.{op}: {name} must be a paddle.Tensor or None, got {type(t).__name__}")
    f = x.shape[-1]
    if len(t.shape) != 1 or (_known(f) and _known(t.shape[0]) and t.shape[0] != f):
        raise ValueError(f"paddle_unpad.{op}: {name} must be 1-D [{f}] (F = x.shape[-1]), got shape {list(t.shape)}")
    if not _call.is_floating(t):
        raise TypeError(f"paddle_unpad.{op}: {name} dtype {_call.dtype_name(t)} is not a floating-point dtype")
    if not _same_place(t, x):
        raise ValueError(f"paddle_unpad.{op}: {name} is on {t.place} but x is on {x.place}")


@host_only
def _check_x(op, x):
    if not _call.is_tensor(x):
        raise TypeError(f"paddle_unpad.{op}: x must be a paddle.Tensor, got {type(x).__name__}")
    if len(x.shape) < 1:
        raise ValueError(f"paddle_unpad.{op}: x must have at least 1 dimension [..., F], got shape {list(x.shape)}")
    if x.shape[-1] != 0:  # F = 0 is refused by each op's own check, in its own words
        _compat.refuse_empty(op, "x", x)
    device = "cpu" if _call.on_cpu(x) else "gpu"
    if device == "gpu" and not _native.has_cuda_kernels():
        return  # the plain-Paddle reference runs there: any dtype Paddle supports
    if _call.dtype_name(x) not in FUSED_OPS_SUPPORT[device]["dtypes"]:
        raise TypeError(
            f"paddle_unpad.{op}: x dtype {_call.dtype_name(x)} is not supported on {device.upper()} (supported: {', '.join(FUSED_OPS_SUPPORT[device]['dtypes'])})"
        )


@host_only
def _filled_vector(x, value, op):
    """A [F] tensor of x's dtype and place holding `value` (stands in for a None vector)."""
    f = x.shape[-1]
    if not _known(f):
        raise ValueError(
            f"paddle_unpad.{op}: the last dimension of x must be known to use a None bias / ln_weight / ln_bias"
        )
    return paddle.full([f], value, dtype=x.dtype)


@host_only
def _check_bias_gelu_args(x, bias):
    _check_x(_GELU, x)
    if bias is not None:
        _check_feature_vector(_GELU, "bias", bias, x)
        _call.check_mixable(_GELU, "bias", bias, x)


@host_only
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
    _host_malloc.ensure(f"paddle_unpad.{_GELU}")
    _check_bias_gelu_args(x, bias)
    bias = _filled_vector(x, 0.0, _GELU) if bias is None else _call.like_x(bias, x)
    if _call.native_ok(REGISTERED["bias_gelu"], x):
        return _call.call_native(REGISTERED["bias_gelu"], x, bias)[0]
    return _bias_gelu_reference(x, bias)


def bias_gelu_reference(x, bias):
    """Plain-Paddle ``bias_gelu``: ``paddle.nn.functional.gelu(x + bias, approximate=False)``,
    computed in float32 (float64 if x is) and rounded once to x's dtype, as the kernels do."""
    _check_bias_gelu_args(x, bias)
    bias = _filled_vector(x, 0.0, _GELU) if bias is None else _call.like_x(bias, x)
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


@host_only
def _check_bdrln_args(x, bias, residual, ln_weight, ln_bias, dropout, epsilon):
    op = _BDRLN
    _check_x(op, x)
    if not _call.is_tensor(residual):
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
        _call.check_mixable(op, name, t, x)


@host_only
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
    ``paddle_unpad.ops.philox.rowwise_keep_mask``).

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
    _host_malloc.ensure(f"paddle_unpad.{_BDRLN}")
    x, bias, residual, ln_weight, ln_bias, p, rng = _bdrln_prepare(
        x, bias, residual, ln_weight, ln_bias, dropout, epsilon, training, rng_state
    )
    if _call.native_ok(REGISTERED["bias_dropout_residual_layer_norm"], x):
        y, _mean, _rstd = _call.call_native(
            REGISTERED["bias_dropout_residual_layer_norm"],
            x,
            bias,
            residual,
            ln_weight,
            ln_bias,
            rng,
            p,
            float(epsilon),
        )
        return y
    if p > 0.0 and not paddle.in_dynamic_mode():
        raise RuntimeError(
            f"paddle_unpad.{_BDRLN}: the compiled operator is needed for dropout inside paddle.jit.to_static (the reference builds its mask on the host); see paddle_unpad._runtime.native.info()"
        )
    return _bdrln_reference(x, bias, residual, ln_weight, ln_bias, p, float(epsilon), rng)


def bias_dropout_residual_layer_norm_reference(
    x, bias, residual, ln_weight, ln_bias, dropout=0.0, epsilon=1e-12, training=True, *, rng_state=None
):
    """Plain-Paddle ``bias_dropout_residual_layer_norm``: add, dropout with the same Philox
    mask (built by numpy in ``paddle_unpad.ops.philox``), add, LayerNorm from elementwise ops
    (mean, biased variance, ``rsqrt``, affine).

    Same arguments and result as :func:`bias_dropout_residual_layer_norm`. With dropout,
    eager mode only.
    """
    x, bias, residual, ln_weight, ln_bias, p, rng = _bdrln_prepare(
        x, bias, residual, ln_weight, ln_bias, dropout, epsilon, training, rng_state
    )
    return _bdrln_reference(x, bias, residual, ln_weight, ln_bias, p, float(epsilon), rng)


@host_only
def _bdrln_prepare(x, bias, residual, ln_weight, ln_bias, dropout, epsilon, training, rng_state):
    """Checks, dtypes lined up (:func:`_bdrln_dtypes`), default vectors (None: zeros / ones /
    zeros), effective p and the Philox state."""
    _check_bdrln_args(x, bias, residual, ln_weight, ln_bias, dropout, epsilon)
    y_dtype, ln_dtype = _bdrln_dtypes(x, residual, ln_weight, ln_bias)
    residual = _as(residual, y_dtype)
    bias = _filled_vector(x, 0.0, _BDRLN) if bias is None else _call.like_x(bias, x)
    ln_weight = paddle.full([x.shape[-1]], 1.0, dtype=ln_dtype) if ln_weight is None else _as(ln_weight, ln_dtype)
    ln_bias = paddle.full([x.shape[-1]], 0.0, dtype=ln_dtype) if ln_bias is None else _as(ln_bias, ln_dtype)
    p = float(dropout) if training else 0.0
    rng = _call.rng_state_tensor(rng_state, x, _BDRLN) if p > 0.0 else None
    return x, bias, residual, ln_weight, ln_bias, p, rng


def _bdrln_dtypes(x, residual, ln_weight, ln_bias):
    """``(y dtype, LayerNorm parameter dtype)`` for the tensors AMP hands over, by Paddle's
    rules for the ops this one fuses:

    * y (and the residual) take x's dtype when the residual has it, else float32 -- Paddle's
      promotion of ``residual + dropout(linear(h))``: under O1 a half GEMM output meets the
      float32 residual stream, and LayerNorm keeps the sum's float32;
    * the LayerNorm parameters keep their dtype when it is x's or float32 (O1 and O2 leave
      them float32; LayerNorm takes float32 parameters next to a half input), else float32;
    * the bias takes x's dtype (as AMP casts a linear layer's bias; :func:`._call.like_x`).

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

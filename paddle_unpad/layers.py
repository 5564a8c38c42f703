"""Unpadded transformer encoder layers: packed ``[T, hidden]`` tokens + ``cu_seqlens``.

The layers here run the post-LN BERT encoder layer of ``paddle.nn.TransformerEncoderLayer``
on packed tokens (see :mod:`paddle_unpad.varlen` for the notation) and reuse **the same
parameter objects**: nothing is copied, so checkpoints, optimizers and ``state_dict`` keys
do not change. One layer computes::

    qkv  = x @ concat(Wq, Wk, Wv)                              # one GEMM, [T, 3h]
    ctx  = fmha_qkvpacked(qkv, cu_seqlens, max_seqlen,         # [T, heads, head_dim]; adds
                          bias=concat(bq, bk, bv), dropout=attn_dropout)  # the bias as it reads qkv
    x    = LayerNorm1(x + dropout1(ctx @ Wo + bo))               # bias+dropout+residual+LN
    f    = act(x @ W1 + b1)                                      # bias+GELU
    out  = LayerNorm2(x + dropout2(f @ W2 + b2))                 # bias+dropout+residual+LN

The concatenated QKV weight is built from the layer's existing ``q_proj``/``k_proj``/
``v_proj`` parameters on every forward (a differentiable ``concat``; its cost is
``3 h^2`` copies against ``6 T h^2`` FLOPs of the GEMM), so gradients reach the original
parameters and checkpoints keep their layout.

The element-wise pieces go through the fused operators of :mod:`paddle_unpad.ops`
(``bias_gelu``, ``bias_dropout_residual_layer_norm``; each runs its compiled kernel or its
plain-Paddle reference, see ``paddle_unpad.ops_available()``) in every training mode (float32,
AMP O1 and O2); an activation other than exact GELU runs as plain Paddle ops.

Public API:

* :func:`encoder_layer_forward` / :func:`encoder_forward` -- functional forms, taking a
  ``paddle.nn.TransformerEncoderLayer`` / ``TransformerEncoder`` and packed inputs.
* :class:`UnpadTransformerEncoderLayer`, :class:`UnpadTransformerEncoder` -- subclasses
  of the Paddle layers: ``forward(src, ..., cu_seqlens=..., max_seqlen=...)`` runs
  unpadded when ``cu_seqlens`` is given and falls back to the padded parent forward
  otherwise. Construct them fresh like their parents, or convert existing layers in
  place with :func:`convert_encoder` (undo with :func:`revert_encoder`).
"""

from __future__ import annotations

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from ._runtime import host_malloc as _host_malloc
from ._runtime import paddle_compat as _compat
from . import ops as _ops

__all__ = [
    "UnpadTransformerEncoderLayer",
    "UnpadTransformerEncoder",
    "encoder_layer_forward",
    "encoder_forward",
    "qkv_weight_and_bias",
    "bias_act",
    "bias_dropout_residual_layer_norm",
    "convert_encoder",
    "revert_encoder",
]


def bias_act(x, bias, activation):
    """``activation(x + bias)``; exact GELU goes through ``ops.bias_gelu`` (which takes AMP's
    dtypes: a float32 bias next to a half x is cast to x's dtype, as AMP casts a linear bias)."""
    if activation is F.gelu and bias is not None:
        return _ops.bias_gelu(x, bias)
    if bias is not None:
        x = x + bias
    return activation(x)


def bias_dropout_residual_layer_norm(x, bias, residual, ln_weight, ln_bias, dropout, epsilon, training):
    """``LayerNorm(residual + dropout(x + bias))`` over the last axis (upscale-in-train dropout),
    by ``ops.bias_dropout_residual_layer_norm`` whatever dtypes AMP hands over (a half x with
    the float32 residual and LayerNorm parameters of O1, half ones of O2; see its rules)."""
    p = float(dropout) if training else 0.0
    return _ops.bias_dropout_residual_layer_norm(
        x, bias, residual, ln_weight, ln_bias, dropout=p, epsilon=float(epsilon), training=bool(training)
    )


def qkv_weight_and_bias(self_attn):
    """``([h, 3h] weight, [3h] bias or None)`` concatenated from q/k/v_proj (differentiable)."""
    w = paddle.concat([self_attn.q_proj.weight, self_attn.k_proj.weight, self_attn.v_proj.weight], axis=1)
    biases = [self_attn.q_proj.bias, self_attn.k_proj.bias, self_attn.v_proj.bias]
    if all(b is None for b in biases):
        return w, None
    if any(b is None for b in biases):
        biases = [b if b is not None else paddle.zeros([self_attn.embed_dim], dtype=w.dtype) for b in biases]
    return w, paddle.concat(biases, axis=0)


def check_supported_layer(layer, where="encoder layer"):
    """Raise ``NotImplementedError`` naming the option when ``layer`` cannot run unpadded."""
    if not isinstance(layer, nn.TransformerEncoderLayer):
        raise NotImplementedError(
            f"paddle_unpad: {where} is a {type(layer).__name__}, not a paddle.nn.TransformerEncoderLayer; only the standard PaddleNLP encoder can run unpadded"
        )
    if layer.normalize_before:
        raise NotImplementedError(
            f"paddle_unpad: {where} has normalize_before=True (pre-LN); only the post-LN BERT layer is supported unpadded"
        )
    attn = layer.self_attn
    if attn.kdim != attn.embed_dim or attn.vdim != attn.embed_dim:
        raise NotImplementedError(f"paddle_unpad: {where}: self_attn.kdim/vdim differ from embed_dim")
    if attn.need_weights:
        raise NotImplementedError(
            f"paddle_unpad: {where}: self_attn.need_weights=True (attention weights, i.e. output_attentions) cannot be produced unpadded"
        )


def encoder_layer_forward(layer, x, cu_seqlens, max_seqlen):
    """One post-LN encoder layer on packed tokens.

    Args:
        layer: a ``paddle.nn.TransformerEncoderLayer`` (its parameters are used as they are).
        x: ``[T, hidden]`` packed hidden states.
        cu_seqlens: int32 ``[B + 1]`` CPU tensor (see :func:`paddle_unpad.fmha`).
        max_seqlen: Python int >= the longest sequence.
    Returns:
        ``[T, hidden]``. Dropout (attention, hidden, activation) follows ``layer.training``.
    """
    attn = layer.self_attn
    training = layer.training
    heads, head_dim = attn.num_heads, attn.head_dim
    w, b = qkv_weight_and_bias(attn)
    # the one QKV GEMM, its bias added by the attention as it reads q, k and v
    qkv = paddle.matmul(x, w).reshape([-1, 3, heads, head_dim])
    bias = None if b is None else b.reshape([3, heads, head_dim])
    ctx = _ops.fmha_qkvpacked(
        qkv, cu_seqlens, max_seqlen, bias=bias, dropout=float(attn.dropout or 0.0), training=bool(attn.training)
    )
    ctx = ctx.reshape([-1, heads * head_dim])
    a = paddle.matmul(ctx, attn.out_proj.weight)
    x = bias_dropout_residual_layer_norm(
        a,
        attn.out_proj.bias,
        x,
        layer.norm1.weight,
        layer.norm1.bias,
        layer.dropout1.p,
        _compat.layer_norm_epsilon(layer.norm1),
        training,
    )
    f = paddle.matmul(x, layer.linear1.weight)
    f = bias_act(f, layer.linear1.bias, layer.activation)
    if training and layer.dropout.p:
        f = F.dropout(f, p=layer.dropout.p, training=True, mode=layer.dropout.mode)
    o = paddle.matmul(f, layer.linear2.weight)
    return bias_dropout_residual_layer_norm(
        o,
        layer.linear2.bias,
        x,
        layer.norm2.weight,
        layer.norm2.bias,
        layer.dropout2.p,
        _compat.layer_norm_epsilon(layer.norm2),
        training,
    )


def encoder_forward(encoder, x, cu_seqlens, max_seqlen, output_hidden_states=False):
    """All layers of a ``paddle.nn.TransformerEncoder`` (and its final ``norm``) on packed tokens.

    Returns ``(out [T, hidden], hidden_states)``; ``hidden_states`` is ``None`` unless
    ``output_hidden_states``, else the list ``[x, layer_1_out, ..., layer_N_out]`` (the
    last one after ``encoder.norm``), as PaddleNLP's encoder returns them.
    Honours ``encoder.enable_recompute`` in training.
    """
    hidden = [x] if output_hidden_states else None
    recompute = None
    if getattr(encoder, "enable_recompute", False) and encoder.training and not x.stop_gradient:
        from paddle.distributed.fleet.utils import recompute
    for layer in encoder.layers:
        if recompute is not None:
            x = recompute(encoder_layer_forward, layer, x, cu_seqlens, max_seqlen)
        else:
            x = encoder_layer_forward(layer, x, cu_seqlens, max_seqlen)
        if hidden is not None:
            hidden.append(x)
    if encoder.norm is not None:
        x = encoder.norm(x)
        if hidden is not None:
            hidden[-1] = x
    return x, hidden


class _UnpadLayerMixin:
    """forward() of :class:`UnpadTransformerEncoderLayer` (also mixed into converted layers)."""

    def forward(self, src, src_mask=None, cache=None, output_attentions=False, *, cu_seqlens=None, max_seqlen=None):
        if cu_seqlens is None:
            return super().forward(src, src_mask=src_mask, cache=cache, output_attentions=output_attentions)
        if src_mask is not None or cache is not None or output_attentions:
            raise NotImplementedError(
                "paddle_unpad: with cu_seqlens, src_mask/cache/output_attentions are not supported (the sequences are given by cu_seqlens)"
            )
        if max_seqlen is None:
            raise ValueError("paddle_unpad: max_seqlen (a Python int) is required with cu_seqlens")
        return encoder_layer_forward(self, src, cu_seqlens, max_seqlen)


class _UnpadEncoderMixin:
    """forward() of :class:`UnpadTransformerEncoder` (also mixed into converted encoders)."""

    def forward(
        self,
        src,
        src_mask=None,
        cache=None,
        output_attentions=False,
        output_hidden_states=False,
        return_dict=False,
        *,
        cu_seqlens=None,
        max_seqlen=None,
    ):
        if cu_seqlens is None:
            return super().forward(
                src,
                src_mask=src_mask,
                cache=cache,
                output_attentions=output_attentions,
                output_hidden_states=output_hidden_states,
                return_dict=return_dict,
            )
        if src_mask is not None or cache is not None or output_attentions:
            raise NotImplementedError(
                "paddle_unpad: with cu_seqlens, src_mask/cache/output_attentions are not supported (the sequences are given by cu_seqlens)"
            )
        if max_seqlen is None:
            raise ValueError("paddle_unpad: max_seqlen (a Python int) is required with cu_seqlens")
        out, hidden = encoder_forward(self, src, cu_seqlens, max_seqlen, output_hidden_states)
        return (out, hidden) if output_hidden_states else out


class UnpadTransformerEncoderLayer(_UnpadLayerMixin, nn.TransformerEncoderLayer):
    """``paddle.nn.TransformerEncoderLayer`` that also runs on packed ``[T, hidden]`` tokens.

    ``forward(src, cu_seqlens=cu, max_seqlen=m)`` runs :func:`encoder_layer_forward`;
    without ``cu_seqlens`` the parent's padded forward runs unchanged.
    """

    def __init__(self, *args, **kwargs):
        _host_malloc.ensure("UnpadTransformerEncoderLayer built")  # before its parameters and training steps
        super().__init__(*args, **kwargs)


class UnpadTransformerEncoder(_UnpadEncoderMixin, nn.TransformerEncoder):
    """``paddle.nn.TransformerEncoder`` that also runs on packed ``[T, hidden]`` tokens.

    ``forward(src, cu_seqlens=cu, max_seqlen=m, output_hidden_states=False)`` returns
    ``out`` (or ``(out, hidden_states)`` with ``output_hidden_states``); without
    ``cu_seqlens`` the parent's padded forward runs unchanged.
    """


# ---- in-place class swap ------------------------------------------------------------------------------

_ORIG_CLASS_ATTR = "_paddle_unpad_original_class"
_SWAP_CACHE = {}


def swap_class(obj, mixin, name=None):
    """Make ``obj`` an instance of a subclass of its class with ``mixin`` in front (in place).

    The subclass keeps the original class name (``save_pretrained`` writes it into
    ``config.architectures``) unless ``name`` is given. Returns ``obj``. No-op when already
    swapped.
    """
    if is_swapped(obj):
        return obj
    obj.__dict__.pop(_ORIG_CLASS_ATTR, None)  # stale marker (e.g. an unpickled copy)
    cls = type(obj)
    key = (mixin, cls, name)
    sub = _SWAP_CACHE.get(key)
    if sub is None:
        sub = type(
            name or cls.__name__,
            (mixin, cls),
            {"__module__": cls.__module__, "__qualname__": name or cls.__qualname__, "_paddle_unpad_mixin": mixin},
        )
        _SWAP_CACHE[key] = sub
    object.__setattr__(obj, _ORIG_CLASS_ATTR, cls)
    obj.__class__ = sub
    return obj


def unswap_class(obj):
    """Undo :func:`swap_class`. Returns whether ``obj`` was swapped."""
    if not is_swapped(obj):
        obj.__dict__.pop(_ORIG_CLASS_ATTR, None)
        return False
    cls = obj.__dict__[_ORIG_CLASS_ATTR]
    obj.__class__ = cls
    object.__delattr__(obj, _ORIG_CLASS_ATTR)
    return True


def original_class(obj):
    """The class ``obj`` had before :func:`swap_class`."""
    return obj.__dict__[_ORIG_CLASS_ATTR]


def is_swapped(obj):
    """Whether ``obj`` was converted in place by :func:`swap_class`."""
    return _ORIG_CLASS_ATTR in obj.__dict__ and getattr(type(obj), "_paddle_unpad_mixin", None) is not None


def convert_encoder(encoder):
    """Convert a ``paddle.nn.TransformerEncoder`` and its layers in place (same parameters).

    Afterwards ``encoder(x_packed, cu_seqlens=..., max_seqlen=...)`` runs unpadded and
    ``encoder(x_padded, src_mask)`` still runs the original padded path. Idempotent.
    Raises ``NotImplementedError`` (naming the option) for layers that cannot run unpadded.
    """
    if not isinstance(encoder, nn.TransformerEncoder):
        raise NotImplementedError(
            f"paddle_unpad: expected a paddle.nn.TransformerEncoder, got {type(encoder).__name__}"
        )
    for i, layer in enumerate(encoder.layers):
        check_supported_layer(layer, f"encoder.layers[{i}]")
    _host_malloc.ensure("paddle_unpad.convert / convert_encoder")  # before the training steps it is for
    for layer in encoder.layers:
        if not isinstance(layer, UnpadTransformerEncoderLayer):
            swap_class(layer, _UnpadLayerMixin)
    if not isinstance(encoder, UnpadTransformerEncoder):
        swap_class(encoder, _UnpadEncoderMixin)
    return encoder


def revert_encoder(encoder):
    """Undo :func:`convert_encoder` in place."""
    for layer in encoder.layers:
        unswap_class(layer)
    unswap_class(encoder)
    return encoder

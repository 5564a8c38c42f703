"""Shared machinery of the converted (unpadded) PaddleNLP models.

A converted model keeps its class name, its sub-layers and its parameters; only the
``forward`` of the model (and of its base model, encoder and encoder layers) changes.
The forward:

1. works out which tokens are real -- from packed inputs (``cu_seqlens``: nothing to
   read), or from the padded inputs' attention mask (one host read of the mask per
   forward; a mask that is not a pure padding mask is refused);
2. gathers the real tokens of ``input_ids`` / ``token_type_ids`` / ``position_ids`` into
   ``[T]`` tensors (position ids are those the original model would use: ``0..`` per
   sequence for BERT/ERNIE, ``pad_token_id + 1 ..`` for RoBERTa);
3. runs the embeddings and the encoder on ``[T, hidden]``
   (:func:`paddle_unpad.layers.encoder_forward`);
4. gives every head only the rows it reads (CLS rows at ``cu_seqlens[:-1]``, masked rows),
   and pads back to ``[B, S, ...]`` only outputs the caller receives in that shape.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import paddle
import paddle.nn.functional as F

from .._runtime import paddle_compat as _compat
from .. import layers as _layers
from .._runtime.warn import warn_once
from ..varlen import check_cu_seqlens, check_no_empty_sequences, pad_input

__all__ = ["UnsupportedInput", "Packing", "FamilySpec", "options_of"]

# Options of convert(); stored on the converted top-level model and its base model.
OPTIONS_ATTR = "_paddle_unpad_options"
#: per-token loss divisors (see token_cross_entropy): "mean" over labelled tokens, or the
#: original PaddleNLP model's "stock" batch x padded length
TOKEN_LOSS_MODES = ("mean", "stock")
DEFAULT_OPTIONS = {"on_unsupported": "raise", "token_loss": "mean"}
# Label value that no loss counts (PaddleNLP's collators pad labels with it; Paddle's default).
IGNORE_INDEX = -100
# Keys of a paddle_unpad packed batch that the model does not need (accepted, ignored).
from ..data.collate import BATCH_BOOKKEEPING_KEYS, MLM_LABEL_FIELDS  # noqa: E402

COLLATOR_EXTRAS = frozenset(BATCH_BOOKKEEPING_KEYS)
# Keys of a packing collator's masked-LM batch that the MLM / pretraining heads read (the
# per-token MLM labels, and the masked rows' positions and labels listed from them).
MLM_BATCH_KEYS = frozenset(("masked_positions", "masked_labels") + tuple(MLM_LABEL_FIELDS))
# Arguments of the converted forwards that the original forwards do not have.
PACKED_ARGS_ALL = ("cu_seqlens", "max_seqlen", "cu_seqlens_host")
# The leading and trailing parameters shared by every BERT / ERNIE / RoBERTa forward.
TOKEN_ARGS = ("input_ids", "token_type_ids", "position_ids", "attention_mask")
OUTPUT_FLAGS = ("output_hidden_states", "output_attentions", "return_dict")


def forward_args(*middle):
    """The original forward's parameter names: the shared leading ones, ``middle``, the output flags.

    Here rather than in :mod:`.forwards`, which imports the family tables that call it."""
    return TOKEN_ARGS + tuple(middle) + OUTPUT_FLAGS


# Additive mask values at or below this count as "masked" (exp underflows to exactly 0 in fp32).
MASKED_BELOW = -1.0e3
# Logit given to padding positions of outputs over the sequence axis (QA start/end logits).
PAD_LOGIT = -1.0e4


class UnsupportedInput(NotImplementedError):
    """An input or option the unpadded forward cannot honour. The message names it."""


def options_of(model):
    return model.__dict__.get(OPTIONS_ATTR, DEFAULT_OPTIONS)


is_tensor = _compat.is_tensor


def _dynamic():
    return paddle.in_dynamic_mode()


# ---- packing ------------------------------------------------------------------------------------------


@dataclass
class Packing:
    """Where the real tokens of a batch are.

    packed: the caller passed packed inputs (outputs stay packed).
    batch, seqlen: B and S of the padded inputs (``seqlen`` = max_seqlen when packed).
    indices: int64 ``[T]`` flat indices into ``B * S`` of the real tokens (padded inputs).
    cu_host: numpy int32 ``[B + 1]`` when known on the host, else None (static graphs).
    cu_cpu: int32 ``[B + 1]`` CPU tensor for ``fmha``; cu_dev: the same on the data's device.
    max_seqlen: Python int for ``fmha`` (an upper bound in static graphs).
    total: T (Python int in eager mode; a 0-D tensor in static graphs).
    place: the device of the data (None in static graphs).

    Construct it with keywords: several fields share a type (batch / seqlen / max_seqlen /
    total, cu_host / cu_cpu / cu_dev), so a positional slip would go unnoticed.
    """

    packed: bool
    batch: Any
    seqlen: Any
    indices: Any
    cu_host: Optional[np.ndarray]
    cu_cpu: Any
    cu_dev: Any
    max_seqlen: int
    total: Any
    place: Any = None
    _seg: Any = None

    def segment_ids(self):
        """int64 ``[T]``: the sequence each packed token belongs to."""
        if self._seg is None:
            if self.cu_host is not None:
                seg = np.repeat(np.arange(len(self.cu_host) - 1, dtype=np.int64), np.diff(self.cu_host))
                self._seg = paddle.to_tensor(seg, place=self.place)
            else:
                ar = paddle.arange(self.total, dtype="int32")
                self._seg = paddle.searchsorted(self.cu_dev[1:], ar, right=True)
        return self._seg

    def offsets_in_sequence(self):
        """int64 ``[T]``: position of each packed token inside its sequence (0-based)."""
        if self.cu_host is not None:
            cu = self.cu_host.astype(np.int64)
            pos = np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], np.diff(cu))
            return paddle.to_tensor(pos, place=self.place)
        ar = paddle.arange(self.total, dtype="int64")
        return ar - paddle.gather(self.cu_dev.astype("int64"), self.segment_ids())

    def flat_index(self, seqlen):
        """int64 ``[T]``: flat index of each packed token in a ``[B, seqlen]`` layout."""
        if not self.packed:
            return self.indices
        return self.segment_ids() * seqlen + self.offsets_in_sequence()

    def to_padded(self, x, fill=0.0):
        """``[T, ...]`` -> ``[B, S, ...]`` (``S`` = max_seqlen for packed inputs); ``fill`` at pads."""
        seqlen = self.seqlen
        idx = self.flat_index(seqlen)
        if _dynamic():
            out = pad_input(x, idx, int(self.batch), int(seqlen))
        else:
            rest = list(x.shape[1:])
            n = self.batch * seqlen
            out = paddle.scatter(paddle.zeros([n] + rest, dtype=x.dtype), idx, x, overwrite=True)
            out = out.reshape([self.batch, seqlen] + rest)
        if fill != 0.0:
            unit = [1] * (len(x.shape) - 1)
            ones = paddle.ones([x.shape[0]] + unit, dtype=x.dtype)
            if _dynamic():
                real = pad_input(ones, idx, int(self.batch), int(seqlen))
            else:
                real = paddle.scatter(
                    paddle.zeros([self.batch * seqlen] + unit, dtype=x.dtype), idx, ones, overwrite=True
                ).reshape([self.batch, seqlen] + unit)
            out = out + (1.0 - real) * fill
        return out

    def gather_tokens(self, t):
        """Per-token input ``[B, S, ...]`` (or already packed ``[T, ...]``) -> ``[T, ...]``."""
        if t is None:
            return None
        if self.packed:
            return t
        flat = t.reshape([-1] + list(t.shape[2:]))
        return paddle.gather(flat, self.indices, axis=0)

    def rows_of_positions(self, positions):
        """Flat positions into ``B * S`` (e.g. ``masked_positions``) -> packed row indices."""
        positions = positions.reshape([-1])
        if self.packed:
            return positions
        n = self.batch * self.seqlen
        rows = paddle.arange(self.total, dtype="int64")
        inv = paddle.scatter(paddle.zeros([n], dtype="int64"), self.indices, rows, overwrite=True)
        return paddle.gather(inv, positions.astype("int64"))

    def cls_rows(self, x, reader):
        """Rows of the first token of every sequence: ``x[cu_seqlens[:-1]]`` -> ``[B, ...]``.

        Every per-sequence output (pooler, sequence classification, NSP) reads its rows here.
        An empty sequence has no first token: refused by name (``reader`` says who needs the
        rows) when ``cu_seqlens`` is on the host; a static graph has no host values to check,
        so its empty sequences get NaN rows (loud downstream, never another sequence's row).
        """
        if self.cu_host is not None:
            check_no_empty_sequences(self.cu_host, reader)
            return paddle.gather(x, self.cu_dev[:-1], axis=0)
        starts, ends = self.cu_dev[:-1], self.cu_dev[1:]
        last = (paddle.shape(x)[0] - 1).astype(starts.dtype)
        rows = paddle.gather(x, paddle.minimum(starts, paddle.full_like(starts, 0) + last), axis=0)
        empty = (ends == starts).astype(rows.dtype).reshape([-1] + [1] * (len(x.shape) - 1))
        # 0 / 0 = NaN at run time: a NaN constant would not survive paddle.jit.save's program file
        return rows + (empty * 0.0) / (1.0 - empty)


def _place_of(t):
    try:
        return t.place
    except Exception:  # static Value
        return None


def pack_from_cu_seqlens(ref, cu_seqlens, max_seqlen, cu_seqlens_host, max_positions):
    """Packing for inputs that are already packed (``[T]`` ids + ``cu_seqlens``). No device sync
    when ``cu_seqlens`` (or ``cu_seqlens_host``) is a host array / CPU tensor and ``max_seqlen`` an int."""
    place = _place_of(ref)
    if not _dynamic():
        cu = cu_seqlens if is_tensor(cu_seqlens) else paddle.to_tensor(np.asarray(cu_seqlens, np.int32))
        if cu.dtype != paddle.int32:
            cu = cu.astype("int32")
        b = paddle.shape(cu)[0] - 1
        return Packing(
            packed=True,
            batch=b,
            seqlen=int(max_positions),
            indices=None,
            cu_host=None,
            cu_cpu=cu,
            cu_dev=cu,
            max_seqlen=int(max_positions),
            total=paddle.shape(ref)[0],
            place=place,
        )
    host = None
    if cu_seqlens_host is not None:
        host = np.asarray(cu_seqlens_host.numpy() if is_tensor(cu_seqlens_host) else cu_seqlens_host, np.int32)
    elif isinstance(cu_seqlens, (np.ndarray, list, tuple)):
        host = np.asarray(cu_seqlens, np.int32)
    elif is_tensor(cu_seqlens):  # a device tensor without a host copy costs one device-to-host read
        host = cu_seqlens.numpy().astype(np.int32, copy=False)
    else:
        raise TypeError(
            f"paddle_unpad: cu_seqlens must be a paddle.Tensor or numpy array, got {type(cu_seqlens).__name__}"
        )
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, np.integer))):
        raise TypeError(f"paddle_unpad: max_seqlen must be a Python int, got {type(max_seqlen).__name__}")
    total = int(ref.shape[0])
    tokens = "input_ids.shape[0]" if len(ref.shape) == 1 else "inputs_embeds.shape[0]"
    longest = check_cu_seqlens(host, total, max_seqlen, who="", tokens=tokens)
    max_seqlen = longest if max_seqlen is None else int(max_seqlen)
    if is_tensor(cu_seqlens) and cu_seqlens.dtype == paddle.int32 and cu_seqlens.place.is_cpu_place():
        cu_cpu = cu_seqlens
    else:
        cu_cpu = paddle.to_tensor(host, dtype="int32", place=paddle.CPUPlace())
    if place is None or place.is_cpu_place():
        cu_dev = cu_cpu
    elif is_tensor(cu_seqlens) and not cu_seqlens.place.is_cpu_place():
        cu_dev = cu_seqlens.astype("int32")
    else:
        cu_dev = paddle.to_tensor(host, dtype="int32", place=place)
    return Packing(
        packed=True,
        batch=host.size - 1,
        seqlen=max_seqlen,
        indices=None,
        cu_host=host,
        cu_cpu=cu_cpu,
        cu_dev=cu_dev,
        max_seqlen=max_seqlen,
        total=total,
        place=place,
    )


def _classify_mask(mask_np, ndim):
    """numpy mask values -> bool keep [B', S] or raise UnsupportedInput."""
    if ndim == 4:
        vals = mask_np[:, 0, 0, :]
    else:
        vals = mask_np
    if vals.dtype == np.bool_:
        return vals.copy()
    if ndim == 2 or np.issubdtype(vals.dtype, np.integer):
        # 2-D masks of any dtype (PaddleNLP: (1 - m) * -1e4) and 4-D int masks ((m - 1) * 1e9): 1 keep, 0 pad
        ok = (vals == 0) | (vals == 1)
        if not ok.all():
            bad = vals[~ok].flat[0]
            raise UnsupportedInput(
                f"paddle_unpad: attention_mask holds {bad!r}; only a padding mask (1 = keep, 0 = pad) can run unpadded (a soft or custom mask would silently change the result)"
            )
        return vals == 1
    # 4-D float: additive, 0 = keep, very negative (-1e4, -1e9, -inf, finfo.min) = pad
    vals = vals.astype(np.float64)
    keep = vals == 0
    masked = vals <= MASKED_BELOW
    ok = keep | masked
    if not ok.all():
        bad = vals[~ok].flat[0]
        raise UnsupportedInput(
            f"paddle_unpad: additive attention_mask holds {bad!r}; only a padding mask (0 = keep, <= -1e3 or -inf = pad) can run unpadded (a soft or custom mask would silently change the result)"
        )
    return keep


# clauses of the mask refusals below: what a left-padded row does to the pooler, why 4-D masks cannot run static
_LEFT_PADDED_POOLER = "the pooler of the original model reads position 0 (a padding token there) while the unpadded model reads the first real token"
_STATIC_4D_MASK = "a 4-D additive mask cannot be checked to be a padding mask in a static graph"


def pack_from_mask(ref, input_ids, attention_mask, pad_token_id, needs_cls, max_positions, who="model"):
    """Packing for padded inputs ``[B, S]``. One host read of the mask (or of the pad positions)."""
    place = _place_of(ref)
    if not _dynamic():
        return _pack_from_mask_static(ref, input_ids, attention_mask, pad_token_id, max_positions, place)
    B, S = int(ref.shape[0]), int(ref.shape[1])
    if attention_mask is None:
        if input_ids is None:
            keep = np.ones([B, S], dtype=bool)
        else:
            keep = (input_ids != pad_token_id).numpy()
    else:
        if not is_tensor(attention_mask):
            attention_mask = paddle.to_tensor(attention_mask)
        shape = [int(d) for d in attention_mask.shape]
        nd = len(shape)
        if nd == 2:
            if shape != [B, S]:
                raise ValueError(f"paddle_unpad: attention_mask of shape {shape} does not match input shape [{B}, {S}]")
        elif nd == 4:
            if shape[1] != 1 or shape[2] != 1 or shape[3] != S or shape[0] not in (1, B):
                raise UnsupportedInput(
                    f"paddle_unpad: attention_mask of shape {shape} is not a padding mask ([B, S] or [B, 1, 1, S]); per-query masks (e.g. [B, 1, S, S], [B, H, S, S]) cannot run unpadded"
                )
        else:
            raise UnsupportedInput(
                f"paddle_unpad: attention_mask of shape {shape} is not a padding mask ([B, S] or [B, 1, 1, S])"
            )
        keep = _classify_mask(attention_mask.numpy(), nd)
        if keep.shape[0] != B:
            keep = np.broadcast_to(keep, (B, S))
    lengths = keep.sum(axis=1)
    if B and (lengths == 0).any():
        b = int(np.flatnonzero(lengths == 0)[0])
        raise UnsupportedInput(
            f"paddle_unpad: attention_mask row {b} keeps no token (an empty sequence); the original model would still produce outputs for it"
        )
    if B and not keep[:, 0].all():
        b = int(np.flatnonzero(~keep[:, 0])[0])
        msg = f"paddle_unpad: attention_mask row {b} masks its first position (left padding?); {_LEFT_PADDED_POOLER}. Pad on the right (tokenizer padding_side='right') or pass packed inputs."
        if needs_cls:
            raise UnsupportedInput(msg)
        warn_once(
            ("left-padding", who),
            f"{msg} pooler_output differs from the original for such rows.",
            UserWarning,
            stacklevel=3,
        )
    indices = np.flatnonzero(keep.reshape(-1)).astype(np.int64)
    cu = np.zeros(B + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    max_seqlen = int(lengths.max()) if B else 0
    cu_cpu = paddle.to_tensor(cu, dtype="int32", place=paddle.CPUPlace())
    if place is None or place.is_cpu_place():
        cu_dev = cu_cpu
        idx = paddle.to_tensor(indices, dtype="int64", place=paddle.CPUPlace())
    else:
        cu_dev = paddle.to_tensor(cu, dtype="int32", place=place)
        idx = paddle.to_tensor(indices, dtype="int64", place=place)
    return Packing(
        packed=False,
        batch=B,
        seqlen=S,
        indices=idx,
        cu_host=cu,
        cu_cpu=cu_cpu,
        cu_dev=cu_dev,
        max_seqlen=max_seqlen,
        total=int(cu[-1]),
        place=place,
    )


def _pack_from_mask_static(ref, input_ids, attention_mask, pad_token_id, max_positions, place):
    shape = paddle.shape(ref)
    B, S = shape[0], shape[1]
    if attention_mask is None:
        if input_ids is None:
            keep = paddle.ones([B, S], dtype="bool")
        else:
            keep = input_ids != pad_token_id
    elif len(attention_mask.shape) == 2:
        keep = attention_mask.astype("bool") if attention_mask.dtype != paddle.bool else attention_mask
    else:
        raise UnsupportedInput(
            f"paddle_unpad: inside paddle.jit.to_static only a [B, S] attention_mask (1 = keep), none, or packed inputs (cu_seqlens) are accepted: {_STATIC_4D_MASK}"
        )
    keep_i32 = keep.astype("int32")  # Paddle 2.6's static flatten refuses bool
    indices = paddle.nonzero(keep_i32.flatten()).flatten()
    seqlens = keep_i32.sum(axis=1)
    cu = paddle.concat([paddle.zeros([1], dtype="int32"), paddle.cumsum(seqlens, axis=0).astype("int32")])
    total = paddle.shape(indices)[0]
    return Packing(
        packed=False,
        batch=B,
        seqlen=S,
        indices=indices,
        cu_host=None,
        cu_cpu=cu,
        cu_dev=cu,
        max_seqlen=int(max_positions),
        total=total,
        place=place,
    )


# ---- model families ----------------------------------------------------------------------------------


@dataclass
class FamilySpec:
    """What differs between BERT, ERNIE and RoBERTa for the shared forward."""

    name: str
    base_class: Any  # e.g. paddlenlp BertModel
    base_attr: str  # attribute of the base model in heads: "bert" / "ernie" / "roberta"
    roberta_positions: bool = False  # position ids start at pad_token_id + 1 (RoBERTa)
    config_defaults: bool = False  # BERT base: None -> config.output_* / use_cache
    embed_extras: tuple = ()  # extra per-token embedding inputs (ERNIE: task_type_ids)
    has_inputs_embeds: bool = True


def _default_positions(spec, base, pk, input_ids, S):
    """Position ids [T] the original model would use when none are given."""
    if not spec.roberta_positions:
        if pk.packed:
            return pk.offsets_in_sequence()
        return pk.indices % S if _dynamic() else pk.indices % S.astype("int64")
    pad = int(base.embeddings.padding_idx)
    if input_ids is None:  # from inputs_embeds: pad + 1 + position
        if pk.packed:
            return pk.offsets_in_sequence() + (pad + 1)
        return pk.indices % S + (pad + 1)
    if not pk.packed:
        from paddlenlp.transformers.roberta.modeling import create_position_ids_from_input_ids

        pos = create_position_ids_from_input_ids(input_ids, padding_idx=pad, past_key_values_length=0)
        return paddle.gather(pos.reshape([-1]), pk.indices)
    # packed: cumulative count of non-pad tokens inside each sequence (RoBERTa's rule)
    m = (input_ids != pad).astype("int64")
    c = paddle.cumsum(m)
    start = paddle.gather(paddle.concat([paddle.zeros([1], dtype="int64"), c]), pk.cu_dev[:-1].astype("int64"))
    return (c - paddle.gather(start, pk.segment_ids())) * m + pad


def resolve_flags(spec, config, output_hidden_states, output_attentions, use_cache):
    if spec.config_defaults:
        if output_hidden_states is None:
            output_hidden_states = config.output_hidden_states
        if output_attentions is None:
            output_attentions = config.output_attentions
        if use_cache is None:
            use_cache = config.use_cache
    return bool(output_hidden_states), bool(output_attentions), bool(use_cache)


def check_unsupported(output_attentions=False, past_key_values=None, use_cache=False):
    if output_attentions:
        raise UnsupportedInput(
            "paddle_unpad: output_attentions=True is not supported by the unpadded model (fmha never materialises attention probabilities)"
        )
    if past_key_values is not None:
        raise UnsupportedInput(
            "paddle_unpad: past_key_values (incremental decoding caches) are not supported by the unpadded model"
        )
    if use_cache:
        raise UnsupportedInput("paddle_unpad: use_cache=True is not supported by the unpadded model")


def encode(
    spec,
    base,
    input_ids=None,
    token_type_ids=None,
    position_ids=None,
    attention_mask=None,
    inputs_embeds=None,
    extras=None,
    cu_seqlens=None,
    max_seqlen=None,
    cu_seqlens_host=None,
    output_hidden_states=False,
    needs_cls=False,
    want_pooled=True,
    reader=None,
):
    """Embeddings + encoder on packed tokens.

    ``reader``: who reads the pooled output, for the refusal of an empty sequence
    (default: the base model's pooler).

    Returns ``(pk, sequence [T, H], pooled [B, H] or None, hidden_states list of [T, H] or None)``.
    """
    if input_ids is not None and inputs_embeds is not None:
        raise ValueError("paddle_unpad: input_ids and inputs_embeds cannot both be given (pass one of them)")
    ref = input_ids if input_ids is not None else inputs_embeds
    if ref is None:
        raise ValueError("paddle_unpad: input_ids (or inputs_embeds) is required")
    config = base.config
    max_positions = int(getattr(config, "max_position_embeddings", 512))
    extras = extras or {}
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError(
                "paddle_unpad: attention_mask cannot be combined with cu_seqlens (packed inputs have no padding)"
            )
        tok_rank = 1 if input_ids is not None else 2
        if len(ref.shape) != tok_rank:
            raise ValueError(
                f"paddle_unpad: with cu_seqlens, input_ids must be packed 1-D [T] (inputs_embeds [T, H]), got shape {list(ref.shape)}"
            )
        pk = pack_from_cu_seqlens(ref, cu_seqlens, max_seqlen, cu_seqlens_host, max_positions)
        S = pk.seqlen
    else:
        if len(ref.shape) != (2 if input_ids is not None else 3):
            raise ValueError(
                f"paddle_unpad: padded input_ids must be [batch, seqlen] (or pass packed [T] ids with cu_seqlens and max_seqlen), got shape {list(ref.shape)}"
            )
        pk = pack_from_mask(
            ref, input_ids, attention_mask, base.pad_token_id, needs_cls, max_positions, who=type(base).__name__
        )
        S = pk.seqlen
    ids_t = pk.gather_tokens(input_ids)
    emb_t = pk.gather_tokens(inputs_embeds)
    if position_ids is not None:
        pos_t = pk.gather_tokens(position_ids)
    else:
        pos_t = _default_positions(spec, base, pk, ids_t if pk.packed else input_ids, S)
    pos_t.stop_gradient = True
    kwargs = {"input_ids": ids_t, "position_ids": pos_t, "token_type_ids": pk.gather_tokens(token_type_ids)}
    if spec.has_inputs_embeds:
        kwargs["inputs_embeds"] = emb_t
    for name in spec.embed_extras:
        kwargs[name] = pk.gather_tokens(extras.get(name))
    x = base.embeddings(**kwargs)
    x, hidden = _layers.encoder_forward(base.encoder, x, pk.cu_cpu, pk.max_seqlen, output_hidden_states)
    pooled = None
    if want_pooled and getattr(base, "pooler", None) is not None:
        pooled = base.pooler(pk.cls_rows(x, reader or f"{type(base).__name__}'s pooler").unsqueeze(1))
    return pk, x, pooled, hidden


def outputs_for_caller(pk, t, fill=0.0):
    """A per-token output ``[T, ...]`` in the layout the caller passed: packed stays packed."""
    if t is None or pk.packed:
        return t
    return pk.to_padded(t, fill)


def hidden_for_caller(pk, hidden):
    if hidden is None:
        return None
    return tuple(outputs_for_caller(pk, h) for h in hidden)


def token_labels(pk, labels):
    """Per-token labels ``[B, S]`` (or packed ``[T]``) -> ``[T]`` at the real tokens."""
    if labels is None:
        return None
    if pk.packed:
        return labels.reshape([-1])
    return paddle.gather(labels.reshape([-1]), pk.indices)


def cross_entropy_mean(logits, labels, num_classes):
    loss_fct = paddle.nn.CrossEntropyLoss()
    return loss_fct(logits.reshape((-1, num_classes)), labels.reshape((-1,)))


def token_cross_entropy(logits_t, labels_t, num_classes, stock_rows, mode="mean", model=None):
    """Cross entropy of per-token (or masked-row) predictions; labels ``-100`` count for nothing.

    ``mode="mean"``: the sum over labelled tokens divided by their number -- the mean over
    labelled tokens, as Hugging Face's models and Paddle's ``CrossEntropyLoss`` with an
    ``ignore_index >= 0`` define it; independent of padding and of packing (0 when no token
    is labelled).
    ``mode="stock"``: what PaddleNLP's original models compute on the running Paddle. Paddle
    3.x's mean cross entropy with the default ``ignore_index=-100`` divides by *all* rows,
    ignored ones included, i.e. ``B * S`` of the padded batch (for packed inputs
    ``B * max_seqlen``: the batch padded to its longest sequence, as PaddleNLP's collators
    pad): the sum divided by ``stock_rows``. Paddle 2.6's divides by the labelled rows: the
    same as ``"mean"`` there.

    With ``mode="mean"`` in eager mode, the first such loss of ``model`` compares the two
    divisors (one host read, once per model) and warns when they differ, with the factor
    between the two losses.
    """
    logits_t = logits_t.reshape((-1, num_classes))
    labels_t = labels_t.reshape((-1,))
    total = F.cross_entropy(logits_t, labels_t, reduction="sum", ignore_index=IGNORE_INDEX)
    labelled = (labels_t != IGNORE_INDEX).astype(total.dtype).sum()
    if mode == "stock" and _compat.mean_cross_entropy_divides_by_all_rows():
        if not is_tensor(stock_rows):
            return total / float(max(int(stock_rows), 1))
        return total / paddle.maximum(stock_rows.astype(total.dtype), paddle.ones([], dtype=total.dtype))
    if (
        _dynamic()
        and model is not None
        and not model.__dict__.get(_SCALING_CHECKED)
        and _compat.mean_cross_entropy_divides_by_all_rows()
    ):
        _compare_scaling_once(model, labelled, int(stock_rows))
    return total / paddle.maximum(labelled, paddle.ones_like(labelled))


# set on a converted model once its per-token loss scaling has been compared with the original's
_SCALING_CHECKED = "_paddle_unpad_loss_scaling_checked"
# the close of the per-token loss warning: the factor varies, and the option that removes it
_STOCK_SCALING = (
    "the factor changes from batch to batch. convert(model, token_loss='stock') reproduces the original scaling."
)


def _compare_scaling_once(model, labelled, stock_rows):
    n = int(labelled)
    if n == 0:  # both losses are 0: nothing to compare yet
        return
    model.__dict__[_SCALING_CHECKED] = True
    if n == stock_rows:
        return
    who = type(model).__name__
    ratio = f"{stock_rows / n:.3g}x"
    divisor = f"PaddleNLP's original model divides the same sum by batch x padded length ({stock_rows}, padding and unlabelled tokens included)"
    warnings.warn(
        f"paddle_unpad: the per-token loss of {who} is the mean over its labelled tokens ({n} in this batch); {divisor}, so this loss is {ratio} the original's here, and {_STOCK_SCALING}",
        UserWarning,
        stacklevel=5,
    )


__all__ += [
    "encode",
    "outputs_for_caller",
    "hidden_for_caller",
    "token_labels",
    "check_unsupported",
    "resolve_flags",
    "pack_from_mask",
    "pack_from_cu_seqlens",
    "token_cross_entropy",
    "cross_entropy_mean",
]

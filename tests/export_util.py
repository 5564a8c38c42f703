"""A converted model traced by ``paddle.jit.to_static`` with the input specs of its two exports:
packed (``PackedInputs``: input_ids [T], cu_seqlens [B + 1]) and padded (input_ids and
attention_mask [B, S]; token_type_ids and position_ids left out)."""

import paddle
from paddle.static import InputSpec

import paddle_unpad as pu


def to_static_packed(model):
    spec = [InputSpec([None], "int64", "input_ids"), InputSpec([None], "int32", "cu_seqlens")]
    return paddle.jit.to_static(pu.models.PackedInputs(model), input_spec=spec, full_graph=True)


def to_static_padded(model):
    """Called as ``static(input_ids, None, None, attention_mask)``."""
    ids, mask = (InputSpec([None, None], "int64", name) for name in ("input_ids", "attention_mask"))
    return paddle.jit.to_static(model, input_spec=[ids, None, None, mask], full_graph=True)

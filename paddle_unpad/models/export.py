"""Inference export of a converted model with packed inputs."""

from __future__ import annotations

import paddle

__all__ = ["PackedInputs"]


class PackedInputs(paddle.nn.Layer):
    """Wraps a converted model so that its forward takes packed tensors positionally, as
    ``paddle.jit.to_static(..., input_spec=[...])`` and the exported program need::

        forward(input_ids [T], cu_seqlens [B + 1] int32, token_type_ids [T] = None, position_ids [T] = None)

    ``max_seqlen`` is fixed at construction (default ``config.max_position_embeddings``, an
    upper bound for every batch); the wrapped model's outputs are returned unchanged.
    The wrapper adds no parameters: ``state_dict`` keys gain the prefix ``model.``.
    """

    def __init__(self, model, max_seqlen=None):
        super().__init__()
        self.model = model
        if max_seqlen is None:
            max_seqlen = int(getattr(model.config, "max_position_embeddings", 512))
        self.max_seqlen = int(max_seqlen)

    def forward(self, input_ids, cu_seqlens, token_type_ids=None, position_ids=None):
        return self.model(
            input_ids,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            max_seqlen=self.max_seqlen,
        )

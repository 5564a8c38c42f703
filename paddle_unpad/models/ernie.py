"""Unpadded forwards for PaddleNLP ERNIE models (``paddlenlp.transformers.ernie``).

Same conventions as :mod:`paddle_unpad.models.bert` (packed keyword-only inputs
``cu_seqlens``, ``max_seqlen``, ``cu_seqlens_host``); ``task_type_ids`` and
``inputs_embeds`` are gathered like ``input_ids``.
"""

from paddlenlp.transformers.ernie import modeling

from . import heads
from .common import FamilySpec, forward_args

SPEC = FamilySpec(name="ernie", base_class=modeling.ErnieModel, base_attr="ernie", embed_extras=("task_type_ids",))

# (original class, head implementation, the original forward's parameters); the converted
# forwards in forwards_generated.py are written from this table (python -m paddle_unpad.models.forwards --write)
FORWARDS = [
    (
        modeling.ErnieModel,
        heads.base_forward,
        forward_args("task_type_ids", "past_key_values", "inputs_embeds", "use_cache"),
    ),
    (modeling.ErnieForSequenceClassification, heads.seqcls_forward, forward_args("inputs_embeds", "labels")),
    (modeling.ErnieForTokenClassification, heads.tokcls_forward, forward_args("inputs_embeds", "labels")),
    (
        modeling.ErnieForQuestionAnswering,
        heads.qa_forward,
        forward_args("inputs_embeds", "start_positions", "end_positions"),
    ),
    (
        modeling.ErnieForPretraining,
        heads.pretraining_forward,
        forward_args("masked_positions", "inputs_embeds", "labels", "next_sentence_label"),
    ),
    (modeling.ErnieForMaskedLM, heads.masked_lm_forward, forward_args("masked_positions", "inputs_embeds", "labels")),
]
REQUIRED = ()

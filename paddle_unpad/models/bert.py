"""Unpadded forwards for PaddleNLP BERT models (``paddlenlp.transformers.bert``).

Every forward has the signature of the original, plus keyword-only packed inputs::

    cu_seqlens       int32 [B + 1] (tensor or numpy); with it, input_ids & co. are packed [T]
    max_seqlen       Python int >= the longest sequence
    cu_seqlens_host  numpy host copy of cu_seqlens (paddle_unpad's packing collator passes it)

and accepts (and ignores) the other bookkeeping keys of a paddle_unpad packed batch, so
``model(**batch)`` works. See :mod:`paddle_unpad.models.heads` for the output conventions.
"""

from paddlenlp.transformers.bert import modeling

from . import heads
from .common import FamilySpec, forward_args

SPEC = FamilySpec(
    name="bert", base_class=modeling.BertModel, base_attr="bert", config_defaults=True, has_inputs_embeds=False
)

# (original class, head implementation, the original forward's parameters); the converted
# forwards in forwards_generated.py are written from this table (python -m paddle_unpad.models.forwards --write)
FORWARDS = [
    (modeling.BertModel, heads.base_forward, forward_args("past_key_values", "use_cache")),
    (modeling.BertForSequenceClassification, heads.seqcls_forward, forward_args("labels")),
    (modeling.BertForTokenClassification, heads.tokcls_forward, forward_args("labels")),
    (modeling.BertForQuestionAnswering, heads.qa_forward, forward_args("start_positions", "end_positions")),
    (
        modeling.BertForPretraining,
        heads.pretraining_forward,
        forward_args("masked_positions", "labels", "next_sentence_label"),
    ),
    (modeling.BertForMaskedLM, heads.masked_lm_forward, forward_args("masked_positions", "labels")),
]
REQUIRED = ("input_ids",)  # BERT has no inputs_embeds: its forwards require input_ids

"""Unpadded forwards for PaddleNLP RoBERTa models (``paddlenlp.transformers.roberta``).

Same conventions as :mod:`paddle_unpad.models.bert`. Position ids follow RoBERTa's rule
(``pad_token_id + 1 + i`` for the i-th non-pad token of a sequence) when none are given;
with packed inputs pass ``position_ids`` only if they already follow that rule
(paddle_unpad's packing collator writes BERT-style ``0..s-1``: drop them for RoBERTa).
RoBERTa has no pretraining (MLM+NSP) class in PaddleNLP 2.8.1: ``RobertaForMaskedLM``
is its pretraining model.
"""

from paddlenlp.transformers.roberta import modeling

from . import heads
from .common import FamilySpec, forward_args

SPEC = FamilySpec(name="roberta", base_class=modeling.RobertaModel, base_attr="roberta", roberta_positions=True)

# (original class, head implementation, the original forward's parameters); the converted
# forwards in forwards_generated.py are written from this table (python -m paddle_unpad.models.forwards --write)
FORWARDS = [
    (modeling.RobertaModel, heads.base_forward, forward_args("past_key_values", "inputs_embeds", "use_cache")),
    (modeling.RobertaForSequenceClassification, heads.seqcls_forward, forward_args("inputs_embeds", "labels")),
    (modeling.RobertaForTokenClassification, heads.tokcls_forward, forward_args("inputs_embeds", "labels")),
    (
        modeling.RobertaForQuestionAnswering,
        heads.qa_forward,
        forward_args("inputs_embeds", "start_positions", "end_positions"),
    ),
    # RoBERTa's original has no masked_positions (a packing collator's batch may still carry them)
    (modeling.RobertaForMaskedLM, heads.masked_lm_forward, forward_args("inputs_embeds", "labels")),
]
REQUIRED = ()

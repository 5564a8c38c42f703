"""Unpadded forwards for PaddleNLP RoBERTa models (``paddlenlp.transformers.roberta``).

Same conventions as :mod:`paddle_unpad.models.bert`. Position ids follow RoBERTa's rule
(``pad_token_id + 1 + i`` for the i-th non-pad token of a sequence) when none are given;
with packed inputs pass ``position_ids`` only if they already follow that rule
(paddle_unpad's packing collator writes BERT-style ``0..s-1``: drop them for RoBERTa).
RoBERTa has no pretraining (MLM+NSP) class in PaddleNLP 2.8.1: ``RobertaForMaskedLM``
is its pretraining model.
"""
from paddlenlp.transformers.roberta import modeling as _m

from . import heads as _h
from .common import FamilySpec
from .ernie import _cls_args

SPEC = FamilySpec(name="roberta", base_class=_m.RobertaModel, base_attr="roberta", roberta_positions=True)


class UnpadRobertaModel:
    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, attention_mask=None,
                past_key_values=None, inputs_embeds=None, use_cache=None, output_hidden_states=None,
                output_attentions=None, return_dict=None, *, cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None,
                **extra):
        a = dict(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                 attention_mask=attention_mask, past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                 use_cache=use_cache, output_hidden_states=output_hidden_states,
                 output_attentions=output_attentions, return_dict=return_dict, cu_seqlens=cu_seqlens,
                 max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host)
        return _h.run(self, SPEC, _h.base_forward, a, extra)


class UnpadRobertaForSequenceClassification:
    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None,
                labels=None, output_hidden_states=None, output_attentions=None, return_dict=None, *,
                cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None, **extra):
        a = _cls_args(input_ids, token_type_ids, position_ids, attention_mask, inputs_embeds, output_hidden_states,
                      output_attentions, return_dict, cu_seqlens, max_seqlen, cu_seqlens_host, labels=labels)
        return _h.run(self, SPEC, _h.seqcls_forward, a, extra)


class UnpadRobertaForTokenClassification:
    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None,
                labels=None, output_hidden_states=None, output_attentions=None, return_dict=None, *,
                cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None, **extra):
        a = _cls_args(input_ids, token_type_ids, position_ids, attention_mask, inputs_embeds, output_hidden_states,
                      output_attentions, return_dict, cu_seqlens, max_seqlen, cu_seqlens_host, labels=labels)
        return _h.run(self, SPEC, _h.tokcls_forward, a, extra)


class UnpadRobertaForQuestionAnswering:
    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None,
                start_positions=None, end_positions=None, output_hidden_states=None, output_attentions=None,
                return_dict=None, *, cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None, **extra):
        a = _cls_args(input_ids, token_type_ids, position_ids, attention_mask, inputs_embeds, output_hidden_states,
                      output_attentions, return_dict, cu_seqlens, max_seqlen, cu_seqlens_host,
                      start_positions=start_positions, end_positions=end_positions)
        return _h.run(self, SPEC, _h.qa_forward, a, extra)


class UnpadRobertaForMaskedLM:
    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None,
                labels=None, output_hidden_states=None, output_attentions=None, return_dict=None, *,
                cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None, **extra):
        a = _cls_args(input_ids, token_type_ids, position_ids, attention_mask, inputs_embeds, output_hidden_states,
                      output_attentions, return_dict, cu_seqlens, max_seqlen, cu_seqlens_host, labels=labels)
        return _h.run(self, SPEC, _h.masked_lm_forward, a, extra)


HEADS = {
    _m.RobertaModel: UnpadRobertaModel,
    _m.RobertaForSequenceClassification: UnpadRobertaForSequenceClassification,
    _m.RobertaForTokenClassification: UnpadRobertaForTokenClassification,
    _m.RobertaForQuestionAnswering: UnpadRobertaForQuestionAnswering,
    _m.RobertaForMaskedLM: UnpadRobertaForMaskedLM,
}

"""Unpadded forwards for PaddleNLP ERNIE models (``paddlenlp.transformers.ernie``).

Same conventions as :mod:`paddle_unpad.models.bert` (packed keyword-only inputs
``cu_seqlens``, ``max_seqlen``, ``cu_seqlens_host``); ``task_type_ids`` and
``inputs_embeds`` are gathered like ``input_ids``.
"""
from paddlenlp.transformers.ernie import modeling as _m

from . import heads as _h
from .common import FamilySpec

SPEC = FamilySpec(name="ernie", base_class=_m.ErnieModel, base_attr="ernie", embed_extras=("task_type_ids",))


class UnpadErnieModel:
    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, attention_mask=None, task_type_ids=None,
                past_key_values=None, inputs_embeds=None, use_cache=None, output_hidden_states=None,
                output_attentions=None, return_dict=None, *, cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None,
                **extra):
        a = dict(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                 attention_mask=attention_mask, task_type_ids=task_type_ids, past_key_values=past_key_values,
                 inputs_embeds=inputs_embeds, use_cache=use_cache, output_hidden_states=output_hidden_states,
                 output_attentions=output_attentions, return_dict=return_dict, cu_seqlens=cu_seqlens,
                 max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host)
        return _h.run(self, SPEC, _h.base_forward, a, extra)


def _cls_args(input_ids, token_type_ids, position_ids, attention_mask, inputs_embeds, output_hidden_states,
              output_attentions, return_dict, cu_seqlens, max_seqlen, cu_seqlens_host, **more):
    a = dict(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
             attention_mask=attention_mask, inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states,
             output_attentions=output_attentions, return_dict=return_dict, cu_seqlens=cu_seqlens,
             max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host)
    a.update(more)
    return a


class UnpadErnieForSequenceClassification:
    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None,
                labels=None, output_hidden_states=None, output_attentions=None, return_dict=None, *,
                cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None, **extra):
        a = _cls_args(input_ids, token_type_ids, position_ids, attention_mask, inputs_embeds, output_hidden_states,
                      output_attentions, return_dict, cu_seqlens, max_seqlen, cu_seqlens_host, labels=labels)
        return _h.run(self, SPEC, _h.seqcls_forward, a, extra)


class UnpadErnieForTokenClassification:
    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None,
                labels=None, output_hidden_states=None, output_attentions=None, return_dict=None, *,
                cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None, **extra):
        a = _cls_args(input_ids, token_type_ids, position_ids, attention_mask, inputs_embeds, output_hidden_states,
                      output_attentions, return_dict, cu_seqlens, max_seqlen, cu_seqlens_host, labels=labels)
        return _h.run(self, SPEC, _h.tokcls_forward, a, extra)


class UnpadErnieForQuestionAnswering:
    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, attention_mask=None, inputs_embeds=None,
                start_positions=None, end_positions=None, output_hidden_states=None, output_attentions=None,
                return_dict=None, *, cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None, **extra):
        a = _cls_args(input_ids, token_type_ids, position_ids, attention_mask, inputs_embeds, output_hidden_states,
                      output_attentions, return_dict, cu_seqlens, max_seqlen, cu_seqlens_host,
                      start_positions=start_positions, end_positions=end_positions)
        return _h.run(self, SPEC, _h.qa_forward, a, extra)


class UnpadErnieForPretraining:
    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, attention_mask=None,
                masked_positions=None, inputs_embeds=None, labels=None, next_sentence_label=None,
                output_hidden_states=None, output_attentions=None, return_dict=None, *,
                cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None, **extra):
        a = _cls_args(input_ids, token_type_ids, position_ids, attention_mask, inputs_embeds, output_hidden_states,
                      output_attentions, return_dict, cu_seqlens, max_seqlen, cu_seqlens_host,
                      masked_positions=masked_positions, labels=labels, next_sentence_label=next_sentence_label)
        return _h.run(self, SPEC, _h.pretraining_forward, a, extra)


class UnpadErnieForMaskedLM:
    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, attention_mask=None,
                masked_positions=None, inputs_embeds=None, labels=None, output_hidden_states=None,
                output_attentions=None, return_dict=None, *, cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None,
                **extra):
        a = _cls_args(input_ids, token_type_ids, position_ids, attention_mask, inputs_embeds, output_hidden_states,
                      output_attentions, return_dict, cu_seqlens, max_seqlen, cu_seqlens_host,
                      masked_positions=masked_positions, labels=labels)
        return _h.run(self, SPEC, _h.masked_lm_forward, a, extra)


HEADS = {
    _m.ErnieModel: UnpadErnieModel,
    _m.ErnieForSequenceClassification: UnpadErnieForSequenceClassification,
    _m.ErnieForTokenClassification: UnpadErnieForTokenClassification,
    _m.ErnieForQuestionAnswering: UnpadErnieForQuestionAnswering,
    _m.ErnieForPretraining: UnpadErnieForPretraining,
    _m.ErnieForMaskedLM: UnpadErnieForMaskedLM,
}

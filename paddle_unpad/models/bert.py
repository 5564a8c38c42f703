"""Unpadded forwards for PaddleNLP BERT models (``paddlenlp.transformers.bert``).

Every forward has the signature of the original, plus keyword-only packed inputs::

    cu_seqlens       int32 [B + 1] (tensor or numpy); with it, input_ids & co. are packed [T]
    max_seqlen       Python int >= the longest sequence
    cu_seqlens_host  numpy host copy of cu_seqlens (paddle_unpad's packing collator passes it)

and accepts (and ignores) the other bookkeeping keys of a paddle_unpad packed batch, so
``model(**batch)`` works. See :mod:`paddle_unpad.models.heads` for the output conventions.
"""
from paddlenlp.transformers.bert import modeling as _m

from . import heads as _h
from .common import FamilySpec

SPEC = FamilySpec(name="bert", base_class=_m.BertModel, base_attr="bert", config_defaults=True,
                  has_inputs_embeds=False)


class UnpadBertModel:
    def forward(self, input_ids, token_type_ids=None, position_ids=None, attention_mask=None, past_key_values=None,
                use_cache=None, output_hidden_states=None, output_attentions=None, return_dict=None, *,
                cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None, **extra):
        a = dict(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                 attention_mask=attention_mask, past_key_values=past_key_values, use_cache=use_cache,
                 output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                 return_dict=return_dict, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                 cu_seqlens_host=cu_seqlens_host)
        return _h.run(self, SPEC, _h.base_forward, a, extra)


class UnpadBertForSequenceClassification:
    def forward(self, input_ids, token_type_ids=None, position_ids=None, attention_mask=None, labels=None,
                output_hidden_states=None, output_attentions=None, return_dict=None, *,
                cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None, **extra):
        a = dict(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                 attention_mask=attention_mask, labels=labels, output_hidden_states=output_hidden_states,
                 output_attentions=output_attentions, return_dict=return_dict, cu_seqlens=cu_seqlens,
                 max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host)
        return _h.run(self, SPEC, _h.seqcls_forward, a, extra)


class UnpadBertForTokenClassification:
    def forward(self, input_ids, token_type_ids=None, position_ids=None, attention_mask=None, labels=None,
                output_hidden_states=None, output_attentions=None, return_dict=None, *,
                cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None, **extra):
        a = dict(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                 attention_mask=attention_mask, labels=labels, output_hidden_states=output_hidden_states,
                 output_attentions=output_attentions, return_dict=return_dict, cu_seqlens=cu_seqlens,
                 max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host)
        return _h.run(self, SPEC, _h.tokcls_forward, a, extra)


class UnpadBertForQuestionAnswering:
    def forward(self, input_ids, token_type_ids=None, position_ids=None, attention_mask=None, start_positions=None,
                end_positions=None, output_hidden_states=None, output_attentions=None, return_dict=None, *,
                cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None, **extra):
        a = dict(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                 attention_mask=attention_mask, start_positions=start_positions, end_positions=end_positions,
                 output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                 return_dict=return_dict, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                 cu_seqlens_host=cu_seqlens_host)
        return _h.run(self, SPEC, _h.qa_forward, a, extra)


class UnpadBertForPretraining:
    def forward(self, input_ids, token_type_ids=None, position_ids=None, attention_mask=None, masked_positions=None,
                labels=None, next_sentence_label=None, output_hidden_states=None, output_attentions=None,
                return_dict=None, *, cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None, **extra):
        a = dict(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                 attention_mask=attention_mask, masked_positions=masked_positions, labels=labels,
                 next_sentence_label=next_sentence_label, output_hidden_states=output_hidden_states,
                 output_attentions=output_attentions, return_dict=return_dict, cu_seqlens=cu_seqlens,
                 max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host)
        return _h.run(self, SPEC, _h.pretraining_forward, a, extra)


class UnpadBertForMaskedLM:
    def forward(self, input_ids, token_type_ids=None, position_ids=None, attention_mask=None, masked_positions=None,
                labels=None, output_hidden_states=None, output_attentions=None, return_dict=None, *,
                cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None, **extra):
        a = dict(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                 attention_mask=attention_mask, masked_positions=masked_positions, labels=labels,
                 output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                 return_dict=return_dict, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                 cu_seqlens_host=cu_seqlens_host)
        return _h.run(self, SPEC, _h.masked_lm_forward, a, extra)


# original class -> mixin whose forward replaces it
HEADS = {
    _m.BertModel: UnpadBertModel,
    _m.BertForSequenceClassification: UnpadBertForSequenceClassification,
    _m.BertForTokenClassification: UnpadBertForTokenClassification,
    _m.BertForQuestionAnswering: UnpadBertForQuestionAnswering,
    _m.BertForPretraining: UnpadBertForPretraining,
    _m.BertForMaskedLM: UnpadBertForMaskedLM,
}

"""Unpadded forwards of PaddleNLP base models and task heads, shared by BERT, ERNIE, RoBERTa.

Each ``*_forward(model, spec, a)`` takes the converted model, its :class:`FamilySpec` and
the dict ``a`` of the original forward's arguments (plus the packed-input arguments) and
returns exactly what the original forward returns (tuple or ``ModelOutput``), with these
differences, all at positions that are padding:

* per-token outputs (sequence output, hidden states, token logits, MLM scores) are zero
  at padding positions (the original computes values there that nothing should read);
* question-answering start/end logits are ``-1e4`` at padding positions, so the loss's
  softmax over the sequence ignores them (the original lets padding compete);
* per-token losses (token classification, masked LM) are the mean over labelled tokens
  (label ``!= -100``) by default; ``convert(..., token_loss="stock")`` divides the same sum
  by ``B * S`` instead, as the original does (see :func:`common.token_cross_entropy`).

With packed inputs (``input_ids [T]`` + ``cu_seqlens`` + ``max_seqlen``) per-token
outputs stay packed (``[T, ...]``), QA logits are ``[B, max_seqlen]`` and
``masked_positions`` index packed rows.

The masked-LM and pretraining heads also take the keys of a packing collator's MLM batch
(``masked_lm_labels`` / ``mlm_labels`` per token, ``masked_positions``, ``masked_labels``),
so ``model(**batch)`` computes the loss on the masked rows only.
"""

from __future__ import annotations

import inspect
import threading

import paddle
from paddlenlp.transformers.model_outputs import (
    BaseModelOutputWithPoolingAndCrossAttentions,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from .._runtime import warn as _warn
from .. import layers as _layers
from . import common


def _encode(model, spec, a, base, needs_cls=False, want_pooled=True, output_hidden_states=False, reader=None):
    return common.encode(
        spec,
        base,
        input_ids=a.get("input_ids"),
        token_type_ids=a.get("token_type_ids"),
        position_ids=a.get("position_ids"),
        attention_mask=a.get("attention_mask"),
        inputs_embeds=a.get("inputs_embeds"),
        extras={k: a.get(k) for k in spec.embed_extras},
        cu_seqlens=a.get("cu_seqlens"),
        max_seqlen=a.get("max_seqlen"),
        cu_seqlens_host=a.get("cu_seqlens_host"),
        output_hidden_states=output_hidden_states,
        needs_cls=needs_cls,
        want_pooled=want_pooled,
        reader=reader,
    )


def _encode_pooled(model, spec, a, base, output_hidden_states, reads, needs_cls=True):
    """:func:`_encode` with the pooled output; ``reads`` names the part of ``model`` that reads
    it, for the refusal of an empty sequence (it has no first token to pool)."""
    return _encode(
        model,
        spec,
        a,
        base,
        needs_cls=needs_cls,
        output_hidden_states=output_hidden_states,
        reader=f"{type(model).__name__}'s {reads}",
    )


def _return_dict(model, a):
    rd = a.get("return_dict")
    return rd if rd is not None else model.config.use_return_dict


def _head_flags(spec, base, a):
    ohs, oa, uc = common.resolve_flags(
        spec, base.config, a.get("output_hidden_states"), a.get("output_attentions"), None
    )
    common.check_unsupported(oa, None, uc)
    return ohs


def _tuple_out(loss, main, hidden):
    output = tuple(main) + ((hidden,) if hidden is not None else ())
    if loss is not None:
        return (loss,) + output
    return output[0] if len(output) == 1 else output


# ---- base model -------------------------------------------------------------------------------------


def base_forward(model, spec, a):
    ohs, oa, uc = common.resolve_flags(
        spec, model.config, a.get("output_hidden_states"), a.get("output_attentions"), a.get("use_cache")
    )
    common.check_unsupported(oa, a.get("past_key_values"), uc)
    return_dict = _return_dict(model, a)
    pk, seq, pooled, hidden = _encode_pooled(model, spec, a, model, ohs, "pooler (pooler_output)", needs_cls=False)
    seq_out = common.outputs_for_caller(pk, seq)
    hs = common.hidden_for_caller(pk, hidden)
    if not return_dict:
        return (seq_out, pooled) if hs is None else (seq_out, pooled, hs)
    return BaseModelOutputWithPoolingAndCrossAttentions(
        last_hidden_state=seq_out, pooler_output=pooled, past_key_values=None, hidden_states=hs, attentions=None
    )


# ---- sequence classification ----------------------------------------------------------------------


def _seqcls_loss_bert(model, logits, labels):
    # same rules as PaddleNLP's Bert/ErnieForSequenceClassification
    if labels is None:
        return None
    num_labels = model.num_labels
    if model.config.problem_type is None:
        if num_labels == 1:
            model.config.problem_type = "regression"
        elif num_labels > 1 and labels.dtype in (paddle.int64, paddle.int32):
            model.config.problem_type = "single_label_classification"
        else:
            model.config.problem_type = "multi_label_classification"
    if model.config.problem_type == "regression":
        if num_labels == 1:
            return paddle.nn.MSELoss()(logits.squeeze(), labels.squeeze())
        return paddle.nn.MSELoss()(logits, labels)
    if model.config.problem_type == "single_label_classification":
        return common.cross_entropy_mean(logits, labels, num_labels)
    return paddle.nn.BCEWithLogitsLoss()(logits, labels)


def _seqcls_loss_roberta(model, logits, labels):
    # same rules as PaddleNLP's RobertaForSequenceClassification
    if labels is None:
        return None
    n = model.config.num_labels
    if n == 1:
        return paddle.nn.MSELoss()(logits, labels)
    if labels.dtype in (paddle.int64, paddle.int32):
        return common.cross_entropy_mean(logits, labels, n)
    return paddle.nn.BCEWithLogitsLoss()(logits, labels)


def seqcls_forward(model, spec, a):
    base = getattr(model, spec.base_attr)
    ohs = _head_flags(spec, base, a)
    return_dict = _return_dict(model, a)
    if spec.roberta_positions:  # RobertaClassificationHead reads features[:, 0]
        pk, seq, _, hidden = _encode(model, spec, a, base, needs_cls=True, want_pooled=False, output_hidden_states=ohs)
        cls = model.dropout(pk.cls_rows(seq, f"{type(model).__name__}'s classifier"))
        logits = model.classifier(cls.unsqueeze(1))
        loss = _seqcls_loss_roberta(model, logits, a.get("labels"))
    else:
        pk, seq, pooled, hidden = _encode_pooled(model, spec, a, base, ohs, "classifier (through the pooler)")
        logits = model.classifier(model.dropout(pooled))
        loss = _seqcls_loss_bert(model, logits, a.get("labels"))
    hs = common.hidden_for_caller(pk, hidden)
    if not return_dict:
        return _tuple_out(loss, (logits,), hs)
    return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=hs, attentions=None)


# ---- token classification -------------------------------------------------------------------------


def _encode_tokens(model, spec, a):
    """The encoder for a per-token head: (packing, sequence output [T, H], hidden states, return_dict)."""
    base = getattr(model, spec.base_attr)
    ohs = _head_flags(spec, base, a)
    pk, seq, _, hidden = _encode(model, spec, a, base, want_pooled=False, output_hidden_states=ohs)
    return pk, seq, hidden, _return_dict(model, a)


def tokcls_forward(model, spec, a):
    pk, seq, hidden, return_dict = _encode_tokens(model, spec, a)
    logits_t = model.classifier(model.dropout(seq))  # [T, num_labels]
    loss = None
    labels = a.get("labels")
    if labels is not None:
        loss = common.token_cross_entropy(
            logits_t,
            common.token_labels(pk, labels),
            model.config.num_labels,
            pk.batch * pk.seqlen,
            _token_loss_mode(model),
            model,
        )
    logits = common.outputs_for_caller(pk, logits_t)
    hs = common.hidden_for_caller(pk, hidden)
    if not return_dict:
        return _tuple_out(loss, (logits,), hs)
    return TokenClassifierOutput(loss=loss, logits=logits, hidden_states=hs, attentions=None)


# ---- question answering -----------------------------------------------------------------------------


def qa_forward(model, spec, a):
    pk, seq, hidden, return_dict = _encode_tokens(model, spec, a)
    logits_t = model.classifier(seq)  # [T, 2]
    logits = pk.to_padded(logits_t, fill=common.PAD_LOGIT)  # [B, S, 2], -1e4 at padding
    logits = paddle.transpose(logits, perm=[2, 0, 1])
    start_logits, end_logits = paddle.unstack(x=logits, axis=0)
    total_loss = None
    start_positions, end_positions = a.get("start_positions"), a.get("end_positions")
    if start_positions is not None and end_positions is not None:
        if start_positions.ndim > 1:
            start_positions = start_positions.squeeze(-1)
        if end_positions.ndim > 1:
            end_positions = end_positions.squeeze(-1)
        ignored_index = paddle.shape(start_logits)[1]
        start_positions = start_positions.clip(0, ignored_index)
        end_positions = end_positions.clip(0, ignored_index)
        loss_fct = paddle.nn.CrossEntropyLoss(ignore_index=ignored_index)
        total_loss = (loss_fct(start_logits, start_positions) + loss_fct(end_logits, end_positions)) / 2
    hs = common.hidden_for_caller(pk, hidden)
    if not return_dict:
        return _tuple_out(total_loss, (start_logits, end_logits), hs)
    return QuestionAnsweringModelOutput(
        loss=total_loss, start_logits=start_logits, end_logits=end_logits, hidden_states=hs, attentions=None
    )


# ---- masked LM / pretraining -----------------------------------------------------------------------


def _mlm_scores(pk, seq, masked_positions, predict):
    """(scores for the caller, scores [N, V] for the loss, whether the loss uses per-token labels)."""
    if masked_positions is not None:
        rows = pk.rows_of_positions(masked_positions)
        scores = predict(paddle.gather(seq, rows, axis=0))  # only the masked rows
        return scores, scores, False
    scores_t = predict(seq)  # [T, V]
    return common.outputs_for_caller(pk, scores_t), scores_t, True


def _token_loss_mode(model):
    return common.options_of(model).get("token_loss", common.DEFAULT_OPTIONS["token_loss"])


def _mlm_loss(model, pk, scores_loss, labels, per_token):
    if labels is None:
        return None
    vocab = scores_loss.shape[-1]
    if per_token:  # stock divisor: every position of the padded batch
        labels, rows = common.token_labels(pk, labels), pk.batch * pk.seqlen
    else:  # masked rows only: the original's mean over those rows
        rows = scores_loss.shape[0] if common._dynamic() else paddle.shape(scores_loss)[0]
    return common.token_cross_entropy(scores_loss, labels, vocab, rows, _token_loss_mode(model), model)


def _mlm_batch_inputs(a, extra):
    """The original arguments ``masked_positions`` / ``labels`` from a packing collator's
    MLM batch keys when the caller did not pass them (``model(**batch)``)."""
    keys = {k: extra[k] for k in common.MLM_BATCH_KEYS if extra.get(k) is not None}
    if not keys:
        return a
    a = dict(a)
    if a.get("masked_positions") is None and "masked_positions" in keys:
        a["masked_positions"] = keys["masked_positions"]
    if a.get("labels") is not None:
        return a
    positions = a.get("masked_positions")
    per_token = next((keys[k] for k in common.MLM_LABEL_FIELDS if k in keys), None)
    if positions is not None and "masked_labels" in keys:
        a["labels"] = keys["masked_labels"]
    elif positions is not None and per_token is not None:
        a["labels"] = paddle.gather(per_token.reshape([-1]), positions.reshape([-1]).astype("int64"))
    elif per_token is not None:  # every token scored; the collator marks unmasked ones with any negative
        a["labels"] = paddle.where(per_token < 0, paddle.full_like(per_token, common.IGNORE_INDEX), per_token)
    elif "masked_labels" in keys:
        raise ValueError("paddle_unpad: masked_labels was given without masked_positions (the rows they label)")
    return a


def pretraining_forward(model, spec, a):
    from paddlenlp.transformers.bert.modeling import BertForPreTrainingOutput

    base = getattr(model, spec.base_attr)
    ohs = _head_flags(spec, base, a)
    return_dict = a.get("return_dict") if spec.name == "bert" else _return_dict(model, a)
    with paddle.static.amp.fp16_guard():
        pk, seq, pooled, hidden = _encode_pooled(model, spec, a, base, ohs, "next-sentence head (through the pooler)")
        scores, scores_loss, per_token = _mlm_scores(
            pk, seq, a.get("masked_positions"), lambda h: model.cls.predictions(h, None)
        )
        nsp = model.cls.seq_relationship(pooled)
        total_loss = None
        labels, nsl = a.get("labels"), a.get("next_sentence_label")
        if labels is not None and nsl is not None:
            mlm = _mlm_loss(model, pk, scores_loss, labels, per_token)
            total_loss = mlm + common.cross_entropy_mean(nsp, nsl, 2)
        hs = common.hidden_for_caller(pk, hidden)
        if not return_dict:
            return _tuple_out(total_loss, (scores, nsp), hs)
        out_cls = BertForPreTrainingOutput
        if spec.name == "ernie":
            from paddlenlp.transformers.ernie.modeling import ErnieForPreTrainingOutput as out_cls
        return out_cls(
            loss=total_loss, prediction_logits=scores, seq_relationship_logits=nsp, hidden_states=hs, attentions=None
        )


def masked_lm_forward(model, spec, a):
    base = getattr(model, spec.base_attr)
    ohs = _head_flags(spec, base, a)
    return_dict = _return_dict(model, a)
    pk, seq, _, hidden = _encode(model, spec, a, base, want_pooled=False, output_hidden_states=ohs)
    # RoBERTa's original has no masked_positions: they come only from a collator's batch
    predict = model.lm_head if spec.roberta_positions else (lambda h: model.cls.predictions(h, None))
    scores, scores_loss, per_token = _mlm_scores(pk, seq, a.get("masked_positions"), predict)
    loss = _mlm_loss(model, pk, scores_loss, a.get("labels"), per_token)
    hs = common.hidden_for_caller(pk, hidden)
    if not return_dict:
        return _tuple_out(loss, (scores,), hs)
    return MaskedLMOutput(loss=loss, logits=scores, hidden_states=hs, attentions=None)


# ---- dispatch -------------------------------------------------------------------------------------------


@paddle.jit.not_to_static
def run(model, spec, impl, a, extra):
    """Run ``impl``; on :class:`UnsupportedInput` raise, or (``on_unsupported="fallback"``) warn once
    and run the original forward."""
    mlm_head = impl in (masked_lm_forward, pretraining_forward)
    unknown = set(extra) - common.COLLATOR_EXTRAS - (common.MLM_BATCH_KEYS if mlm_head else frozenset())
    if unknown:
        hint = ""
        if unknown & {"label", "label_ids"}:  # a batch built without PaddleNLP's collators
            hint = "; the model's argument is 'labels' (PaddleNLP's collators and paddle_unpad.data.PackingCollator rename 'label' / 'label_ids' to it)"
        raise TypeError(
            f"paddle_unpad: {type(model).__name__}.forward() got unexpected keyword argument(s) {', '.join(sorted(unknown))}{hint}"
        )
    if mlm_head:
        a = _mlm_batch_inputs(a, extra)
    if _FALLBACK.depth and a.get("cu_seqlens") is None:  # inside another model's fallback: stay original
        return _original_forward(model, a)
    try:
        return impl(model, spec, a)
    except common.UnsupportedInput as e:
        packed = a.get("cu_seqlens") is not None
        if common.options_of(model).get("on_unsupported") != "fallback" or packed or not paddle.in_dynamic_mode():
            raise
        _warn.warn_once(
            ("fallback", type(model).__name__, str(e)),
            f"{e} -- running the original padded forward of {type(model).__name__} instead (convert(..., on_unsupported='fallback'))",
        )
        _FALLBACK.depth += 1
        try:
            return _original_forward(model, a)
        finally:
            _FALLBACK.depth -= 1


class _FallbackState(threading.local):
    depth = 0


_FALLBACK = _FallbackState()


def _original_forward(model, a):
    orig = _layers.original_class(model)
    kw = {k: v for k, v in a.items() if k not in common.PACKED_ARGS_ALL}
    if "masked_positions" not in inspect.signature(orig.forward).parameters:  # RoBERTa: only from a batch
        if kw.pop("masked_positions", None) is not None:
            raise common.UnsupportedInput(
                f"paddle_unpad: the original {orig.__name__}.forward has no masked_positions; its padded fallback cannot score only the masked rows"
            )
    return orig.forward(model, **kw)

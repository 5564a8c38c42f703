"""paddle_unpad.convert / revert on PaddleNLP 2.8.1 BERT, ERNIE and RoBERTa models.

Every check compares the converted model with an unconverted twin holding the same
weights (the original PaddleNLP model is the reference; no number comes from the code
under test). Small random configs (hidden 64, 2 layers, 4 heads) and ragged batches
whose lengths include 1 and the padded length.
"""

import warnings

import numpy as np
import paddle
import pytest

import paddle_unpad as pu
from paddle_unpad._runtime import paddle_compat as _compat
from export_util import to_static_packed, to_static_padded

pytestmark = [pytest.mark.usefixtures("native_ops"), pytest.mark.paddle_gpu_stage]

T = pytest.importorskip("paddlenlp.transformers")

VOCAB, HIDDEN, SEQ = 97, 64, 16
LENGTHS = [1, 9, SEQ, 5]  # includes 1 and the maximum (= the padded length)
RTOL = 1e-5  # acceptance: outputs and gradients match to 1e-5 relative (fp32)
LR = 1e-3

FAMILIES = {
    "bert": (
        T.BertConfig,
        {
            "model": T.BertModel,
            "seqcls": T.BertForSequenceClassification,
            "tokcls": T.BertForTokenClassification,
            "qa": T.BertForQuestionAnswering,
            "pretrain": T.BertForPretraining,
            "mlm": T.BertForMaskedLM,
        },
    ),
    "ernie": (
        T.ErnieConfig,
        {
            "model": T.ErnieModel,
            "seqcls": T.ErnieForSequenceClassification,
            "tokcls": T.ErnieForTokenClassification,
            "qa": T.ErnieForQuestionAnswering,
            "pretrain": T.ErnieForPretraining,
            "mlm": T.ErnieForMaskedLM,
        },
    ),
    "roberta": (
        T.RobertaConfig,
        {
            "model": T.RobertaModel,
            "seqcls": T.RobertaForSequenceClassification,
            "tokcls": T.RobertaForTokenClassification,
            "qa": T.RobertaForQuestionAnswering,
            "mlm": T.RobertaForMaskedLM,
        },
    ),
}
CASES = [(fam, kind) for fam, (_, kinds) in FAMILIES.items() for kind in kinds]
PAD = {"bert": 0, "ernie": 0, "roberta": 1}


def make_config(fam, dropout=0.0, **kw):
    cfg_cls = FAMILIES[fam][0]
    args = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=40,
        type_vocab_size=2,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=3,
        pad_token_id=PAD[fam],
    )
    if fam == "roberta":
        args.update(bos_token_id=0, eos_token_id=2, cls_token_id=0)
    args.update(kw)
    return cfg_cls(**args)


def make_pair(fam, kind, dropout=0.0, seed=0, token_loss="mean", **kw):
    """(original, converted) with identical weights."""
    cls = FAMILIES[fam][1][kind]
    cfg = make_config(fam, dropout, **kw)
    paddle.seed(seed)
    ref = cls(cfg)
    model = cls(make_config(fam, dropout, **kw))
    model.set_state_dict(ref.state_dict())
    for m in (ref, model):
        m.train() if dropout else m.eval()
    pu.convert(model, token_loss=token_loss)
    return ref, model


def ragged_batch(fam, lengths=LENGTHS, seq=SEQ, seed=1):
    rng = np.random.default_rng(seed)
    pad = PAD[fam]
    B = len(lengths)
    ids = np.full((B, seq), pad, np.int64)
    tt = np.zeros((B, seq), np.int64)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(3, VOCAB, n)
        tt[b, n // 2 : n] = 1
    mask = np.zeros((B, seq), np.int64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    return ids, tt, mask


def valid_flat(mask):
    return np.flatnonzero(mask.reshape(-1))


def masked_positions_for(mask, rng, per_seq=3):
    pos = []
    S = mask.shape[1]
    for b in range(mask.shape[0]):
        n = int(mask[b].sum())
        pos += [b * S + int(j) for j in sorted(rng.choice(n, size=min(per_seq, n), replace=False))]
    return np.array(pos, np.int64)


def call(model, fam, kind, ids, tt, mask, extra=None):
    kw = dict(token_type_ids=paddle.to_tensor(tt), attention_mask=paddle.to_tensor(mask))
    kw.update(extra or {})
    return model(paddle.to_tensor(ids), **kw)


def outputs_at_valid(kind, out, mask):
    """The tensors to compare, restricted to real tokens (paddle tensors, differentiable)."""
    idx = paddle.to_tensor(valid_flat(mask))

    def tok(t):  # [B, S, ...] -> [T, ...]
        return paddle.gather(t.reshape([-1] + list(t.shape[2:])), idx)

    if kind == "model":
        seq, pooled = out[0], out[1]
        return [tok(seq)] + ([pooled] if pooled is not None else [])
    if kind == "seqcls":
        return [out]
    if kind == "tokcls":
        return [tok(out)]
    if kind == "qa":
        return [tok(out[0]), tok(out[1])]
    if kind == "pretrain":
        return [out[0], out[1]]
    if kind == "mlm":
        return [out] if len(out.shape) == 2 else [tok(out)]
    raise AssertionError(kind)


def extra_inputs(fam, kind, mask, rng):
    if kind in ("pretrain",) or (kind == "mlm" and fam != "roberta"):
        return {"masked_positions": paddle.to_tensor(masked_positions_for(mask, rng))}
    return {}


def weighted_sum(tensors, seed=7):
    rng = np.random.default_rng(seed)
    total = 0.0
    for t in tensors:
        w = paddle.to_tensor(rng.standard_normal(t.shape).astype(np.float32))
        total = total + (t * w).sum()
    return total


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.abs(b).max(initial=0.0), 1e-30)
    return float(np.abs(a - b).max(initial=0.0) / scale)


def grads_by_name(model):
    return {
        n: (p.grad.numpy() if p.grad is not None else np.zeros(p.shape, np.float32))
        for n, p in model.named_parameters()
    }


# Gradients that are mathematically zero: softmax is invariant to adding q.b_k to every score
# of a query row, so d loss / d k_proj.bias == 0 and both models return rounding noise.
# Compared against the scale of the layer's other attention gradients instead.
def _is_key_bias(name):
    return name.endswith("self_attn.k_proj.bias")


def check_grads(ref, model):
    g_ref, g_new = grads_by_name(ref), grads_by_name(model)
    assert g_ref.keys() == g_new.keys()
    scale_all = max(np.abs(g).max(initial=0.0) for g in g_ref.values())
    worst = {}
    for name in g_ref:
        if _is_key_bias(name):
            err = np.abs(g_new[name] - g_ref[name]).max() / scale_all
            assert err < RTOL, (name, err)
            continue
        if not np.any(g_ref[name]) and not np.any(g_new[name]):
            continue
        worst[name] = rel_err(g_new[name], g_ref[name])
    bad = {k: v for k, v in worst.items() if v > RTOL}
    assert not bad, f"gradients differ (relative max-abs error): {bad}"
    return worst


# ---- outputs and gradients, every family and head ----------------------------------------------------


@pytest.mark.parametrize("fam,kind", CASES)
def test_outputs_and_gradients_match(fam, kind):
    ref, model = make_pair(fam, kind)
    ids, tt, mask = ragged_batch(fam)
    extra = extra_inputs(fam, kind, mask, np.random.default_rng(3))
    outs = []
    for m in (ref, model):
        o = outputs_at_valid(kind, call(m, fam, kind, ids, tt, mask, extra), mask)
        loss = weighted_sum(o)
        loss.backward()
        outs.append([t.numpy() for t in o])
    for a, b in zip(outs[1], outs[0]):
        assert a.shape == b.shape
        assert rel_err(a, b) < RTOL, rel_err(a, b)
    check_grads(ref, model)


def _loss_inputs(fam, kind, ids, mask, rng):
    """Labels for the model's own loss, in the padded layout PaddleNLP collators produce."""
    B = ids.shape[0]
    if kind == "seqcls":
        return {"labels": paddle.to_tensor(rng.integers(0, 3, B).astype(np.int64))}
    if kind == "tokcls":
        lab = rng.integers(0, 3, ids.shape).astype(np.int64)
        lab[mask == 0] = -100  # DataCollatorForTokenClassification's label_pad_token_id
        return {"labels": paddle.to_tensor(lab)}
    if kind == "pretrain":
        pos = masked_positions_for(mask, rng)
        return {
            "masked_positions": paddle.to_tensor(pos),
            "labels": paddle.to_tensor(rng.integers(0, VOCAB, len(pos)).astype(np.int64)),
            "next_sentence_label": paddle.to_tensor(rng.integers(0, 2, B).astype(np.int64)),
        }
    if kind == "mlm":
        lab = np.full(ids.shape, -100, np.int64)
        for b in range(B):
            lab[b, 0] = rng.integers(0, VOCAB)
        return {"labels": paddle.to_tensor(lab)}
    return None


@pytest.mark.parametrize("fam,kind", CASES)
def test_three_adamw_steps_match(fam, kind):
    ref, model = make_pair(fam, kind, token_loss="stock")  # the original's own loss, same scale
    ids, tt, mask = ragged_batch(fam)
    rng = np.random.default_rng(5)
    extra = extra_inputs(fam, kind, mask, rng)
    labels = _loss_inputs(fam, kind, ids, mask, np.random.default_rng(6))
    opts = [
        paddle.optimizer.AdamW(learning_rate=LR, parameters=m.parameters(), weight_decay=0.01) for m in (ref, model)
    ]
    for step in range(3):
        losses = []
        for m, opt in zip((ref, model), opts):
            if labels is not None:  # the model's own loss
                out = call(m, fam, kind, ids, tt, mask, dict(labels, return_dict=True))
                loss = out.loss
            else:
                loss = weighted_sum(outputs_at_valid(kind, call(m, fam, kind, ids, tt, mask, extra), mask), seed=step)
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
        assert abs(losses[1] - losses[0]) <= RTOL * max(abs(losses[0]), 1.0), losses
    # Adam divides each element's gradient by its own magnitude, so an element whose gradient
    # is at fp32 rounding level (in both models) moves by an arbitrary fraction of lr: allow a
    # tenth of one step on top of the 1e-5 relative tolerance (a wrong gradient moves by ~lr).
    ref_p = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if _is_key_bias(name):  # gradient mathematically zero (see _is_key_bias): pure noise in both
            continue
        a, b = p.numpy(), ref_p[name].numpy()
        assert np.abs(a - b).max() <= RTOL * np.abs(b).max() + 0.1 * LR, (name, rel_err(a, b))
    o_ref = outputs_at_valid(kind, call(ref, fam, kind, ids, tt, mask, extra), mask)
    o_new = outputs_at_valid(kind, call(model, fam, kind, ids, tt, mask, extra), mask)
    for a, b in zip(o_new, o_ref):
        assert rel_err(a.numpy(), b.numpy()) < 1e-4


def test_losses_match_original():
    """With token_loss="stock" the model-computed losses equal the original's on the same padded batch."""
    for fam, kind in [
        ("bert", "seqcls"),
        ("bert", "tokcls"),
        ("bert", "pretrain"),
        ("ernie", "pretrain"),
        ("roberta", "seqcls"),
        ("roberta", "mlm"),
        ("bert", "mlm"),
    ]:
        ref, model = make_pair(fam, kind, token_loss="stock")
        ids, tt, mask = ragged_batch(fam)
        labels = _loss_inputs(fam, kind, ids, mask, np.random.default_rng(11))
        l_ref = float(call(ref, fam, kind, ids, tt, mask, labels)[0])
        l_new = float(call(model, fam, kind, ids, tt, mask, labels)[0])
        assert abs(l_new - l_ref) <= RTOL * abs(l_ref), (fam, kind, l_new, l_ref)


def test_qa_loss_ignores_padding():
    """QA: start/end logits at padding are -1e4, so the loss is the original's loss with
    padding positions removed from the softmax (computed here from the original's logits)."""
    ref, model = make_pair("bert", "qa")
    ids, tt, mask = ragged_batch("bert")
    B = ids.shape[0]
    start = np.array([0, 3, 12, 4], np.int64)
    end = np.array([0, 5, 15, 4], np.int64)
    kw = {"start_positions": paddle.to_tensor(start), "end_positions": paddle.to_tensor(end)}
    s_ref, e_ref = (t.numpy().astype(np.float64) for t in call(ref, "bert", "qa", ids, tt, mask))
    loss = float(call(model, "bert", "qa", ids, tt, mask, kw)[0])

    def ce(logits, target):
        total = 0.0
        for b in range(B):
            z = logits[b][mask[b] == 1]
            total += np.log(np.exp(z - z.max()).sum()) + z.max() - z[target[b]]
        return total / B

    expected = (ce(s_ref, start) + ce(e_ref, end)) / 2
    assert abs(loss - expected) <= 1e-5 * abs(expected)
    s_new = call(model, "bert", "qa", ids, tt, mask)[0].numpy()
    assert np.all(s_new[mask == 0] == -1e4)


def test_multiple_choice_uses_unpadded_base():
    """A head without its own unpadded forward (BertForMultipleChoice) runs on the converted
    base model, padded back for it; results match."""
    cfg = make_config("bert", num_choices=2)
    paddle.seed(0)
    ref = T.BertForMultipleChoice(cfg)
    model = T.BertForMultipleChoice(make_config("bert", num_choices=2))
    model.set_state_dict(ref.state_dict())
    ref.eval(), model.eval()
    pu.convert(model)
    assert pu.models.is_converted(model)
    ids, tt, mask = ragged_batch("bert")
    r = call(ref, "bert", "mc", ids.reshape(2, 2, SEQ), tt.reshape(2, 2, SEQ), mask.reshape(2, 2, SEQ)).numpy()
    n = call(model, "bert", "mc", ids.reshape(2, 2, SEQ), tt.reshape(2, 2, SEQ), mask.reshape(2, 2, SEQ)).numpy()
    assert rel_err(n, r) < RTOL


def test_hidden_states_output():
    ref, model = make_pair("bert", "model")
    ids, tt, mask = ragged_batch("bert")
    h_ref = call(ref, "bert", "model", ids, tt, mask, {"output_hidden_states": True})[2]
    h_new = call(model, "bert", "model", ids, tt, mask, {"output_hidden_states": True})[2]
    assert len(h_ref) == len(h_new) == 3  # embeddings + 2 layers
    v = mask.astype(bool)
    for a, b in zip(h_new, h_ref):
        assert rel_err(a.numpy()[v], b.numpy()[v]) < RTOL
        assert np.all(a.numpy()[~v] == 0)
    out = call(model, "bert", "model", ids, tt, mask, {"output_hidden_states": True, "return_dict": True})
    assert out.hidden_states is not None and out.attentions is None


# ---- attention mask forms ---------------------------------------------------------------------------


def _mask_forms(mask):
    B, S = mask.shape
    add = (1 - mask).astype(np.float32)[:, None, None, :]
    return {
        "none": None,
        "2d_int": paddle.to_tensor(mask),
        "2d_bool": paddle.to_tensor(mask.astype(bool)),
        "2d_float": paddle.to_tensor(mask.astype(np.float32)),
        "4d_additive_1e4": paddle.to_tensor(add * -1e4),
        "4d_additive_inf": paddle.to_tensor(np.where(add > 0, -np.inf, 0).astype(np.float32)),
        "4d_additive_1e9": paddle.to_tensor(add * -1e9),
        "4d_bool": paddle.to_tensor(mask.astype(bool)[:, None, None, :]),
        "4d_int": paddle.to_tensor(mask[:, None, None, :]),
    }


def test_every_padding_mask_form():
    ref, model = make_pair("bert", "model")
    ids, tt, mask = ragged_batch("bert")
    v = mask.astype(bool)
    expected = call(ref, "bert", "model", ids, tt, mask)
    for name, m in _mask_forms(mask).items():
        out = model(paddle.to_tensor(ids), token_type_ids=paddle.to_tensor(tt), attention_mask=m)
        assert rel_err(out[0].numpy()[v], expected[0].numpy()[v]) < RTOL, name
        assert rel_err(out[1].numpy(), expected[1].numpy()) < RTOL, name


def test_non_padding_masks_are_refused():
    ref, model = make_pair("bert", "seqcls")
    ids, tt, mask = ragged_batch("bert")
    S = SEQ
    causal = np.triu(np.full((S, S), -1e4, np.float32), 1)[None, None]
    soft = ((1 - mask) * -1e4).astype(np.float32)[:, None, None, :]
    soft[0, 0, 0, 0] = -0.5
    bad = {
        "per-query [B,1,S,S]": paddle.to_tensor(np.broadcast_to(causal, (4, 1, S, S)).copy()),
        "soft additive": paddle.to_tensor(soft),
        "2-D with 0.5": paddle.to_tensor(mask.astype(np.float32) * 0.5),
    }
    for name, m in bad.items():
        with pytest.raises(NotImplementedError, match="attention_mask"):
            model(paddle.to_tensor(ids), attention_mask=m)


def test_fallback_option_warns_once_and_matches_original():
    ref, model = make_pair("bert", "seqcls")
    pu.revert(model)
    pu.convert(model, on_unsupported="fallback")
    ids, tt, mask = ragged_batch("bert")
    S = SEQ
    causal = paddle.to_tensor(np.triu(np.full((S, S), -1e4, np.float32), 1)[None, None])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out1 = model(paddle.to_tensor(ids), attention_mask=causal)
        out2 = model(paddle.to_tensor(ids), attention_mask=causal)
    ours = [x for x in w if "paddle_unpad" in str(x.message)]
    assert len(ours) == 1 and "original padded forward" in str(ours[0].message)
    expected = ref(paddle.to_tensor(ids), attention_mask=causal)
    assert rel_err(out1.numpy(), expected.numpy()) < RTOL and rel_err(out2.numpy(), expected.numpy()) < RTOL


@pytest.mark.parametrize(
    "kwargs,option",
    [
        ({"output_attentions": True}, "output_attentions"),
        ({"use_cache": True}, "use_cache"),
    ],
)
def test_unsupported_options_raise_naming_them(kwargs, option):
    ref, model = make_pair("bert", "model")
    ids, tt, mask = ragged_batch("bert")
    with pytest.raises(NotImplementedError, match=option):
        model(paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask), **kwargs)


def test_past_key_values_raise():
    ref, model = make_pair("roberta", "model")
    ids, tt, mask = ragged_batch("roberta")
    cache = [(paddle.zeros([4, 4, 2, 16]), paddle.zeros([4, 4, 2, 16]))] * 2
    with pytest.raises(NotImplementedError, match="past_key_values"):
        model(paddle.to_tensor(ids), past_key_values=cache)


def test_output_attentions_on_head_raises():
    ref, model = make_pair("ernie", "tokcls")
    ids, tt, mask = ragged_batch("ernie")
    with pytest.raises(NotImplementedError, match="output_attentions"):
        model(paddle.to_tensor(ids), output_attentions=True)


def test_fuse_config_is_refused():
    cfg = make_config("bert", fuse=True)
    try:
        model = T.BertModel(cfg)
    except Exception as e:  # pragma: no cover - depends on the Paddle build
        pytest.skip(f"FusedTransformerEncoderLayer cannot be built here: {e}")
    if not model.fuse:
        pytest.skip("this Paddle ignores config.fuse")
    with pytest.raises(NotImplementedError, match="config.fuse"):
        pu.convert(model)
    with pytest.warns(UserWarning, match="config.fuse"):
        assert pu.convert(model, on_unsupported="fallback") is model
    assert not pu.models.is_converted(model)


def test_left_padding_refused_for_cls_heads():
    ref, model = make_pair("bert", "seqcls")
    ids, tt, mask = ragged_batch("bert")
    left_ids, left_mask = ids.copy(), mask.copy()
    for b, n in enumerate(LENGTHS):
        left_ids[b] = np.roll(ids[b], SEQ - n)
        left_mask[b] = np.roll(mask[b], SEQ - n)
    with pytest.raises(NotImplementedError, match="first position"):
        model(paddle.to_tensor(left_ids), attention_mask=paddle.to_tensor(left_mask))
    # token outputs of a left-padded batch still match (positions as the original assigns them)
    ref_t, model_t = make_pair("bert", "tokcls")
    v = left_mask.astype(bool)
    a = model_t(paddle.to_tensor(left_ids), attention_mask=paddle.to_tensor(left_mask)).numpy()
    b = ref_t(paddle.to_tensor(left_ids), attention_mask=paddle.to_tensor(left_mask)).numpy()
    assert rel_err(a[v], b[v]) < RTOL


def test_empty_row_refused():
    ref, model = make_pair("bert", "model")
    ids, tt, mask = ragged_batch("bert")
    mask[2] = 0
    with pytest.raises(NotImplementedError, match="row 2"):
        model(paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask))


# ---- empty sequences in packed batches -------------------------------------------------------------------

EMPTY_AT = {"first": 0, "middle": 2, "last": len(LENGTHS)}  # where a 0-length sequence joins LENGTHS


def _with_empty(fam, where):
    """The ragged batch and the packed inputs of the same rows with an empty sequence inserted."""
    ids, tt, mask = ragged_batch(fam)
    lengths = list(LENGTHS)
    lengths.insert(EMPTY_AT[where], 0)
    v = mask.astype(bool)
    cu, mx = pu.cu_seqlens_from_lengths(lengths)
    packed = dict(
        token_type_ids=paddle.to_tensor(tt[v]),
        cu_seqlens=cu,
        max_seqlen=mx,
        cu_seqlens_host=np.cumsum([0] + lengths).astype(np.int32),
    )
    return ids, tt, mask, lengths, packed


PER_SEQUENCE = [(fam, kind) for fam, kind in CASES if kind in ("model", "seqcls", "pretrain")]
PER_TOKEN = [(fam, kind) for fam, kind in CASES if kind in ("tokcls", "qa", "mlm")]


@pytest.mark.parametrize("where", list(EMPTY_AT))
@pytest.mark.parametrize("fam,kind", PER_SEQUENCE)
def test_empty_sequence_refused_by_per_sequence_outputs(fam, kind, where):
    """A pooled output, sequence logits or NSP logits need the sequence's [CLS] row: an empty
    sequence is refused naming it, wherever it is (it used to get the next sequence's row, or an
    IndexError when last); with labels too, so no step trains on another sequence's row."""
    ref, model = make_pair(fam, kind)
    ids, tt, mask, lengths, packed = _with_empty(fam, where)
    b, start = EMPTY_AT[where], sum(lengths[: EMPTY_AT[where]])
    extra = {"labels": paddle.to_tensor(np.zeros(len(lengths), np.int64))} if kind == "seqcls" else {}
    msg = (
        rf"^paddle_unpad: sequence {b} of {len(lengths)} is empty \(cu_seqlens\[{b}\] == cu_seqlens\[{b + 1}\] "
        rf"== {start}\): {type(model).__name__}'s .*first \(\[CLS\]\) token"
    )
    with pytest.raises(ValueError, match=msg):
        model(paddle.to_tensor(ids[mask.astype(bool)]), **packed, **extra)


@pytest.mark.parametrize("where", list(EMPTY_AT))
@pytest.mark.parametrize("fam,kind", PER_TOKEN)
def test_empty_sequence_per_token_outputs_match_the_original(fam, kind, where):
    """Per-token heads take empty sequences: they produce no rows, the other sequences' outputs
    and gradients are the original model's on the padded batch without the empty one; QA's
    [B, max_seqlen] logits give the empty sequence's row the padding value (-1e4)."""
    ref, model = make_pair(fam, kind)
    ids, tt, mask, lengths, packed = _with_empty(fam, where)
    v = mask.astype(bool)
    out = model(paddle.to_tensor(ids[v]), **packed)
    expected = call(ref, fam, kind, ids, tt, mask)
    ref_idx = paddle.to_tensor(valid_flat(mask))
    if kind == "qa":
        b = EMPTY_AT[where]
        assert [list(t.shape) for t in out] == [[len(lengths), SEQ]] * 2
        assert all((t.numpy()[b] == -1e4).all() for t in out)
        idx = paddle.to_tensor(valid_flat(np.insert(mask, b, 0, axis=0)))
        got = [paddle.gather(t.reshape([-1]), idx) for t in out]
        want = [paddle.gather(t.reshape([-1]), ref_idx) for t in expected]
    else:
        got, want = [out], [paddle.gather(expected.reshape([-1, expected.shape[-1]]), ref_idx)]
    for a, e in zip(got, want):
        assert a.shape == e.shape and rel_err(a.numpy(), e.numpy()) < RTOL
    weighted_sum(got).backward()
    weighted_sum(want).backward()
    check_grads(ref, model)


def test_empty_sequence_token_loss():
    """The per-token loss of a packed batch with an empty sequence: the mean over its labelled
    tokens, computed here from the original model's logits."""
    ref, model = make_pair("bert", "tokcls")
    ids, tt, mask, _, packed = _with_empty("bert", "middle")
    v = mask.astype(bool)
    lab = _token_labels("bert", "tokcls", ids, mask, np.random.default_rng(33))
    expected = _ce_mean_over_labelled(call(ref, "bert", "tokcls", ids, tt, mask).numpy()[v], lab[v])
    loss = float(model(paddle.to_tensor(ids[v]), labels=paddle.to_tensor(lab[v]), **packed)[0])
    assert abs(loss - expected) <= RTOL * abs(expected), (loss, expected)


def test_static_graph_empty_sequence_rows_are_nan(tmp_path):
    """An exported program has no host copy of cu_seqlens to check: an empty sequence's
    per-sequence row is NaN (never another sequence's), the other rows are the original's."""
    ref, model = make_pair("bert", "seqcls")
    static = to_static_packed(model)
    paddle.jit.save(static, str(tmp_path / "cls"))
    static = paddle.jit.load(str(tmp_path / "cls"))
    for where, b in EMPTY_AT.items():
        ids, tt, mask, lengths, packed = _with_empty("bert", where)
        out = static(paddle.to_tensor(ids[mask.astype(bool)]), packed["cu_seqlens"]).numpy()
        expected = call(ref, "bert", "seqcls", ids, tt * 0, mask).numpy()
        assert np.isnan(out[b]).all(), where
        assert rel_err(np.delete(out, b, axis=0), expected) < RTOL, where


# ---- packed inputs (the packing collator) ----------------------------------------------------------------


def _samples(ids, tt, mask, labels=None):
    out = []
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        s = {"input_ids": ids[b, :n], "token_type_ids": tt[b, :n]}
        if labels is not None:
            s["labels"] = np.int64(labels[b])
        out.append(s)
    return out


@pytest.mark.parametrize("fam", ["bert", "ernie"])
def test_packed_collator_batch_matches_padded(fam):
    from paddle_unpad.data import PackingCollator

    ref, model = make_pair(fam, "seqcls")
    ids, tt, mask = ragged_batch(fam)
    labels = np.array([0, 2, 1, 1])
    batch = PackingCollator(max_seqlen=SEQ)(_samples(ids, tt, mask, labels))
    out = model(**batch, return_dict=True)  # every key of the packed batch is accepted
    expected = call(ref, fam, "seqcls", ids, tt, mask, dict(labels=paddle.to_tensor(labels), return_dict=True))
    assert rel_err(out.logits.numpy(), expected.logits.numpy()) < RTOL
    assert abs(float(out.loss) - float(expected.loss)) <= RTOL * abs(float(expected.loss))


def test_collator_label_key_reaches_the_model_as_labels():
    """Samples with PaddleNLP's 'label' key: the packing collator renames it, and the loss is
    the original model's with those labels; a batch that still says 'label' gets a hint."""
    from paddle_unpad.data import PackingCollator

    ref, model = make_pair("bert", "seqcls")
    ids, tt, mask = ragged_batch("bert")
    labels = np.array([2, 0, 1, 1])
    samples = [
        {"input_ids": s["input_ids"], "token_type_ids": s["token_type_ids"], "label": np.int64(y)}
        for s, y in zip(_samples(ids, tt, mask), labels)
    ]
    out = model(**PackingCollator(max_seqlen=SEQ)(samples), return_dict=True)
    expected = call(ref, "bert", "seqcls", ids, tt, mask, dict(labels=paddle.to_tensor(labels), return_dict=True))
    assert abs(float(out.loss) - float(expected.loss)) <= RTOL * abs(float(expected.loss))
    with pytest.raises(TypeError, match=r"argument\(s\) label; the model's argument is 'labels'"):
        model(paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask), label=paddle.to_tensor(labels))


def _packed(fam, ids, tt, mask, **per_token):
    """The packing collator's batch of these rows, with extra per-token fields ([B, S] arrays)."""
    from paddle_unpad.data import PackingCollator

    samples = _samples(ids, tt, mask)
    for b, smp in enumerate(samples):
        n = len(smp["input_ids"])
        smp.update({k: v[b, :n] for k, v in per_token.items()})
    batch = PackingCollator(max_seqlen=SEQ)(samples)
    if fam == "roberta":  # the collator writes BERT-style 0..s-1 position ids; RoBERTa computes its own
        batch.pop("position_ids")
    return batch


@pytest.mark.parametrize(
    "fam,kind", [("bert", "mlm"), ("bert", "pretrain"), ("ernie", "mlm"), ("ernie", "pretrain"), ("roberta", "mlm")]
)
def test_mlm_collator_batch_is_accepted(fam, kind):
    """model(**batch) on the packing collator's own masked-LM batch (masked_lm_labels per token ->
    masked_positions, masked_labels): the MLM head scores the masked rows only, and the loss is the
    original's on the same masked rows."""
    from paddle_unpad.data import PackingCollator

    ref, model = make_pair(fam, kind)
    ids, tt, mask = ragged_batch(fam)
    rng = np.random.default_rng(21)
    flat = masked_positions_for(mask, rng)
    mlm = np.full(ids.shape, -100, np.int64)
    mlm.reshape(-1)[flat] = rng.integers(0, VOCAB, len(flat))
    nsl = rng.integers(0, 2, ids.shape[0]).astype(np.int64)
    samples = _samples(ids, tt, mask)
    for b, smp in enumerate(samples):
        smp["masked_lm_labels"] = mlm[b, : len(smp["input_ids"])]
        if kind == "pretrain":
            smp["next_sentence_label"] = nsl[b]
    batch = PackingCollator(max_seqlen=SEQ)(samples)
    assert {"masked_lm_labels", "masked_positions", "masked_labels"} <= set(batch)
    if fam == "roberta":
        batch.pop("position_ids")
    out = model(**batch, return_dict=True)
    M = len(flat)
    x, m = paddle.to_tensor(ids), paddle.to_tensor(mask)
    kw = dict(token_type_ids=paddle.to_tensor(tt), attention_mask=m, return_dict=True)
    if fam == "roberta":  # the original has no masked_positions: per-token labels, scores of every token
        e = ref(x, labels=paddle.to_tensor(mlm), **kw)
        e_scores = e.logits.numpy().reshape(-1, VOCAB)[flat]
        # the original divides by B * S, padding included (Paddle 3.x; 2.6: by the labelled rows);
        # the default here is the mean over the M masked rows
        e_loss = float(e.loss) * (ids.size / M if _compat.mean_cross_entropy_divides_by_all_rows() else 1.0)
    else:
        if kind == "pretrain":
            kw["next_sentence_label"] = paddle.to_tensor(nsl)
        e = ref(x, masked_positions=paddle.to_tensor(flat), labels=paddle.to_tensor(mlm.reshape(-1)[flat]), **kw)
        e_scores, e_loss = e.prediction_logits.numpy() if kind == "pretrain" else e.logits.numpy(), float(e.loss)
    scores = out.prediction_logits if kind == "pretrain" else out.logits
    assert list(scores.shape) == [M, VOCAB]
    assert rel_err(scores.numpy(), e_scores) < RTOL
    assert abs(float(out.loss) - e_loss) <= RTOL * abs(e_loss), (float(out.loss), e_loss)


def test_mlm_masked_labels_without_positions_is_refused():
    ref, model = make_pair("bert", "mlm")
    ids, tt, mask = ragged_batch("bert")
    v = mask.astype(bool)
    cu, mx = pu.cu_seqlens_from_lengths(LENGTHS)
    with pytest.raises(ValueError, match="masked_labels was given without masked_positions"):
        model(paddle.to_tensor(ids[v]), cu_seqlens=cu, max_seqlen=mx, masked_labels=paddle.to_tensor([3, 4]))
    with pytest.raises(TypeError, match="unexpected keyword argument.*masked_labels"):
        make_pair("bert", "seqcls")[1](
            paddle.to_tensor(ids[v]), cu_seqlens=cu, max_seqlen=mx, masked_labels=paddle.to_tensor([3, 4])
        )


def _ce_mean_over_labelled(logits, labels):
    """float64 cross entropy averaged over the positions whose label is not -100."""
    logits = np.asarray(logits, np.float64).reshape(-1, logits.shape[-1])
    labels = np.asarray(labels).reshape(-1)
    keep = labels != -100
    z = logits[keep]
    zmax = z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z - zmax).sum(axis=1)) + zmax[:, 0]
    return float((lse - z[np.arange(len(z)), labels[keep]]).mean())


def _token_labels(fam, kind, ids, mask, rng):
    lab = _loss_inputs(fam, kind, ids, mask, rng)["labels"].numpy()
    if kind == "tokcls":
        lab[:, 0] = -100  # e.g. special tokens: real tokens without a label
    return lab


@pytest.mark.parametrize("fam,kind", [("bert", "tokcls"), ("roberta", "tokcls"), ("bert", "mlm"), ("roberta", "mlm")])
def test_token_loss_default_is_mean_over_labelled_tokens(fam, kind):
    """Default per-token loss: sum over labelled tokens / their count, computed here from the
    original model's logits; the same for the padded batch and its packed twin."""
    ref, model = make_pair(fam, kind)
    ids, tt, mask = ragged_batch(fam)
    lab = _token_labels(fam, kind, ids, mask, np.random.default_rng(31))
    logits = call(ref, fam, kind, ids, tt, mask).numpy()
    expected = _ce_mean_over_labelled(logits, lab)
    padded = float(call(model, fam, kind, ids, tt, mask, {"labels": paddle.to_tensor(lab)})[0])
    packed = float(model(**_packed(fam, ids, tt, mask, labels=lab))[0])
    assert abs(padded - expected) <= RTOL * abs(expected), (padded, expected)
    assert abs(packed - expected) <= RTOL * abs(expected), (packed, expected)


@pytest.mark.parametrize("fam,kind", [("bert", "tokcls"), ("roberta", "mlm")])
def test_token_loss_stock_matches_original_padded_and_packed(fam, kind):
    """token_loss="stock": the original's loss on the padded batch, and on the packed twin of a
    batch padded to its longest row (what PaddleNLP's padding collators build)."""
    ref, model = make_pair(fam, kind, token_loss="stock")
    ids, tt, mask = ragged_batch(fam)  # padded to its longest row (SEQ)
    assert mask.sum(1).max() == ids.shape[1]
    lab = _token_labels(fam, kind, ids, mask, np.random.default_rng(32))
    original = float(call(ref, fam, kind, ids, tt, mask, {"labels": paddle.to_tensor(lab)})[0])
    padded = float(call(model, fam, kind, ids, tt, mask, {"labels": paddle.to_tensor(lab)})[0])
    packed = float(model(**_packed(fam, ids, tt, mask, labels=lab))[0])
    assert abs(padded - original) <= RTOL * abs(original), (padded, original)
    assert abs(packed - original) <= RTOL * abs(original), (packed, original)


def test_token_loss_scaling_message_once_per_model():
    ids, tt, mask = ragged_batch("bert")
    lab = _token_labels("bert", "tokcls", ids, mask, np.random.default_rng(33))
    n, stock = int((lab != -100).sum()), ids.size
    kw = {"labels": paddle.to_tensor(lab)}
    _, model = make_pair("bert", "tokcls")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        call(model, "bert", "tokcls", ids, tt, mask, kw)
        call(model, "bert", "tokcls", ids, tt, mask, kw)
    msgs = [str(x.message) for x in w if "per-token loss" in str(x.message)]
    if not _compat.mean_cross_entropy_divides_by_all_rows():  # Paddle 2.6: the original is the mean too
        assert msgs == [], msgs
        return
    assert len(msgs) == 1, msgs
    assert f"({n} in this batch)" in msgs[0] and f"({stock}," in msgs[0], msgs[0]
    assert f"{stock / n:.3g}x" in msgs[0] and "token_loss='stock'" in msgs[0], msgs[0]
    _, stock_model = make_pair("bert", "tokcls", token_loss="stock")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        call(stock_model, "bert", "tokcls", ids, tt, mask, kw)
    assert not [x for x in w if "per-token loss" in str(x.message)]


def test_token_loss_option_is_checked():
    with pytest.raises(ValueError, match="token_loss must be one of .*'sum'"):
        make_pair("bert", "tokcls", token_loss="sum")


def test_packed_token_outputs_stay_packed():
    from paddle_unpad.data import PackingCollator

    for fam in ("bert", "roberta"):
        ref, model = make_pair(fam, "tokcls")
        ids, tt, mask = ragged_batch(fam)
        batch = PackingCollator(max_seqlen=SEQ)(_samples(ids, tt, mask))
        if fam == "roberta":  # the collator writes BERT-style 0..s-1 position ids; RoBERTa computes its own
            batch.pop("position_ids")
        out = model(**batch)
        expected = call(ref, fam, "tokcls", ids, tt, mask).numpy()[mask.astype(bool)]
        assert list(out.shape) == [sum(LENGTHS), 3]
        assert rel_err(out.numpy(), expected) < RTOL


def test_packed_pretraining_masked_rows():
    """Packed inputs: masked_positions index packed rows; only those rows reach the MLM head."""
    ref, model = make_pair("bert", "pretrain")
    ids, tt, mask = ragged_batch("bert")
    flat = masked_positions_for(mask, np.random.default_rng(2))
    packed_rows = np.searchsorted(valid_flat(mask), flat)
    cu, mx = pu.cu_seqlens_from_lengths(LENGTHS)
    v = mask.astype(bool)
    scores, nsp = model(
        paddle.to_tensor(ids[v]),
        token_type_ids=paddle.to_tensor(tt[v]),
        cu_seqlens=cu,
        max_seqlen=mx,
        masked_positions=paddle.to_tensor(packed_rows),
    )
    e_scores, e_nsp = call(ref, "bert", "pretrain", ids, tt, mask, {"masked_positions": paddle.to_tensor(flat)})
    assert list(scores.shape) == [len(flat), VOCAB]
    assert rel_err(scores.numpy(), e_scores.numpy()) < RTOL and rel_err(nsp.numpy(), e_nsp.numpy()) < RTOL


def test_mlm_head_sees_only_masked_rows():
    ref, model = make_pair("bert", "pretrain")
    ids, tt, mask = ragged_batch("bert")
    flat = masked_positions_for(mask, np.random.default_rng(2))
    seen = []
    hook = model.cls.predictions.transform.register_forward_pre_hook(lambda layer, inp: seen.append(inp[0].shape))
    call(model, "bert", "pretrain", ids, tt, mask, {"masked_positions": paddle.to_tensor(flat)})
    hook.remove()
    assert seen == [[len(flat), HIDDEN]]


class _SyncCounter:
    """Counts reads of tensor values on the host (Tensor.numpy / item / tolist / int / float / bool)."""

    NAMES = ("numpy", "item", "tolist", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self):
        self.count = 0
        self.saved = {}

    def __enter__(self):
        for n in self.NAMES:
            orig = getattr(paddle.Tensor, n, None)
            if orig is None:
                continue
            self.saved[n] = orig

            def wrap(*a, _orig=orig, **k):
                self.count += 1
                return _orig(*a, **k)

            setattr(paddle.Tensor, n, wrap)
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(paddle.Tensor, n, f)


def test_host_reads_per_forward():
    """Packed inputs with host cu_seqlens: no tensor value is read on the host in the forward.
    Padded inputs with an attention mask: exactly one read (the mask)."""
    from paddle_unpad.data import PackingCollator

    ref, model = make_pair("bert", "seqcls")
    ids, tt, mask = ragged_batch("bert")
    batch = PackingCollator(max_seqlen=SEQ)(_samples(ids, tt, mask))
    model(**batch)  # warm-up
    with _SyncCounter() as c:
        model(**batch)
    assert c.count == 0
    x, m = paddle.to_tensor(ids), paddle.to_tensor(mask)
    with _SyncCounter() as c:
        model(x, attention_mask=m)
    assert c.count == 1
    with _SyncCounter() as c:
        model(x)  # mask from pad_token_id
    assert c.count == 1


# ---- conversion mechanics --------------------------------------------------------------------------------


def test_in_place_same_parameters_and_keys():
    cls = T.BertForSequenceClassification
    model = cls(make_config("bert"))
    keys = list(model.state_dict().keys())
    params = [id(p) for p in model.parameters()]
    sub = [id(s) for s in model.sublayers()]
    out = pu.convert(model)
    assert out is model
    assert isinstance(model, cls) and type(model).__name__ == cls.__name__
    assert list(model.state_dict().keys()) == keys
    assert [id(p) for p in model.parameters()] == params
    assert [id(s) for s in model.sublayers()] == sub
    assert pu.models.is_converted(model)
    forward = type(model).forward
    pu.convert(model)  # twice: no-op
    assert type(model).forward is forward and [id(p) for p in model.parameters()] == params


@pytest.mark.parametrize("fam,kind", CASES)
def test_converted_forward_signature_extends_the_original(fam, kind):
    """PaddleNLP's Trainer keeps the batch columns named in inspect.signature(model.forward), and
    callers pass the original arguments positionally: the converted forward lists the original's
    parameters (order, kinds, defaults), then the keyword-only packed inputs and **extra."""
    import inspect

    ref, model = make_pair(fam, kind)
    original = [(p.name, p.kind, p.default) for p in inspect.signature(ref.forward).parameters.values()]
    converted = [(p.name, p.kind, p.default) for p in inspect.signature(model.forward).parameters.values()]
    packed = [(name, inspect.Parameter.KEYWORD_ONLY, None) for name in ("cu_seqlens", "max_seqlen", "cu_seqlens_host")]
    assert converted == original + packed + [("extra", inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty)]
    ids, tt, mask = ragged_batch(fam)
    with pytest.raises(TypeError, match="positional"):  # one more than the original takes
        model(*([paddle.to_tensor(ids)] + [None] * len(original)))


def test_data_parallel_wrapper_is_converted():
    ref, model = make_pair("bert", "seqcls")
    pu.revert(model)
    dp = paddle.DataParallel(model)
    assert pu.convert(dp) is dp and pu.models.is_converted(model)
    pu.revert(dp)
    assert not pu.models.is_converted(model)


def test_revert_restores_the_original():
    ref, model = make_pair("bert", "tokcls")
    ids, tt, mask = ragged_batch("bert")
    pu.revert(model)
    assert type(model) is T.BertForTokenClassification
    assert type(model.bert) is T.BertModel
    assert type(model.bert.encoder) is paddle.nn.TransformerEncoder
    assert all(type(layer) is paddle.nn.TransformerEncoderLayer for layer in model.bert.encoder.layers)
    assert not pu.models.is_converted(model)
    a = call(model, "bert", "tokcls", ids, tt, mask).numpy()
    b = call(ref, "bert", "tokcls", ids, tt, mask).numpy()
    np.testing.assert_array_equal(a, b)  # padding positions too: the original forward again
    pu.revert(model)  # reverting an unconverted model is a no-op


def test_optimizer_built_before_conversion_keeps_training():
    ref, model = make_pair("bert", "seqcls")
    pu.revert(model)
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    pu.convert(model)
    ids, tt, mask = ragged_batch("bert")
    before = model.classifier.weight.numpy().copy()
    loss = call(model, "bert", "seqcls", ids, tt, mask, {"labels": paddle.to_tensor(np.array([0, 1, 2, 0]))})[0]
    loss.backward()
    opt.step()
    assert not np.array_equal(before, model.classifier.weight.numpy())


def test_checkpoint_round_trips(tmp_path):
    ref, model = make_pair("bert", "seqcls")
    ids, tt, mask = ragged_batch("bert")
    expected = call(ref, "bert", "seqcls", ids, tt, mask).numpy()
    # saved after conversion -> loads in an unconverted model
    paddle.save(model.state_dict(), str(tmp_path / "after.pdparams"))
    fresh = T.BertForSequenceClassification(make_config("bert"))
    fresh.set_state_dict(paddle.load(str(tmp_path / "after.pdparams")))
    fresh.eval()
    assert rel_err(call(fresh, "bert", "seqcls", ids, tt, mask).numpy(), expected) < 1e-7
    # saved before conversion -> loads in a converted model
    paddle.save(ref.state_dict(), str(tmp_path / "before.pdparams"))
    other = pu.convert(T.BertForSequenceClassification(make_config("bert")))
    other.set_state_dict(paddle.load(str(tmp_path / "before.pdparams")))
    other.eval()
    assert rel_err(call(other, "bert", "seqcls", ids, tt, mask).numpy(), expected) < RTOL


@pytest.mark.parametrize("fam", ["bert", "roberta"])
def test_save_pretrained_loads_in_unmodified_paddlenlp(tmp_path, fam):
    ref, model = make_pair(fam, "seqcls")
    ids, tt, mask = ragged_batch(fam)
    expected = call(ref, fam, "seqcls", ids, tt, mask).numpy()
    model.save_pretrained(str(tmp_path))
    import json

    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == [FAMILIES[fam][1]["seqcls"].__name__]
    loaded = FAMILIES[fam][1]["seqcls"].from_pretrained(str(tmp_path))
    loaded.eval()
    assert not pu.models.is_converted(loaded)
    assert rel_err(call(loaded, fam, "seqcls", ids, tt, mask).numpy(), expected) < 1e-7


# ---- inference export ------------------------------------------------------------------------------------


def test_to_static_jit_save_load(tmp_path):
    ref, model = make_pair("bert", "seqcls")
    ids, tt, mask = ragged_batch("bert")
    x, m = paddle.to_tensor(ids), paddle.to_tensor(mask)
    eager = model(x, attention_mask=m).numpy()
    assert rel_err(eager, ref(x, attention_mask=m).numpy()) < RTOL
    static = to_static_padded(model)
    assert rel_err(static(x, None, None, m).numpy(), eager) < 1e-6
    path = str(tmp_path / "cls")
    paddle.jit.save(static, path)
    loaded = paddle.jit.load(path)
    assert rel_err(loaded(x, m).numpy(), eager) < 1e-6
    # a different ragged batch through the same exported program
    ids2, tt2, mask2 = ragged_batch("bert", lengths=[3, 1, 11], seq=11, seed=4)
    assert (
        rel_err(
            loaded(paddle.to_tensor(ids2), paddle.to_tensor(mask2)).numpy(),
            ref(paddle.to_tensor(ids2), attention_mask=paddle.to_tensor(mask2)).numpy(),
        )
        < RTOL
    )


def test_to_static_packed_inputs(tmp_path):
    ref, model = make_pair("bert", "tokcls")
    ids, tt, mask = ragged_batch("bert")

    v = mask.astype(bool)
    expected = call(ref, "bert", "tokcls", ids, tt * 0, mask).numpy()[v]
    cu, _ = pu.cu_seqlens_from_lengths(LENGTHS)
    static = to_static_packed(model)
    path = str(tmp_path / "tok")
    paddle.jit.save(static, path)
    out = paddle.jit.load(path)(paddle.to_tensor(ids[v]), cu).numpy()
    assert rel_err(out, expected) < RTOL


# ---- training with dropout --------------------------------------------------------------------------------


def test_training_with_dropout_loss_falls():
    """Dropout on (hidden, attention; fused kernels' Philox masks): a toy task is learnt.
    Label = whether token 5 occurs in the sequence."""
    from paddle_unpad.data import PackingCollator

    paddle.seed(123)
    cfg = make_config("bert", dropout=0.1, num_labels=2)
    model = pu.convert(T.BertForSequenceClassification(cfg))
    model.train()
    opt = paddle.optimizer.AdamW(learning_rate=2e-3, parameters=model.parameters())
    rng = np.random.default_rng(0)
    collate = PackingCollator(max_seqlen=SEQ)
    losses = []
    for step in range(40):
        samples = []
        for _ in range(8):
            n = int(rng.integers(1, SEQ + 1))
            s = rng.integers(6, VOCAB, n)
            y = int(rng.integers(0, 2))
            if y:
                s[rng.integers(0, n)] = 5
            samples.append({"input_ids": s, "labels": np.int64(y)})
        loss = model(**collate(samples))[0]
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert np.mean(losses[-8:]) < 0.6 * np.mean(losses[:8]), losses


# ---- family specifics ---------------------------------------------------------------------------------


def test_ernie_task_type_ids_and_inputs_embeds():
    ref, model = make_pair("ernie", "model", use_task_id=True, task_type_vocab_size=3, task_id=1)
    ids, tt, mask = ragged_batch("ernie")
    task = (np.arange(ids.size).reshape(ids.shape) % 3).astype(np.int64)
    v = mask.astype(bool)
    kw = dict(
        token_type_ids=paddle.to_tensor(tt), attention_mask=paddle.to_tensor(mask), task_type_ids=paddle.to_tensor(task)
    )
    a = model(paddle.to_tensor(ids), **kw)[0].numpy()
    b = ref(paddle.to_tensor(ids), **kw)[0].numpy()
    assert rel_err(a[v], b[v]) < RTOL
    emb = ref.embeddings.word_embeddings(paddle.to_tensor(ids))
    a = model(inputs_embeds=emb, **kw)[0].numpy()
    b = ref(inputs_embeds=emb, **kw)[0].numpy()
    assert rel_err(a[v], b[v]) < RTOL


def test_roberta_positions_from_inputs_embeds_and_packed():
    ref, model = make_pair("roberta", "model")
    ids, tt, mask = ragged_batch("roberta")
    v = mask.astype(bool)
    m = paddle.to_tensor(mask)
    emb = ref.embeddings.word_embeddings(paddle.to_tensor(ids))
    a = model(inputs_embeds=emb, attention_mask=m)[0].numpy()
    b = ref(inputs_embeds=emb, attention_mask=m)[0].numpy()
    assert rel_err(a[v], b[v]) < RTOL
    cu, mx = pu.cu_seqlens_from_lengths(LENGTHS)
    seq, pooled = model(paddle.to_tensor(ids[v]), cu_seqlens=cu, max_seqlen=mx)
    e_seq, e_pooled = ref(paddle.to_tensor(ids), attention_mask=m)
    assert rel_err(seq.numpy(), e_seq.numpy()[v]) < RTOL and rel_err(pooled.numpy(), e_pooled.numpy()) < RTOL

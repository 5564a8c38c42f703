"""Real-text readers and the BERT pre-training sample builder (paddle_unpad.data.corpora)."""

import os

import numpy as np
import pytest

from paddle_unpad.data import corpora


@pytest.fixture(scope="module")
def tokenizer():
    from paddlenlp.transformers import BertTokenizer

    return BertTokenizer(os.path.join(corpora.minilm_dir(), "vocab.txt"))


def test_rotten_tomatoes_split_is_fixed_disjoint_and_complete():
    train, dev, every = (corpora.rotten_tomatoes(s) for s in ("train", "dev", "all"))
    t, d = {x["text"] for x in train}, {x["text"] for x in dev}
    assert not t & d
    assert t | d == {x["text"] for x in every}
    assert 0.07 < len(dev) / len(every) < 0.13
    # the corpus holds 7,403 fresh and 5,405 rotten snippets (some are exact duplicates)
    fresh = sum(x["label"] for x in every)
    assert 0.97 * 7403 <= fresh <= 7403
    assert 0.97 * 5405 <= len(every) - fresh <= 5405
    assert corpora.rotten_tomatoes("dev") == dev  # same split on every call


def test_rotten_tomatoes_refuses_bad_split():
    with pytest.raises(ValueError, match="split"):
        corpora.rotten_tomatoes("test")
    with pytest.raises(ValueError, match="dev_fraction"):
        corpora.rotten_tomatoes("dev", dev_fraction=1.5)


def test_split_sentences():
    assert corpora.split_sentences("Thank you.  It is great! Is it? 'Yes' he said.\nOK") == [
        "Thank you.",
        "It is great!",
        "Is it?",
        "'Yes' he said.",
        "OK",
    ]


def test_pretraining_samples_follow_bert_recipe(tokenizer):
    docs = corpora.political_speeches()[:40]
    samples = corpora.pretraining_samples(tokenizer, docs, max_seq_len=128, seed=3)
    assert len(samples) > 50
    cls, sep, mask = tokenizer.convert_tokens_to_ids(["[CLS]", "[SEP]", "[MASK]"])
    lengths, masked, nsp = [], 0, []
    for s in samples:
        ids, types = s["input_ids"], s["token_type_ids"]
        lengths.append(len(ids))
        assert len(ids) == len(types) <= 128
        assert ids[0] == cls and ids[-1] == sep and ids.count(sep) == 2
        first_sep = ids.index(sep)
        assert types == [0] * (first_sep + 1) + [1] * (len(ids) - first_sep - 1)
        pos = s["masked_positions"]
        assert pos == sorted(set(pos)) and len(pos) == len(s["masked_labels"]) >= 1
        assert all(ids[p] not in (cls, sep) or ids[p] == mask for p in pos)
        assert all(lbl not in (cls, sep) for lbl in s["masked_labels"])
        masked += len(pos)
        nsp.append(s["next_sentence_label"])
    lengths = np.array(lengths)
    assert 0.12 < masked / lengths.sum() < 0.17
    assert 0.35 < np.mean(nsp) < 0.65
    assert (lengths >= 120).mean() > 0.5  # most samples fill the target length
    again = corpora.pretraining_samples(tokenizer, docs, max_seq_len=128, seed=3)
    assert again == samples


def test_pretraining_samples_errors(tokenizer):
    with pytest.raises(ValueError, match="max_seq_len"):
        corpora.pretraining_samples(tokenizer, ["a. b."], max_seq_len=4)
    with pytest.raises(ValueError, match="at least 2"):
        corpora.pretraining_samples(tokenizer, ["One sentence only."], max_seq_len=64)

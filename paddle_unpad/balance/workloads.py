"""Realistic sample-length distributions for tests and benchmarks (no data download).

:func:`bert_pretraining_lengths` replays the sample-building loop of BERT's
``create_pretraining_data.py`` (the MLPerf BERT data pipeline) on synthetic documents:

* a document is a run of sentences; sentence lengths (WordPiece tokens) are
  log-normal with median ~24 tokens, document sizes log-normal with median ~18 sentences
  (Wikipedia-like: many stubs, a long tail of long articles);
* with probability 0.9 a sample's target is the full ``max_len - 3`` tokens, with
  probability ``short_seq_prob = 0.1`` a uniform random length in ``[2, max_len - 3]``;
* sentences are accumulated until the target is reached (the sample is then truncated
  to ``max_len - 3``) or the document ends (a shorter sample); ``[CLS]``/``[SEP]``/``[SEP]``
  add 3 tokens;
* samples are shuffled.

The result has a large spike at ``max_len`` (~55% of the samples) and a broad tail of
shorter samples from document ends and short targets (mean ~390 tokens at max 512) --
the shape of the MLPerf Wikipedia set (arXiv 2208.08124 / NVIDIA's packing paper report a
mean near 400 tokens of 512 for it).
"""

from __future__ import annotations

import numpy as np

__all__ = ["bert_pretraining_lengths", "global_batches"]


def bert_pretraining_lengths(n: int, max_len: int = 512, seed: int = 0, short_seq_prob: float = 0.1) -> np.ndarray:
    """``n`` sample lengths (int64, each in ``[4, max_len]``), see the module docstring."""
    if max_len < 8:
        raise ValueError(f"paddle_unpad.balance.bert_pretraining_lengths: max_len must be >= 8, got {max_len!r}")
    rng = np.random.default_rng(seed)
    max_tokens = max_len - 3
    out = []
    while len(out) < n:
        n_sent = max(1, int(rng.lognormal(np.log(18.0), 1.0)))
        sents = np.maximum(1, rng.lognormal(np.log(24.0), 0.6, size=n_sent).astype(np.int64))
        i = 0
        while i < n_sent:
            if rng.random() < short_seq_prob:
                target = int(rng.integers(2, max_tokens + 1))
            else:
                target = max_tokens
            acc = 0
            while i < n_sent:
                acc += int(sents[i])
                i += 1
                if acc >= target:
                    break
            if acc >= 1:
                out.append(min(acc, max_tokens) + 3)
    arr = np.array(out[:n], dtype=np.int64)
    rng.shuffle(arr)
    return arr


def global_batches(num_batches: int, ranks: int, per_rank: int, max_len: int = 512, seed: int = 0):
    """``num_batches`` global batches, each a list over ranks of per-rank length lists."""
    total = num_batches * ranks * per_rank
    pool = bert_pretraining_lengths(total, max_len=max_len, seed=seed)
    pool = pool.reshape(num_batches, ranks, per_rank)
    return [[row.tolist() for row in b] for b in pool]

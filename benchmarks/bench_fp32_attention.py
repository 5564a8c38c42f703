"""What float32 attention costs where no kernel takes it (float32 on a GPU): the plain-Paddle
bucketed attention (``paddle_unpad.ops.bucketed_attention``) against the stock model's attention
padded to the batch maximum, and against the packed kernel, side by side in one process.

Two parts:

* **Work**, counted on real length distributions (many batches): attention FLOPs of the real
  tokens (``sum s_i^2``), of the length buckets (``sum n_b L_b^2``) and of the batch maximum
  (``B S_max^2``), and attention's share of a BERT-base / BERT-large layer's FLOPs (GEMMs
  ``24 T h^2``, attention ``4 s^2 h`` per sequence) on each path. This is what a GPU run would
  do too: the same Paddle ops on the same shapes.
* **Time** on this CPU, float32 forward + backward (MiniLM's 12 heads of 32), one batch of
  each distribution: the packed CPU kernel, the bucketed path, and the stock path
  (PaddleNLP's ``nn.MultiHeadAttention`` math on the padded batch). Interleaved rounds,
  medians; the same threads for every side.

Distributions: the demo's review snippets (Rotten Tomatoes, MiniLM's WordPiece tokens, batch
32) and BERT pre-training samples cut from the convention speeches (batch 16, max 512), as
``bench_attention.py`` builds them.

Usage::

    OMP_NUM_THREADS=2 python benchmarks/bench_fp32_attention.py   # ~1 minute
"""

import math
import os
import statistics
import sys

import bench_args
import bench_util

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    options = [
        ("--threads", int, 2, "CPU threads, the same for every side"),
        ("--batches", int, 200, "batches per distribution for the work counts"),
        ("--repeats", int, 5, "timed rounds"),
        ("--quick", bool, False, "small sizes (a smoke run)"),
        ("--out", str, None, "JSON path (default benchmarks/results/fp32_attention_<kind>.json)"),
    ]
    ap = bench_args.add_options(bench_args.parser(__doc__, first_line=True, show_defaults=True), options)
    return ap.parse_args(argv)


def review_lengths():
    from paddlenlp.transformers import BertTokenizer

    from paddle_unpad.data import corpora

    tok = BertTokenizer(os.path.join(corpora.minilm_dir(), "vocab.txt"))
    return [len(tok(r["text"], max_length=128, truncation=True)["input_ids"]) for r in corpora.rotten_tomatoes()]


def pretraining_lengths(rng, max_len=512):
    from bench_attention import political_data_path, pretraining_lengths_from_text

    return pretraining_lengths_from_text(political_data_path(), max_len, rng)


def work(pool, batch, batches, rng):
    """Mean attention work per batch (in units of s^2) on each path, and tokens per batch."""
    import numpy as np

    from paddle_unpad.ops.bucketed_attention import bucket_plan

    useful = bucketed = padded = tokens = 0.0
    for _ in range(batches):
        lengths = np.asarray(rng.choice(pool, size=batch), np.int64)
        cu = np.concatenate([[0], np.cumsum(lengths)])
        useful += float((lengths.astype(np.float64) ** 2).sum())
        bucketed += float(sum(len(seqs) * L * L for seqs, L in bucket_plan(cu)))
        padded += float(batch * lengths.max() ** 2)
        tokens += float(lengths.sum())
    n = float(batches)
    return {"useful_s2": useful / n, "bucketed_s2": bucketed / n, "batch_max_s2": padded / n, "tokens": tokens / n}


def attention_share(w, hidden):
    """Attention's share of one encoder layer's FLOPs on each path (the GEMMs do not change)."""
    gemm = 24.0 * w["tokens"] * hidden * hidden
    return {
        path: 4.0 * w[key] * hidden / (gemm + 4.0 * w[key] * hidden)
        for path, key in (("packed", "useful_s2"), ("bucketed", "bucketed_s2"), ("stock", "batch_max_s2"))
    }


def timing(lengths, heads, head_dim, repeats, seed):
    """Median ms of forward + backward per path on one batch."""
    import numpy as np
    import paddle
    import paddle.nn.functional as F

    import paddle_unpad
    from paddle_unpad.ops.bucketed_attention import bucketed_attention

    rng = np.random.default_rng(seed)
    B, S, T = len(lengths), max(lengths), int(sum(lengths))
    c = bench_util.attention_cases(lengths, heads, head_dim, rng)
    cu, max_seqlen, keep, mask = c["cu"], c["max_seqlen"], c["keep"], c["mask"]
    packed, dout, padded, dout_padded = c["packed"], c["dout_packed"], c["padded"], c["dout_padded"]
    scale = 1.0 / math.sqrt(head_dim)

    def stock():
        q, k, v = (paddle.transpose(t, [0, 2, 1, 3]) for t in padded)
        w = F.softmax(paddle.matmul(q * scale, k, transpose_y=True) + mask)
        return paddle.transpose(paddle.matmul(w, v), [0, 2, 1, 3])

    fns = {
        "packed_kernel": (lambda: paddle_unpad.fmha(*packed, cu, max_seqlen), packed, dout),
        "bucketed": (lambda: bucketed_attention(*packed, cu, max_seqlen, 0.0, scale), packed, dout),
        "stock_batch_max": (stock, padded, dout_padded),
    }
    ref = fns["packed_kernel"][0]().numpy()
    agree = {
        "bucketed": float(np.abs(fns["bucketed"][0]().numpy() - ref).max()),
        "stock_batch_max": float(np.abs(stock().numpy()[keep] - ref).max()),
    }

    def step(fn, ins, d):
        def run():
            [g.numpy() for g in paddle.grad([fn()], ins, grad_outputs=[d])]

        return run

    times = bench_util.interleaved_times({n: step(*v) for n, v in fns.items()}, 1, repeats)
    ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    useful = 3.5 * 4.0 * float(np.sum(np.asarray(lengths, np.float64) ** 2)) * heads * head_dim
    return {
        "batch": B,
        "max_seqlen": S,
        "tokens": T,
        "ms": ms,
        "useful_gflops": {n: useful / t / 1e6 for n, t in ms.items()},
        "bucketed_vs_stock": ms["stock_batch_max"] / ms["bucketed"],
        "max_abs_diff_vs_kernel": agree,
    }


def main(argv=None):
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import numpy as np
    import paddle

    from paddle_unpad._runtime.paddle_compat import set_num_threads

    set_num_threads(args.threads)
    paddle.set_device("cpu")
    rng = np.random.default_rng(0)
    dists = {
        "reviews (demo, batch 32)": (review_lengths(), 32),
        "pre-training (max 512, batch 16)": (pretraining_lengths(rng), 16),
    }
    result = {"date": bench_util.utc_now(), "threads": args.threads, "distributions": {}}
    batches = 20 if args.quick else args.batches
    for name, (pool, batch) in dists.items():
        w = work(pool, batch, batches, rng)
        entry = {
            "work": w,
            "bucketed_over_useful": w["bucketed_s2"] / w["useful_s2"],
            "batch_max_over_useful": w["batch_max_s2"] / w["useful_s2"],
            "share_of_layer_flops": {
                "bert-base (h=768)": attention_share(w, 768),
                "bert-large (h=1024)": attention_share(w, 1024),
            },
        }
        lengths = [int(x) for x in rng.choice(pool, size=4 if args.quick else batch)]
        entry["cpu_fp32_fwd_bwd"] = timing(lengths, 12, 32, 2 if args.quick else args.repeats, seed=1)
        result["distributions"][name] = entry
        t = entry["cpu_fp32_fwd_bwd"]
        print(
            f"{name}: attention work per batch, relative to the real tokens: bucketed "
            f"{entry['bucketed_over_useful']:.2f}x, batch max (stock) {entry['batch_max_over_useful']:.2f}x"
        )
        for model, share in entry["share_of_layer_flops"].items():
            paths = ", ".join(f"{path} {share[path]:.1%}" for path in ("packed", "bucketed", "stock"))
            print(f"  attention share of a {model} layer: {paths}")
        print(
            f"  CPU fp32 fwd+bwd ms (B={t['batch']}, S_max={t['max_seqlen']}): "
            + ", ".join(f"{n} {v:.1f}" for n, v in t["ms"].items())
            + f"; stock / bucketed = {t['bucketed_vs_stock']:.2f}x",
            flush=True,
        )
    path = args.out or bench_util.kind_result_path("fp32_attention")
    bench_util.write_result(path, result)
    print("wrote", path)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()

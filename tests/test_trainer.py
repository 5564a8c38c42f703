"""PaddleNLP Trainer integration: paddle_unpad.trainer.UnpadTrainer (examples/trainer_classifier.py)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "trainer_classifier.py")
ARGS = ["--max-train", "96", "--max-dev", "40", "--batch-size", "16"]


def _run(cmd, tmp_path, log_dir=None):
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        logs = ""
        if log_dir is not None:
            for r in (0, 1):
                f = os.path.join(log_dir, f"workerlog.{r}")
                if os.path.exists(f):
                    logs += f"\n--- workerlog.{r}\n" + "".join(open(f, errors="replace").readlines()[-40:])
        pytest.fail(f"failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}{logs}")


def test_unpad_trainer_matches_stock_trainer_without_dropout(tmp_path):
    out = {}
    for mode in ("unpad", "stock"):
        js = tmp_path / f"{mode}.json"
        cmd = [sys.executable, SCRIPT, *ARGS, "--max-steps", "3", "--dropout", "0", "--output-dir",
               str(tmp_path / mode), "--json-out", str(js)] + (["--no-unpad"] if mode == "stock" else [])
        _run(cmd, tmp_path)
        out[mode] = json.load(open(js))
    u, s = out["unpad"], out["stock"]
    assert u["steps"] == s["steps"] == 3
    assert u["train_loss"] == pytest.approx(s["train_loss"], rel=1e-4), (u, s)
    assert u["eval_loss"] == pytest.approx(s["eval_loss"], rel=1e-4), (u, s)
    assert u["eval_accuracy"] == s["eval_accuracy"]


def test_unpad_trainer_two_ranks(tmp_path):
    js = tmp_path / "ddp.json"
    log_dir = str(tmp_path / "log")
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", log_dir,
           SCRIPT, *ARGS, "--max-steps", "3", "--output-dir", str(tmp_path / "out"), "--json-out", str(js)]
    _run(cmd, tmp_path, log_dir)
    s = json.load(open(js))
    assert s["unpad"] is True and s["world_size"] == 2 and s["steps"] == 3
    assert 0.0 < s["train_loss"] < 5.0 and 0.0 <= s["eval_accuracy"] <= 1.0


def test_pad_collator_pads_to_batch_max_or_pad_to():
    import numpy as np

    from paddle_unpad.trainer import PadCollator

    samples = [{"input_ids": np.array([5, 6, 7]), "token_type_ids": np.array([0, 0, 1]), "labels": np.int64(1)},
               {"input_ids": np.array([8]), "token_type_ids": np.array([0]), "labels": np.int64(0)}]
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

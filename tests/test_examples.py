"""Smoke runs of the example scripts: a few steps each, under fleetrun with 2 CPU ranks."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = os.path.join(ROOT, "examples")


def launch(script, args, tmp_path, nproc=2, timeout=600):
    log_dir = tmp_path / f"log_{os.path.basename(script)}"
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
           "--log_dir", str(log_dir), os.path.join(EX, script), *args]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        logs = "".join(
            f"\n--- workerlog.{r}\n" + "".join(open(log_dir / f"workerlog.{r}", errors="replace").readlines()[-40:])
            for r in range(nproc) if (log_dir / f"workerlog.{r}").exists()
        )
        pytest.fail(f"{script} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}{logs}")
    return proc


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["unpadded", "padded"])
def test_finetune_classifier_two_ranks(mode, tmp_path):
    out = tmp_path / "summary.json"
    ckpt = tmp_path / "ckpt"
    args = ["--max-train", "96", "--max-dev", "50", "--batch-size", "16", "--no-progress",
            "--json-out", str(out), "--output-dir", str(ckpt)]
    if mode == "padded":
        args.append("--no-unpad")
    launch("finetune_classifier.py", args, tmp_path)
    s = json.load(open(out))
    assert s["ranks"] == 2 and s["train_samples"] == 96 and s["dev_samples"] == 50
    assert s["steps"] == 3 and 0.0 <= s["dev_accuracy"] <= 1.0 and s["tokens_per_s"] > 0
    assert s["path"] == ("unpadded+balanced" if mode == "unpadded" else "padded (stock)")
    # the checkpoint loads in unmodified PaddleNLP (fresh process: no paddle_unpad import)
    code = (
        "import paddle\n"
        "from paddlenlp.transformers import BertForSequenceClassification\n"
        f"m = BertForSequenceClassification.from_pretrained({str(ckpt)!r}); m.eval()\n"
        "x = paddle.to_tensor([[101, 2023, 3185, 2001, 2307, 102]])\n"
        "print(m(x).shape)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0 and "[1, 2]" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.dist
def test_pretrain_mlm_two_ranks_loss_falls(tmp_path):
    out = tmp_path / "pt.json"
    launch("pretrain_mlm.py", ["--steps", "12", "--max-docs", "24", "--max-seq-len", "128",
                               "--batch-size", "8", "--json-out", str(out)], tmp_path)
    s = json.load(open(out))
    assert s["steps"] == 12 and s["ranks"] == 2
    assert np.isfinite(s["first_loss"]) and s["last_loss"] < s["first_loss"] - 0.1, s


@pytest.mark.slow
def test_make_demo_job_runs_on_a_tiny_slice(tmp_path):
    """A time budget smaller than one step: the stock job stops after its first step (of 4), and
    the paddle_unpad job trains exactly that step, on the same samples."""
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, os.path.join(EX, "run_demo.py"), "--max-train", "128", "--batch-size",
                           "16", "--time-budget", "0.001", "--max-dev", "32", "--json-out", str(out)],
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stock (padded)" in proc.stdout and "paddle_unpad" in proc.stdout
    assert "stopped at 1 of 4 steps by the 0.001 s budget" in proc.stdout, proc.stdout[-2000:]
    assert "host: " in proc.stdout
    d = json.load(open(out))
    pad, unp = d["padded"], d["unpadded"]
    assert pad["stopped_by_time_budget"] is True and pad["steps"] == unp["steps"] == 1
    assert pad["train_samples"] == unp["train_samples"] == 32
    assert pad["train_tokens"] == unp["train_tokens"]  # the same samples both ways


@pytest.mark.slow
def test_demo_fmha_runs_respects_threads_and_explains_its_speedup():
    proc = subprocess.run([sys.executable, os.path.join(EX, "demo_fmha.py")], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "-> OK" in out and "threads=1" in out, out  # the user's OMP_NUM_THREADS, not the demo's own
    rows = [line.split() for line in out.splitlines()
            if line.startswith(("forward ", "forward+backward ")) and line.endswith("x")]
    assert len(rows) == 2, out
    speedups = [float(r[-2].rstrip("x")) for r in rows]
    ideal = float(rows[0][-1].rstrip("x"))
    assert "(kernel, at equal work)" in out, out
    assert ("exceeds the ideal ratio because" in out) == (max(speedups) > ideal), out


def _example_util():
    sys.path.insert(0, EX)
    try:
        import example_util
    finally:
        sys.path.remove(EX)
    return example_util


def test_example_util_history_progress_and_plot(tmp_path, capsys):
    eu = _example_util()
    h = eu.StepHistory()
    for i in range(4):
        h.add(step=i, loss=5.0 - i, tokens_per_s=100.0 + i, lr=1e-3 * i, mlm_acc=0.1 * i)
    h.save(tmp_path / "h.json")
    back = eu.StepHistory.load(tmp_path / "h.json")
    assert back.rows == h.rows and back.rows[2] == {"step": 2, "loss": 3.0, "tokens_per_s": 102.0, "lr": 0.002,
                                                    "mlm_acc": 0.2}

    now = [100.0]
    p = eu.Progress(10, every_s=30, clock=lambda: now[0])
    now[0] = 162.0  # 2 steps in 62 s: 31 s a step, 8 steps left
    assert p.update(2, "loss 3.1") == "step 2/10 loss 3.1 elapsed 1m02s, about 4m08s left"
    now[0] = 170.0  # within every_s of the last line: nothing
    assert p.update(3) is None
    now[0] = 400.0
    assert p.update(10).startswith("step 10/10 elapsed 5m00s")  # the last step always prints
    assert capsys.readouterr().out.count("step ") == 2
    assert eu.Progress(5, enabled=False).update(5) is None
    with pytest.raises(ValueError, match="total_steps"):
        eu.Progress(0)

    png = tmp_path / "loss.png"
    eu.plot_loss_curves(str(png), {"a": h, "b": [{"step": 0, "loss": 4.0}, {"step": 3, "loss": 1.0}]}, "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000

    parser = eu.add_run_args(eu.make_parser("x"))
    assert "default" in parser.format_help()
    assert parser.parse_args(["--output-dir", "d"]).output_dir == "d"

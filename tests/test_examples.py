"""Smoke runs of the example scripts: a few steps each, under fleetrun with 2 CPU ranks."""

import json
import os
import subprocess

import numpy as np
import pytest
from launch_util import launch_cmd
from model_util import small_config
from testutil import example_module, run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = os.path.join(ROOT, "examples")


def launch(script, args, tmp_path, nproc=2, timeout=600):
    log_dir = tmp_path / f"log_{os.path.basename(script)}"
    cmd = launch_cmd([os.path.join(EX, script), *args], nproc, log_dir)
    proc = subprocess.run(
        cmd,
        cwd=str(tmp_path),
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        logs = "".join(
            f"\n--- workerlog.{r}\n" + "".join(open(log_dir / f"workerlog.{r}", errors="replace").readlines()[-40:])
            for r in range(nproc)
            if (log_dir / f"workerlog.{r}").exists()
        )
        pytest.fail(f"{script} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}{logs}")
    return proc


def assert_loads_in_stock_paddlenlp(folder):
    """``folder`` loads with unmodified PaddleNLP ``from_pretrained`` (a fresh process: no paddle_unpad
    import) and classifies."""
    code = (
        "import zlib  # before paddle: paddlepaddle-gpu 2.6 and zlib, see docs/gpu.md\n"
        "import paddle\n"
        "from paddlenlp.transformers import BertForSequenceClassification\n"
        f"m = BertForSequenceClassification.from_pretrained({str(folder)!r}); m.eval()\n"
        "x = paddle.to_tensor([[101, 2023, 3185, 2001, 2307, 102]])\n"
        "print(m(x).shape)\n"
    )
    proc = run_python("-c", code)
    assert proc.returncode == 0 and "[1, 2]" in proc.stdout, proc.stderr[-2000:]


def assert_history(folder, steps):
    """``history.json`` holds one row per step (loss, tokens/s, learning rate) and ``loss.png`` a plot."""
    rows = json.load(open(os.path.join(folder, "history.json")))["rows"]
    assert [r["step"] for r in rows] == steps, rows
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 and r["tokens_per_s"] > 0 and r["lr"] >= 0 for r in rows), rows
    png = open(os.path.join(folder, "loss.png"), "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    return rows


@pytest.mark.dist
def test_finetune_classifier_two_ranks_and_resume_on_the_stock_path(tmp_path):
    """The unpadded job (3 steps, a checkpoint at step 2), then the stock padded job resumed from that
    checkpoint: it trains step 3 only, on the same samples, to the same loss."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "summary.json"
    common = ["--max-train", "96", "--max-dev", "50", "--batch-size", "16", "--dropout", "0", "--no-progress"]
    launch(
        "finetune_classifier.py",
        common + ["--json-out", str(out), "--output-dir", str(ckpt), "--save-steps", "2"],
        tmp_path,
    )
    s = json.load(open(out))
    assert s["ranks"] == 2 and s["train_samples"] == 96 and s["dev_samples"] == 50
    assert s["steps"] == 3 and 0.0 <= s["dev_accuracy"] <= 1.0 and s["tokens_per_s"] > 0
    assert s["path"] == "unpadded+balanced"
    rows = assert_history(ckpt, [1, 2, 3])
    assert json.load(open(ckpt / "train_state.json"))["step"] == 3
    assert json.load(open(ckpt / "checkpoint-2" / "train_state.json"))["step"] == 2
    assert_loads_in_stock_paddlenlp(ckpt)

    stock, out2 = tmp_path / "stock", tmp_path / "stock.json"
    launch(
        "finetune_classifier.py",
        common
        + ["--json-out", str(out2), "--output-dir", str(stock), "--no-unpad", "--resume", str(ckpt / "checkpoint-2")],
        tmp_path,
    )
    s2 = json.load(open(out2))
    assert s2["path"] == "padded (stock)" and s2["steps"] == 3 and s2["train_samples"] == 32, s2
    assert s2["dev_samples"] == 50 and 0.0 <= s2["dev_accuracy"] <= 1.0
    resumed = assert_history(stock, [1, 2, 3])
    assert resumed[:2] == rows[:2]
    assert resumed[2]["lr"] == rows[2]["lr"]
    assert resumed[2]["loss"] == pytest.approx(rows[2]["loss"], rel=1e-4), (rows, resumed)


@pytest.mark.parametrize("script", ["finetune_classifier.py", "trainer_classifier.py"])
def test_help_shows_every_default(script):
    proc = run_python(os.path.join(EX, script), "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    blocks = {}  # option line (every spelling) -> its help text
    for line in proc.stdout.splitlines():
        if line.startswith("  --"):
            key = line
            blocks[key] = line
        elif blocks and line.startswith("    "):
            blocks[key] += " " + line.strip()
    spellings = {w.rstrip(",") for k in blocks for w in k.split() if w.startswith("--")}
    assert {
        "--output-dir",
        "--resume",
        "--verbose",
        "--no-progress",
        "--model-name-or-path",
        "--train-file",
        "--eval-file",
        "--text-column",
        "--label-column",
    } <= spellings, proc.stdout
    assert all("(default:" in text for text in blocks.values()), [k for k, t in blocks.items() if "(default:" not in t]


@pytest.mark.dist
def test_pretrain_mlm_two_ranks_loss_falls_and_resumes_bit_exactly(tmp_path):
    tiny = (
        "--steps 12 --max-docs 24 --max-seq-len 128 --batch-size 8 --eval-samples 16 --eval-every 6 --save-every 5"
    ).split()
    out, d = tmp_path / "pt.json", tmp_path / "run"
    proc = launch("pretrain_mlm.py", tiny + ["--json-out", str(out), "--output-dir", str(d)], tmp_path)
    s = json.load(open(out))
    assert s["steps"] == 12 and s["ranks"] == 2 and s["path"] == "unpadded+balanced"
    assert np.isfinite(s["first_loss"]) and s["last_loss"] < s["first_loss"] - 0.1, s
    assert [e["step"] for e in s["evals"]] == [6, 12] and 0.0 <= s["mlm_accuracy"] <= 1.0
    assert s["evals"][-1]["mlm_loss"] < s["evals"][0]["mlm_loss"] and s["evals"][0]["masked_tokens"] > 0
    rows = json.load(open(d / "history.json"))["rows"]
    assert [r["step"] for r in rows] == list(range(1, 13)) and [r["loss"] for r in rows] == s["losses"]
    assert all(r["tokens_per_s"] > 0 for r in rows) and rows[0]["lr"] < rows[4]["lr"] > rows[-1]["lr"] > 0
    assert (d / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in d.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-12", "checkpoint-5"]
    log0 = open(tmp_path / "log_pretrain_mlm.py" / "workerlog.0").read()
    assert "step 1/12" in log0 and "left" in log0 and "step 12/12" in log0
    assert "tcp_store.cc" not in log0 and "[    INFO]" not in log0, log0[:2000]  # start-up logs kept out
    assert proc.returncode == 0

    # the last two steps again, from the checkpoint of step 10: bit for bit the same losses
    (tmp_path / "resume").mkdir()
    out2 = tmp_path / "resumed.json"
    resume = ["--resume", str(d / "checkpoint-10"), "--no-progress"]
    launch(
        "pretrain_mlm.py",
        tiny + ["--json-out", str(out2), "--output-dir", str(tmp_path / "run2"), *resume],
        tmp_path / "resume",
    )
    r = json.load(open(out2))
    assert r["first_step"] == 11 and r["losses"] == s["losses"][10:], (r["losses"], s["losses"])
    assert r["evals"] == s["evals"]


def test_pretrain_mlm_help_shows_defaults_and_fused_lamb_is_refused(capsys):
    pm = example_module("pretrain_mlm")
    with pytest.raises(SystemExit) as e:
        pm.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "(default: 30)" in text and "--eval-samples" in text and "--fused-lamb" not in text
    with pytest.raises(SystemExit) as e:
        pm.parse_args(["--fused-lamb"])
    assert e.value.code == 2 and "--fused-lamb" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pm.parse_args(["--stock", "--compare"])
    assert "not allowed with" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pm.parse_args(["--save-every", "-1"])
    assert "--save-every must be >= 0, got -1" in capsys.readouterr().err


def test_pretrain_mlm_no_weight_decay_selects_biases_and_layer_norms():
    import paddle_unpad as pu
    from paddlenlp.transformers import BertConfig, BertForPretraining

    pm = example_module("pretrain_mlm")
    model = BertForPretraining(
        small_config(BertConfig, vocab=64, hidden=16, layers=2, heads=2, max_position_embeddings=32)
    )
    pu.convert(model)
    excluded = pm.no_weight_decay(model)
    got = {n for n, p in model.named_parameters() if excluded(p)}
    # in BERT the 1-D parameters are exactly the biases and the LayerNorm scales and shifts
    assert got == {n for n, p in model.named_parameters() if len(p.shape) == 1}
    assert {
        "cls.predictions.decoder_bias",
        "bert.encoder.layers.1.norm2.weight",
        "bert.embeddings.layer_norm.bias",
        "cls.predictions.layer_norm.weight",
    } <= got
    # per layer 6 biases and 2 LayerNorms; embeddings' LayerNorm; pooler bias; MLM transform bias,
    # LayerNorm and decoder bias, NSP bias
    assert "bert.encoder.layers.0.linear1.weight" not in got and len(got) == 2 * (6 + 2 * 2) + 2 + 1 + 5


@pytest.mark.slow
def test_pretrain_mlm_compare_stock_and_unpadded(tmp_path):
    """One process: stock PaddleNLP then the unpadded model, same samples and initial weights."""
    out = tmp_path / "cmp.json"
    args = "--compare --steps 3 --max-docs 12 --max-seq-len 128 --batch-size 4 --eval-samples 8 --dropout 0 --hidden 32"
    proc = run_python(
        os.path.join(EX, "pretrain_mlm.py"),
        *args.split(),
        "--output-dir",
        tmp_path / "o",
        "--json-out",
        out,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.load(open(out))
    st, up = d["stock"], d["unpadded"]
    assert st["path"] == "padded (stock)" and up["path"] == "unpadded" and st["steps"] == up["steps"] == 3
    np.testing.assert_allclose(up["losses"], st["losses"], rtol=1e-4)  # no dropout: the same math
    assert abs(up["mlm_accuracy"] - st["mlm_accuracy"]) <= 1 / 16 and st["train_tokens"] == up["train_tokens"]
    for label in ("tokens/s", "step time (ms)", "MLM accuracy", "stock (padded)", "paddle_unpad", "per-step loss"):
        assert label in proc.stdout, proc.stdout[-2000:]
    assert (tmp_path / "o" / "loss.png").stat().st_size > 2000 and (tmp_path / "o" / "stock" / "history.json").exists()
    # the trained unpadded model loads with PaddleNLP's from_pretrained (no conversion in this process)
    # and carries the trained weights
    import paddle
    from paddlenlp.transformers import BertForPretraining

    m = BertForPretraining.from_pretrained(str(tmp_path / "o" / "model"))
    ckpt = paddle.load(str(tmp_path / "o" / "checkpoint-3" / "model.pdparams"))
    assert set(m.state_dict()) == set(ckpt)
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), ckpt[k].numpy(), err_msg=k)


@pytest.mark.slow
def test_make_demo_job_runs_on_a_tiny_slice(tmp_path):
    """A time budget smaller than one step: the probe before the jobs makes it one step for both
    (of the slice's 4), on the same samples. The terminal gets a few lines, the table last; the
    launcher's and workers' output goes to the log folder, none to the working directory."""
    out, logs = tmp_path / "demo.json", tmp_path / "logs"
    args = "--max-train 128 --batch-size 16 --time-budget 0.001 --max-dev 32".split()
    proc = run_python(
        os.path.join(EX, "run_demo.py"), *args, "--json-out", out, "--log-dir", logs, cwd=tmp_path, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) <= 40 and not proc.stderr, lines
    assert lines[-6].split() == ["stock", "(padded)", "paddle_unpad", "ratio"], lines  # the table is last
    assert [line.split()[0] for line in lines[-5:]] == ["samples/s", "tokens/s", "dev", "peak", "train"], lines
    d = json.load(open(out))
    pad, unp, plan = d["padded"], d["unpadded"], d["plan"]
    assert plan["steps"] == 1 and plan["slice"] == 32 and plan["probe_step_seconds"] > 0, plan
    assert (
        f"1 step each (what the 0.001 s budget holds at {plan['probe_step_seconds']:.2f} s a stock step" in proc.stdout
    ), proc.stdout[-2000:]
    assert lines[1].startswith("probe: ") and lines[2].startswith("stock (padded): 1 step, "), lines
    assert "host: " in proc.stdout and "LAUNCH" not in proc.stdout and "{" not in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.json", "logs"]  # no log/ left behind
    assert {"probe.json", "padded.json", "padded.out", "unpadded.out"} <= {p.name for p in logs.iterdir()}
    assert "step 1/1" in (logs / "padded.out").read_text()
    # both jobs: the planned step over a slice of exactly one batch per rank, the whole schedule
    assert not pad["stopped_by_time_budget"] and pad["steps"] == unp["steps"] == pad["schedule_steps"] == 1
    assert pad["train_samples"] == unp["train_samples"] == 32
    assert pad["train_tokens"] == unp["train_tokens"]  # the same samples both ways


@pytest.mark.slow
def test_demo_fmha_runs_respects_threads_and_explains_its_speedup():
    proc = run_python(os.path.join(EX, "demo_fmha.py"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "-> OK" in out and "threads=1" in out, out  # the user's OMP_NUM_THREADS, not the demo's own
    rows = [
        line.split()
        for line in out.splitlines()
        if line.startswith(("forward ", "forward+backward ")) and line.endswith("x")
    ]
    assert len(rows) == 2, out
    speedups = [float(r[-2].rstrip("x")) for r in rows]
    ideal = float(rows[0][-1].rstrip("x"))
    assert "(kernel, at equal work)" in out, out
    assert ("exceeds the ideal ratio because" in out) == (max(speedups) > ideal), out


def test_progress_time_left_honours_the_time_budget():
    eu = example_module("example_util")
    now = [0.0]
    p = eu.Progress(100, clock=lambda: now[0], budget_s=60)
    now[0] = 20.0  # 10 steps in 20 s: 180 s by the steps, 40 s by the budget
    assert p.line(10, "loss 0.7").endswith("elapsed 20s, about 40s left")
    now[0] = 70.0  # past the budget: nothing left
    assert p.remaining_s(30) == 0.0
    assert eu.Progress(100, clock=lambda: 0.0, budget_s=600).remaining_s(50, now=70.0) == pytest.approx(70.0)
    assert eu.Progress.parse("step 7/21 loss 0.6, 300 tokens/s elapsed 1m02s, about 3h05m left") == (
        7,
        21,
        "loss 0.6, 300 tokens/s",
        62.0,
    )
    assert eu.Progress.parse("step 3/3 elapsed 1h00m, done") == (3, 3, "", 3600.0)
    assert eu.Progress.parse("{") is None and eu.Progress.parse("step 1/4 loss 1") is None


class _Terminal(list):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty

    def write(self, text):
        self.append(text)

    def flush(self):
        pass


def test_demo_shows_one_line_per_job():
    """On a terminal the progress line is rewritten in place, its time left within the job's budget;
    elsewhere only the job's closing line is written."""
    rd = example_module("run_demo")
    term = _Terminal(tty=True)
    job = rd.JobLine("stock (padded)", 60.0, stream=term)
    job.feed("step 10/100 loss 0.7 elapsed 20s, about 3m00s left\n")
    job.feed("{\n")
    job.close("10 steps")
    assert term == [
        "\r\033[Kstock (padded): step 10/100 loss 0.7 elapsed 20s, about 40s left",
        "\r\033[Kstock (padded): 10 steps\n",
    ]
    pipe = _Terminal(tty=False)
    job = rd.JobLine("paddle_unpad", 0.0, stream=pipe)
    job.feed("step 10/100 loss 0.7 elapsed 20s, about 3m00s left\n")
    job.close("10 steps")
    assert pipe == ["paddle_unpad: 10 steps\n"]


def test_example_util_history_progress_and_plot(tmp_path, capsys):
    eu = example_module("example_util")
    h = eu.StepHistory()
    for i in range(4):
        h.add(step=i, loss=5.0 - i, tokens_per_s=100.0 + i, lr=1e-3 * i, mlm_acc=0.1 * i)
    h.save(tmp_path / "h.json")
    back = eu.StepHistory.load(tmp_path / "h.json")
    assert back.rows == h.rows and back.rows[2] == {
        "step": 2,
        "loss": 3.0,
        "tokens_per_s": 102.0,
        "lr": 0.002,
        "mlm_acc": 0.2,
    }

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
    resumed = eu.Progress(10, clock=lambda: now[0], start=4)  # 2 steps of this run in 60 s, 4 left
    now[0] += 60.0
    assert resumed.line(6).endswith("elapsed 1m00s, about 2m00s left")
    table = eu.comparison_table([("tokens/s", "t", "{:.0f}")], {"t": 100.0}, {"t": 250.0})
    assert table[0].split() == ["stock", "(padded)", "paddle_unpad", "ratio"] and table[1].split() == [
        "tokens/s",
        "100",
        "250",
        "2.50",
    ]
    with pytest.raises(ValueError, match="total_steps"):
        eu.Progress(0)

    png = tmp_path / "loss.png"
    eu.plot_loss_curves(str(png), {"a": h, "b": [{"step": 0, "loss": 4.0}, {"step": 3, "loss": 1.0}]}, "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000

    parser = eu.add_run_args(eu.make_parser("x"))
    assert "default" in parser.format_help()
    assert parser.parse_args(["--output-dir", "d"]).output_dir == "d"

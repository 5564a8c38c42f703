"""Serving an unpadded export: benchmarks/bench_serving.py in its smoke size (both predictors answer the
same batches alike, every cell timed on both sides, the report renders it) and examples/serve.py answering
texts from the export that run kept."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from testutil import run_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDES = ("unpadded", "padded")


def _serve(*args):
    """examples/serve.py with args in a process of its own (one thread, the tree first on PYTHONPATH)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "serve.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """(result JSON, folder of the two exports) of one ``bench_serving.py --quick --tiny`` run."""
    tmp = tmp_path_factory.mktemp("serving")
    out, exports = tmp / "serving_test.json", tmp / "exports"
    run_benchmark(
        "bench_serving.py",
        "--quick",
        "--tiny",
        "--out",
        str(out),
        "--keep-exports",
        str(exports),
        timeout=300,
        OMP_NUM_THREADS="1",
    )
    return json.loads(out.read_text()), exports


@pytest.mark.slow
@pytest.mark.usefixtures("native_ops")
def test_bench_serving_quick(quick_run, report, tmp_path):
    res, _ = quick_run
    (run,) = res["runs"]
    assert run["threads"] == 1 and res["machine"]["cpu_model"]
    for config, e in run["sweep"].items():  # each setting measured both sides, or says why it could not
        assert (isinstance(e.get("refused"), str) and e["refused"]) or e["max_rel_diff"] < 1e-4, (config, e)
        assert "refused" in e or sorted(e["by_batch"]) == ["1", "4"]
    for size, best in run["best"].items():  # the fastest working setting per side at each swept size
        working = {c: e["by_batch"][size] for c, e in run["sweep"].items() if "refused" not in e}
        for side in SIDES:
            assert best[side] == min(working, key=lambda c: sum(v[side] for v in working[c].values()))
    cells = run["cells"]
    assert sorted({(c["distribution"], c["batch"]) for c in cells}) == sorted(
        (d, b) for d in ("short reviews", "pre-training pairs") for b in (1, 4)
    )
    for c in cells:
        assert c["max_rel_diff"] < 1e-4, c  # the unpadded and the padded predictor answer the same batch alike
        assert c["settings"] == run["best"][str(c["batch"])]
        assert all(c["same_batch_p50_ms"][side] > 0 for side in SIDES)
        for side in SIDES:
            t = c[side]
            assert 0 < t["best_ms"] <= t["p50_ms"] <= t["p99_ms"] and t["seqs_per_s"] > 0, (side, c)
        assert 0 < c["real_tokens"] <= c["padded_tokens"]
        assert c["real_over_padded"] == c["real_tokens"] / c["padded_tokens"]
        assert abs(c["ideal_p50_ms"] - c["padded"]["p50_ms"] * c["real_over_padded"]) < 1e-9 * c["ideal_p50_ms"]
        u, p = c["calls_ms"]["unpadded"], c["calls_ms"]["padded"]
        assert len(u) == len(p) == len(c["call_tokens"]) == c["calls"]
        assert c["padded"]["p50_ms"] == pytest.approx(float(np.median(p)), abs=1e-2)
        assert c["unpadded"]["best_ms"] == pytest.approx(min(u), abs=1e-2)
        paired = np.median([a / (b * r / q) for a, b, (r, q) in zip(u, p, c["call_tokens"])])
        assert c["unpadded_over_ideal_paired"] == pytest.approx(paired, rel=1e-3)
    for e in run["profile"].values():
        assert e["total_ms"]["padded"] > 0 and e["total_ms"]["unpadded"] > 0
        assert any(k.startswith("attention") and v > 0 for k, v in e["unpadded"].items()), e["unpadded"]
    (tmp_path / "serving_amd.json").write_text(json.dumps(res))
    text = "\n".join(report.serving())
    assert "## Serving with Paddle Inference" in text and "bench_serving.py --quick --tiny" in text
    assert text.count("| 1 | short reviews |") == 2  # batches 1 and 4 at one thread


@pytest.mark.slow
@pytest.mark.usefixtures("native_ops")
def test_serve_answers_texts_from_stdin(quick_run, monkeypatch, capsys):
    """examples/serve.py in this process (Paddle is loaded once): texts from stdin, one answer line each."""
    _, exports = quick_run
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    import serve

    texts = ["a gripping, beautifully shot film", "two hours I will never get back", "fine"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(texts) + "\n\n"))
    from paddle_unpad.data import corpora

    # the benchmark's export has MiniLM's vocabulary and keeps no tokenizer next to it
    serve.main(["--export", str(exports / "unpadded"), "--tokenizer", os.path.join(corpora.minilm_dir(), "vocab.txt")])
    out = capsys.readouterr().out
    # the benchmark's export has no labels.json and no configuration naming classes: class ids
    answers = [line for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert len(answers) == len(texts) and "rotten" not in out, out
    for line, text in zip(answers, texts):
        label, first, second = line.split()[:3]
        scores = dict(x.split("=") for x in (first, second))
        scores = {k: float(v) for k, v in scores.items()}
        assert sorted(scores) == ["0", "1"] and abs(sum(scores.values()) - 1.0) < 2e-3
        assert label == max(scores, key=scores.get) and line.rstrip().endswith(text)
    assert f"{len(texts)} texts" in out and "predictor" in out and " ms" in out


def test_serve_without_a_tokenizer_next_to_the_export_says_so(tmp_path):
    for f in ("m.json", "m.pdiparams"):
        (tmp_path / f).write_text("")
    r = _serve("--export", str(tmp_path / "m"), "x")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"--export {str(tmp_path / 'm')!r}: no tokenizer next to the export (tokenizer_config.json or vocab.txt in "
        f"{tmp_path}); give --tokenizer (a tokenizer folder, vocab.txt or PaddleNLP name)"
    ], r.stderr


def test_serve_refuses_bad_arguments():
    r = _serve("--max-seq-len", "1", "x")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "--max-seq-len 1 is below the 3 tokens an input needs (the special tokens and one token of text): give at "
        "least 3"
    ], r.stderr

"""Smoke test: benchmarks/bench_encoder.py --quick runs and writes a complete, consistent JSON."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from testutil import run_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_encoder.py")
SIDES = ("unpadded", "batch_max", "max_len")


def _run(tmp_path, *extra):
    out = tmp_path / "encoder.json"
    r = run_benchmark("bench_encoder.py", "--quick", "--threads", "1", "--out", str(out), *extra, timeout=600)
    return json.loads(out.read_text()), r.stdout


def _check_point(s, h, L):
    """Every derived number of one point recomputed from its lengths and step times."""
    lengths = s["lengths"]
    T, B, S, M = sum(lengths), len(lengths), max(lengths), s["max_len"]
    assert s["tokens"] == T and s["batch"] == B and s["max_seqlen"] == S and S <= M
    assert s["sum_sq"] == sum(x * x for x in lengths) and s["hidden"] == h and s["layers"] == L
    assert abs(s["padding_ratio"] - (1 - T / (B * S))) < 1e-12
    assert s["loss_rel_diff_eval"] < 1e-4  # both sides compute the same model
    real = 24 * T * h * h + 4 * h * sum(x * x for x in lengths)
    padded = {
        "unpadded": real,
        "batch_max": 24 * B * S * h * h + 4 * h * B * S * S,
        "max_len": 24 * B * M * h * h + 4 * h * B * M * M,
    }
    assert abs(s["ideal_vs_batch_max"] - padded["batch_max"] / real) < 1e-9 * padded["batch_max"] / real
    assert abs(s["ideal_vs_max_len"] - padded["max_len"] / real) < 1e-9 * padded["max_len"] / real
    for side in SIDES:
        d = s["sides"][side]
        sec = d["ms"] / 1e3
        assert d["ms"] > 0 and abs(d["tokens_per_s"] - T / sec) < 1e-6 * d["tokens_per_s"]
        assert d["encoder_fwd_flops"] == L * padded[side]
        assert abs(d["useful_gflops"] - 3 * L * real / sec / 1e9) < 1e-9 * d["useful_gflops"]
        assert abs(d["computed_gflops"] - 3 * L * padded[side] / sec / 1e9) < 1e-9 * d["computed_gflops"]
        a = s["paddle_alloc_step_peak_bytes"][side]
        assert a is None or a > 0
    for base in ("batch_max", "max_len"):
        sp = s[f"speedup_vs_{base}"]
        assert abs(sp - s["sides"][base]["ms"] / s["sides"]["unpadded"]["ms"]) < 1e-9 * sp
        assert abs(s[f"speedup_over_ideal_vs_{base}"] - sp / s[f"ideal_vs_{base}"]) < 1e-9
    if S >= M:  # the max_len batch is the batch_max batch: reported once for both
        assert s["max_len_same_as_batch_max"] and s["sides"]["max_len"]["ms"] == s["sides"]["batch_max"]["ms"]


def _r2_of(y, pred):
    y, pred = np.asarray(y, float), np.asarray(pred, float)
    return 1 - ((y - pred) ** 2).sum() / ((y - np.mean(y)) ** 2).sum()


def _r2(X, y):
    A = np.column_stack([np.asarray(X, float), np.ones(len(y))])
    return _r2_of(y, A @ np.linalg.lstsq(A, np.asarray(y, float), rcond=None)[0])


@pytest.mark.slow
def test_bench_encoder_quick(tmp_path, native_ops):
    pytest.importorskip("paddlenlp")
    res, stdout = _run(tmp_path)
    cfg, sw = res["config"], res["config"]["sweep"]
    assert cfg["threads"] == 1 and cfg["quick"] is True
    assert cfg["parts"] == ["real", "padding", "max_len", "hidden"]
    # the real scenario on the main model, with the RSS subprocess measurement
    names = [s["name"] for s in res["scenarios"]]
    assert names == [names[0]] and names[0] in ("real", "synthetic")
    h, L = cfg["model_config"]["hidden_size"], cfg["model_config"]["num_hidden_layers"]
    for s in res["scenarios"]:
        assert s["max_len"] == cfg["max_len"]
        _check_point(s, h, L)
    rss = res["scenarios"][0]["rss"]
    for side in SIDES:
        assert rss[side]["rss_peak_kib"] >= rss[side]["rss_setup_kib"] > 0
    assert "speedup bm" in stdout and "peak memory" in stdout
    acc = res["summary"]["acceptance"]
    first = res["scenarios"][0]
    assert acc["speedup_at_least_0.9x_ideal"] == (first["speedup_vs_batch_max"] >= 0.9 * first["ideal_vs_batch_max"])
    assert acc["peak_memory_lower"] == (rss["unpadded"]["rss_peak_kib"] < rss["batch_max"]["rss_peak_kib"])
    assert [row["scenario"] for row in res["summary"]["rows"]] == names

    # the three sweeps, on the sweep model
    assert set(res["sweeps"]) == {"padding", "max_len", "hidden"}
    SL = sw["layers"]
    pad = res["sweeps"]["padding"]["points"]
    assert [p["name"] for p in pad] == [f"pad_{x:.0f}" for x in sw["pad_ratios"]]
    for p, pct in zip(pad, sw["pad_ratios"]):
        _check_point(p, sw["hidden"], SL)
        assert p["batch"] == sw["batch_padding_sweep"] and p["max_seqlen"] == p["max_len"] == cfg["max_len"]
        assert abs(p["padding_ratio"] - pct / 100) < 0.02 and p["x"] == round(100 * p["padding_ratio"], 1)
        assert "rss" not in p  # --memory real: RSS only for the real scenario
    ml = res["sweeps"]["max_len"]["points"]
    assert [p["x"] for p in ml] == sw["max_lens"]
    for p in ml:
        _check_point(p, sw["hidden"], SL)
        Lx = p["x"]
        assert p["max_len"] == p["max_seqlen"] == Lx
        assert p["batch"] == max(2, sw["tokens_per_batch_max_len_sweep"] // Lx)
        assert min(p["lengths"]) >= 1
    hid = res["sweeps"]["hidden"]["points"]
    assert [p["x"] for p in hid] == sw["hiddens"]
    for p in hid:
        _check_point(p, p["x"], SL)
        assert p["heads"] == p["x"] // sw["head_dim"] and p["lengths"] == hid[0]["lengths"]
        assert p["batch"] == sw["batch_hidden_sweep"] and p["max_seqlen"] == cfg["max_len"]
    for k, pts in res["sweeps"].items():
        assert [r["scenario"] for r in res["summary"]["sweeps"][k]] == [p["name"] for p in pts["points"]]
    assert "sweep max_len" in stdout and "sweep hidden" in stdout

    # the step-time fits, recomputed from the points of the sweep model at the sweep hidden size
    fit = res["fits"]
    pts = [
        (k, p)
        for k in ("padding", "max_len", "hidden")
        for p in res["sweeps"][k]["points"]
        if p["hidden"] == sw["hidden"]
    ]
    assert fit["points"] == [f"{k}/{p['name']}" for k, p in pts] and fit["n"] == len(pts) >= 5
    groups = [k for k, _ in pts]
    pts = [p for _, p in pts]
    for side in ("unpadded", "batch_max"):
        y = np.array([p["sides"][side]["ms"] for p in pts])
        assert fit[side]["ms"] == list(y)
        r2_real = _r2([[sum(p["lengths"]), sum(x * x for x in p["lengths"])] for p in pts], y)
        r2_shape = _r2(
            [[len(p["lengths"]) * max(p["lengths"]), len(p["lengths"]) * max(p["lengths"]) ** 2] for p in pts], y
        )
        assert abs(fit[side]["real_work"]["r2"] - r2_real) < 1e-6
        assert abs(fit[side]["padded_shape"]["r2"] - r2_shape) < 1e-6
        e = fit[side]["real_work"]
        pred = [e["a_ms_per_token"] * p["tokens"] + e["b_ms_per_sq_token"] * p["sum_sq"] + e["c_ms"] for p in pts]
        assert np.allclose(pred, e["pred_ms"], rtol=1e-6, atol=1e-6)
        idx = [i for i, g in enumerate(groups) if g == "padding"]  # R^2 of the fit within the padding sweep
        for key in ("real_work", "padded_shape"):
            within = _r2_of(y[idx], [fit[side][key]["pred_ms"][i] for i in idx])
            assert abs(fit[side][key]["r2_within_sweep"]["padding"] - within) < 1e-6


@pytest.mark.slow
def test_bench_encoder_one_part(tmp_path, native_ops):
    """--sweeps runs the named parts alone."""
    pytest.importorskip("paddlenlp")
    res, _ = _run(tmp_path, "--sweeps", "max_len")
    assert res["config"]["parts"] == ["max_len"] and res["scenarios"] == [] and list(res["sweeps"]) == ["max_len"]
    assert [p["x"] for p in res["sweeps"]["max_len"]["points"]] == res["config"]["sweep"]["max_lens"]
    assert "skipped" in res["fits"]  # too few points of one model for a 3-parameter fit


def test_bench_encoder_bad_part():
    r = subprocess.run(
        [sys.executable, SCRIPT, "--sweeps", "padding,nope"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "nope" in r.stderr

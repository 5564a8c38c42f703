"""Smoke test: benchmarks/bench_encoder.py --quick runs and writes a complete, consistent JSON."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_encoder_quick(tmp_path, native_ops):
    pytest.importorskip("paddlenlp")
    out = tmp_path / "encoder.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_encoder.py"), "--quick",
                        "--threads", "1", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    res = json.loads(out.read_text())
    cfg = res["config"]
    assert cfg["threads"] == 1 and cfg["quick"] is True
    names = [s["name"] for s in res["scenarios"]]
    assert names[0] in ("real", "synthetic") and "pad_0" in names and "pad_50" in names
    h, L = cfg["model_config"]["hidden_size"], cfg["model_config"]["num_hidden_layers"]
    for s in res["scenarios"]:
        lengths = s["lengths"]
        T, B, S = sum(lengths), len(lengths), max(lengths)
        assert s["tokens"] == T and s["batch"] == B and s["max_seqlen"] == S
        assert s["loss_rel_diff_eval"] < 1e-4  # both sides compute the same model
        real = 24 * T * h * h + 4 * h * sum(x * x for x in lengths)
        padded = 24 * B * S * h * h + 4 * h * B * S * S
        assert abs(s["ideal_vs_batch_max"] - padded / real) < 1e-9 * padded / real
        for side in ("unpadded", "batch_max", "max_len"):
            d = s["sides"][side]
            assert d["ms"] > 0 and abs(d["tokens_per_s"] - T / (d["ms"] / 1e3)) < 1e-6 * d["tokens_per_s"]
        assert s["sides"]["max_len"]["encoder_fwd_flops"] == L * (24 * B * cfg["max_len"] * h * h
                                                                  + 4 * h * B * cfg["max_len"] ** 2)
        for base in ("batch_max", "max_len"):
            sp = s[f"speedup_vs_{base}"]
            assert abs(sp - s["sides"][base]["ms"] / s["sides"]["unpadded"]["ms"]) < 1e-9 * sp
            assert abs(s[f"speedup_over_ideal_vs_{base}"] - sp / s[f"ideal_vs_{base}"]) < 1e-9
    rss = res["scenarios"][0]["rss"]
    for side in ("unpadded", "batch_max", "max_len"):
        assert rss[side]["rss_peak_kib"] >= rss[side]["rss_setup_kib"] > 0
    assert "speedup bm" in r.stdout and "peak memory" in r.stdout
    acc = res["summary"]["acceptance"]
    first = res["scenarios"][0]
    assert acc["speedup_at_least_0.9x_ideal"] == (first["speedup_vs_batch_max"] >= 0.9 * first["ideal_vs_batch_max"])
    assert acc["peak_memory_lower"] == (rss["unpadded"]["rss_peak_kib"] < rss["batch_max"]["rss_peak_kib"])
    assert [row["scenario"] for row in res["summary"]["rows"]] == names

"""Smoke test: benchmarks/bench_e2e.py --quick runs a 2-rank fleetrun job and writes a consistent JSON.

Every derived figure is recomputed here from the per-step sample lengths the JSON records.
"""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("padded_max_len", "padded_batch_max", "unpadded", "unpadded_balanced", "unpadded_balanced_after")

pytestmark = pytest.mark.dist


def layer_flops(lengths, h, ffn):
    return 2 * sum(lengths) * (4 * h * h + 2 * h * ffn) + 4 * h * sum(s * s for s in lengths)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("paddlenlp")
    out = tmp_path_factory.mktemp("e2e") / "e2e.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_e2e.py"), "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + "\n--- stderr:\n" + r.stderr[:8000]
    return json.loads(out.read_text()), r.stdout


def test_every_way_sees_the_same_samples(quick_run, native_ops):
    res, stdout = quick_run
    cfg, ways = res["config"], res["ways"]
    assert cfg["world"] == 2 and cfg["quick"] is True and list(ways) == list(WAYS)
    everything = {}
    for w, d in ways.items():
        assert len(d["per_rank"]) == 2 and d["steps"] == cfg["steps"]
        everything[w] = Counter(n for pr in d["per_rank"] for step in pr["lengths_per_step"] for n in step)
        for pr in d["per_rank"]:
            assert pr["tokens"] == sum(sum(step) for step in pr["lengths_per_step"])
            assert pr["samples"] == sum(len(step) for step in pr["lengths_per_step"])
    # the balancer moves samples between ranks but loses and duplicates none
    assert everything["unpadded_balanced"] == everything["unpadded"] == everything["padded_batch_max"]
    # the two balanced ways differ only in when the gradients are reduced: the same plan, step by step
    assert [pr["lengths_per_step"] for pr in ways["unpadded_balanced"]["per_rank"]] == [
        pr["lengths_per_step"] for pr in ways["unpadded_balanced_after"]["per_rank"]
    ]
    for w in ("padded_max_len", "padded_batch_max", "unpadded"):  # without balancing: the same per rank
        assert [pr["lengths_per_step"] for pr in ways[w]["per_rank"]] == [
            pr["lengths_per_step"] for pr in ways["unpadded"]["per_rank"]
        ]
    # same model in every way: eval loss on the first batch agrees
    losses = list(cfg["eval_loss_rank0"].values())
    assert max(losses) - min(losses) < 1e-4 * max(1.0, abs(losses[0]))
    assert "speedup over padded_batch_max" in stdout and "profile of unpadded_balanced" in stdout


def test_derived_figures(quick_run, native_ops):
    res, _ = quick_run
    cfg, ways = res["config"], res["ways"]
    h, ffn, L, M = cfg["hidden"], cfg["ffn"], cfg["layers"], cfg["max_len"]
    for w, d in ways.items():
        n, step_s = d["steps"], d["step_ms"] / 1e3
        assert step_s * 1e3 == max(pr["step_ms"] for pr in d["per_rank"])
        samples = sum(pr["samples"] for pr in d["per_rank"])
        tokens = sum(pr["tokens"] for pr in d["per_rank"])
        assert abs(d["samples_per_s"] - samples / (n * step_s)) < 1e-9 * d["samples_per_s"]
        assert abs(d["tokens_per_s"] - tokens / (n * step_s)) < 1e-9 * d["tokens_per_s"]
        useful = sum(3 * L * layer_flops(step, h, ffn) for pr in d["per_rank"] for step in pr["lengths_per_step"])
        mm = sum(cfg["matmul_gflops_per_rank"]) / len(cfg["matmul_gflops_per_rank"])
        assert abs(d["mfu"] - useful / (n * step_s) / 2 / (mm * 1e9)) < 1e-9
        computed = sum(
            len(step) * (M if w == "padded_max_len" else max(step)) if w.startswith("padded") else sum(step)
            for pr in d["per_rank"]
            for step in pr["lengths_per_step"]
        )
        assert abs(d["padding_computed_pct"] - 100 * (1 - tokens / computed)) < 1e-9
        for pr in d["per_rank"]:
            parts = pr["fetch_ms"] + pr["compute_ms"] + pr["wait_ms"] + pr["comm_ms"] + pr["opt_ms"]
            assert abs(parts - pr["step_ms"]) < 1e-6 * pr["step_ms"]
    steps_bm = [step for pr in ways["padded_batch_max"]["per_rank"] for step in pr["lengths_per_step"]]
    pad = sum(layer_flops([max(s)] * len(s), h, ffn) for s in steps_bm)
    real = sum(layer_flops(s, h, ffn) for s in steps_bm)
    assert abs(res["ideal"]["padded_batch_max"] - pad / real) < 1e-9 * pad / real
    acc = res["acceptance"]
    sp = ways["unpadded_balanced"]["tokens_per_s"] / ways["padded_batch_max"]["tokens_per_s"]
    assert abs(acc["balanced_speedup_vs_batch_max"] - sp) < 1e-9 * sp
    assert acc["at_least_0.85x_ideal"] == (sp >= 0.85 * pad / real)
    assert acc["wait_lower_with_balancing"] == (ways["unpadded_balanced"]["wait_ms"] < ways["unpadded"]["wait_ms"])


def test_profile_breakdown(quick_run, native_ops):
    res, _ = quick_run
    p = res["profile"]
    assert p["way"] == "unpadded_balanced" and p["steps_per_rank"] == res["config"]["profile_steps"] >= 1
    assert abs(sum(p["shares"].values()) - 1.0) < 1e-9
    assert abs(sum(p["ms_per_step"].values()) - p["profiled_step_ms"]) < 1e-6 * p["profiled_step_ms"]
    # the converted model's work shows up under its own categories
    for cat in ("GEMM", "attention", "fused element-wise", "embeddings", "optimizer", "gradient all-reduce"):
        assert p["ms_per_step"].get(cat, 0.0) > 0.0, (cat, p["ms_per_step"])
    shares = sorted(((v, k) for k, v in p["shares"].items() if k != "framework & Python overhead"), reverse=True)
    assert [t["category"] for t in p["top3"]] == [k for _, k in shares[:3]]
    assert all(t["reduce_by"] for t in p["top3"])


def test_profiles_before_and_after_and_the_exposed_communication(quick_run, native_ops):
    res, _ = quick_run
    profiles = res["profiles"]
    assert set(profiles) == {"overlap", "serial"} and res["profile"] == profiles["overlap"]
    for mode, p in profiles.items():
        assert p["grad_sync"] == mode and p["ms_per_step"].get("gradient all-reduce", 0.0) > 0.0
        assert p["useful_gflops_per_rank"] > 0.0
    # the serial all-reduce sends every gradient; by rows the word-embedding table sends only used rows
    assert profiles["overlap"]["grad_bytes_per_step"] < profiles["serial"]["grad_bytes_per_step"]
    ub = res["ways"]["unpadded_balanced"]
    acc = res["acceptance"]
    assert abs(acc["exposed_comm_share_balanced"] - ub["comm_ms"] / ub["step_ms"]) < 1e-12
    assert acc["exposed_comm_at_most_5pct"] == (ub["comm_ms"] <= 0.05 * ub["step_ms"])
    ua = res["ways"]["unpadded_balanced_after"]
    assert acc["mfu_balanced_after"] == ua["mfu"] and acc["mfu_balanced"] == ub["mfu"]
    assert abs(acc["exposed_comm_share_balanced_after"] - ua["comm_ms"] / ua["step_ms"]) < 1e-12
    assert res["config"]["grad_sync"] == "overlap"
    m = res["machine"]
    assert m["cpu_model"] and m["cores"] >= 1 and "mkl_kernels" in m

"""Smoke tests: benchmarks/bench_attention.py, bench_fp32_attention.py and bench_exchange_scale.py run small and
write complete JSON."""

import json
import math

import pytest
from testutil import run_benchmark

pytestmark = pytest.mark.slow


def test_bench_attention_quick(tmp_path):
    out = tmp_path / "attention.json"
    r = run_benchmark("bench_attention.py", "--quick", "--threads", "1", "--out", str(out), timeout=300)
    assert "== forward ==" in r.stdout and "== forward + backward ==" in r.stdout, r.stdout
    res = json.loads(out.read_text())
    cfg = res["config"]
    assert cfg["threads"] == 1 and cfg["quick"] is True
    assert cfg["fmha_impl"] in ("native", "reference")
    assert res["matmul_gflops"] > 0
    names = [s["name"] for s in res["scenarios"]]
    assert names[0] in ("real", "synthetic") and "pad_0" in names and "pad_50" in names
    gemm_seen = []
    for s in res["scenarios"]:
        lengths = s["lengths"]
        assert s["batch"] == len(lengths) and s["max_seqlen"] == max(lengths) and s["tokens"] == sum(lengths)
        assert 0.0 <= s["padding_ratio"] < 1.0
        expected_ideal = len(lengths) * max(lengths) ** 2 / sum(x * x for x in lengths)
        assert abs(s["ideal_ratio"] - expected_ideal) < 1e-9 * expected_ideal
        # packed and padded attention agree at real tokens
        assert set(s["max_abs_diff_vs_packed"]) == {"sdpa", "mha"}
        assert max(s["max_abs_diff_vs_packed"].values()) < 1e-4
        for mode in ("fwd", "fwd_bwd"):
            m = s[mode]
            for method in ("packed", "sdpa", "mha"):
                assert m[method]["ms"] > 0 and m[method]["useful_gflops"] > 0
            # the packed path's best round over the fastest GEMM rate of the run
            rounds = m["round_ms"]
            assert len(rounds["packed"]) == len(rounds["gemm"]) == cfg["repeats"]
            mult = 1.0 if mode == "fwd" else 3.5
            assert abs(m["matmul_best_gflops"] - 2.0 * res["matmul_n"] ** 3 / 1e9 / (min(rounds["gemm"]) / 1e3)) < 1e-6
            want = (mult * s["useful_gflop_fwd"] / (min(rounds["packed"]) / 1e3)) / res["gemm_ceiling_gflops"]
            assert abs(m["packed_fraction_of_matmul_peak"] - want) < 1e-9 * want
            gemm_seen.append(m["matmul_best_gflops"])
            for base in ("sdpa", "mha"):
                sp = m[f"speedup_vs_{base}"]
                assert abs(sp - m[base]["ms"] / m["packed"]["ms"]) < 1e-9 * sp
                assert abs(m[f"speedup_vs_{base}_over_ideal"] - sp / s["ideal_ratio"]) < 1e-9
    pad0 = res["scenarios"][names.index("pad_0")]
    assert pad0["padding_ratio"] == 0.0 and pad0["ideal_ratio"] == 1.0
    # per head size: packed fmha alone, dropout off and on, share of the run's fastest GEMM shape
    hs = res["head_sizes"]
    assert sorted({(r["head_dim"], r["dropout"]) for r in hs}) == [(16, 0.0), (16, 0.1), (32, 0.0), (32, 0.1)]
    real = res["scenarios"][0]
    sum_sq = sum(x * x for x in real["lengths"])
    for r in hs:
        for mode, mult in (("fwd", 1.0), ("fwd_bwd", 3.5)):
            g = mult * 4.0 * sum_sq * r["head_dim"] * cfg["heads"] / (r[mode]["ms"] / 1e3) / 1e9
            assert abs(r[mode]["useful_gflops"] - g) < 1e-6 * g
            # best round, share of the fastest GEMM rate of the run
            rounds = r["round_ms"]
            assert r[mode]["ms"] == min(rounds[mode]) and r[mode]["median_ms"] >= r[mode]["ms"]
            assert abs(r[mode]["of_matmul"] - g / res["gemm_ceiling_gflops"]) < 1e-9 * g / res["gemm_ceiling_gflops"]
        gemm_gflop = 2.0 * math.prod(res["gemm_ceiling_shape"]) / 1e9
        assert abs(r["gemm_best_gflops"] - gemm_gflop / (min(rounds["gemm"]) / 1e3)) < 1e-6 * r["gemm_best_gflops"]
        gemm_seen.append(r["gemm_best_gflops"])
        assert r["meets_target"] == (min(r["fwd"]["of_matmul"], r["fwd_bwd"]["of_matmul"]) >= 0.55)
    # the ceiling is the fastest GEMM rate seen anywhere in the run
    assert res["gemm_ceiling_gflops"] == max(gemm_seen + [res["gemm_start_gflops"]])
    assert res["gemm_start_gflops"] >= res["matmul_gflops"]
    assert len(res["gemm_ceiling_shape"]) == 3
    assert res["machine"]["cpu_model"] and res["machine"]["cores"] >= 1


def test_bench_gemm_quick(tmp_path):
    out = tmp_path / "gemm.json"
    run_benchmark("bench_gemm.py", "--quick", "--no-probes", "--out", str(out), timeout=300)
    res = json.loads(out.read_text())
    results = res["results"]
    for key in ("default/paddle_matmul", "paddle_unpad/paddle_matmul", "mkl_cpu_avx2/paddle_matmul"):
        assert results[key]["correct"], (key, results[key]["errors"])
    # every configuration but "paddle_unpad" measures Paddle as installed (the plugin's MKL set-up off)
    from paddle_unpad._runtime import cpu_gemm

    vendor, _, flags = cpu_gemm.cpu_identity()
    value, _ = cpu_gemm.choose(vendor, flags)
    detect = {n: w["mkl"]["mkl_serv_cpu_detect"] for n, w in res["workers"].items() if isinstance(w.get("mkl"), dict)}
    if value is not None:
        assert detect["default"] == 0 and detect["paddle_unpad"] == int(value), detect
    else:
        assert detect["default"] == detect["paddle_unpad"], detect
    steps = res["encoder_step"]
    assert set(steps) >= {"default", "paddle_unpad"}
    for st in steps.values():  # the same weights and batch everywhere: the same eval loss
        assert st["loss_rel_diff_vs_default"] < 1e-5
    assert res["machine"]["cpu_model"]


@pytest.mark.dist
def test_bench_demo_seeds_smoke(tmp_path, report):
    """Two tiny seed pairs (dropout 0.1 and 0) of the demo's jobs: a complete JSON whose
    differences are the accuracies' differences, and the report renders it."""
    out = tmp_path / "demo_seeds.json"
    run_benchmark(
        "bench_demo_seeds.py",
        "--seeds",
        "3",
        "--no-dropout-seeds",
        "3",
        "--steps",
        "2",
        "--max-train",
        "128",
        "--max-dev",
        "64",
        "--batch-size",
        "8",
        "--out",
        str(out),
        timeout=600,
        OMP_NUM_THREADS="1",
    )
    res = json.loads(out.read_text())
    assert [(p["seed"], p["dropout"]) for p in res["pairs"]] == [(3, 0.1), (3, 0.0)]
    for p in res["pairs"]:
        assert p["steps"] == 2 and p["dev_samples"] == 64
        assert 0.0 <= p["stock"] <= 1.0 and 0.0 <= p["unpadded"] <= 1.0
        assert p["diff"] == p["unpadded"] - p["stock"]
    assert set(res["summary"]) == {"0.1", "0.0"} and res["summary"]["0.1"]["pairs"] == 1
    text = "\n".join(report.demo_seeds())
    assert "| 3 | 0.1 |" in text and "| 3 | 0.0 |" in text and "Dropout 0.1: 1 pairs" in text


def test_bench_fp32_attention_quick(tmp_path):
    """benchmarks/bench_fp32_attention.py --quick: both distributions, the work counts consistent with
    their definitions (bucketed between the real tokens' work and the batch maximum's), every side timed."""
    out = tmp_path / "fp32_attention.json"
    run_benchmark("bench_fp32_attention.py", "--quick", "--threads", "1", "--out", str(out), timeout=300)
    res = json.loads(out.read_text())
    assert len(res["distributions"]) == 2
    for name, e in res["distributions"].items():
        w = e["work"]
        assert 0 < w["useful_s2"] <= w["bucketed_s2"] <= w["batch_max_s2"], (name, w)
        for share in e["share_of_layer_flops"].values():
            assert 0 < share["packed"] <= share["bucketed"] <= share["stock"] < 1
        t = e["cpu_fp32_fwd_bwd"]
        assert all(v > 0 for v in t["ms"].values()) and set(t["ms"]) == {"packed_kernel", "bucketed", "stock_batch_max"}
        assert max(t["max_abs_diff_vs_kernel"].values()) < 1e-4


@pytest.mark.dist
def test_bench_exchange_scale_smoke(tmp_path):
    """Two small jobs of the shipped exchange: one group per rank whatever the size, the
    moved bytes accounted for, and a model row for each cluster size."""
    out = tmp_path / "scale.json"
    run_benchmark(
        "bench_exchange_scale.py",
        "--worlds",
        "2,3",
        "--designs",
        "allgather",
        "--nodes",
        "0",
        "--quick",
        "--timeout",
        "120",
        "--out",
        str(out),
        timeout=400,
    )
    res = json.loads(out.read_text())
    runs = res["runs"]
    assert [(x["design"], x["world"]) for x in runs] == [("allgather", 2), ("allgather", 3)], runs
    for x in runs:
        assert "error" not in x, x
        assert x["groups_per_rank"] == 1 and x["group_creations_per_rank"] == 1
        assert x["steps"] == res["steps"] and x["first_batch_s"] > 0 and x["step_ms"] > 0
        # an all-gather delivers every moving sample to every rank, padded to the largest share
        assert x["received_bytes_per_step"] >= x["moved_bytes_per_step"] > 0
    model = res["at_scale"]
    assert [row["ranks"] for row in model["rows"]] == [64, 256, 1024]
    for row in model["rows"]:
        assert row["messages_per_rank"] == 6 * (row["ranks"] - 1)
        assert row["group_s"] <= row["group_nagle_s"] and row["startup_s"] > row["step_s"] > 0
    assert all(model["inputs"][k] > 0 for k in ("store_request_s", "store_server_s", "connect_s", "hop_s"))

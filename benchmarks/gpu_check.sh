#!/usr/bin/env bash
# One-shot GPU check of the CUDA kernels, for a machine with an NVIDIA GPU, nvcc and
# PyTorch with CUDA (no Paddle, no package index needed). Budget: < 8 minutes on one H100.
#
#   benchmarks/gpu_check.sh OUT_DIR
#
# 1. builds custom_ops/harness for the local GPU (make; SM version from nvidia-smi),
# 2. runs tests/gpu (FMHA in both backward modes and the fused bias_gelu /
#    bias_dropout_residual_layer_norm: correctness vs a PyTorch fp32 reference, dropout mask
#    vs numpy Philox, NaN-poisoned neighbours, bitwise reruns, refusals),
# 3. runs benchmarks/bench_gpu_fmha.py (ours vs torch's varlen_attn / FlashAttention-2 varlen
#    and SDPA's flash, cuDNN and efficient backends, dropout 0 and 0.1, bf16),
# 4. runs benchmarks/bench_gpu_layer.py (a BERT-base and a BERT-large layer, fwd+bwd, packed
#    with our kernels vs padded PyTorch vs the ideal),
# 5. runs benchmarks/bench_gpu_fused.py (fused ops fwd / fwd+bwd GB/s vs unfused torch).
# Writes into OUT_DIR: summary.json, bench_fmha.json, bench_layer.json, bench_fused.json,
# tests.xml (JUnit), build.log, tests.log, bench.log, bench_layer.log, bench_fused.log,
# env.txt. Exit status: 0 only when the build and the tests passed and every benchmark
# produced its JSON and passed its own correctness check. The step time limits
# (120 + 150 + 80 + 60 + 40 = 450 s) keep the whole run under 8 minutes.
set -u -o pipefail

OUT=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
LIB="$ROOT/custom_ops/harness/build/libpu_cuda_harness.so"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

{
  date -u
  nvidia-smi 2>&1 || true
  nvcc --version 2>&1 || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" 2>&1 || true
} > "$OUT/env.txt"

ARCH=${ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d '. ')}
ARCH=${ARCH:-90}
stamp "building the harness for sm_${ARCH}"
BUILD_T=$(date +%s)
timeout 120 make -C custom_ops/harness -j"$(nproc)" ARCH="$ARCH" > "$OUT/build.log" 2>&1
BUILD_RC=$?
BUILD_S=$(( $(date +%s) - BUILD_T ))
stamp "build rc=$BUILD_RC (${BUILD_S}s)"

# step NAME LIMIT_S LOG CMD...: runs CMD (after a good build) under `timeout`, sets
# <NAME>_RC (99 = not run) and <NAME>_S, prints the log's tail.
step() {
  local name=$1 limit=$2 log=$3; shift 3
  local rc=99 t
  t=$(date +%s)
  if [ "$BUILD_RC" = 0 ]; then
    PU_CUDA_HARNESS="$LIB" timeout "$limit" "$@" > "$log" 2>&1
    rc=$?
  fi
  printf -v "${name}_RC" '%s' "$rc"
  printf -v "${name}_S" '%s' "$(( $(date +%s) - t ))"
  stamp "$name rc=$rc ($(( $(date +%s) - t ))s, limit ${limit}s)"
  [ -f "$log" ] && tail -n 8 "$log"
}

PU_GPU_REQUIRED=1 step TESTS 150 "$OUT/tests.log" \
  "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider --confcutdir=tests/gpu --junitxml="$OUT/tests.xml"
step BENCH 80 "$OUT/bench.log" "$PY" benchmarks/bench_gpu_fmha.py --out "$OUT/bench_fmha.json"
step LAYER 60 "$OUT/bench_layer.log" "$PY" benchmarks/bench_gpu_layer.py --out "$OUT/bench_layer.json"
step FUSED 40 "$OUT/bench_fused.log" "$PY" benchmarks/bench_gpu_fused.py --out "$OUT/bench_fused.json"

"$PY" - "$OUT" "$ARCH" "$BUILD_RC" "$BUILD_S" "$TESTS_RC" "$TESTS_S" "$BENCH_RC" "$BENCH_S" \
  "$LAYER_RC" "$LAYER_S" "$FUSED_RC" "$FUSED_S" "$T0" <<'PYEOF'
import json, os, sys, time
out, arch, brc, bs, trc, ts, xrc, xs, lrc, ls, frc, fs, t0 = sys.argv[1:]
summary = {"arch": arch, "build_rc": int(brc), "build_s": int(bs), "tests_rc": int(trc),
           "tests_s": int(ts), "bench_rc": int(xrc), "bench_s": int(xs),
           "layer_bench_rc": int(lrc), "layer_bench_s": int(ls),
           "fused_bench_rc": int(frc), "fused_bench_s": int(fs),
           "total_s": int(time.time()) - int(t0)}


def load(name):
    with open(os.path.join(out, name)) as f:
        return json.load(f)


try:
    import xml.etree.ElementTree as ET
    suite = ET.parse(os.path.join(out, "tests.xml")).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["failed_tests"] = [tc.get("classname", "") + "::" + tc.get("name", "")
                               for tc in suite.iter("testcase")
                               if tc.find("failure") is not None or tc.find("error") is not None]
except Exception as e:  # noqa: BLE001
    summary["tests"] = f"no junit xml: {e}"
try:
    b = load("bench_fmha.json")
    summary["gpu"] = b.get("gpu")
    summary["targets_bert_large_bf16_d64"] = b.get("targets_bert_large_bf16_d64")
    summary["ratios"] = {k: v.get("ratios") for k, v in b.get("cases", {}).items()}
    summary["checks_vs_peer"] = {k: v.get("check", {}).get("ok") for k, v in b.get("cases", {}).items()}
    ref = b.get("cases", {}).get("bert-large-40x512", {})
    r = ref.get("ratios", {})
    overhead = r.get("dropout_overhead", {})
    summary["bert_large_40x512"] = {
        **{p: {"strongest_peer": r.get(p, {}).get("strongest_peer_fwdbwd"),
               "fwdbwd ours_grouped / strongest peer": r.get(p, {}).get("fwdbwd_ms ours_grouped / strongest peer"),
               "fwdbwd ours_grouped_deterministic / strongest peer":
                   r.get(p, {}).get("fwdbwd_ms ours_grouped_deterministic / strongest peer")}
           for p in ("dropout=0", "dropout=0.1")},
        "dropout_overhead_fwdbwd": {m: v.get("fwdbwd_ms") for m, v in overhead.items()},
        "varlen_attn": b.get("varlen_attn"),
    }
except Exception as e:  # noqa: BLE001
    summary["bench"] = f"no benchmark json: {e}"
try:
    lb = load("bench_layer.json")
    summary["layer"] = {"gemm_bf16_tflops": lb.get("gemm", {}).get("tflops"), **lb.get("headline", {})}
except Exception as e:  # noqa: BLE001
    summary["layer_bench"] = f"no layer benchmark json: {e}"
try:
    fb = load("bench_fused.json")
    summary["fused_ratios_ours_over_torch_unfused"] = {
        case: {op: r.get("ratios") for op, r in v.items() if isinstance(r, dict)}
        for case, v in fb.get("cases", {}).items()}
except Exception as e:  # noqa: BLE001
    summary["fused_bench"] = f"no fused benchmark json: {e}"
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(json.dumps(summary, indent=1))
PYEOF

[ "$BUILD_RC" = 0 ] && [ "$TESTS_RC" = 0 ] && [ "$BENCH_RC" = 0 ] && [ "$LAYER_RC" = 0 ] && [ "$FUSED_RC" = 0 ]

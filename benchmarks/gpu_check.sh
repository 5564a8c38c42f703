#!/usr/bin/env bash
# One-shot GPU check of the CUDA kernels, for a machine with an NVIDIA GPU, nvcc and
# PyTorch with CUDA (no Paddle, no package index needed). Budget: < 8 minutes on one H200.
#
#   benchmarks/gpu_check.sh OUT_DIR
#
# 1. builds custom_ops/harness for the local GPU (make; SM version from nvidia-smi),
# 2. runs tests/gpu (FMHA and the fused bias_gelu / bias_dropout_residual_layer_norm:
#    correctness vs a PyTorch fp32 reference, dropout mask vs numpy Philox, NaN-poisoned
#    neighbours, bitwise reruns),
# 3. runs benchmarks/bench_gpu_fmha.py (ours grouped / ungrouped vs padded SDPA and torch's
#    flash varlen attention, BERT-base and BERT-large shapes, bf16),
# 4. runs benchmarks/bench_gpu_fused.py (fused ops fwd / fwd+bwd GB/s vs unfused torch).
# Writes into OUT_DIR: summary.json, bench_fmha.json, bench_fused.json, tests.xml (JUnit),
# build.log, tests.log, bench.log, bench_fused.log, env.txt. Exit status: 0 only when the
# build and the tests passed and both benchmarks produced their JSON. Step time limits
# (130 + 170 + 120 + 40 s) keep the whole run under 8 minutes.
set -u -o pipefail

OUT=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
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
timeout 130 make -C custom_ops/harness -j"$(nproc)" ARCH="$ARCH" > "$OUT/build.log" 2>&1
BUILD_RC=$?
BUILD_S=$(( $(date +%s) - BUILD_T ))
stamp "build rc=$BUILD_RC (${BUILD_S}s)"

TESTS_RC=99; TESTS_S=0
if [ "$BUILD_RC" = 0 ]; then
  TT=$(date +%s)
  PU_GPU_REQUIRED=1 PU_CUDA_HARNESS="$ROOT/custom_ops/harness/build/libpu_cuda_harness.so" \
    timeout 170 "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider --confcutdir=tests/gpu \
      --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1
  TESTS_RC=$?
  TESTS_S=$(( $(date +%s) - TT ))
  stamp "tests rc=$TESTS_RC (${TESTS_S}s)"; tail -n 3 "$OUT/tests.log"
fi

BENCH_RC=99; BENCH_S=0
if [ "$BUILD_RC" = 0 ]; then
  TB=$(date +%s)
  PU_CUDA_HARNESS="$ROOT/custom_ops/harness/build/libpu_cuda_harness.so" \
    timeout 120 "$PY" benchmarks/bench_gpu_fmha.py --out "$OUT/bench_fmha.json" > "$OUT/bench.log" 2>&1
  BENCH_RC=$?
  BENCH_S=$(( $(date +%s) - TB ))
  stamp "bench rc=$BENCH_RC (${BENCH_S}s)"; tail -n 6 "$OUT/bench.log"
fi

FUSED_RC=99; FUSED_S=0
if [ "$BUILD_RC" = 0 ]; then
  TF=$(date +%s)
  PU_CUDA_HARNESS="$ROOT/custom_ops/harness/build/libpu_cuda_harness.so" \
    timeout 40 "$PY" benchmarks/bench_gpu_fused.py --out "$OUT/bench_fused.json" > "$OUT/bench_fused.log" 2>&1
  FUSED_RC=$?
  FUSED_S=$(( $(date +%s) - TF ))
  stamp "fused bench rc=$FUSED_RC (${FUSED_S}s)"; tail -n 6 "$OUT/bench_fused.log"
fi

"$PY" - "$OUT" "$ARCH" "$BUILD_RC" "$BUILD_S" "$TESTS_RC" "$TESTS_S" "$BENCH_RC" "$BENCH_S" \
  "$FUSED_RC" "$FUSED_S" "$T0" <<'PYEOF'
import json, os, sys, time
out, arch, brc, bs, trc, ts, xrc, xs, frc, fs, t0 = sys.argv[1:]
summary = {"arch": arch, "build_rc": int(brc), "build_s": int(bs), "tests_rc": int(trc),
           "tests_s": int(ts), "bench_rc": int(xrc), "bench_s": int(xs),
           "fused_bench_rc": int(frc), "fused_bench_s": int(fs),
           "total_s": int(time.time()) - int(t0)}
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
    with open(os.path.join(out, "bench_fmha.json")) as f:
        b = json.load(f)
    summary["gpu"] = b.get("gpu")
    summary["targets_bert_large_bf16_d64"] = b.get("targets_bert_large_bf16_d64")
    summary["ratios"] = {k: v.get("ratios") for k, v in b.get("cases", {}).items()}
except Exception as e:  # noqa: BLE001
    summary["bench"] = f"no benchmark json: {e}"
try:
    with open(os.path.join(out, "bench_fused.json")) as f:
        fb = json.load(f)
    summary["fused_ratios_ours_over_torch_unfused"] = {
        case: {op: r.get("ratios") for op, r in v.items() if isinstance(r, dict)}
        for case, v in fb.get("cases", {}).items()}
except Exception as e:  # noqa: BLE001
    summary["fused_bench"] = f"no fused benchmark json: {e}"
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(json.dumps(summary, indent=1))
PYEOF

[ "$BUILD_RC" = 0 ] && [ "$TESTS_RC" = 0 ] && [ "$BENCH_RC" = 0 ] && [ "$FUSED_RC" = 0 ]

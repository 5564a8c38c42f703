"""The GPU benchmarks, where no CUDA GPU with PyTorch is at hand, say so in one sentence and
exit 1 (no traceback)."""

import importlib.util

import pytest
from testutil import ROOT, run_python


def _cuda_torch():
    if importlib.util.find_spec("torch") is None:
        return False
    probe = run_python(
        "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)", cwd=ROOT, timeout=120
    )
    return probe.returncode == 0


@pytest.mark.parametrize("script", ["bench_gpu_fmha.py", "bench_gpu_fused.py"])
def test_gpu_benchmark_without_a_gpu_is_one_sentence(script, tmp_path):
    if _cuda_torch():
        pytest.skip("PyTorch with a CUDA device is here: the benchmark would run")
    r = run_python(f"{ROOT}/benchmarks/{script}", "--out", str(tmp_path / "out.json"), cwd=ROOT, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"{script} needs a CUDA GPU"), r.stderr
    assert not (tmp_path / "out.json").exists()

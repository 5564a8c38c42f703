"""GPU tests of the CUDA kernels through the C-ABI harness (no Paddle needed).

Skipped, with the reason, where torch with CUDA is not importable (these 2-core CI
machines). On a GPU machine: ``benchmarks/gpu_check.sh OUT`` builds the harness and
runs them (or ``make -C custom_ops/harness && python -m pytest tests/gpu``).
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/: philox_ref (the numpy Philox of the CPU tests)


def _torch_cuda():
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means "no torch here"
        return None, f"torch is not importable ({type(e).__name__}: {e}); the CUDA kernel tests need PyTorch with CUDA"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} has no usable CUDA device; the CUDA kernel tests need a GPU"
    return torch, None


@pytest.fixture(scope="session")
def torch_cuda():
    torch, why = _torch_cuda()
    if torch is None:
        if os.environ.get("PU_GPU_REQUIRED", "") not in ("", "0"):  # set by benchmarks/gpu_check.sh
            pytest.fail("PU_GPU_REQUIRED is set but " + why)
        pytest.skip(why)
    return torch


@pytest.fixture(scope="session")
def harness(torch_cuda):
    import pu_harness

    try:
        return pu_harness.load()
    except pu_harness.HarnessError as e:
        pytest.fail(f"torch with CUDA is here, but the harness is not usable: {e}")

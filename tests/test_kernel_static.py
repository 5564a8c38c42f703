"""What the CUDA kernels' machine code costs, held to its limits without a GPU.

benchmarks/kernel_static.py reads every unit of custom_ops/kernels/cuda built for sm_80 and
sm_90 (the session's one build, shared with tests/test_cuda_compile.py): ptxas's registers and
spills and cuobjdump's SASS. Here it runs on a fresh build and:

* the attention dropout costs at most one Philox call per 8 elements and at most 8
  thread-instructions per element in the main loop of the forward and of every backward
  kernel; a kernel built without dropout holds no Philox constant at all;
* nothing spills, in any kernel of any unit; the deterministic dQ kernel without dropout
  needs at most 168 registers (three blocks of 128 threads per SM);
* the default (one-pass) backward does 5 matmuls of 2 d FLOP per attention element (640 at
  d = 64, counted from its HMMA), the deterministic one no RED/ATOM;
* the roofline estimate at BERT-large 40 x 512: backward at most 2.6x the forward, forward +
  backward with dropout 0.1 within 1.25x of the same without;
* benchmarks/results/kernel_static.json (what docs/performance.md shows) is this build's:
  a kernel change that moves these numbers must rerun the script.

Needs nvcc, c++filt, cuobjdump and nvdisasm (requirements/test.txt installs the last two
from PyPI); skipped without them locally, failed under CI. About a minute on 2 cores after the build.
"""

import json
import os
import sys

import pytest

import testutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import kernel_static  # noqa: E402

pytestmark = pytest.mark.build
SMS = ("80", "90")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, cuda_kernel_build):
    """The analysis of the session's one build of the kernels (tests/test_cuda_compile.py checks its warnings)."""
    try:
        kernel_static.tools()
    except RuntimeError as e:
        if testutil.in_ci():
            pytest.fail(f"CI=true: {e}")
        pytest.skip(str(e))
    return kernel_static.run(
        [int(s) for s in SMS],
        str(tmp_path_factory.mktemp("ks") / "kernel_static.json"),
        os.cpu_count() or 1,
        built=cuda_kernel_build["built"],
    )


@pytest.mark.parametrize("sm", SMS)
def test_dropout_costs_whole_philox_calls(fresh, sm):
    kinds = fresh["sms"][sm]["checks"]["kinds"]
    for kind, c in kinds.items():
        assert c["philox_calls_per_element"] <= 1 / 8, (sm, kind, c)
        assert c["dropout_added_thread_instructions_per_element"] <= 8, (sm, kind, c)
    assert fresh["sms"][sm]["checks"]["philox_constants_without_dropout"] == 0


@pytest.mark.parametrize("sm", SMS)
def test_no_spills_and_the_dq_kernel_fits_three_blocks(fresh, sm):
    checks = fresh["sms"][sm]["checks"]
    assert checks["spill_bytes"] == 0, [
        e for es in fresh["sms"][sm]["units"].values() for e in es if e.get("spill_stores") or e.get("spill_loads")
    ]
    assert checks["kinds"]["bwd_dq_det"]["registers_without_dropout"] <= 168, checks["kinds"]["bwd_dq_det"]
    for k in fresh["sms"][sm]["kernels"]:  # every backward kernel reports what it occupies
        if k["meta"]["kind"].startswith("bwd"):
            assert k["registers"] > 0 and k["blocks_per_sm"] >= 1, k["name"]


@pytest.mark.parametrize("sm", SMS)
def test_the_backward_does_five_matmuls_and_the_deterministic_one_no_atomics(fresh, sm):
    checks = fresh["sms"][sm]["checks"]
    d = checks["head_dim"]
    assert checks["backward_tensor_flop_per_element"] <= 5 * 2 * d, checks
    assert checks["deterministic_red_atom_instructions"] == 0, checks
    assert checks["kinds"]["bwd_kv"]["red_atom_instructions"] > 0  # the count sees atomics where there are


def test_the_roofline_estimate(fresh):
    est = fresh["sms"]["90"]["estimate"]
    assert est["dropout_0"]["backward_over_forward"] <= 2.6, est["dropout_0"]
    assert est["fwd_bwd_dropout_over_none"] <= 1.25, est


def test_the_committed_record_is_this_build(fresh):
    with open(kernel_static.OUT) as f:
        committed = json.load(f)

    def key(r):
        return {
            (sm, k["name"]): (k["registers"], k["spill_stores"], k["analysis"].get("loop", {}).get("instructions"))
            for sm, res in r["sms"].items()
            for k in res["kernels"]
        }

    new, old = key(fresh), key(committed)
    moved = sorted(
        f"sm_{sm} {name}: {old.get((sm, name))} -> {new.get((sm, name))}"
        for sm, name in set(new) | set(old)
        if old.get((sm, name)) != new.get((sm, name))
    )
    assert not moved, (
        "the kernels changed since benchmarks/results/kernel_static.json was written: rerun "
        "python benchmarks/kernel_static.py and python benchmarks/report.py\n" + "\n".join(moved[:20])
    )

"""paddle_unpad._runtime.cpu_gemm: MKL's AVX2/AVX-512 GEMM kernels on non-Intel x86 CPUs.

The rule (which value for which CPU) is checked on made-up CPUs; what happens in a real
process (the variable set before MKL's first GEMM, MKL's own answer, the products still
right, a user's choice and the opt-out respected, the warning when it is too late) is
checked in fresh subprocesses on this host."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from paddle_unpad import config
from paddle_unpad._runtime import cpu_gemm

pytestmark = pytest.mark.paddle_gpu_stage

AVX512 = set(cpu_gemm.AVX512_FLAGS) | set(cpu_gemm.AVX2_FLAGS)


@pytest.mark.parametrize(
    "vendor, flags, machine, value",
    [
        ("GenuineIntel", AVX512, "x86_64", None),
        ("AuthenticAMD", AVX512, "x86_64", "7"),
        ("AuthenticAMD", {"avx2", "fma", "avx512f"}, "x86_64", "5"),  # AVX-512 F alone is not MKL's SKX set
        ("HygonGenuine", {"avx2", "fma"}, "x86_64", "5"),
        ("AuthenticAMD", {"avx", "sse4_2"}, "x86_64", None),
        ("AuthenticAMD", AVX512, "aarch64", None),
        (None, AVX512, "x86_64", None),
    ],
)
def test_choice_per_cpu(vendor, flags, machine, value):
    got, why = cpu_gemm.choose(vendor, flags, machine)
    assert got == value
    assert why


def test_cpuinfo_is_read_from_the_first_cpu():
    text = textwrap.dedent("""\
        processor\t: 0
        vendor_id\t: AuthenticAMD
        model name\t: AMD EPYC 9J14 96-Core Processor
        flags\t\t: fpu sse2 avx2 fma
        processor\t: 1
        vendor_id\t: Other
        flags\t\t: fpu
        """)
    assert cpu_gemm.cpu_identity(text) == (
        "AuthenticAMD",
        "AMD EPYC 9J14 96-Core Processor",
        {"fpu", "sse2", "avx2", "fma"},
    )


def _run(code, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("MKL_DEBUG_CPU_TYPE", "PADDLE_UNPAD_MKL_DISPATCH")}
    full.update(env, OMP_NUM_THREADS="2")
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


PRODUCT = """
    import json, os, warnings
    import numpy as np
    {prelude}
    import paddle
    import paddle_unpad as pu
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((333, 384)), rng.standard_normal((384, 1536))
    c = paddle.matmul(paddle.to_tensor(a, dtype="float32"), paddle.to_tensor(b, dtype="float32")).numpy()
    err = float(np.linalg.norm(c - a @ b) / np.linalg.norm(a @ b))
    print(json.dumps(dict(pu._runtime.cpu_gemm.info(), err=err, env=os.environ.get("MKL_DEBUG_CPU_TYPE"))))
"""


def test_this_host_gets_its_widest_kernels_and_right_products():
    vendor, _, flags = cpu_gemm.cpu_identity()
    value, _ = cpu_gemm.choose(vendor, flags)
    got = _run(PRODUCT.format(prelude=""))
    assert got["err"] < 10 * 384**0.5 * 2.0**-23  # fp32 GEMM rounding, not a lower-precision path
    if value is None:
        assert got["action"] == "unchanged" and got["env"] is None
    else:
        assert (got["action"], got["value"], got["env"]) == ("set", value, value)
        if got["mkl"] is not None:  # MKL's own account of the kernels it runs
            assert got["mkl_kernels"] == cpu_gemm.KERNELS[value]


def test_a_users_setting_and_the_opt_out_are_left_alone():
    got = _run(PRODUCT.format(prelude=""), MKL_DEBUG_CPU_TYPE="5")
    assert (got["action"], got["value"], got["env"]) == ("unchanged", "5", "5")
    got = _run(PRODUCT.format(prelude=""), PADDLE_UNPAD_MKL_DISPATCH="off")
    assert got["action"] == "unchanged" and got["env"] is None and "off" in got["why"]


def test_a_bad_opt_out_value_raises_naming_it_and_changes_nothing(monkeypatch):
    monkeypatch.delenv(cpu_gemm.ENV, raising=False)
    monkeypatch.setenv(config.variable("MKL_DISPATCH").env, "maybe")
    with pytest.raises(config.ConfigError, match="PADDLE_UNPAD_MKL_DISPATCH='maybe'"):
        cpu_gemm.configure()
    assert cpu_gemm.ENV not in os.environ


def test_too_late_after_a_gemm_warns_and_sets_nothing():
    # a matmul before the plugin's configure(): simulated for any host by calling it again
    # with an AMD AVX2 CPU, after a GEMM has loaded MKL
    got = _run("""
        import json, os, warnings
        import paddle
        paddle.matmul(paddle.ones([8, 8]), paddle.ones([8, 8]))
        from paddle_unpad._runtime import cpu_gemm
        os.environ.pop("MKL_DEBUG_CPU_TYPE", None)
        if cpu_gemm.mkl_library() is None:
            print(json.dumps({"no_mkl": True}))
            raise SystemExit(0)
        cpu_gemm.cpu_identity = lambda: ("AuthenticAMD", "test CPU", {"avx2", "fma"})
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            cpu_gemm.configure()
        print(json.dumps(dict(cpu_gemm.info(), warnings=[str(x.message) for x in w],
                              env=os.environ.get("MKL_DEBUG_CPU_TYPE"))))
    """)
    if got.get("no_mkl"):
        pytest.skip("this Paddle build runs its GEMMs without MKL: nothing to configure")
    assert got["action"] == "too late" and got["env"] is None
    assert len(got["warnings"]) == 1 and "MKL_DEBUG_CPU_TYPE=5" in got["warnings"][0]

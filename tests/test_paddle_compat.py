"""The version shim and the build's view of Paddle and CUDA: the same answers on every
supported Paddle (2.6.x, 3.x; CPU and GPU builds), CUDA found the way Paddle users expect,
and a GPU build that can never pass as a CPU-only one."""

import os
import stat
import subprocess
import sys
import warnings

import numpy as np
import paddle
import pytest

from paddle_unpad._runtime import build_config as cfg
from paddle_unpad._runtime import paddle_compat as compat
from paddle_unpad import ops
from testutil import assert_close, in_ci, require_native

pytestmark = pytest.mark.paddle_gpu_stage


def _need_nvcc():
    if cfg.find_cuda() is None:
        msg = "no CUDA toolkit (nvcc) on this machine: the CUDA discovery cannot be checked"
        if in_ci():
            pytest.fail("CI=true: " + msg)
        pytest.skip(msg)


# ----------------------------------------------------------------------------- versions


def test_running_paddle_is_a_supported_version():
    assert compat.PADDLE_VERSION in compat.SUPPORTED_PADDLE, (paddle.__version__, compat.SUPPORTED_PADDLE)


def test_untested_paddle_warns_once_at_import(monkeypatch):
    monkeypatch.setattr(compat, "PADDLE_VERSION", (2, 5))
    with pytest.warns(RuntimeWarning, match=r"has not been tested .*tested: 2\.6"):
        compat.check_versions()


def test_protobuf_that_breaks_paddle_26_fleet_is_named():
    assert 'install "protobuf<7"' in compat.protobuf_problem((2, 6), "7.36.2")
    assert compat.protobuf_problem((2, 6), "6.33.6") is None
    assert compat.protobuf_problem((3, 3), "7.36.2") is None
    # and the running pair is one that works (the set-up pins it)
    assert compat.protobuf_problem() is None


def test_untested_paddlenlp_warns():
    with pytest.warns(RuntimeWarning, match="PaddleNLP 2.7.2 has not been tested"):
        compat.check_paddlenlp_version("2.7.2")
    for tested in ("2.8.1", "3.0.0b4"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compat.check_paddlenlp_version(tested)


def test_missing_paddlenlp_is_one_sentence_naming_the_versions(monkeypatch):
    """PaddleNLP is an extra: convert, the model families and UnpadTrainer say at first use which one to install."""
    monkeypatch.setitem(sys.modules, "paddlenlp.transformers", None)  # its import now fails
    with pytest.raises(ImportError) as e:
        compat.require_paddlenlp()
    said = str(e.value)
    assert (
        said.startswith(
            "paddle_unpad: convert, the model families and UnpadTrainer need PaddleNLP 2.8.1 or 3.0 "
            '(pip install "paddlenlp>=2.8.1,<3.1"'
        )
        and "\n" not in said
    )
    assert "importing paddlenlp.transformers failed: " in said


# ----------------------------------------------------------------------------- custom-op calls


def test_generated_op_function_returns_every_output(native_ops):
    q = paddle.to_tensor(np.random.default_rng(0).standard_normal((5, 2, 8)).astype("float32"))
    cu = paddle.to_tensor([0, 2, 5], dtype="int32")
    outs = compat.custom_op_function("pu_fmha")(q, q, q, cu, None, 3, 0.5, 0.0, True, False)
    assert isinstance(outs, list) and len(outs) == 2  # out, log-sum-exp
    assert list(outs[0].shape) == [5, 2, 8]
    single = compat.custom_op_function("pu_bias_gelu")(q.reshape([5, 16]), paddle.zeros([16]))
    assert isinstance(single, list) and list(single[0].shape) == [5, 16]


def test_is_tensor_knows_dygraph_tensors_and_nothing_else():
    assert compat.is_tensor(paddle.zeros([2]))
    assert not compat.is_tensor(np.zeros(2))
    assert not compat.is_tensor([0, 1])


def test_default_generator_is_the_one_paddle_seed_sets():
    paddle.seed(1234)
    a = compat.default_generator(paddle.CPUPlace()).random()
    paddle.seed(1234)
    assert compat.default_generator(paddle.CPUPlace()).random() == a


def test_strided_inputs_are_read_as_their_logical_values(native_ops, rng):
    """Transposed views reach the kernels (Paddle 3.x: Tensor::contiguous(); 2.6: a copy
    through a regular op); the result is the one of the dense tensor."""
    T, H, D = 11, 3, 8
    base = paddle.to_tensor(rng.standard_normal((H, T, D)).astype("float32"))
    q = base.transpose([1, 0, 2])  # a view in Paddle versions with strides
    k = paddle.to_tensor(rng.standard_normal((T, H, D)).astype("float32"))
    cu = paddle.to_tensor([0, 4, 4, 11], dtype="int32")
    got = ops.fmha(q, k, k, cu, 7)
    ref = ops.fmha_reference(paddle.to_tensor(q.numpy()), k, k, cu, 7)
    assert_close("fmha(strided q)", got.numpy(), ref.numpy(), ops.FMHA_TOLERANCE["float32"])
    x = paddle.to_tensor(rng.standard_normal((6, 10)).astype("float32")).transpose([1, 0])  # [10, 6] view
    b = paddle.to_tensor(rng.standard_normal(6).astype("float32"))
    got = ops.bias_gelu(x, b)
    ref = ops.bias_gelu_reference(paddle.to_tensor(x.numpy()), b)
    assert_close("bias_gelu(strided x)", got.numpy(), ref.numpy(), ops.FUSED_OPS_TOLERANCE["float32"])


# ----------------------------------------------------------------------------- CUDA discovery


def _write_wrapper(folder, target):
    """An `nvcc` on PATH that is a shell script outside the toolkit (as on the CI machines)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "nvcc")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nexec "{target}" "$@"\n')
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


def test_a_wrapper_nvcc_on_path_leads_to_its_toolkit(tmp_path, monkeypatch):
    _need_nvcc()
    real = cfg.find_cuda().nvcc
    wrapper = _write_wrapper(str(tmp_path / "bin"), real)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin") + os.pathsep + "/usr/bin:/bin")
    monkeypatch.setattr(compat, "paddle_cuda_home", lambda: str(tmp_path))  # Paddle's guess: the wrapper's folder
    found = cfg.find_cuda()
    assert found is not None and found.nvcc == wrapper and found.found_by == "nvcc on PATH"
    assert any(os.path.exists(os.path.join(d, "cuda_runtime.h")) for d in found.include_dirs), found
    assert all(any(n.startswith("libcudart.so") for n in os.listdir(d)) for d in found.library_dirs), found
    thrust = [d for d in found.include_dirs if os.path.exists(os.path.join(d, "thrust", "complex.h"))]
    assert thrust, f"no include dir with thrust/complex.h among {found.include_dirs}"


def test_cuda_home_wins_and_a_wrong_one_is_named(tmp_path, monkeypatch):
    _need_nvcc()
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"CUDA_HOME='.*' has no bin/nvcc"):
        cfg.find_cuda()


def test_cuda_flags_reach_every_cuda_unit_and_the_fingerprint(monkeypatch):
    _need_nvcc()
    inc = cfg.find_cuda().include_dirs
    flags = cfg.cxx_flags(with_cuda=True)
    assert "-DPADDLE_WITH_CUDA" in flags and all("-isystem" + d in flags for d in inc)
    assert "-DPADDLE_WITH_CUDA" not in cfg.cxx_flags(with_cuda=False)
    monkeypatch.setenv("PADDLE_UNPAD_CUDA_ARCHS", "80")
    one = cfg.build_fingerprint(True)
    monkeypatch.setenv("PADDLE_UNPAD_CUDA_ARCHS", "80;90")
    assert cfg.build_fingerprint(True) != one, "the CUDA archs must be part of the JIT build fingerprint"


def test_cpu_paddle_builds_cpu_kernels_and_says_why(monkeypatch):
    if paddle.is_compiled_with_cuda():
        pytest.skip(f"Paddle {paddle.__version__} is a CUDA build: the CPU-only plan does not apply")
    monkeypatch.delenv("PADDLE_UNPAD_REQUIRE_CUDA", raising=False)
    wanted, why = cfg.cuda_plan()
    assert not wanted and "CPU build" in why
    monkeypatch.setenv("PADDLE_UNPAD_REQUIRE_CUDA", "1")
    with pytest.raises(RuntimeError, match="PADDLE_UNPAD_REQUIRE_CUDA is set but the CUDA kernels cannot be built"):
        cfg.cuda_plan()


def test_libraries_of_other_paddle_builds_are_left_alone(tmp_path):
    tag = cfg.library_tag()
    other = "p26gpu" if tag != "p26gpu" else "p33cpu"
    (tmp_path / f"_ops_lib_{other}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    assert cfg.find_installed_library(str(tmp_path)) is None
    mine = tmp_path / f"_ops_lib_{tag}.cpython-311-x86_64-linux-gnu.so"
    mine.write_bytes(b"")
    assert cfg.find_installed_library(str(tmp_path)) == str(mine)


def test_paddle_with_cuda_never_passes_as_a_cpu_only_build():
    """Where Paddle has CUDA and the build had a toolkit (CI: the paddlepaddle-gpu stage),
    every op must have its GPU kernels registered."""
    import paddle_unpad as pu

    if not paddle.is_compiled_with_cuda():
        pytest.skip(f"Paddle {paddle.__version__} is a CPU build: no CUDA kernels expected")
    require_native(pu.ops_available(), ("fmha",), "fmha")
    if cfg.find_cuda() is None and not in_ci():
        pytest.skip("no CUDA toolkit here: this build could only make the CPU kernels")
    avail = pu.ops_available()
    assert all(v["gpu"] for v in avail.values()), f"a CUDA Paddle got a CPU-only build: {avail}"


def test_build_says_in_one_line_when_cuda_paddle_gets_cpu_kernels_only(tmp_path):
    """Paddle with CUDA but no toolkit: one line on stderr, CPU kernels built (no silent half-build)."""
    if not paddle.is_compiled_with_cuda():
        pytest.skip(f"Paddle {paddle.__version__} is a CPU build: the message is for CUDA builds of Paddle")
    code = (
        "import zlib, sys; sys.path.insert(0, %r)\n"
        "from paddle_unpad._runtime import build_config as cfg\n"
        "cfg.find_cuda = lambda: None\n"
        "print(cfg.cuda_plan())\n"
    ) % os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PADDLE_UNPAD_REQUIRE_CUDA", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "(False, " in proc.stdout and "no CUDA toolkit was found" in proc.stdout, proc.stdout

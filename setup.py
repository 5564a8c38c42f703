"""Build and install paddle_unpad.

Two native artefacts are built:

* ``paddle_unpad/_ops_lib_<tag>*.so`` -- the Paddle custom operators (``PD_BUILD_OP``),
  tagged with the Paddle it is built against (``p33cpu``, ``p26gpu``, ...).
  It is not a Python module: ``paddle_unpad._native`` registers it with
  ``load_op_meta_info_and_register_op``. C++ CPU kernels always; CUDA kernels too
  when Paddle is compiled with CUDA and ``nvcc`` is found.
* ``paddle_unpad/balance/_planner*.so`` -- the load-balance planner (pybind11),
  built when its source exists.

Needs paddle at build time, hence ``pip install --no-build-isolation``.

Build settings (environment variables, declared in paddle_unpad/config.py and listed in
docs/api.md): SKIP_CUDA, REQUIRE_CUDA, CUDA_ARCHS, NATIVE_ARCH, BUILD_JOBS.
"""
import os
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "paddle_unpad"))
import _build_config as cfg  # noqa: E402  (one source of truth for flags, shared with the JIT fallback)

sys.path.pop(0)


class BuildExt(build_ext):
    """Builds the custom-op library with its own compile loop (per-file compilers, parallel jobs)."""

    def get_ext_filename(self, ext_name):
        name = super().get_ext_filename(ext_name)
        if ext_name.split(".")[-1] == "_ops_lib":  # one library per Paddle build (see library_tag)
            head, base = os.path.split(name)
            name = os.path.join(head, base.replace("_ops_lib", cfg.library_stem(), 1))
        return name

    def build_extension(self, ext):
        if ext.name == "paddle_unpad._ops_lib":
            out = self.get_ext_fullpath(ext.name)
            # A fixed folder (pip's editable builds get a fresh build_temp each time), so
            # that a rebuild compiles only what changed; objects are kept per flag set.
            tmp = os.path.join(ROOT, "build", "paddle_unpad_ops")
            cfg.build_ops_library(out, tmp, verbose=True)
        else:
            super().build_extension(ext)


def extensions():
    exts = [Extension("paddle_unpad._ops_lib", sources=cfg.ops_sources(with_cuda=False))]
    planner = os.path.join(ROOT, "custom_ops", "planner", "planner.cc")
    if os.path.exists(planner):
        import pybind11

        exts.append(
            Extension(
                "paddle_unpad.balance._planner",
                sources=[os.path.relpath(planner, ROOT)],
                include_dirs=[pybind11.get_include()],
                extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden"],
                language="c++",
            )
        )
    return exts


setup(
    name="paddle_unpad",
    version="0.1.0",
    description="Unpadded BERT-style training for PaddlePaddle: varlen FMHA, fused encoder ops, "
    "load-balanced fleet training",
    packages=find_packages(include=["paddle_unpad", "paddle_unpad.*"]),
    python_requires=">=3.8",
    # paddle itself is deliberately absent: paddlepaddle (CPU) and paddlepaddle-gpu
    # provide the same module, and the user brings the one they need.
    install_requires=["numpy"],
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExt},
    zip_safe=False,
)

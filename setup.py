"""Build and install paddle_unpad.

Two native artefacts are built:

* ``paddle_unpad/_ops_lib_<tag>*.so`` -- the Paddle custom operators (``PD_BUILD_OP``),
  tagged with the Paddle it is built against (``p33cpu``, ``p26gpu``, ...).
  It is not a Python module: ``paddle_unpad._runtime.native`` registers it with
  ``load_op_meta_info_and_register_op``. C++ CPU kernels always; CUDA kernels too
  when Paddle is compiled with CUDA and ``nvcc`` is found.
* ``paddle_unpad/balance/_planner*.so`` -- the load-balance planner (pybind11),
  built when its source exists.

Needs paddle at build time, hence ``pip install --no-build-isolation``, which installs no
build requirement: those in pyproject.toml must be there first. Before anything is
imported from paddle, the build checks both and stops with one sentence naming what is
missing and what to run.

Requirements are read from requirements/*.txt, which ``make setup`` installs too (with the exact
pins of constraints.txt): install.txt (install_requires: numpy, as your Paddle brought it), the
extras ``paddlenlp`` (PaddleNLP 2.8.1 or 3.0, for ``convert``, the model families and
``UnpadTrainer``), ``examples`` and ``test`` (each including the one before); data.txt is
installed with ``--no-deps`` and is no extra (see that file).

Build settings (environment variables, declared in paddle_unpad/config.py and listed in
docs/api.md): SKIP_CUDA, REQUIRE_CUDA, CUDA_ARCHS, NATIVE_ARCH, BUILD_JOBS.
"""

import importlib.util
import os
import re
import sys
import sysconfig

ROOT = os.path.dirname(os.path.abspath(__file__))


def build_requirements():
    """pyproject.toml's ``[build-system] requires`` (read with a pattern: tomllib is 3.11+)."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        found = re.search(r"^requires\s*=\s*\[(.*?)\]", f.read(), re.M | re.S)
    return re.findall(r'"([^"]+)"', found.group(1))


# The README's install line (tests/test_install.py runs it from there and checks the two agree).
INSTALL_LINE = (
    "pip install "
    + " ".join(f'"{r}"' if re.search(r"[<>=!~;\[ ]", r) else r for r in build_requirements())
    + " && pip install --no-build-isolation ."
)


def _unmet(requirement):
    """True when ``requirement`` (a PEP 508 string) is not installed in a matching version."""
    from importlib import metadata

    try:
        from packaging.requirements import Requirement
    except ImportError:
        try:
            from pip._vendor.packaging.requirements import Requirement
        except ImportError:
            Requirement = None
    name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return True
    return Requirement is not None and not Requirement(requirement).specifier.contains(version, prereleases=True)


def check_build_environment():
    """Stop with one sentence when the build cannot work here: no Paddle (pip's isolated build
    environment hides the installed one), or a build requirement missing (pip installs none
    with --no-build-isolation), instead of a traceback from deep inside the build."""
    if importlib.util.find_spec("paddle") is None:
        site = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
        hidden = any(os.path.isdir(os.path.join(d, "paddle")) for d in site)
        isolated = hidden or any("build-env" in p for p in sys.path)
        if isolated:
            sys.exit(
                f"paddle_unpad builds against the Paddle you have installed: run {INSTALL_LINE} "
                "(pip's isolated build environment has no Paddle)"
            )
        sys.exit(
            f"paddle_unpad builds against an installed Paddle and {sys.executable} has none: install "
            "paddlepaddle (CPU) or paddlepaddle-gpu first, then run " + INSTALL_LINE
        )
    missing = [r for r in build_requirements() if _unmet(r)]
    if missing:
        sys.exit(
            f"paddle_unpad's build needs {', '.join(missing)} (pip installs no build requirement with "
            f"--no-build-isolation): run {INSTALL_LINE}"
        )


def read_requirements(name):
    """The requirement lines of requirements/<name>.txt (one source for setup.py and make setup)."""
    with open(os.path.join(ROOT, "requirements", name + ".txt"), encoding="utf-8") as f:
        return [line.split("#", 1)[0].strip() for line in f if line.split("#", 1)[0].strip()]


check_build_environment()

from setuptools import Extension, find_packages, setup  # noqa: E402
from setuptools.command.build_ext import build_ext  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "paddle_unpad", "_runtime"))
import build_config as cfg  # noqa: E402  (one source of truth for flags, shared with the JIT fallback)

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
    install_requires=read_requirements("install"),
    extras_require={
        "paddlenlp": read_requirements("paddlenlp"),
        "examples": read_requirements("examples") + read_requirements("paddlenlp"),
        "test": read_requirements("test") + read_requirements("examples") + read_requirements("paddlenlp"),
    },
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExt},
    zip_safe=False,
)

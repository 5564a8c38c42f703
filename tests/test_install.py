"""The README's install line, run into a user's own Paddle environment.

A fresh venv (``python -m venv``) holding only paddlepaddle gets the line from README.md's
"Install into your own environment", run in a copy of the repository (an in-tree build
writes ``build/`` and ``*.egg-info`` there). Then the compiled CPU operators, PaddleNLP and
the section's check snippet (three training steps) must work in that venv, run from outside
the source tree. ``pip install .`` without ``--no-build-isolation`` must stop with the one
sentence that gives that line. Needs the package index (paddlepaddle, the PaddleNLP pins).
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
SECTION = "## Install into your own environment"
STOP_SENTENCE = "paddle_unpad builds against the Paddle you have installed: run "


def _section(path=os.path.join(ROOT, "README.md"), title=SECTION):
    text = open(path, encoding="utf-8").read()
    assert title in text, f"{os.path.relpath(path, ROOT)} has no section {title!r}: the install tests read it"
    return text.split(title, 1)[1].split("\n## ", 1)[0]


def _blocks(text, lang):
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _commands(block):
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def readme_install_line():
    bash = _blocks(_section(), "bash")
    assert bash, f"README.md {SECTION!r} has no bash block"
    lines = _commands(bash[0])
    assert len(lines) == 1, f"README.md {SECTION!r}: the first bash block should be the one install line, got {lines}"
    return lines[0]


def _run(cmd, timeout, **kw):
    """Run, and fail naming the command and its output's tail on a non-zero exit or a timeout."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"timed out after {timeout} s: {cmd}\n{(e.stdout or '')[-2000:]}{(e.stderr or '')[-2000:]}")
    return proc


def _ok(cmd, timeout, **kw):
    proc = _run(cmd, timeout, **kw)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_install_docs_agree():
    """The GPU line and docs/gpu.md repeat the README's line; the Makefile pins nothing itself."""
    line = readme_install_line()
    gpu = [b for b in _blocks(_section(), "bash") if "CUDA_HOME" in b]
    assert gpu and line in _commands(gpu[0]), f"README.md's GPU block should run the same line: {line}"
    docs = open(os.path.join(ROOT, "docs", "gpu.md"), encoding="utf-8").read()
    assert line in docs, f"docs/gpu.md ('Without the Makefile') should give the README's line: {line}"
    make = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
    assert "-r requirements/install.txt" in make and "paddlenlp==" not in make, \
        "the Makefile should install requirements/install.txt, not pins of its own"


@pytest.fixture(scope="module")
def paddle_venv(tmp_path_factory):
    """A fresh venv holding only paddlepaddle, a copy of the repository, and the env to run in."""
    base = tmp_path_factory.mktemp("install")
    venv = base / "venv"
    _ok([sys.executable, "-m", "venv", str(venv)], timeout=120)
    py = str(venv / "bin" / "python")
    _ok([py, "-m", "pip", "install", "-q", PADDLE], timeout=300)
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "*.so", "*.o", "__pycache__", ".pytest_cache"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # PIP_NO_COMPILE: pip's byte-compiling of the ~100 packages PaddleNLP brings took over a
    # minute of the install on 2 busy cores; Python compiles what the checks import anyway.
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               OMP_NUM_THREADS="1", PIP_NO_COMPILE="1")
    return {"py": py, "venv": str(venv), "src": str(src), "env": env, "work": base}


@pytest.mark.slow
@pytest.mark.build
def test_pip_install_without_flag_stops_with_one_sentence(paddle_venv):
    proc = _run([paddle_venv["py"], "-m", "pip", "install", paddle_venv["src"]], timeout=300,
                cwd=paddle_venv["src"], env=paddle_venv["env"])
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode != 0, "pip install . without --no-build-isolation should fail (no Paddle in its build env)"
    said = [i for i, text in enumerate(out) if STOP_SENTENCE in text]
    assert said, "pip's output lacks the sentence saying what to run:\n" + "\n".join(out[-30:])
    assert len(out) - said[-1] <= 15, "the sentence should be near the end of pip's output:\n" + "\n".join(out[-30:])
    assert readme_install_line() in out[said[-1]], f"the sentence should give the README's line:\n{out[said[-1]]}"
    assert not any("Traceback" in text for text in out), "the build should stop without a traceback:\n" + \
        "\n".join(out[-60:])


@pytest.mark.slow
@pytest.mark.build
def test_readme_install_line_into_fresh_paddle_venv(paddle_venv):
    py, env = paddle_venv["py"], paddle_venv["env"]
    line = readme_install_line()
    _ok(["bash", "-c", f"set -e; {line}"], timeout=900, cwd=paddle_venv["src"], env=env)
    _ok([py, "-m", "pip", "check"], timeout=120, env=env)

    # The README's snippet as written, then (in the same interpreter: one Paddle import) where
    # paddle_unpad and its operator library came from; run outside the source tree.
    snippets = _blocks(_section(), "python")
    assert snippets, f"README.md {SECTION!r} has no python snippet to check the install with"
    outside = paddle_venv["work"] / "run"
    outside.mkdir()
    script = outside / "check_install.py"
    script.write_text(snippets[0] + "\n\nimport json, paddle_unpad, paddlenlp.transformers\n"
                      "print('PROBE', json.dumps({'file': paddle_unpad.__file__, "
                      "'avail': paddle_unpad.ops_available(), 'info': paddle_unpad._native.info()}))\n")
    out = _ok([py, str(script)], timeout=300, cwd=str(outside), env=env).stdout
    losses = [float(x) for x in re.findall(r"^step \d+: loss (\S+)$", out, re.M)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), f"the snippet should train 3 steps:\n{out}"
    got = json.loads(re.search(r"^PROBE (.*)$", out, re.M).group(1))
    assert got["file"].startswith(paddle_venv["venv"]), f"paddle_unpad was not imported from the venv: {got['file']}"
    assert got["info"]["path"] and got["info"]["path"].startswith(paddle_venv["venv"]), \
        f"the installed operator library was not the one registered: {got['info']}"
    assert got["avail"] and all(v["cpu"] for v in got["avail"].values()), f"CPU operators not built: {got['avail']}"

"""The code blocks of README.md and docs/*.md run as written, or are labelled with the reason why not.

Labels: an HTML comment (invisible when rendered) on the line before a block's opening fence.

    <!-- fragment: REASON -->          not run: part of a larger script, or minutes of work (the
                                       reason is required and names where it is checked, if anywhere)
    <!-- needs: gpu -->                not run here; the prose before the block says it needs a GPU
    <!-- needs: several machines -->   not run here; the prose before the block says so
    <!-- slow -->                      run in the slow tier (pytest -m slow): small jobs, a minute or
                                       so (measured on 2 cores: the pre-training pair 61 s alone)
    (no label)                         run in the unit tier: seconds

How they run. Every block names its language; python, bash, sh, shell and console blocks are
code, other languages (text: output, diff: an edit) are not run.

- The ```python blocks of one page run in order in one fresh interpreter: a page reads top to
  bottom, so a later block may use names (``np``, ``model``, ``batch``) from an earlier one.
  A fragment is left out of that sequence; python blocks take no ``slow`` label.
- Each shell block runs alone, under ``bash -e -o pipefail``, in a fresh temporary folder that
  links ``examples/`` and ``benchmarks/`` (the commands name them relative to the repository
  root), with this interpreter's ``python`` first on PATH and OMP_NUM_THREADS=1. A shell block
  that installs into or replaces the environment (``pip install``, ``make setup``, ``-m venv``)
  must carry a label that keeps it from running: the test never runs one.

Nothing downloads: the environment is set offline for Hugging Face and pip, and the examples
read their data and weights from installed packages.
"""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
CODE = {"python", "bash", "sh", "shell", "console"}
SHELL = CODE - {"python"}
NEEDS = {"gpu": r"\bgpus?\b", "several machines": r"\bmachines?\b"}
LABEL = re.compile(r"<!--\s*(fragment|needs|slow)\s*(?::\s*(.*?))?\s*-->")
FENCE = re.compile(r"^\s*```\s*([\w+-]*)\s*$")
# commands that change the environment the tests run in: never run, whatever the label says
CHANGES_ENV = re.compile(r"\bpip3? +(install|uninstall)\b|\bmake +setup\b|-m +venv\b|\bconda +install\b")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PIP_NO_INDEX": "1"}


class Block:
    def __init__(self, path, line, lang, code, label, prose):
        self.path, self.line, self.lang, self.code, self.prose = path, line, lang, code, prose
        self.kind, self.value = label

    @property
    def name(self):
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"

    @property
    def runs(self):
        return self.kind in ("", "slow")


def _label(lines, i):
    """The label on the line before line ``i`` (an opening fence): (kind, value), ("", "") if none."""
    m = LABEL.fullmatch(lines[i - 1].strip()) if i > 0 else None
    return (m.group(1), m.group(2) or "") if m else ("", "")


def _closing(lines, i, path):
    """The line of the fence that closes the block opened at line ``i``."""
    for j in range(i + 1, len(lines)):
        m = FENCE.match(lines[j])
        if m and not m.group(1):
            return j
    raise AssertionError(f"{path}:{i + 1}: a fenced block that is never closed")


def blocks(path):
    """Every fenced block of a markdown file, with its label and the prose since the previous block."""
    lines = open(path, encoding="utf-8").read().splitlines()
    found, i, prose_start = [], 0, 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = _closing(lines, i, path)
        found.append(
            Block(
                path,
                i + 1,
                m.group(1),
                "\n".join(lines[i + 1 : end]) + "\n",
                _label(lines, i),
                "\n".join(lines[prose_start:i]),
            )
        )
        i = prose_start = end + 1
    return found


ALL = [b for p in DOCS for b in blocks(p)]
PAGES = [p for p in DOCS if any(b.lang == "python" and b.runs for b in blocks(p))]


def _shell_param(b):
    marks = [pytest.mark.slow] if b.kind == "slow" else []
    if "paddle.distributed.launch" in b.code:
        marks.append(pytest.mark.dist)
    return pytest.param(b, id=b.name, marks=marks)


SHELL_BLOCKS = [_shell_param(b) for b in ALL if b.lang in SHELL and b.runs]


def _env():
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    pythonpath = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH", "")]))
    return dict(os.environ, OMP_NUM_THREADS="1", PATH=path, PYTHONPATH=pythonpath, **OFFLINE)


def _label_problem(b):
    """Why a block's label (or its lack of one) breaks the rules above; "" when it does not."""
    if not b.lang:
        return "a fenced block names its language (python, bash, text, ...)"
    if b.kind and b.lang not in CODE:
        return f"a label on a {b.lang} block, which never runs"
    if b.kind == "fragment" and not b.value:
        return "<!-- fragment: REASON --> needs its reason"
    if b.kind == "needs" and b.value not in NEEDS:
        return f"<!-- needs: {b.value} -->: known needs are {sorted(NEEDS)}"
    if b.kind == "needs" and not re.search(NEEDS[b.value], b.prose, re.I):
        return f"the prose before a block that needs {b.value} does not say so"
    if b.kind == "slow" and (b.value or b.lang == "python"):
        return "<!-- slow --> takes no value and labels shell blocks only"
    if b.runs and b.lang in SHELL and CHANGES_ENV.search(b.code):
        return "it installs into (or replaces) the environment: label it a fragment, or needs: gpu"
    return ""


def test_every_block_runs_or_says_why_not():
    problems = [f"{b.name}: {_label_problem(b)}" for b in ALL if _label_problem(b)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "lang,label,prose,code",
    [
        ("", ("", ""), "", "x\n"),  # no language
        ("bash", ("fragment", ""), "", "make demo\n"),  # a fragment without its reason
        ("bash", ("needs", "tpu"), "on a TPU", "run\n"),  # an unknown need
        ("bash", ("needs", "gpu"), "One machine:", "run --gpus 0\n"),  # the prose does not say so
        ("python", ("slow", ""), "", "print(1)\n"),  # python takes no tier label
        ("text", ("fragment", "output"), "", "a table\n"),  # a label on a block that never runs
        ("bash", ("", ""), "", "pip install .\n"),  # would change the environment
        ("bash", ("slow", ""), "", "make setup PADDLE=gpu\n"),
    ],
)
def test_label_rules_catch_mistakes(lang, label, prose, code):
    assert _label_problem(Block("x.md", 1, lang, code, label, prose))


def test_docs_have_code_that_runs_in_each_tier():
    assert os.path.join(ROOT, "README.md") in PAGES and len(PAGES) >= 3
    kinds = {b.kind for b in ALL if b.lang in SHELL and b.runs}
    assert kinds == {"", "slow"}, kinds


def test_labels_are_read():
    """The parser itself: a label, a fragment's reason, the prose, a fence inside a block's text."""
    path = os.path.join(ROOT, "docs", "distributed.md")
    found = {b.line: b for b in blocks(path)}
    gpu = [b for b in found.values() if b.kind == "needs" and b.value == "gpu"]
    assert gpu and all("--gpus" in b.code and re.search("GPU", b.prose) for b in gpu)
    assert sum(b.value == "several machines" for b in found.values()) >= 2
    assert LABEL.fullmatch("<!-- fragment: a reason -->").groups() == ("fragment", "a reason")
    assert CHANGES_ENV.search("make setup PADDLE=gpu") and not CHANGES_ENV.search("python examples/x.py --help")


@pytest.mark.parametrize("path", PAGES, ids=[os.path.relpath(p, ROOT) for p in PAGES])
def test_doc_page_python_runs(path, tmp_path):
    code = [b for b in blocks(path) if b.lang == "python" and b.runs]
    script = "".join(f"print('### block {i}', flush=True)\n{b.code}\n" for i, b in enumerate(code))
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=str(tmp_path), env=_env(), capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        done = re.findall(r"### block (\d+)", proc.stdout)
        b = code[int(done[-1]) if done else 0]
        pytest.fail(f"{b.name} failed:\n{b.code}\n--- stderr ---\n{proc.stderr[-3000:]}")


@pytest.mark.parametrize("block", SHELL_BLOCKS)
def test_doc_shell_block_runs(block, tmp_path):
    assert not CHANGES_ENV.search(block.code), f"{block.name}: {_label_problem(block)}"
    for name in ("examples", "benchmarks"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    timeout = 240 if block.kind == "slow" else 60
    proc = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.code],
        cwd=str(tmp_path),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"{block.name} failed ({proc.returncode}):\n{block.code}\n--- stdout ---\n"
        f"{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    )

"""Every ```python block in README.md and docs/*.md runs as written.

The blocks of one file run in order in one fresh interpreter (a page reads top to
bottom, so later blocks may use names from earlier ones).
"""
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _blocks(path):
    return re.findall(r"```python\n(.*?)```", open(path, encoding="utf-8").read(), re.S)


PAGES = [p for p in DOCS if _blocks(p)]


def test_readme_and_docs_have_python_examples():
    assert os.path.join(ROOT, "README.md") in PAGES and len(PAGES) >= 3


@pytest.mark.parametrize("path", PAGES, ids=[os.path.relpath(p, ROOT) for p in PAGES])
def test_doc_page_code_runs(path, tmp_path):
    blocks = _blocks(path)
    script = "".join(f"print('### block {i}', flush=True)\n{code}\n" for i, code in enumerate(blocks))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        done = re.findall(r"### block (\d+)", proc.stdout)
        i = int(done[-1]) if done else 0
        pytest.fail(f"{os.path.relpath(path, ROOT)}: block {i} failed:\n{blocks[i]}\n--- stderr ---\n"
                    f"{proc.stderr[-3000:]}")

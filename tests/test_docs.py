"""Every ```python block in README.md and docs/*.md runs as written."""
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _blocks():
    for path in DOCS:
        text = open(path, encoding="utf-8").read()
        for i, m in enumerate(re.finditer(r"```python\n(.*?)```", text, re.S)):
            yield pytest.param(m.group(1), id=f"{os.path.relpath(path, ROOT)}#{i}")


BLOCKS = list(_blocks())


def test_docs_have_python_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("code", BLOCKS)
def test_doc_block_runs(code, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"--- code ---\n{code}\n--- stderr ---\n{proc.stderr[-3000:]}"

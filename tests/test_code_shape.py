"""Where things live, held: every paddle.distributed collective in distributed/groups.py, the
record of process changes reading no other module, GradientAllReduce short enough to read."""

import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "paddle_unpad")
COLLECTIVE = re.compile(
    r"\bdist\.(irecv|isend|all_\w+|new_group|broadcast|barrier|send|recv|reduce\w*|scatter|gather)\("
)


def _sources():
    return sorted(glob.glob(os.path.join(PKG, "**", "*.py"), recursive=True))


def test_every_collective_call_is_in_groups():
    found = []
    for path in _sources():
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if COLLECTIVE.search(line) and not line.lstrip().startswith("#"):
                    found.append(os.path.relpath(path, ROOT) + f":{n}")
    assert found, "the pattern no longer finds the collectives in groups.py"
    assert {p.split(":")[0] for p in found} == {"paddle_unpad/distributed/groups.py"}, found


def test_the_record_of_process_changes_reads_no_other_module():
    with open(os.path.join(PKG, "_runtime", "process_changes.py"), encoding="utf-8") as f:
        text = f.read()
    assert "sys.modules" not in text


def test_gradient_all_reduce_is_under_250_lines():
    with open(os.path.join(PKG, "distributed", "grad_sync.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GradientAllReduce")
    assert cls.end_lineno - cls.lineno + 1 < 250

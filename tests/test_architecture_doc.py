"""docs/architecture.md's layer table names every module of the package.

A top-level module is named by its path in a row's *where* column; a module of a subpackage
(``paddle_unpad/<pkg>/<name>.py``) by a row whose *where* names ``paddle_unpad/<pkg>/`` and
whose text names ``<name>.py``. A subpackage's ``__init__.py`` is the package itself.
"""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "paddle_unpad")


def layer_rows():
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Layers of the code", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("layer", "") and not set(cells[0]) <= set("-"):
            rows.append(cells)
    return rows


def modules():
    out = []
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/")
                if f == "__init__.py" and os.path.dirname(rel) != "paddle_unpad":
                    continue
                out.append(rel)
    return sorted(out)


def named(rel, rows):
    pkg, name = os.path.dirname(rel), os.path.basename(rel)
    for _, where, what in rows:
        paths = re.findall(r"`([^`]+)`", where)
        if rel in paths:
            return True
        if pkg != "paddle_unpad" and f"{pkg}/" in paths and f"`{name}`" in what:
            return True
    return False


def test_layer_table_is_read():
    rows = layer_rows()
    assert len(rows) >= 10, rows
    assert named("paddle_unpad/distributed/groups.py", rows)
    assert not named("paddle_unpad/distributed/no_such_module.py", rows)
    assert not named("paddle_unpad/no_such_module.py", rows)


def test_every_module_is_in_the_layer_table():
    rows = layer_rows()
    mods = modules()
    assert len(mods) > 40, mods
    missing = [m for m in mods if not named(m, rows)]
    assert not missing, f"docs/architecture.md, 'Layers of the code': add {missing} to the table"

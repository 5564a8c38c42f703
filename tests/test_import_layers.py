"""The package's imports follow docs/architecture.md's layer table.

The import graph is read from the source (``ast``), not by importing: ``import x``,
``from . import y``, ``from ..a import b`` (an edge to ``a.b`` when that is a module, else to
``a``), and a string that is a module's full dotted name (what ``importlib.import_module``
loads). An import inside a function runs on first use; every other one at import time.

- No cycle among the imports that run at import time.
- A module imports from its own layer or the layers below it (the table lists them from the
  bottom up; a module is in the row whose *where* names its path or its folder). The only
  upward imports are the first-use ones in ``LAZY_UPWARD``, each with its reason.
"""

import ast
import os
import re

from test_architecture_doc import PKG, ROOT, layer_rows

# (importer, imported) -> why an import inside a function may reach a higher layer
LAZY_UPWARD = {
    (
        "paddle_unpad._runtime.aliases",
        "paddle_unpad.ops.philox",
    ): "the old name paddle_unpad.philox stays importable (with a DeprecationWarning); the module loads "
    "only when a caller imports that name",
    (
        "paddle_unpad._runtime.aliases",
        "paddle_unpad.ops.bucketed_attention",
    ): "the old name paddle_unpad.bucketed_attention stays importable (with a DeprecationWarning); the "
    "module loads only when a caller imports that name",
    (
        "paddle_unpad.balance",
        "paddle_unpad.distributed",
    ): "the exchange's old names under paddle_unpad.balance (BalancedLoader, ...) are forwarded, with a "
    "DeprecationWarning, when a caller reads one; balance itself never loads the distributed layer",
}


def module_files():
    """``{dotted name: path}`` of every module of the package, extension modules included."""
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            stem = f[:-3] if f.endswith(".py") else f.split(".", 1)[0] if f.endswith(".so") else None
            if stem is None:
                continue
            parts = os.path.relpath(os.path.join(d, stem), ROOT).split(os.sep)
            out[".".join(parts[:-1] if stem == "__init__" else parts)] = os.path.join(d, f)
    return out


def _resolve(importer, is_package, node, mods):
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = importer.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix for a in node.names]


def imports_of(name, path, mods):
    """``[(imported module, at_import_time)]`` of one module, the package's modules only."""
    if not path.endswith(".py"):
        return []
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((t, not in_function) for t in _resolve(name, is_package, child, mods))
            elif isinstance(child, ast.Constant) and child.value in mods and child.value != "paddle_unpad":
                found.append((child.value, False))  # a name handed to importlib: loaded when called
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return [(t, now) for t, now in found if t in mods and t != name]


def import_graph():
    """``{module: [(imported module, at_import_time)]}``."""
    mods = module_files()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def find_cycle(edges):
    """One cycle of the directed graph ``{node: iterable of nodes}`` as a list of nodes, or None."""
    state, stack = {}, []

    def dfs(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = dfs(nxt)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = dfs(node)
            if cycle:
                return cycle
    return None


def layer_map(rows):
    """``module -> (index from the bottom, layer name)`` for every module the table places."""
    out = {}
    for name, path in module_files().items():
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        for i, (layer, where, _) in enumerate(rows):
            paths = re.findall(r"`([^`]+)`", where)
            if rel in paths or any(p.endswith("/") and rel.startswith(p) for p in paths):
                out[name] = (i, layer)
                break
    return out


def upward_imports():
    """``[(importer, its layer, imported, its layer, at_import_time)]`` that climb the table."""
    rows = layer_rows()
    layers = layer_map(rows)
    out = []
    for src, targets in import_graph().items():
        for dst, now in sorted(set(targets)):
            dst_layer = layers.get(dst, (len(rows), "no layer"))  # an unplaced module counts as the top
            if dst_layer[0] > layers[src][0]:
                out.append((src, layers[src][1], dst, dst_layer[1], now))
    return out


def test_the_graph_reader_sees_each_kind_of_import():
    graph = {src: set(t for t, _ in targets) for src, targets in import_graph().items()}
    assert "paddle_unpad.layers" in graph["paddle_unpad.models.common"]  # from .. import layers
    assert "paddle_unpad._runtime.paddle_compat" in graph["paddle_unpad.models.common"]  # from .._runtime import x
    assert "paddle_unpad.data.collate" in graph["paddle_unpad.models.common"]  # from ..data.collate import X
    assert "paddle_unpad.balance._planner" in graph["paddle_unpad.balance.planner"]  # an extension module
    assert ("paddle_unpad.models.bert", False) in import_graph()["paddle_unpad.models.forwards"]  # in a function
    assert "paddle_unpad.distributed" in graph["paddle_unpad"]  # loaded on first use, by name


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None


def test_no_cycle_among_imports_at_import_time():
    edges = {src: [t for t, now in targets if now] for src, targets in import_graph().items()}
    assert sum(map(len, edges.values())) > 50, edges
    cycle = find_cycle(edges)
    assert cycle is None, f"import cycle at import time: {' -> '.join(cycle)}"


def test_every_module_has_a_layer():
    layers = layer_map(layer_rows())
    unplaced = sorted(name for name, path in module_files().items() if path.endswith(".py") and name not in layers)
    assert not unplaced, f"docs/architecture.md, 'Layers of the code': no row's where column holds {unplaced}"
    assert layers["paddle_unpad"][1] == "front door" and layers["paddle_unpad.config"][1] == "settings"
    assert layers["paddle_unpad.models.heads"] == layers["paddle_unpad.layers"]


def test_imports_go_down_the_layer_table_only():
    upward = upward_imports()
    bad = [
        f"{src} ({src_layer}) imports {dst} ({dst_layer}){'' if now else ' in a function'}"
        for src, src_layer, dst, dst_layer, now in upward
        if now or (src, dst) not in LAZY_UPWARD
    ]
    assert not bad, "imports that climb docs/architecture.md's layer table:\n" + "\n".join(bad)


def test_every_allowed_upward_import_is_still_made():
    made = {(src, dst) for src, _, dst, _, _ in upward_imports()}
    stale = sorted(set(LAZY_UPWARD) - made)
    assert not stale, f"LAZY_UPWARD lists imports the code no longer makes: {stale}"

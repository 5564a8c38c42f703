"""Paddle's internals are touched in two modules only: ``paddle_unpad/_runtime/paddle_compat.py`` (every
difference between Paddle versions, every private name read) and
``paddle_unpad/distributed/workarounds.py`` (the patches of Paddle's distributed runtime). A new
Paddle release is then adapted there and nowhere else.

The walk reads every other module of the package and refuses:

* an import of a private Paddle module (``paddle.base``, ``paddle.fluid``, ``paddle.framework.core``,
  ``paddle.distributed.collective``, ``paddle._C_ops``, ``paddle.utils.cpp_extension.extension_utils``)
  or of an underscore name from any Paddle module;
* an attribute chain through one of those modules (``paddle.base.core.X``);
* ``obj._name`` where no module of the package defines ``_name`` (a private attribute of a
  Paddle object: ``layer._epsilon``, ``model._layers``);
* ``getattr``/``hasattr``/``setattr``/``delattr`` and ``__dict__`` lookups by such a name.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "paddle_unpad")
ALLOWED = {os.path.join("_runtime", "paddle_compat.py"), os.path.join("distributed", "workarounds.py")}
PRIVATE_MODULES = (
    "paddle.base",
    "paddle.fluid",
    "paddle.framework.core",
    "paddle.distributed.collective",
    "paddle._C_ops",
    "paddle.utils.cpp_extension.extension_utils",
)
OURS_PREFIX = "_paddle_unpad"  # marker attributes the plugin sets on Paddle objects


def _sources():
    for d, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path, encoding="utf-8") as fh:
                    yield os.path.relpath(path, PACKAGE), ast.parse(fh.read(), path)


def _is_private(name):
    return (
        name.startswith("_")
        and not (name.startswith("__") and name.endswith("__"))
        and not name.startswith(OURS_PREFIX)
    )


def _own_names(trees):
    """Every name the package defines: functions, classes, assignments, parameters, attributes
    it assigns (``self._x = ...``), parameters. Not the names it imports under (``from .. import
    layers as _layers`` defines no attribute of any object)."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
    return own


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _under_private_module(dotted):
    return any(dotted == m or dotted.startswith(m + ".") for m in PRIVATE_MODULES)


def _names_private(key, own):
    """The node `key` (of getattr(obj, key) or obj.__dict__[key]) is a string naming a private attribute
    that is not one of the package's own names."""
    return (
        isinstance(key, ast.Constant) and isinstance(key.value, str) and _is_private(key.value) and key.value not in own
    )


def problems(path, tree, own):
    """``(path:line, what)`` for each use of a Paddle internal in ``tree``."""
    found = []

    def flag(node, what):
        found.append((f"{path}:{node.lineno}", what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _under_private_module(a.name):
                    flag(node, f"import {a.name}")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.level == 0
            and node.module.split(".")[0] == "paddle"
        ):
            for a in node.names:
                if _under_private_module(f"{node.module}.{a.name}") or _is_private(a.name):
                    flag(node, f"from {node.module} import {a.name}")
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted and _under_private_module(dotted):
                flag(node, dotted)
            elif _is_private(node.attr) and node.attr not in own:
                flag(node, f".{node.attr}")
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else None
            is_dict_get = (
                isinstance(fn, ast.Attribute)
                and fn.attr in ("get", "pop", "setdefault")
                and isinstance(fn.value, ast.Attribute)
                and fn.value.attr == "__dict__"
            )
            if name in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
                key = node.args[1]
            elif is_dict_get and node.args:
                key = node.args[0]
            else:
                continue
            if _names_private(key, own):
                flag(node, f"{name or '__dict__.' + fn.attr}(..., {key.value!r})")
        elif (
            isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__"
        ):
            key = node.slice
            if _names_private(key, own):
                flag(node, f"__dict__[{key.value!r}]")
    # one report per chain: paddle.base.core.X is reported as its private module only
    return [
        (where, what)
        for where, what in dict.fromkeys(found)
        if not any(w == where and what.startswith(s + ".") for w, s in found)
    ]


SOURCES = list(_sources())
OWN = _own_names(tree for _, tree in SOURCES)


def test_only_the_compat_and_workaround_modules_touch_paddle_internals():
    assert {p for p, _ in SOURCES} >= ALLOWED, "the allowed modules moved: update ALLOWED and their docstrings"
    found = [
        f"{where}: {what}" for path, tree in SOURCES if path not in ALLOWED for where, what in problems(path, tree, OWN)
    ]
    assert not found, (
        "Paddle internals outside paddle_unpad/_runtime/paddle_compat.py and distributed/workarounds.py (add a helper to _runtime/paddle_compat.py):\n"
        + "\n".join(found)
    )


@pytest.mark.parametrize(
    "code, what",
    [
        ("import paddle.base.core as core", "import paddle.base.core"),
        ("from paddle.distributed import collective", "from paddle.distributed import collective"),
        (
            "from paddle.framework import _current_expected_place",
            "from paddle.framework import _current_expected_place",
        ),
        ("x = paddle.framework.core.set_num_threads", "paddle.framework.core"),
        ("eps = layer._epsilon", "._epsilon"),
        ("inner = getattr(model, '_layers', None)", "getattr(..., '_layers')"),
        ("subs = layer.__dict__.get('_sub_layers', {})", "__dict__.get(..., '_sub_layers')"),
        ("v = obj.__dict__['_parameters']", "__dict__['_parameters']"),
    ],
)
def test_the_walk_sees_each_kind_of_use(code, what):
    found = problems("example.py", ast.parse(code), OWN)
    assert [w for _, w in found] == [what], found


@pytest.mark.parametrize(
    "code",
    [
        "import paddle.distributed as dist",
        "self._lock = None; x = self._lock",
        "setattr(fn, '_paddle_unpad_original', f)",
        "n = obj.__len__()",
    ],
)
def test_the_walk_lets_public_and_own_names_pass(code):
    own = OWN | {"_lock"}
    assert problems("example.py", ast.parse(code), own) == []

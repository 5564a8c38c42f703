"""The custom operators' names are listed once per language and the two lists agree:
custom_ops/paddle/op_names.h (registered names, the public names the messages start with)
and paddle_unpad/ops/_names.py (what the Python side calls and looks for)."""

import ast
import glob
import os
import re

from paddle_unpad.ops import _names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLUE = os.path.join(ROOT, "custom_ops", "paddle")
HEADER = os.path.join(GLUE, "op_names.h")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _header():
    """({public op: registered name} from the PU_OP_* macros, {constant: message name})."""
    text = _read(HEADER)
    registered = {m.lower(): name for m, name in re.findall(r"^#define PU_OP_(\w+) (\w+)$", text, re.M)}
    prefixes = dict(re.findall(r'constexpr const char\* (k\w+) = "([^"]*)";', text))
    return registered, prefixes


def _glue_sources():
    return sorted(p for ext in ("cc", "cu", "h") for p in glob.glob(os.path.join(GLUE, f"*.{ext}")))


def test_the_header_lists_the_registered_names_of_the_python_table():
    registered, _ = _header()
    assert len(registered) == 4, registered
    assert registered == _names.REGISTERED


def test_the_header_lists_the_message_names_of_the_python_table():
    _, prefixes = _header()
    assert sorted(prefixes.values()) == sorted(f"paddle_unpad.{w}" for w in _names.WHERE.values())
    assert sorted(_names.MESSAGE_PREFIXES) == sorted(f"{p}: " for p in prefixes.values())
    # one style: every op lives in paddle_unpad.ops
    assert all(w == f"ops.{op}" for op, w in _names.WHERE.items()), _names.WHERE


def test_every_registration_takes_its_name_from_the_header():
    registered, _ = _header()
    built = {"PU_BUILD_OP": [], "PU_BUILD_GRAD_OP": []}
    for path in _glue_sources():
        if path == HEADER:
            continue
        text = _read(path)
        direct = re.findall(r"\bPD_BUILD_\w*OP\((\w+)\)", text)
        assert not direct, f"{os.path.relpath(path, ROOT)} registers {direct} by a name of its own"
        for macro, name in re.findall(r"\b(PU_BUILD_OP|PU_BUILD_GRAD_OP)\((\w+)\)", text):
            built[macro].append(name)
    expected = sorted(f"PU_OP_{op.upper()}" for op in registered)
    assert sorted(built["PU_BUILD_OP"]) == expected
    assert sorted(built["PU_BUILD_GRAD_OP"]) == expected


def test_no_op_name_is_spelled_outside_the_two_tables():
    cpp = [os.path.relpath(p, ROOT) for p in _glue_sources() if p != HEADER and '"paddle_unpad.' in _read(p)]
    assert not cpp, f"a literal public name outside custom_ops/paddle/op_names.h: {cpp}"
    table = os.path.join(ROOT, "paddle_unpad", "ops", "_names.py")
    pattern = re.compile(r"""["']pu_\w""")
    py = [
        f"{os.path.relpath(p, ROOT)}:{i}"
        for p in glob.glob(os.path.join(ROOT, "paddle_unpad", "**", "*.py"), recursive=True)
        if p != table
        for i, line in enumerate(_read(p).splitlines(), 1)
        if pattern.search(line)
    ]
    assert not py, f"a registered name outside paddle_unpad/ops/_names.py: {py}"


def test_the_python_table_imports_nothing():
    """So that code without Paddle (tests/gpu, tools) can read it by path, as ops/_rules.py."""
    tree = ast.parse(_read(_names.__file__))
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_check_cu_seqlens_names_fmha_as_the_table_does():
    """varlen sits below ops (it cannot import the table): its default `who` is checked here."""
    tree = ast.parse(_read(os.path.join(ROOT, "paddle_unpad", "varlen.py")))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check_cu_seqlens")
    who = dict(zip((a.arg for a in fn.args.kwonlyargs), fn.args.kw_defaults))["who"]
    assert who.value == f".{_names.WHERE['fmha']}"


def test_the_library_registers_the_names_of_the_table(native_ops):
    """The registrations go through PU_BUILD_OP: what Paddle knows is pu_fmha, not PU_OP_FMHA."""
    from paddle_unpad._runtime import native

    missing = [name for name in _names.REGISTERED.values() if not native.has_op(name)]
    assert not missing, f"not registered by the loaded library: {missing}"

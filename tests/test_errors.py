"""One exception type per kind of mistake and one message prefix (docs/api.md, "Errors").

A wrong type raises TypeError, a wrong value ValueError (or the named domain errors), and
every message starts with ``paddle_unpad.<name>: ``, naming what the caller used. The
table walks the public API with wrong types and wrong values; the source walk checks every
message the package writes as a literal.
"""

import ast
import glob
import math
import os
import re

import numpy as np
import paddle
import pytest

import paddle_unpad as pu
from paddle_unpad import balance, config, ops
from paddle_unpad._runtime import paddle_compat as _paddle_compat
from paddle_unpad.data import PackingCollator, SampleError
from paddle_unpad.distributed import BalancedLoader, GradientAllReduce
from paddle_unpad.trainer import PadCollator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = re.compile(r"^paddle_unpad(\.[A-Za-z_][\w.]*)?: ")


def _strategy_set(attr, value):
    setattr(pu.fleet.DistributedStrategy(), attr, value)


def _tensors():
    q = paddle.ones([6, 2, 16])
    cu = paddle.to_tensor(np.array([0, 2, 6], np.int32))
    return q, cu


def _fmha(**kw):
    q, cu = _tensors()
    args = dict(q=q, k=q, v=q, cu_seqlens=cu, max_seqlen=4)
    args.update(kw)
    pu.fmha(**args)


def _bias_gelu(x=None, bias=None):
    ops.bias_gelu(paddle.ones([2, 8]) if x is None else x, bias)


def _bdrln(**kw):
    x = paddle.ones([2, 8])
    args = dict(x=x, bias=None, residual=x, ln_weight=None, ln_bias=None)
    args.update(kw)
    ops.bias_dropout_residual_layer_norm(**args)


def _pad_input(indices=None, batch_size=2, seqlen=3):
    idx = paddle.to_tensor(np.array([0, 1, 2])) if indices is None else indices
    pu.pad_input(paddle.ones([3, 2]), idx, batch_size, seqlen)


def _config_get(name, text):
    config.get(name, {config.variable(name).env: text})


S, D, F = "fleet.DistributedStrategy", "fleet.distributed_loader", "distributed.GradientAllReduce"
# (what is called, the exception type, the name after "paddle_unpad.")
CASES = {
    "strategy.unpad = 1": (lambda: _strategy_set("unpad", 1), TypeError, S),
    "unpad_configs balance=1": (lambda: _strategy_set("unpad_configs", {"balance": 1}), TypeError, S),
    "unpad_configs not a dict": (lambda: _strategy_set("unpad_configs", [("balance", True)]), TypeError, S),
    "unpad_configs unknown key": (lambda: _strategy_set("unpad_configs", {"balanse": True}), ValueError, S),
    "unpad_configs prefetch=0": (lambda: _strategy_set("unpad_configs", {"prefetch": 0}), ValueError, S),
    "unpad_configs prefetch='2'": (lambda: _strategy_set("unpad_configs", {"prefetch": "2"}), TypeError, S),
    "unpad_configs tol=nan": (lambda: _strategy_set("unpad_configs", {"tol": math.nan}), ValueError, S),
    "unpad_configs tol='0.1'": (lambda: _strategy_set("unpad_configs", {"tol": "0.1"}), TypeError, S),
    "unpad_configs timeout=-1": (lambda: _strategy_set("unpad_configs", {"timeout": -1}), ValueError, S),
    "unpad_configs timeout='5'": (lambda: _strategy_set("unpad_configs", {"timeout": "5"}), TypeError, S),
    "unpad_configs max_seqlen=0": (lambda: _strategy_set("unpad_configs", {"max_seqlen": 0}), ValueError, S),
    "unpad_configs max_seqlen=2.5": (lambda: _strategy_set("unpad_configs", {"max_seqlen": 2.5}), TypeError, S),
    "unpad_configs cost='flop'": (lambda: _strategy_set("unpad_configs", {"cost": "flop"}), ValueError, S),
    "unpad_configs cost=3": (lambda: _strategy_set("unpad_configs", {"cost": 3}), TypeError, S),
    "unpad_configs counts='most'": (lambda: _strategy_set("unpad_configs", {"counts": "most"}), ValueError, S),
    "unpad_configs counts=[1.5]": (lambda: _strategy_set("unpad_configs", {"counts": [1.5]}), TypeError, S),
    "unpad_configs counts=[-1]": (lambda: _strategy_set("unpad_configs", {"counts": [-1]}), ValueError, S),
    "distributed_loader balance='no'": (lambda: pu.fleet.distributed_loader([], balance="no"), TypeError, D),
    "distributed_loader unknown key": (lambda: pu.fleet.distributed_loader([], prefech=2), ValueError, D),
    "BalancedLoader token_fields str": (
        lambda: BalancedLoader([], token_fields="input_ids"),
        TypeError,
        "distributed.BalancedLoader",
    ),
    "BalancedLoader prefetch=1.5": (lambda: BalancedLoader([], prefetch=1.5), TypeError, "distributed.BalancedLoader"),
    "GradientAllReduce average=1": (lambda: GradientAllReduce(paddle.nn.Linear(2, 2), average=1), TypeError, F),
    "GradientAllReduce bucket_mb=0": (lambda: GradientAllReduce(paddle.nn.Linear(2, 2), bucket_mb=0), ValueError, F),
    "GradientAllReduce item str": (lambda: GradientAllReduce(["weight"]), TypeError, F),
    "fmha cu_seqlens int64": (lambda: _fmha(cu_seqlens=paddle.to_tensor(np.array([0, 2, 6]))), TypeError, "ops.fmha"),
    "fmha cu_seqlens 2-D": (
        lambda: _fmha(cu_seqlens=paddle.to_tensor(np.array([[0, 2, 6]], np.int32))),
        ValueError,
        "ops.fmha",
    ),
    "fmha q numpy": (lambda: _fmha(q=np.ones([6, 2, 16], np.float32)), TypeError, "ops.fmha"),
    "fmha k float64": (lambda: _fmha(k=paddle.ones([6, 2, 16], "float64")), TypeError, "ops.fmha"),
    "fmha k shape": (lambda: _fmha(k=paddle.ones([6, 2, 8])), ValueError, "ops.fmha"),
    "fmha max_seqlen 4.0": (lambda: _fmha(max_seqlen=4.0), TypeError, "ops.fmha"),
    "fmha max_seqlen -1": (lambda: _fmha(max_seqlen=-1), ValueError, "ops.fmha"),
    "fmha dropout 'a'": (lambda: _fmha(dropout="a"), TypeError, "ops.fmha"),
    "fmha dropout 1.5": (lambda: _fmha(dropout=1.5), ValueError, "ops.fmha"),
    "fmha grouping 1": (lambda: _fmha(grouping=1), TypeError, "ops.fmha"),
    "fmha rng_state 3 ints": (lambda: _fmha(dropout=0.1, rng_state=(1, 2, 3)), ValueError, "ops.fmha"),
    "fmha rng_state str": (lambda: _fmha(dropout=0.1, rng_state="seed"), TypeError, "ops.fmha"),
    "fmha_qkvpacked qkv 3-D": (
        lambda: pu.fmha_qkvpacked(paddle.ones([6, 3, 16]), _tensors()[1], 4),
        ValueError,
        "ops.fmha_qkvpacked",
    ),
    "bias_gelu x int64": (lambda: _bias_gelu(x=paddle.ones([2, 8], "int64")), TypeError, "ops.bias_gelu"),
    "bias_gelu bias shape": (lambda: _bias_gelu(bias=paddle.ones([7])), ValueError, "ops.bias_gelu"),
    "bdrln epsilon 'a'": (lambda: _bdrln(epsilon="a"), TypeError, "ops.bias_dropout_residual_layer_norm"),
    "bdrln dropout 2.0": (lambda: _bdrln(dropout=2.0), ValueError, "ops.bias_dropout_residual_layer_norm"),
    "bdrln residual shape": (
        lambda: _bdrln(residual=paddle.ones([3, 8])),
        ValueError,
        "ops.bias_dropout_residual_layer_norm",
    ),
    "unpad_input x numpy": (lambda: pu.unpad_input(np.ones((2, 3)), paddle.ones([2, 3])), TypeError, "unpad_input"),
    "unpad_input mask 3-D": (
        lambda: pu.unpad_input(paddle.ones([2, 3]), paddle.ones([2, 3, 1])),
        ValueError,
        "unpad_input",
    ),
    "pad_input indices float32": (lambda: _pad_input(indices=paddle.ones([3])), TypeError, "pad_input"),
    "pad_input batch_size -1": (lambda: _pad_input(batch_size=-1), ValueError, "pad_input"),
    "pad_input seqlen 2.5": (lambda: _pad_input(seqlen=2.5), TypeError, "pad_input"),
    "cu_seqlens_from_lengths 1.5": (lambda: pu.cu_seqlens_from_lengths([1.5]), TypeError, "cu_seqlens_from_lengths"),
    "cu_seqlens_from_lengths -1": (lambda: pu.cu_seqlens_from_lengths([-1]), ValueError, "cu_seqlens_from_lengths"),
    "plan str": (lambda: balance.plan("lengths"), TypeError, "balance.plan"),
    "plan negative": (lambda: balance.plan([[3, -1]]), ValueError, "balance.plan"),
    "plan tol str": (lambda: balance.plan([[3]], tol="0.1"), TypeError, "balance.plan"),
    "plan backend": (lambda: balance.plan([[3]], backend="gpu"), ValueError, "balance.plan"),
    "CostModel a str": (lambda: balance.CostModel(a="1"), TypeError, "balance.CostModel"),
    "CostModel a -1": (lambda: balance.CostModel(a=-1.0), ValueError, "balance.CostModel"),
    "PackingCollator max_seqlen 2.5": (lambda: PackingCollator(max_seqlen=2.5), TypeError, "data.PackingCollator"),
    "PackingCollator max_seqlen 0": (lambda: PackingCollator(max_seqlen=0), ValueError, "data.PackingCollator"),
    "PackingCollator return_tensors": (
        lambda: PackingCollator(return_tensors="tf"),
        ValueError,
        "data.PackingCollator",
    ),
    "PackingCollator batch str": (lambda: PackingCollator()("input_ids"), TypeError, "data"),
    "PackingCollator empty sample": (
        lambda: PackingCollator()([{"input_ids": np.zeros(0, np.int64)}]),
        SampleError,
        "data",
    ),
    "PadCollator pad_to 2.5": (lambda: PadCollator(pad_to=2.5), TypeError, "trainer.PadCollator"),
    "PadCollator pad_to 0": (lambda: PadCollator(pad_to=0), ValueError, "trainer.PadCollator"),
    "convert model str": (lambda: pu.convert("bert"), TypeError, "convert"),
    "convert on_unsupported": (
        lambda: pu.convert(paddle.nn.Linear(2, 2), on_unsupported="skip"),
        ValueError,
        "convert",
    ),
    "config FMHA_STREAMS x": (lambda: _config_get("FMHA_STREAMS", "x"), config.ConfigError, "config"),
    "config unknown variable": (lambda: config.variable("NO_SUCH_SETTING"), KeyError, "config"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_wrong_types_and_values_raise_one_type_with_the_prefix(case):
    call, error, name = CASES[case]
    with pytest.raises(Exception) as e:
        call()
    err = e.value
    assert isinstance(err, error), f"{case}: {type(err).__name__}: {err}"
    # the two kinds never overlap: a wrong type is no ValueError, a wrong value no TypeError
    assert not isinstance(err, ValueError if error is TypeError else TypeError), f"{case}: {type(err).__mro__}"
    message = err.args[0]
    assert message.startswith(f"paddle_unpad.{name}: "), f"{case}: {message}"


def _head(node):
    """The literal start of a message: f-string fields as ``{}``; None when it is not a literal."""
    while isinstance(node, ast.BinOp):
        node = node.left
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def _is_exception_class(func):
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name.endswith(("Error", "Timeout", "Exception")) or name == "UnsupportedInput"


def _messages(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    getattr_bodies = {
        id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__getattr__" for n in ast.walk(f)
    }  # AttributeError there follows Python's own wording
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and _is_exception_class(node.func)
            and node.args
            and id(node) not in getattr_bodies
        ):
            head = _head(node.args[0])
            if head is not None:
                yield node.lineno, head


def test_every_literal_message_in_the_package_starts_with_the_prefix():
    sources = glob.glob(os.path.join(ROOT, "paddle_unpad", "**", "*.py"), recursive=True)
    # a name part made of fields ("paddle_unpad.{op}: ") is checked by the table above
    rule = re.compile(r"^paddle_unpad(\.[\w.{}]*|{})?(: |$)")
    bad, seen = [], 0
    for path in sources:
        for line, head in _messages(path):
            seen += 1
            if not rule.match(head):
                bad.append(f"{os.path.relpath(path, ROOT)}:{line}: {head[:80]!r}")
    assert seen > 150, seen  # the walk finds the package's messages
    assert not bad, "messages without the paddle_unpad prefix:\n" + "\n".join(bad)


# Renders Python source (the generated forwards), whose lines are code, not messages.
_CODE_RENDERERS = {os.path.join("paddle_unpad", "models", "forwards.py")}


def _implicit_concatenations(path):
    """Lines where one string literal follows another (Python joins them into one string)."""
    import io
    import tokenize

    with open(path, encoding="utf-8") as f:
        toks = [
            t
            for t in tokenize.generate_tokens(io.StringIO(f.read()).readline)
            if t.type not in (tokenize.NL, tokenize.COMMENT)
        ]
    starts = {getattr(tokenize, "FSTRING_START", None), tokenize.STRING} - {None}
    ends = {getattr(tokenize, "FSTRING_END", None), tokenize.STRING} - {None}
    return [b.start[0] for a, b in zip(toks, toks[1:]) if a.type in ends and b.type in starts]


def _added_messages(path):
    """Message arguments built with ``+`` from a literal (a message split in pieces)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        is_call = isinstance(node, ast.Call) and (
            _is_exception_class(node.func)
            or getattr(node.func, "attr", getattr(node.func, "id", "")) in ("warn", "warn_once")
        )
        if is_call and node.args and isinstance(node.args[0], ast.BinOp):
            parts = [n for n in ast.walk(node.args[0]) if isinstance(n, (ast.Constant, ast.JoinedStr))]
            if any(isinstance(n, ast.JoinedStr) or isinstance(n.value, str) for n in parts):
                yield node.lineno


def test_every_message_in_the_package_is_one_literal_string():
    """A message a user sees is one literal in the source, so that grepping a phrase of it
    finds where it is raised: no literal split over implicitly joined pieces, no pieces
    joined with ``+`` in a raise or a warning."""
    sources = glob.glob(os.path.join(ROOT, "paddle_unpad", "**", "*.py"), recursive=True)
    bad, seen = [], 0
    for path in sources:
        rel = os.path.relpath(path, ROOT)
        seen += sum(1 for _ in _messages(path))
        if rel not in _CODE_RENDERERS:
            bad += [f"{rel}:{line}: a literal joined to the one before it" for line in _implicit_concatenations(path)]
        bad += [f"{rel}:{line}: a message joined with +" for line in _added_messages(path)]
    assert seen > 150, seen
    assert not bad, "messages that grep cannot find as one string:\n" + "\n".join(bad)


def test_the_one_literal_rule_sees_a_split_message(tmp_path):
    """The checks above find both ways of splitting a message."""
    f = tmp_path / "m.py"
    f.write_text(
        'def f(x):\n    raise ValueError("paddle_unpad.x: a message "\n                     f"in {x} pieces")\n'
        'def g(x):\n    raise ValueError("paddle_unpad.x: two " + str(x))\n'
    )
    assert _implicit_concatenations(str(f)) == [3]
    assert list(_added_messages(str(f))) == [5]


def _cpp_calls(text, names):
    """(name, [argument texts]) of every call to one of `names` in C++ source text."""
    for m in re.finditer(r"\b(" + "|".join(names) + r")\s*\(", text):
        args, depth, cur, i, quote = [], 0, "", m.end(), None
        while i < len(text):
            c = text[i]
            if quote:
                cur += c
                if c == "\\":
                    cur, i = cur + text[i + 1], i + 1
                elif c == quote:
                    quote = None
            elif c in "\"'":
                quote, cur = c, cur + c
            elif c in "([{":
                depth, cur = depth + 1, cur + c
            elif c in ")]}" and depth:
                depth, cur = depth - 1, cur + c
            elif c == ")":
                args.append(cur.strip())
                break
            elif c == "," and not depth:
                args.append(cur.strip())
                cur = ""
            else:
                cur += c
            i += 1
        yield m.group(1), args


def _takes_op(text):
    """The C++ helpers that take the public name of the op they check for (``const char* op``)."""
    return set(re.findall(r"\b(\w+)\(const char\* op\b", text))


def _operator_name_problems(text, names, helpers=()):
    """Where a C++ check of custom_ops/paddle would start its message with something other than
    the public name of an op: one of `names` (the constants of op_names.h, which hold
    ``paddle_unpad.ops.<op>``), or the ``op`` a helper was handed. `helpers`: functions of other
    files that take ``const char* op``, with those of `text`."""
    bad = [
        f"{name} = {value}"
        for name, value in re.findall(r"constexpr const char\* (k\w+) = (\"[^\"]*\")", text)
        if not re.match(r'^"paddle_unpad\.ops\.\w+"$', value)
    ]
    named = set(names) | {"op"}
    for name, args in _cpp_calls(text, ["PD_CHECK", "PD_THROW"]):
        first = args[1 if name == "PD_CHECK" else 0] if len(args) > (name == "PD_CHECK") else ""
        if first not in named:
            bad.append(f"{name}({first[:60]}")
    for helper in sorted(_takes_op(text) | set(helpers)):
        for _, args in _cpp_calls(text, [helper]):
            if args and not args[0].startswith("const char*") and args[0] not in named:  # a call, not the definition
                bad.append(f"{helper}({args[0]}")
    return bad


def _included_helpers(path, texts, seen=()):
    """The helpers taking ``const char* op`` of the headers `path` includes from its folder."""
    out = set()
    for header in re.findall(r'#include "(\w+\.h)"', texts[path]):
        inc = os.path.join(os.path.dirname(path), header)
        if inc in texts and inc not in seen:
            out |= _takes_op(texts[inc]) | _included_helpers(inc, texts, (*seen, path))
    return out


def test_the_operators_write_the_public_prefix_themselves():
    """Every check of the Paddle operators starts its message with the public op name, so that
    the Python side raises the operator's line as written (no rewrite of a prefix)."""
    sources = sorted(
        glob.glob(os.path.join(ROOT, "custom_ops", "paddle", "*.c[cu]"))
        + glob.glob(os.path.join(ROOT, "custom_ops", "paddle", "*.h"))
    )
    texts = {os.path.relpath(p, ROOT): open(p, encoding="utf-8").read() for p in sources}
    checks = sum(len(list(_cpp_calls(t, ["PD_CHECK", "PD_THROW"]))) for t in texts.values())
    assert checks > 60, checks  # the walk reads the operators' checks
    names = re.findall(r"constexpr const char\* (k\w+) = ", texts[os.path.join("custom_ops", "paddle", "op_names.h")])
    assert len(names) >= 4, names
    helpers = {path: _included_helpers(path, texts) for path in texts}
    assert {"fmha_problem", "read_rng_state"} <= helpers[os.path.join("custom_ops", "paddle", "fmha_op.cc")]
    bad = [f"{path}: {b}" for path, t in texts.items() for b in _operator_name_problems(t, names, helpers[path])]
    assert not bad, "operator messages without the public op name:\n" + "\n".join(bad)


def test_the_operator_prefix_rule_sees_each_way_of_naming_an_op():
    text = (
        'constexpr const char* kA = "bias_gelu";\n'
        'void check_x(const char* op, const Tensor& x) { PD_CHECK(x.ok(), op, ": x"); }\n'
        'void f() { PD_CHECK(a == b, "fmha: k shape ", g(a, b)); PD_THROW("paddle_unpad.ops.fmha: no");\n'
        '  check_x("bias_gelu", x); PD_CHECK(c, kFmha, ": fine, (really)", x); PD_CHECK(d, why);\n'
        "  check_x(kFmha, x); glue::fmha_problem(kOther, cu); }\n"
    )
    assert _operator_name_problems(text, ["kFmha"], ["fmha_problem"]) == [
        'kA = "bias_gelu"',
        'PD_CHECK("fmha: k shape "',
        'PD_THROW("paddle_unpad.ops.fmha: no"',
        "PD_CHECK(why",
        'check_x("bias_gelu"',
        "fmha_problem(kOther",
    ]


def test_an_operator_refusal_reaches_the_user_as_written(native_ops):
    """A check only the operator makes (cu_seqlens' values: the Python side does not read them)
    reaches the caller as the operator's own line, with the public name, as a ValueError."""
    q = paddle.zeros([6, 2, 32])
    cu = paddle.to_tensor([0, 5, 3, 6], dtype="int32")  # decreasing
    with pytest.raises(ValueError) as public:
        pu.fmha(q, q, q, cu, 5)
    message = str(public.value)
    assert message.startswith("paddle_unpad.ops.fmha: ") and "cu_seqlens" in message, message
    with pytest.raises(OSError) as raw:  # the operator itself, without the package's call path
        _paddle_compat.custom_op_function("pu_fmha")(q, q, q, cu, None, 5, 1.0, 0.0, False, False)
    assert message in str(raw.value)
    x = paddle.zeros([4, 8])
    with pytest.raises(ValueError, match=r"^paddle_unpad\.ops\.bias_gelu: bias must be 1-D \[8\]"):
        ops._call.call_native("pu_bias_gelu", x, paddle.zeros([5]))

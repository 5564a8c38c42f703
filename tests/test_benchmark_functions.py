"""Benchmark scripts read as named steps: no function in benchmarks/ holds more than 50
statements. Statements, not lines: the formatter (ruff, `make format`) decides where a long
call or table literal breaks, the author how many steps a function takes."""

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 50


def statements(node):
    """The statements inside a function (nested ones included), not the def itself."""
    return sum(1 for n in ast.walk(node) if isinstance(n, ast.stmt)) - 1


def test_statements_are_counted():
    tree = ast.parse("def f(x):\n    y = [1,\n         2]\n    if x:\n        return y\n    return None\n")
    assert statements(tree.body[0]) == 4


def test_no_benchmark_function_is_over_the_limit():
    sources = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "**", "*.py"), recursive=True))
    assert sources
    long = []
    for path in sources:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and statements(node) > LIMIT:
                long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name}: {statements(node)} statements")
    assert not long, f"functions over {LIMIT} statements (split them into named steps):\n" + "\n".join(long)

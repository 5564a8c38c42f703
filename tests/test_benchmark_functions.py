"""Benchmark scripts read as named steps: no function in benchmarks/ is longer than 60 lines."""
import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 60


def test_no_benchmark_function_is_over_the_limit():
    sources = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "**", "*.py"), recursive=True))
    assert sources
    long = []
    for path in sources:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LIMIT:
                    long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"functions over {LIMIT} lines (split them into named steps):\n" + "\n".join(long)

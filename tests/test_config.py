"""paddle_unpad.config: every environment variable declared once, parsed by one rule, listed once."""
import json
import os
import subprocess
import sys

import pytest

from paddle_unpad import config, ops

pytestmark = pytest.mark.paddle_gpu_stage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("text, value", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                         ("0", False), ("False", False), ("no", False), ("OFF", False)])
def test_flags_have_one_rule(text, value):
    assert config.get("FORCE_JIT", {"PADDLE_UNPAD_FORCE_JIT": text}) is value
    assert config.get("JIT", {"PADDLE_UNPAD_JIT": text}) is value


def test_unset_or_empty_is_the_default_and_bad_values_name_variable_and_value():
    for var in config.VARIABLES:
        assert config.get(var.name, {}) == var.default
        assert config.get(var.name, {var.env: "  "}) == var.default
    cases = [("FORCE_JIT", "2", "expected one of"), ("BUILD_JOBS", "four", "whole number"),
             ("NUM_THREADS", "-1", ">= 0"), ("CPU_ISA", "avx1024", "auto, avx512, avx2, sse2"),
             ("MKL_DISPATCH", "maybe", "auto, off")]
    for name, bad, words in cases:
        env = config.variable(name).env
        with pytest.raises(config.ConfigError) as e:
            config.get(name, {env: bad})
        assert f"{env}={bad!r}" in str(e.value) and words in str(e.value)
    with pytest.raises(KeyError, match="known:"):
        config.variable("NO_SUCH_SETTING")


def test_an_explicit_argument_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("PADDLE_UNPAD_FMHA_GROUPING", "0")
    assert ops._grouping(None) is False and ops._grouping(True) is True
    monkeypatch.setenv("PADDLE_UNPAD_FMHA_GROUPING", "1")
    assert ops._grouping(None) is True and ops._grouping(False) is False
    with pytest.raises(TypeError, match="grouping must be a bool"):
        ops._grouping("yes")


def test_the_docs_table_is_the_declared_table():
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        assert config.markdown_table() in f.read(), "docs/api.md: regenerate the table with config.markdown_table()"


def test_no_variable_name_outside_the_configuration_module_docs_and_tests():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for rel in files:
        if rel.startswith(("tests/", "docs/")) or rel.endswith(".md") or rel == "paddle_unpad/config.py":
            continue
        try:
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        if config.PREFIX in text:
            offenders.append(rel)
    assert not offenders, f"{config.PREFIX}* names outside paddle_unpad/config.py: {offenders}"


def test_a_bad_kernel_setting_falls_back_with_a_warning_naming_it():
    env = dict(os.environ, PADDLE_UNPAD_NUM_THREADS="two")
    code = ("import json, warnings\nwith warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n    import paddle_unpad as pu\n"
            "print(json.dumps({'ok': pu.ops_available()['fmha']['cpu'], 'w': [str(x.message) for x in w]}))")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["ok"] is False
    assert any("PADDLE_UNPAD_NUM_THREADS='two'" in m for m in got["w"]), got["w"]


def test_the_shell_helper_checks_names_and_values():
    run = [sys.executable, os.path.join(ROOT, "paddle_unpad", "config.py")]
    p = subprocess.run(run + ["REQUIRE_CUDA=1", "CUDA_ARCHS=80;90"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.split() == ["PADDLE_UNPAD_REQUIRE_CUDA=1", "PADDLE_UNPAD_CUDA_ARCHS=80;90"]
    for bad in ("REQUIRE_CUDA=sometimes", "NO_SUCH=1"):
        p = subprocess.run(run + [bad], capture_output=True, text=True, timeout=60)
        assert p.returncode != 0 and bad.split("=")[0] in p.stderr

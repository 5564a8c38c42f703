"""paddle_unpad.config: every environment variable declared once, parsed by one rule, listed once."""

import os
import subprocess
import sys

import pytest

from paddle_unpad import config, ops

pytestmark = pytest.mark.paddle_gpu_stage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "text, value",
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        (" on ", True),
        ("0", False),
        ("False", False),
        ("no", False),
        ("OFF", False),
    ],
)
def test_flags_have_one_rule(text, value):
    assert config.get("FORCE_JIT", {"PADDLE_UNPAD_FORCE_JIT": text}) is value
    assert config.get("JIT", {"PADDLE_UNPAD_JIT": text}) is value


def test_unset_or_empty_is_the_default_and_bad_values_name_variable_and_value():
    for var in config.VARIABLES:
        assert config.get(var.name, {}) == var.default
        assert config.get(var.name, {var.env: "  "}) == var.default
    cases = [
        ("FORCE_JIT", "2", "expected one of"),
        ("BUILD_JOBS", "four", "whole number"),
        ("NUM_THREADS", "-1", ">= 0"),
        ("FMHA_STREAMS", "17", "1-16"),
        ("CPU_ISA", "avx1024", "auto, avx512, avx2, sse2"),
        ("MKL_DISPATCH", "maybe", "auto, off"),
    ]
    for name, bad, words in cases:
        env = config.variable(name).env
        with pytest.raises(config.ConfigError) as e:
            config.get(name, {env: bad})
        assert f"{env}={bad!r}" in str(e.value) and words in str(e.value)
    with pytest.raises(KeyError, match="known:"):
        config.variable("NO_SUCH_SETTING")


def test_an_explicit_argument_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("PADDLE_UNPAD_FMHA_GROUPING", "0")
    assert ops.attention._grouping(None) is False and ops.attention._grouping(True) is True
    monkeypatch.setenv("PADDLE_UNPAD_FMHA_GROUPING", "1")
    assert ops.attention._grouping(None) is True and ops.attention._grouping(False) is False
    with pytest.raises(TypeError, match="grouping must be a bool"):
        ops.attention._grouping("yes")


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


def _bad_values(var):
    """Values the variable's declared type refuses (none for free text and paths)."""
    if var.kind == "flag":
        return ["sometimes"]
    if var.kind == "choice":
        return ["no-such-choice"]
    if var.kind == "int":
        low, high = var.bounds
        return ["two", str(low - 1)] + ([] if high is None else [str(high + 1)])
    if var.name == "CUDA_ARCHS":  # a text with a rule: SM versions 80 and newer
        return ["75", "sm_90", "80;seventy"]
    return []


BAD = [(var.name, text) for var in config.VARIABLES for text in _bad_values(var)]


def test_every_variable_but_free_text_has_values_it_refuses():
    assert {v.kind for v in config.VARIABLES if not _bad_values(v)} <= {"str", "path"}


@pytest.mark.parametrize("name, text", BAD)
def test_every_bad_value_is_one_error_naming_variable_and_value(name, text):
    env = config.variable(name).env
    with pytest.raises(config.ConfigError) as e:
        config.get(name, {env: text})
    assert isinstance(e.value, ValueError) and f"{env}={text!r}" in str(e.value)


def test_the_documented_stream_range_is_the_checked_range():
    env = config.variable("FMHA_STREAMS").env
    for text in ("0", "17"):
        with pytest.raises(config.ConfigError, match="1-16"):
            config.get("FMHA_STREAMS", {env: text})
    assert [config.get("FMHA_STREAMS", {env: t}) for t in ("1", "16")] == [1, 16]


def _native_load():
    from paddle_unpad._runtime import native as _native

    saved = dict(_native._state)
    _native._state["tried"] = False
    try:
        _native.load()
    finally:
        _native._state.update(saved)


def _install_group_stores():
    from paddle_unpad.distributed import groups

    groups.install_group_stores()


def _host_malloc():
    from paddle_unpad._runtime import host_malloc

    host_malloc.configure()


def _mkl_dispatch():
    from paddle_unpad._runtime import cpu_gemm

    cpu_gemm.configure()


# where each run-time setting is first read: a bad value must raise there, not fall back
READERS = {
    **{name: _native_load for name in ("DISABLE_NATIVE", "FORCE_JIT", "JIT", "NUM_THREADS", "CPU_ISA", "FMHA_STREAMS")},
    "FMHA_GROUPING": lambda: ops.attention._grouping(None),
    "FMHA_DETERMINISTIC": lambda: ops.attention._deterministic(None),
    "MKL_DISPATCH": _mkl_dispatch,
    "HOST_MALLOC": _host_malloc,
    "GLOO_GROUP_STORES": _install_group_stores,
    "STORE_NODELAY": _install_group_stores,
}


def test_every_run_time_setting_has_its_reader_listed():
    assert set(READERS) == {v.name for v in config.VARIABLES if v.when == "run" and _bad_values(v)}


@pytest.mark.parametrize("name", sorted(READERS))
def test_a_bad_run_time_setting_raises_where_it_is_read(name, monkeypatch):
    var = config.variable(name)
    text = _bad_values(var)[0]
    monkeypatch.setenv(var.env, text)
    with pytest.raises(config.ConfigError, match=f"{var.env}={text!r}"):
        READERS[name]()


def test_a_typo_in_the_kernel_threads_is_an_error_not_the_reference_path(monkeypatch):
    from paddle_unpad._runtime import native as _native

    monkeypatch.setenv("PADDLE_UNPAD_NUM_THREADS", "tow")
    saved = dict(_native._state)
    _native._state["tried"] = False
    try:
        for _ in range(2):  # every later load asks again: nothing falls back quietly
            with pytest.raises(ValueError, match="PADDLE_UNPAD_NUM_THREADS='tow'"):
                _native.load()
        assert _native._state["tried"] is False
    finally:
        _native._state.update(saved)


def test_the_shell_helper_checks_names_and_values():
    run = [sys.executable, os.path.join(ROOT, "paddle_unpad", "config.py")]
    p = subprocess.run(run + ["REQUIRE_CUDA=1", "CUDA_ARCHS=80;90"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.split() == ["PADDLE_UNPAD_REQUIRE_CUDA=1", "PADDLE_UNPAD_CUDA_ARCHS=80;90"]
    for bad in ("REQUIRE_CUDA=sometimes", "NO_SUCH=1"):
        p = subprocess.run(run + [bad], capture_output=True, text=True, timeout=60)
        assert p.returncode != 0 and bad.split("=")[0] in p.stderr


def test_a_misspelt_variable_is_named_once_with_the_closest_setting(monkeypatch):
    """Before, ``PADDLE_UNPAD_GLOO_GROUP_STORE=0`` (no S) was ignored without a word."""
    monkeypatch.setattr(config, "_warned_unknown", set())
    monkeypatch.setattr(config, "_checked_names", [])
    monkeypatch.setenv("PADDLE_UNPAD_GLOO_GROUP_STORE", "0")
    monkeypatch.setenv("PADDLE_UNPAD_FLUX_CAPACITOR", "1")
    with pytest.warns(UserWarning) as seen:
        assert config.get("GLOO_GROUP_STORES") is True  # the misspelt one does not count
    texts = [str(w.message) for w in seen if "paddle_unpad.config" in str(w.message)]
    assert any(
        "PADDLE_UNPAD_GLOO_GROUP_STORE is not a paddle_unpad setting" in t
        and "did you mean PADDLE_UNPAD_GLOO_GROUP_STORES?" in t
        for t in texts
    ), texts
    assert any("PADDLE_UNPAD_FLUX_CAPACITOR" in t and "known: PADDLE_UNPAD_DISABLE_NATIVE" in t for t in texts), texts
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: the next reads say nothing
        config.get("GLOO_GROUP_STORES")
        assert config.warn_unknown() == ["PADDLE_UNPAD_FLUX_CAPACITOR", "PADDLE_UNPAD_GLOO_GROUP_STORE"]


def test_settings_that_must_agree_across_ranks_are_declared_and_read_alike():
    assert [v.name for v in config.VARIABLES if v.agree] == ["GLOO_GROUP_STORES"]
    assert config.agreed_settings({}) == {"PADDLE_UNPAD_GLOO_GROUP_STORES": "on"}
    assert config.agreed_settings({"PADDLE_UNPAD_GLOO_GROUP_STORES": "OFF"}) == {
        "PADDLE_UNPAD_GLOO_GROUP_STORES": "off"
    }
    assert config.agreed_settings({"PADDLE_UNPAD_GLOO_GROUP_STORES": "maybe"}) == {
        "PADDLE_UNPAD_GLOO_GROUP_STORES": "invalid 'maybe'"
    }  # compared too: every rank hears of it
    assert "| run time, equal on every rank |" in config.markdown_table()

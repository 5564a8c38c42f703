"""Every environment variable the plugin reads: declared once here, parsed by one rule.

Each variable has a name, a type, a default and a one-line meaning; :data:`VARIABLES`
is the table (docs/api.md lists it). Rules:

* flags accept ``1/true/yes/on`` and ``0/false/no/off`` (any case); an empty value is the
  default; anything else is an error naming the variable and the value;
* ints (within their declared range) and choices are checked the same way;
* a bad value is a :class:`ConfigError` (a ``ValueError``) naming the variable and the value,
  raised where the setting is first read -- never a silent fallback to a default; a value
  is read when it is needed, so a variable set before the process (or before the first
  use) takes effect;
* an explicit argument always wins: functions that take the same setting as an
  argument use the variable only when the argument is ``None``;
* a ``PADDLE_UNPAD_*`` variable that is not in the table (a misspelt name) is reported
  once, with the closest known name, when the configuration is first read (a
  ``UserWarning``): it would otherwise be ignored without a word;
* a setting marked ``agree`` decides how the ranks of a job talk to each other: it must be
  the same on every rank, and the distributed layer compares it across ranks (through the
  job's store, bounded) before the first group that depends on it
  (:func:`paddle_unpad.distributed.groups.check_settings_agree`).

This module imports only the standard library: the build (``setup.py``) reads it
before the package exists.
"""

from __future__ import annotations

import difflib
import os
import warnings
from typing import NamedTuple, Optional, Tuple

PREFIX = "PADDLE_UNPAD_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class Variable(NamedTuple):
    name: str  # without the PADDLE_UNPAD_ prefix
    kind: str  # "flag", "int", "str", "path" or "choice"
    default: object
    meaning: str
    choices: Tuple[str, ...] = ()
    when: str = "run"  # "build": read by setup.py / the JIT build; "run": at run time
    bounds: Tuple[int, Optional[int]] = (0, None)  # ints: the smallest and largest value (None: no limit)
    agree: bool = False  # must be equal on every rank of a distributed job (compared before the first group)

    @property
    def env(self):
        return PREFIX + self.name


# When the mallopt of HOST_MALLOC is made (paddle_unpad._runtime.host_malloc.ensure's callers; info() quotes it)
MALLOPT_WHEN = "the first convert(), unpadded layer, op call or paddle_unpad DistributedStrategy"
# Clauses of the meanings below, named to keep the table's lines short
_MALLOPT_AT = f"mallopt at {MALLOPT_WHEN}, unless the user tuned malloc's mmap/trim settings"
_GROUP_STORES_READ = (
    "read when the plugin makes its first group, a paddle_unpad DistributedStrategy or an UnpadTrainer is built"
)
_GROUP_STORES_OFF = "off: Paddle's groups share the job's store and can read each other's addresses; must be equal on every rank: compared across ranks there"
_NODELAY_OFF = "off: each request can wait ~40 ms for a delayed ACK"

VARIABLES = tuple(
    Variable(*v)
    for v in (
        # run time: which operator library, and where
        ("DISABLE_NATIVE", "flag", False, "run every op's plain-Paddle reference instead of the compiled operators"),
        ("FORCE_JIT", "flag", False, "ignore an installed operator library and JIT-build one from the source checkout"),
        ("JIT", "flag", True, "allow the JIT build from a source checkout when no installed library is found"),
        ("CACHE", "path", "", "folder of JIT-built libraries (default ~/.cache/paddle_unpad)"),
        # run time: kernels
        ("NUM_THREADS", "int", 0, "threads of the CPU kernels (0: OMP_NUM_THREADS, else all cores)"),
        (
            "CPU_ISA",
            "choice",
            "auto",
            "CPU kernel path: auto (widest the CPU has) or a narrower avx2/sse2",
            ("auto", "avx512", "avx2", "sse2"),
        ),
        ("FMHA_GROUPING", "flag", True, "default of fmha(grouping=None) on GPU: the grouped multi-stream launch"),
        ("FMHA_STREAMS", "int", 4, "size of the CUDA stream pool of the grouped FMHA launch", (), "run", (1, 16)),
        (
            "FMHA_DETERMINISTIC",
            "flag",
            False,
            "default of fmha(deterministic=None) on GPU: the two-kernel backward without atomics, bitwise identical reruns (off: the one-pass backward, dQ added with float32 atomics)",
        ),
        (
            "MKL_DISPATCH",
            "choice",
            "auto",
            "auto: on a non-Intel x86 CPU, make Paddle's MKL use its AVX2/AVX-512 GEMM kernels (MKL_DEBUG_CPU_TYPE, set at import when unset); off: leave MKL as Paddle ships it",
            ("auto", "off"),
        ),
        (
            "HOST_MALLOC",
            "choice",
            "retain",
            f"retain: on Linux with glibc, keep freed host memory for reuse instead of returning it to the kernel and faulting it in again every step ({_MALLOPT_AT}); off: glibc's defaults",
            ("retain", "off"),
        ),
        # run time: distributed
        (
            "GLOO_GROUP_STORES",
            "flag",
            True,
            f"give every gloo process group after the default one a rendezvous store of its own ({_GROUP_STORES_READ}; {_GROUP_STORES_OFF})",
            (),
            "run",
            (0, None),
            True,
        ),
        (
            "STORE_NODELAY",
            "flag",
            True,
            f"send this process's requests to Paddle's TCP stores without Nagle's delay (TCP_NODELAY on its connections to the job's and the groups' stores; {_NODELAY_OFF})",
        ),
        # build time
        ("SKIP_CUDA", "flag", False, "never compile the CUDA sources", (), "build"),
        (
            "REQUIRE_CUDA",
            "flag",
            False,
            "fail the build unless the CUDA kernels are compiled (make setup PADDLE=gpu)",
            (),
            "build",
        ),
        ("CUDA_ARCHS", "str", "80;90", "SM versions the CUDA kernels are compiled for (80 or newer)", (), "build"),
        (
            "NATIVE_ARCH",
            "flag",
            False,
            "add -march=native to the CPU build (the default dispatches by ISA at run time)",
            (),
            "build",
        ),
        ("BUILD_JOBS", "int", 0, "parallel compile jobs (0: one per CPU)", (), "build"),
    )
)
_BY_NAME = {v.name: v for v in VARIABLES}


class ConfigError(ValueError):
    """A ``PADDLE_UNPAD_*`` variable holds a value its type does not allow."""


def variable(name):
    try:
        return _BY_NAME[name[len(PREFIX) :] if name.startswith(PREFIX) else name]
    except KeyError:
        raise KeyError(
            f"paddle_unpad.config: no configuration variable {name!r} (known: {', '.join(sorted(_BY_NAME))})"
        ) from None


_warned_unknown = set()  # names already reported in this process
_checked_names = []  # [True] once the process's environment has been checked


def warn_unknown(environ=None):
    """Warn once per name about ``PADDLE_UNPAD_*`` variables that are not in the table (a
    misspelt name is otherwise ignored without a word), naming the closest known one.
    Returns the unknown names found."""
    env = os.environ if environ is None else environ
    unknown = sorted(k for k in env if k.startswith(PREFIX) and k[len(PREFIX) :] not in _BY_NAME)
    for name in unknown:
        if name in _warned_unknown:
            continue
        _warned_unknown.add(name)
        close = difflib.get_close_matches(name[len(PREFIX) :], list(_BY_NAME), n=1, cutoff=0.6)  # the prefix aside
        hint = f"did you mean {PREFIX}{close[0]}?" if close else f"known: {', '.join(v.env for v in VARIABLES)}"
        warnings.warn(
            f"paddle_unpad.config: {name} is not a paddle_unpad setting and is ignored ({hint})",
            UserWarning,
            stacklevel=3,
        )
    return unknown


def get(name, environ=None):
    """The parsed value of a variable (its default when unset or empty)."""
    var = variable(name)
    if environ is None and not _checked_names:
        _checked_names.append(True)  # the first read of the process's own environment: check its names once
        warn_unknown()
    text = (os.environ if environ is None else environ).get(var.env, "").strip()
    if not text:
        return var.default
    return parse(var, text)


def parse(var: Variable, text: str):
    if var.kind == "flag":
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(
            f"paddle_unpad.config: {var.env}={text!r}: expected one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}"
        )
    if var.kind == "int":
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"paddle_unpad.config: {var.env}={text!r}: expected a whole number") from None
        low, high = var.bounds
        if value < low or (high is not None and value > high):
            raise ConfigError(f"paddle_unpad.config: {var.env}={text!r}: expected a whole number in {_range_text(var)}")
        return value
    if var.kind == "choice":
        low = text.lower()
        if low not in var.choices:
            raise ConfigError(f"paddle_unpad.config: {var.env}={text!r}: expected one of {', '.join(var.choices)}")
        return low
    if var.name in _TEXT_RULES:
        _TEXT_RULES[var.name](var, text)
    return text


def sm_versions(text: str):
    """The SM versions of a ``CUDA_ARCHS`` text ("80;90"; commas and spaces separate too)."""
    return [a.strip() for a in text.replace(",", ";").replace(" ", ";").split(";") if a.strip()]


def _check_sm_versions(var, text):
    for a in sm_versions(text):
        if not a.isdigit() or int(a) < 80:
            raise ConfigError(
                f"paddle_unpad.config: {var.env}={text!r}: {a!r} is not a supported SM version (need 80 or newer, e.g. '80;90')"
            )


# text settings with a rule of their own
_TEXT_RULES = {"CUDA_ARCHS": _check_sm_versions}


def agreed_settings(environ=None):
    """``{variable: text}`` of the settings that must be equal on every rank (``agree``), as this
    process reads them: the parsed value (``on``/``off`` for flags), or ``invalid 'text'``."""
    env = os.environ if environ is None else environ
    out = {}
    for v in VARIABLES:
        if not v.agree:
            continue
        text = env.get(v.env, "").strip()
        try:
            value = parse(v, text) if text else v.default
        except ConfigError:
            out[v.env] = f"invalid {text!r}"
            continue
        out[v.env] = ("on" if value else "off") if v.kind == "flag" else str(value)
    return out


def _range_text(var):
    low, high = var.bounds
    return f"{low}-{high}" if high is not None else f">= {low}"


def resolve(argument, name):
    """``argument`` when given (not None), else the variable's value: the explicit argument wins."""
    return get(name) if argument is None else argument


def markdown_table():
    """The table of docs/api.md (a test keeps the two equal)."""
    rows = ["| variable | type | default | read | meaning |", "|---|---|---|---|---|"]
    for v in VARIABLES:
        kind = " / ".join(v.choices) if v.kind == "choice" else f"int ({_range_text(v)})" if v.kind == "int" else v.kind
        if v.kind == "flag":
            default = "on" if v.default else "off"
        else:
            default = f"`{v.default}`" if v.default != "" else "-"
        read = "build" if v.when == "build" else "run time, equal on every rank" if v.agree else "run time"
        rows.append(f"| `{v.env}` | {kind} | {default} | {read} | {v.meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python paddle_unpad/config.py NAME=VALUE ...: checked NAME=VALUE pairs for a shell
    import sys

    pairs = []
    for arg in sys.argv[1:]:
        name, _, value = arg.partition("=")
        var = variable(name)
        parse(var, value)
        pairs.append(f"{var.env}={value}")
    print(" ".join(pairs))

"""The package's front door: a short top level, ``from paddle_unpad import *`` that loads no
training code, and the modules' old names still importable, each with a DeprecationWarning."""

import glob
import importlib
import json
import os
import sys
import warnings

import pytest

import paddle_unpad as pu
from paddle_unpad._runtime import aliases
from testutil import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINING = (
    "paddle_unpad.distributed",
    "paddle_unpad.fleet",
    "paddle_unpad.trainer",
    "paddle_unpad.models",
    "paddlenlp",
    "paddle.distributed.fleet.meta_parallel",
)


def test_top_level_holds_the_public_modules_only():
    top = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "paddle_unpad", "*.py")))
    assert len(top) <= 7, top
    assert not [m for m in top if m.startswith("_") and m != "__init__.py"], top


def test_star_import_loads_no_training_code():
    code = (
        "import sys, json\nimport paddle\nbefore = set(sys.modules)\nfrom paddle_unpad import *\n"
        "import paddle_unpad\n"
        "print(json.dumps({'new': sorted(set(sys.modules) - before), 'all': paddle_unpad.__all__,"
        " 'bound': sorted(n for n in paddle_unpad.__all__ if n in globals())}))\n"
    )
    p = run_python("-c", code)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["bound"] == sorted(got["all"])
    assert [m for m in got["new"] if m.startswith(TRAINING)] == []
    # and the names that are loaded on first use still are
    assert "paddle_unpad.ops" in got["new"] and "paddle_unpad.varlen" in got["new"]


@pytest.mark.parametrize("old", sorted(aliases.MOVED))
def test_old_module_names_work_and_warn(old):
    new = importlib.import_module(aliases.MOVED[old])
    sys.modules.pop(f"paddle_unpad.{old}", None)
    pu.__dict__.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"paddle_unpad\.{old} moved to {aliases.MOVED[old]}"):
        got = importlib.import_module(f"paddle_unpad.{old}")
    assert got is new and new.__spec__.name == aliases.MOVED[old]
    pu.__dict__.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"paddle_unpad\.{old} moved"):
        assert getattr(pu, old) is new
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(pu, old) is new  # warned once per name: ``from pu import x`` reads it twice


def test_unknown_names_are_still_refused():
    with pytest.raises(AttributeError, match="no attribute 'cpu_gemmm'"):
        pu.cpu_gemmm
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("paddle_unpad.no_such_module")

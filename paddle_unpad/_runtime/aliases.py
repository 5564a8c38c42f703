"""Old module names that keep working: the modules moved into ``paddle_unpad.ops`` and
``paddle_unpad._runtime``; importing or reading one by its old name gives the module itself
and a DeprecationWarning naming where it lives now."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from . import process_changes

# old name under paddle_unpad -> the module it is now
MOVED = {
    "philox": "paddle_unpad.ops.philox",
    "bucketed_attention": "paddle_unpad.ops.bucketed_attention",
    "cpu_gemm": "paddle_unpad._runtime.cpu_gemm",
    "host_malloc": "paddle_unpad._runtime.host_malloc",
    "process_changes": "paddle_unpad._runtime.process_changes",
    "_native": "paddle_unpad._runtime.native",
}
_PUBLIC_INSTEAD = {
    "cpu_gemm": "pu.info()['MKL_DEBUG_CPU_TYPE'] and pu.host_info()",
    "host_malloc": "pu.info()['mallopt']",
    "process_changes": "pu.info()",
    "_native": "pu.ops_available() and pu.info()['operator library']",
}


def _warn(old, stacklevel):
    instead = f"; use {_PUBLIC_INSTEAD[old]}" if old in _PUBLIC_INSTEAD else ""
    warnings.warn(
        f"paddle_unpad.{old} moved to {MOVED[old]} and will be removed in a later release{instead}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def resolve(old, stacklevel=4):
    """The module an old attribute name of ``paddle_unpad`` stands for, with the warning."""
    _warn(old, stacklevel)
    return importlib.import_module(MOVED[old])


class _Loader(importlib.abc.Loader):
    def __init__(self, old):
        self.old = old

    def create_module(self, spec):
        module = importlib.import_module(MOVED[self.old])
        self.spec = module.__spec__
        return module

    def exec_module(self, module):
        # the import system stamped the alias spec on the real module: give it its own back
        module.__spec__ = self.spec
        _warn(self.old, stacklevel=3)  # importlib._bootstrap frames are not counted


class _Finder(importlib.abc.MetaPathFinder):
    """``import paddle_unpad.<old name>`` -> the moved module."""

    def find_spec(self, fullname, path=None, target=None):
        head, _, old = fullname.rpartition(".")
        if head != "paddle_unpad" or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _Loader(old))


_FINDER = _Finder()


def install():
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
    process_changes.record("module aliases", applied=installed, names=[f"paddle_unpad.{old}" for old in MOVED])


def installed():
    return _FINDER in sys.meta_path

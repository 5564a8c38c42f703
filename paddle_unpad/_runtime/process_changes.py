"""Every change the plugin makes to the process outside its own objects, and when it makes it.

``import paddle_unpad`` makes one: ``MKL_DEBUG_CPU_TYPE`` (:mod:`paddle_unpad._runtime.cpu_gemm`),
because MKL reads it once, at its first GEMM, and any Paddle code may run one after the
import. Every other change waits for the first use of the feature that needs it.
:func:`info` (``paddle_unpad.info()``) lists them all: applied or not, when, and why.
"""
from __future__ import annotations

import sys
import threading

from .. import config
from . import cpu_gemm, host_malloc

__all__ = ["info"]

_FIRST_GROUP = ("the plugin's first process group, pu.fleet.DistributedStrategy() or import paddle_unpad.trainer")


def _mkl():
    state = cpu_gemm.info()
    return {"applied": state["action"] == "set", "value": state["value"], "mkl_kernels": state["mkl_kernels"],
            "when": "import paddle_unpad (MKL reads it once, at its first GEMM, which any Paddle code may run)",
            "why": f"{state['why']}; MKL's vendor check gives non-Intel CPUs its generic SSE2 GEMM kernels (off: {config.variable('MKL_DISPATCH').env}=off)"}


def _mallopt():
    state = host_malloc.info()
    when = state["when"] or f"not yet: {config.MALLOPT_WHEN}"
    return {"applied": state["action"] == "retain", "when": when,
            "why": f"{state['why'] or 'no feature that needs it has run'}; freed host memory is kept for the next step instead of being faulted in again (off: {config.variable('HOST_MALLOC').env}=off)"}


def _group_factory():
    from . import paddle_compat as _paddle_compat

    rules = getattr(_paddle_compat.process_group_factory(), "_paddle_unpad_rules", None)
    return {"applied": rules is not None, "when": _FIRST_GROUP,
            "why": "paddle.distributed's process-group factory wrapped: each gloo group gets a rendezvous store of its own (Paddle's groups overwrite each other's keys in the job's store), and store connections get TCP_NODELAY" + ("" if rules is None else f" (group stores {rules[0]}, TCP_NODELAY {rules[1]})")}


def _loaded(name):
    """The plugin's module ``name`` if something imported it (not imported: it changed nothing;
    info() must not load the distributed layer into an inference process)."""
    return sys.modules.get(f"paddle_unpad.{name}")


def _atexit():
    workarounds = _loaded("distributed.workarounds")
    return {"applied": workarounds is not None and workarounds.exit_handler_installed(),
            "when": "the plugin's first process group, background thread or wrapped host group",
            "why": "at exit the plugin's background threads are stopped and joined before the interpreter finalizes, and rank 0 leaves a clean job last"}


def _excepthook():
    source = _loaded("distributed.source")
    return {"applied": source is not None and threading.excepthook is source._excepthook,
            "when": "a BalancedLoader first iterates a rank's own loader",
            "why": "a DataLoader thread that dies of an exception wakes its reader (which would block for ever) and the error reaches every rank"}


def _nodelay():
    workarounds = _loaded("distributed.workarounds")
    count = 0 if workarounds is None else workarounds.nodelay_connections()
    return {"applied": count > 0, "connections": count,
            "when": "each group the wrapped factory creates (the job's store) and each group store",
            "why": f"the store's small requests skip Nagle's delay (~40 ms per request otherwise; off: {config.variable('STORE_NODELAY').env}=off)"}


def _operators():
    from . import native

    state = native.info()
    return {"applied": state["path"] is not None, "path": state["path"], "ops": list(state["ops"]),
            "isa": state["isa"], "error": state["error"],
            "when": "import paddle_unpad (an exported model that holds the operators loads only where they are registered)",
            "why": f"the compiled operators registered with Paddle (off: {config.variable('DISABLE_NATIVE').env}=1)"}


def _aliases():
    from . import aliases

    return {"applied": aliases.installed(), "names": [f"paddle_unpad.{old}" for old in aliases.MOVED],
            "when": "import paddle_unpad",
            "why": "a finder on sys.meta_path keeps the modules' old names importable (each with a DeprecationWarning)"}


_CHANGES = {"MKL_DEBUG_CPU_TYPE": _mkl, "operator library": _operators, "module aliases": _aliases, "mallopt": _mallopt, "process-group factory": _group_factory,
            "atexit handler": _atexit, "threading.excepthook": _excepthook, "TCP_NODELAY": _nodelay}


def info():
    """``{change: {"applied": bool, "when": str, "why": str, ...}}`` for every process-wide
    change the plugin makes (``when``: the point at which it is made)."""
    return {name: describe() for name, describe in _CHANGES.items()}

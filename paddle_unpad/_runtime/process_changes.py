"""Every change the plugin makes to the process outside its own objects: declared here, reported
by the code that makes it.

Each change is declared once in :data:`CHANGES` (its name, when it is made, why); the code that
makes it calls :func:`record` with what it did, and :func:`info` (``paddle_unpad.info()``) lists
them all from those reports, applied or not. ``import paddle_unpad`` makes three: MKL's kernel
choice (``MKL_DEBUG_CPU_TYPE``: MKL reads it once, at its first GEMM, which any Paddle code may
run after the import), the operators' registration (an exported model that holds them loads
only where they are registered) and the finder of the modules' old names. Every other change
waits for the first use of the feature that needs it.
"""

from __future__ import annotations

import threading
from typing import Dict

from .. import config

__all__ = ["info", "record", "Change", "CHANGES"]


class Change:
    """One process-wide change: its name, the function that makes it (``by``), when it is made,
    why, and the extra fields ``paddle_unpad.info()`` shows for it (their values before it is
    made). ``reason``: why it was (or was not) made in this process, put before ``why``; the
    function that makes it reports its own with :func:`record`."""

    def __init__(self, name: str, by: str, when: str, why: str, reason: str = None, **extra):
        self.name, self.by, self.when, self.why, self.reason, self.extra = name, by, when, why, reason, extra
        self._report = {"applied": False}

    def report(self, applied, when=None, reason=None, **extra):
        unknown = sorted(set(extra) - set(self.extra))
        if unknown:
            raise ValueError(
                f"paddle_unpad: the {self.name!r} change has no field(s) {unknown}: its declaration in paddle_unpad._runtime.process_changes names {sorted(self.extra)}"
            )
        self._report = dict(extra, applied=applied, when=when, reason=reason)

    def describe(self) -> dict:
        """``{"applied": bool, "when": str, "why": str, **extra}`` as last reported; a reported
        value that is a function is called now (a state that may change after it was made)."""
        got = {k: v() if callable(v) else v for k, v in self._report.items()}
        reason = got.pop("reason", None) or self.reason
        out = {
            "applied": bool(got.pop("applied")),
            "when": got.pop("when", None) or self.when,
            "why": f"{reason}; {self.why}" if reason else self.why,
        }
        out.update(self.extra)
        out.update(got)
        return out


_FIRST_GROUP = "the plugin's first process group, pu.fleet.DistributedStrategy() or an UnpadTrainer built"
_OWN_STORES = "each gloo group gets a rendezvous store of its own (Paddle's groups overwrite each other's keys in the job's store)"

CHANGES: Dict[str, Change] = {
    c.name: c
    for c in (
        Change(
            "MKL_DEBUG_CPU_TYPE",
            "_runtime.cpu_gemm.configure",
            "import paddle_unpad (MKL reads it once, at its first GEMM, which any Paddle code may run)",
            f"MKL's vendor check gives non-Intel CPUs its generic SSE2 GEMM kernels (off: {config.variable('MKL_DISPATCH').env}=off)",
            reason="not configured",
            value=None,
            mkl_kernels=None,
        ),
        Change(
            "operator library",
            "_runtime.native.load",
            "import paddle_unpad (an exported model that holds the operators loads only where they are registered)",
            f"the compiled operators registered with Paddle (off: {config.variable('DISABLE_NATIVE').env}=1)",
            path=None,
            ops=[],
            isa=None,
            error=None,
        ),
        Change(
            "module aliases",
            "_runtime.aliases.install",
            "import paddle_unpad",
            "a finder on sys.meta_path keeps the modules' old names importable (each with a DeprecationWarning)",
            names=[],
        ),
        Change(
            "mallopt",
            "_runtime.host_malloc.configure",
            f"not yet: {config.MALLOPT_WHEN}",
            f"freed host memory is kept for the next step instead of being faulted in again (off: {config.variable('HOST_MALLOC').env}=off)",
            reason="no feature that needs it has run",
        ),
        Change(
            "process-group factory",
            "distributed.workarounds.install_group_stores",
            _FIRST_GROUP,
            f"paddle.distributed's process-group factory wrapped: {_OWN_STORES}, and store connections get TCP_NODELAY",
        ),
        Change(
            "atexit handler",
            "distributed.workarounds.ensure_exit_handler",
            "the plugin's first process group, background thread or wrapped host group",
            "at exit the plugin's background threads are stopped and joined before the interpreter finalizes, and rank 0 leaves after its peers (a clean or a failed job)",
        ),
        Change(
            "threading.excepthook",
            "distributed.workarounds.catch_thread_deaths",
            "a BalancedLoader first iterates a rank's own loader",
            "a DataLoader thread that dies of an exception wakes its reader (which would block for ever) and the error reaches every rank",
        ),
        Change(
            "TCP_NODELAY",
            "distributed.workarounds.quick_store_requests",
            "each group the wrapped factory creates (the job's store) and each group store",
            f"the store's small requests skip Nagle's delay (~40 ms per request otherwise; off: {config.variable('STORE_NODELAY').env}=off)",
            connections=0,
        ),
    )
}

_lock = threading.Lock()


def record(name: str, applied=True, when: str = None, reason: str = None, **extra):
    """What the code that makes the change ``name`` (one of :data:`CHANGES`) did: ``applied``
    (a bool, or a function that says whether it still is), ``when`` it made it (None: as
    declared), the ``reason`` it was made or not here, and the declared extra fields. Each
    report replaces the one before."""
    if name not in CHANGES:
        raise ValueError(
            f"paddle_unpad: no process change named {name!r}: declare it in paddle_unpad._runtime.process_changes.CHANGES ({sorted(CHANGES)})"
        )
    with _lock:
        CHANGES[name].report(applied, when=when, reason=reason, **extra)


def info():
    """``{change: {"applied": bool, "when": str, "why": str, ...}}`` for every process-wide
    change the plugin makes (``when``: the point at which it is made)."""
    with _lock:
        return {name: change.describe() for name, change in CHANGES.items()}

"""Keep freed host memory in the process, so that CPU training does not fault it in again every step.

Paddle's CPU tensors come from the C library's ``malloc``. With glibc's defaults a block of
more than 128 KiB -- up to 32 MiB once glibc has adapted -- is a fresh ``mmap`` that
``free`` hands back to the kernel, and so is a heap top of more than twice that. Every
step of a training loop then allocates its activations and gradients anew, and the
kernel zero-fills each 4 KiB page again on the first write to it (a minor page fault,
about 2 us each on these VMs). For element-wise work that costs more than the work
itself: a ``[1300, 1536]`` fp32 bias+GELU took 6.8 ms with glibc's defaults and 2.1 ms
with freed memory kept (1 thread, every call faulting its 8 MB output in); a plain copy
3.5 ms against 0.6 ms. In a training step the tensors above 32 MiB fault every time
(a 30522 x 384 embedding gradient is 47 MB), the others until glibc's adaptive
threshold has grown past them.

So when the plugin's training features are first used (:func:`ensure`, at the points
``paddle_unpad.config.MALLOPT_WHEN`` lists -- before the training loop's allocations, not at
``import paddle_unpad``), on Linux with glibc, the plugin tells
``malloc`` (``mallopt``) never to serve a block by ``mmap``
(``M_MMAP_MAX = 0``) and never to give the top of its heap back (``M_TRIM_THRESHOLD =
-1``): freed memory is reused by later steps instead of being faulted in again (after the
heap has grown to the loop's working set: a few steps). The cost is that the process
keeps its high-water mark of host memory, fragments included: the peak RSS of the
2-rank end-to-end job grew by 4% (unpadded ways alone) to 15% (with the padded ways'
large tensors), measured by ``benchmarks/bench_e2e.py``. Memory allocated before that first
use is unaffected until it is freed.

Nothing is changed with the ``HOST_MALLOC`` setting off (:mod:`paddle_unpad.config`),
when the user has tuned these parts of glibc's malloc already (``MALLOC_MMAP_MAX_``,
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or their
``GLIBC_TUNABLES``), or where the C library is not glibc.
:func:`info` says what was done and why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

from .. import config
from . import process_changes

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# the environment through which a user tunes glibc's malloc (read by glibc at start-up)
USER_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
USER_TUNABLES = (
    "glibc.malloc.mmap_max",
    "glibc.malloc.mmap_threshold",
    "glibc.malloc.trim_threshold",
    "glibc.malloc.top_pad",
)

_state = {"action": None, "why": None, "when": None}


def _user_tuned(environ):
    named = [k for k in USER_ENV if environ.get(k, "").strip()]
    if any(t in environ.get("GLIBC_TUNABLES", "") for t in USER_TUNABLES):
        named.append("GLIBC_TUNABLES")
    return named


def _glibc():
    """The C library's handle when it is glibc, else (None, why not)."""
    if platform.system() != "Linux":
        return None, f"not Linux ({platform.system()})"
    lib, version = platform.libc_ver()
    if lib != "glibc":
        return None, f"the C library is not glibc ({lib or 'unknown'})"
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), f"glibc {version}"
    except OSError as e:
        return None, f"glibc could not be opened: {e}"


def ensure(trigger):
    """Apply the setting once per process, at the first use of a feature that needs it
    (``trigger`` names it for :func:`info`). Cheap after the first call."""
    if _state["action"] is None:
        configure(when=f"first use: {trigger}")


def configure(environ=None, when=None):
    """Apply the setting (see the module docstring). A bad ``HOST_MALLOC`` value raises
    ``config.ConfigError`` naming it and changes nothing. Reported to ``paddle_unpad.info()``."""
    _configure(environ, when)
    process_changes.record("mallopt", applied=_state["action"] == "retain", when=_state["when"], reason=_state["why"])


def _configure(environ, when):
    environ = os.environ if environ is None else environ
    mode = config.get("HOST_MALLOC", environ)
    _state["when"] = when
    if mode == "off":
        _state.update(action="unchanged", why=f"{config.variable('HOST_MALLOC').env}=off")
        return
    named = _user_tuned(environ)
    if named:
        _state.update(action="unchanged", why=f"malloc tuned by the user ({', '.join(named)})")
        return
    libc, why = _glibc()
    if libc is None:
        _state.update(action="unchanged", why=why)
        return
    # mallopt returns 1 on success, 0 on error
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, -1) == 1
    _state.update(
        action="retain" if ok else "unchanged",
        why=f"{why}: mallopt(M_MMAP_MAX=0, M_TRIM_THRESHOLD=-1)" + ("" if ok else " refused"),
    )


def info():
    """What the plugin did: ``{"action": "retain" | "unchanged" | None (not yet: no feature
    that needs it has run), "why": str, "when": the first use that applied it}``."""
    return dict(_state)

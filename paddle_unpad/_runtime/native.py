"""Finds the compiled operator library and registers its operators with Paddle.

Order of search:
  1. ``paddle_unpad/_ops_lib_<tag>*.so`` -- built by ``pip install`` (editable or not) against
     the running Paddle (``build_config.library_tag``: libraries of other Paddle builds are skipped);
  2. a JIT build from the source checkout's ``custom_ops/`` into a cache folder (the
     ``CACHE`` setting, default ``~/.cache/paddle_unpad``), keyed by a hash of sources and
     flags, so it is rebuilt only when they change (the ``JIT`` setting turns this off).
When neither works, every op runs its plain-Paddle reference and one warning says why.
The ``DISABLE_NATIVE`` setting forces the reference path (for comparisons), ``FORCE_JIT``
ignores an installed library and takes step 2 (settings: :mod:`paddle_unpad.config`).
Once registered, the library gets the kernels' run-time settings (threads, CPU ISA cap,
CUDA streams) through ``paddle_unpad_configure`` before any kernel runs. Every one of these
settings is read before the search starts: a bad value is a ``ConfigError`` naming it
(at import), never a reason to fall back to the references.

``import paddle_unpad`` registers the operators (:func:`load_at_import`): a program saved
by ``paddle.jit.save`` that contains them is then loadable by ``paddle.jit.load`` or a
``paddle.inference`` predictor before any op has been called in the process (Paddle
resolves every op of a loaded program when it first runs it, and an unregistered custom
op fails there with an unhelpful ``kernel output args (0) defs`` error).
"""

import ctypes
import os
import sys
import threading
import warnings

from .. import config
from . import process_changes

_lock = threading.RLock()
# the settings of the library's search and of its kernels (paddle_unpad/config.py)
SETTINGS = ("DISABLE_NATIVE", "FORCE_JIT", "JIT", "CACHE", "NUM_THREADS", "CPU_ISA", "FMHA_STREAMS")
_state = {"tried": False, "path": None, "ops": (), "error": None, "flags": 0, "isa": None}


def _installed_library():
    from . import build_config as cfg

    return cfg.find_installed_library(cfg.PACKAGE)


def settings():
    """The parsed :data:`SETTINGS` (``config.ConfigError`` for a bad value)."""
    return {name: config.get(name) for name in SETTINGS}


def _jit_library(cache):
    from . import build_config as cfg

    if not os.path.isdir(cfg.CUSTOM_OPS) or not cfg.ops_sources(False):
        return None
    with_cuda = cfg.cuda_wanted()
    cache = cache or os.path.join(os.path.expanduser("~"), ".cache", "paddle_unpad")
    folder = os.path.join(cache, cfg.build_fingerprint(with_cuda))
    out = os.path.join(folder, "paddle_unpad_ops.so")
    if os.path.exists(out):
        return out
    os.makedirs(folder, exist_ok=True)
    import fcntl

    # Several ranks of one fleetrun job may start at once: one builds, the rest wait.
    with open(os.path.join(folder, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(out):
            print(
                f"paddle_unpad: compiled operators not installed; building them into {folder} (once, about a minute)...",
                file=sys.stderr,
                flush=True,
            )
            cfg.build_ops_library(out, os.path.join(folder, "obj"), verbose=False, with_cuda=with_cuda)
    return out


def load():
    """Registers the operators once per process; returns True when they are usable."""
    if _state["tried"]:  # every op call asks: answer without taking the lock
        return _state["path"] is not None
    with _lock:
        if _state["tried"]:
            return _state["path"] is not None
        wanted = settings()  # outside the try: a bad setting is an error, not a reason to fall back
        try:
            return _load_locked(wanted)
        finally:
            _state["tried"] = True  # only now: the lock-free check above must not see a half-load
            _report()


def _load_locked(wanted):
    try:
        if wanted["DISABLE_NATIVE"]:
            _state["error"] = f"{config.variable('DISABLE_NATIVE').env} is set"
            return False
        path = None if wanted["FORCE_JIT"] else _installed_library()
        if path is None and wanted["JIT"]:
            path = _jit_library(wanted["CACHE"])
        if path is None:
            raise FileNotFoundError(
                "paddle_unpad: no compiled library (run `make setup` or `pip install --no-build-isolation -e .`)"
            )
        from paddle.utils.cpp_extension import load_op_meta_info_and_register_op

        ops = load_op_meta_info_and_register_op(path)
        lib = ctypes.CDLL(path)
        lib.paddle_unpad_configure.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.paddle_unpad_configure(wanted["NUM_THREADS"], wanted["CPU_ISA"].encode(), wanted["FMHA_STREAMS"])
        lib.paddle_unpad_cpu_isa.restype = ctypes.c_char_p
        _state.update(
            path=path,
            ops=tuple(ops),
            flags=int(lib.paddle_unpad_build_flags()),
            isa=lib.paddle_unpad_cpu_isa().decode(),
        )
    except Exception as e:  # import must never fail because of native code
        _state["error"] = f"{type(e).__name__}: {e}"
        warnings.warn(
            f"paddle_unpad: native operators unavailable, using the plain-Paddle reference implementations (slower). Reason: {_state['error']}",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


def load_at_import():
    """Called by ``paddle_unpad/__init__.py``. Registering an installed (or already built)
    library takes milliseconds; a first JIT build says so on stderr before it starts. Raises
    only for a bad setting (``config.ConfigError``): without the library, import succeeds and
    the references run (one warning)."""
    try:
        load()
    except config.ConfigError:
        raise
    except Exception as e:  # load() catches its own errors; this guards import against the unforeseen
        _state["error"] = _state["error"] or f"{type(e).__name__}: {e}"
        _state["tried"] = True
        _report()


def _report():
    process_changes.record(
        "operator library",
        applied=_state["path"] is not None,
        path=_state["path"],
        ops=list(_state["ops"]),
        isa=_state["isa"],
        error=_state["error"],
    )


def has_op(name):
    return load() and name in _state["ops"]


def has_cuda_kernels():
    return load() and bool(_state["flags"] & 2)


def info():
    """Where the library came from, its ops, the CPU ISA in use, or why it is missing."""
    load()
    return {k: _state[k] for k in ("path", "ops", "isa", "error")}

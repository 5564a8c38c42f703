"""Fast fp32 GEMMs from Paddle's CPU build on AMD (and other non-Intel x86) hosts.

Paddle's CPU wheels run dygraph ``matmul`` / ``linear`` through the MKL they bundle
(``libmklml_intel.so``, MKL 2019.0.5). That MKL picks its kernels by CPU *vendor*: on a
CPU that is not Intel's it runs its generic SSE2 kernels, whatever the CPU's ISA --
2.8-3x slower than its AVX2 / AVX-512 kernels on the same AMD EPYC cores
(``benchmarks/bench_gemm.py``). MKL up to 2020.0 honours ``MKL_DEBUG_CPU_TYPE``
(5: AVX2 kernels, 7: AVX-512 kernels), read once, when MKL runs its first GEMM.

So at import (:func:`configure`, called by ``paddle_unpad/__init__.py``), on a non-Intel
x86-64 CPU with AVX2 + FMA and ``MKL_DEBUG_CPU_TYPE`` unset, the plugin sets it to the
widest kernel family the CPU runs (7 with AVX-512 F/CD/BW/DQ/VL, else 5). Nothing is
changed on Intel CPUs (MKL already picks its best kernels there), when the user set
``MKL_DEBUG_CPU_TYPE`` themselves, or with the ``MKL_DISPATCH`` setting off
(:mod:`paddle_unpad.config`).
The kernels compute the same products (results agree to fp32 rounding; checked in
``tests/test_cpu_gemm.py``). :func:`info` reports what MKL actually uses.

Paddle loads MKL lazily, at its first GEMM: a process that multiplied matrices before
importing ``paddle_unpad`` keeps the generic kernels, and gets one warning saying so.
"""

from __future__ import annotations

import ctypes
import os
import platform
import warnings

from .. import config
from . import process_changes
from .host import cpu_identity, describe

ENV = "MKL_DEBUG_CPU_TYPE"
AVX512_FLAGS = ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl")  # MKL's AVX-512 (SKX) kernels
AVX2_FLAGS = ("avx2", "fma")
KERNELS = {"5": "avx2", "7": "avx512"}
# what mkl_serv_cpu_detect() returns, by kernel family
DETECTED = {0: "generic (SSE2)", 2: "avx", 4: "avx2", 5: "avx2", 6: "avx512_mic", 7: "avx512"}

_state = {"action": None, "value": None, "why": None}


def choose(vendor, flags, machine=None):
    """The ``MKL_DEBUG_CPU_TYPE`` value for this CPU, or (None, why not)."""
    machine = machine or platform.machine()
    if machine not in ("x86_64", "AMD64"):
        return None, f"not an x86-64 CPU ({machine})"
    if vendor == "GenuineIntel":
        return None, "Intel CPU: MKL picks its best kernels itself"
    if vendor is None:
        return None, "CPU vendor unknown"
    if all(f in flags for f in AVX512_FLAGS):
        return "7", f"{vendor} with AVX-512"
    if all(f in flags for f in AVX2_FLAGS):
        return "5", f"{vendor} with AVX2"
    return None, f"{vendor} without AVX2/FMA: MKL's generic kernels are its only ones"


def mkl_library():
    """The MKL library loaded in this process (path), or None: Paddle loads it at its first GEMM."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if "/" in line else ""
                base = os.path.basename(path)
                if base.startswith(("libmklml", "libmkl_rt")):
                    return path
    except OSError:
        pass
    return None


def configure():
    """Set ``MKL_DEBUG_CPU_TYPE`` for this CPU when it helps and nobody else chose (see the module docstring).
    A bad ``MKL_DISPATCH`` value raises ``config.ConfigError`` naming it (at import). Reported to
    ``paddle_unpad.info()``."""
    _configure()
    process_changes.record(
        "MKL_DEBUG_CPU_TYPE",
        applied=_state["action"] == "set",
        reason=_state["why"],
        value=_state["value"],
        mkl_kernels=lambda: info()["mkl_kernels"],
    )


def _configure():
    mode = config.get("MKL_DISPATCH")
    if mode == "off":
        _state.update(action="unchanged", why=f"{config.variable('MKL_DISPATCH').env}=off")
        return
    if os.environ.get(ENV, "").strip():
        _state.update(action="unchanged", value=os.environ[ENV].strip(), why=f"{ENV} set by the user")
        return
    vendor, _, flags = cpu_identity()
    value, why = choose(vendor, flags)
    if value is None:
        _state.update(action="unchanged", why=why)
        return
    if mkl_library() is not None:
        _state.update(action="too late", value=value, why="MKL had already run a GEMM before paddle_unpad was imported")
        advice = f"import paddle_unpad first, or start Python with {ENV}={value}, for its {KERNELS[value]} kernels (2-3x faster fp32 GEMMs)"
        warnings.warn(
            f"paddle_unpad: Paddle's MKL already chose its generic GEMM kernels on this {vendor} CPU (a matmul ran before `import paddle_unpad`); {advice}",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    os.environ[ENV] = value
    _state.update(action="set", value=value, why=why)


def info():
    """What the plugin did and what MKL uses: ``{"action", "value", "why", "mkl", "mkl_kernels"}``.

    ``action`` is "set" (the plugin set ``MKL_DEBUG_CPU_TYPE=value``), "unchanged" or
    "too late"; ``mkl_kernels`` is MKL's own answer once it is loaded (None before)."""
    out = dict(_state)
    out["mkl"], out["mkl_kernels"] = None, None
    path = mkl_library()
    if path is not None:
        try:
            lib = ctypes.CDLL(path)
            buf = ctypes.create_string_buffer(256)
            lib.MKL_Get_Version_String(buf, 256)
            out["mkl"] = buf.value.decode(errors="replace")
            detect = int(lib.mkl_serv_cpu_detect())
            out["mkl_kernels"] = DETECTED.get(detect, f"type {detect}")
        except (OSError, AttributeError):  # another MKL build without these symbols
            pass
    return out


def host_info():
    """The host for result records: CPU model and vendor, cores, notable ISA flags, and the
    GEMM kernels MKL runs (None before its first GEMM)."""
    return dict(describe(), mkl_kernels=info()["mkl_kernels"])

"""The host CPU, read from /proc/cpuinfo (standard library only: benchmark parents that must not
load Paddle read this file directly)."""

import os
import platform

# flags worth recording: what the kernels (ours, MKL's, oneDNN's) choose between
NOTABLE_FLAGS = (
    "avx",
    "fma",
    "avx2",
    "avx512f",
    "avx512cd",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512_bf16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
)


def cpu_identity(cpuinfo_text=None):
    """(vendor, model name, set of flags) of the first CPU in /proc/cpuinfo (or of ``cpuinfo_text``)."""
    if cpuinfo_text is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo_text = f.read()
        except OSError:
            return None, platform.processor() or platform.machine(), set()
    vendor, model, flags = None, None, set()
    for line in cpuinfo_text.splitlines():
        key, _, val = line.partition(":")
        key, val = key.strip(), val.strip()
        if key == "vendor_id" and vendor is None:
            vendor = val
        elif key == "model name" and model is None:
            model = val
        elif key == "flags":
            flags = set(val.split())
            break
    return vendor, model or platform.processor() or platform.machine(), flags


def describe():
    """The host as a dict for result files: CPU model and vendor, cores, notable ISA flags."""
    vendor, model, flags = cpu_identity()
    return {
        "cpu_model": model,
        "cpu_vendor": vendor,
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "cpu_flags": [f for f in NOTABLE_FLAGS if f in flags],
    }

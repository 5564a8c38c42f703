"""Host buffers for the emulated kernels: fp16 / bf16 / fp32 storage and NaN-filled guard
rows around every buffer, so a kernel that reads outside its rows produces NaN and one
that writes outside them overwrites the NaN."""

import ctypes

import numpy as np

STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}
NAN_BITS = {"bfloat16": 0x7FC0}


def to_storage(a, dt):
    """float values -> (storage array of dt, the float64 values it holds)."""
    a = np.asarray(a, np.float32)
    if dt == "bfloat16":  # round to nearest even, keep the top 16 bits
        b = a.view(np.uint32).astype(np.uint64)
        s = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    else:
        s = a.astype(STORAGE[dt])
    return s, from_storage(s, dt)


def from_storage(s, dt):
    if dt == "bfloat16":
        return (s.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return s.astype(np.float64)


def aligned_empty(shape, dtype, align=64):
    """An uninitialised array whose data pointer is `align`-byte aligned."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + n].view(dtype).reshape(shape)


class Buffer:
    """A NaN-filled array with `pad` rows (elements) on each side; .view is the inside."""

    def __init__(self, shape, dt, pad, fill=None):
        self.dt = dt
        self.pad = pad
        self.full = aligned_empty((shape[0] + 2 * pad, *shape[1:]), STORAGE[dt])
        self.full[...] = NAN_BITS.get(dt, np.nan)
        self.view = self.full[pad : pad + shape[0]]
        if fill is not None:
            self.view[...] = fill

    @property
    def ptr(self):
        return ctypes.c_void_p(self.view.ctypes.data)

    def values(self):
        return from_storage(self.view, self.dt)

    def check(self, name):
        f = from_storage(self.full, self.dt)
        pad = self.pad
        assert np.isnan(f[:pad]).all() and np.isnan(f[len(f) - pad :]).all(), f"{name}: written outside"
        assert np.isfinite(f[pad : len(f) - pad]).all(), f"{name}: non-finite (unwritten, or a neighbour read)"

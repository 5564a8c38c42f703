"""Shared by the GPU tests: NaN-poisoned neighbours, relative error, and the op rules."""

import importlib.util
import math
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def op_rules():
    """paddle_unpad/ops/_rules.py, the tables paddle_unpad.ops re-exports (FMHA_GPU_TOLERANCE,
    ...), loaded by path: GPU machines have no Paddle, which importing the package needs."""
    spec = importlib.util.spec_from_file_location(
        "paddle_unpad_op_rules", os.path.join(ROOT, "paddle_unpad", "ops", "_rules.py")
    )
    rules = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rules)
    return rules


ALIGN = 16  # bytes: the kernels refuse (FMHA) or fall back from (fused ops) a less aligned pointer


def guard_rows(row_shape, element_size, min_rows):
    """The fewest guard rows >= min_rows whose bytes are a multiple of ALIGN, so that a view
    starting after them is as aligned as the buffer (torch allocations are 256-byte aligned).
    row_shape: shape of one row ([] for a 1-D buffer); any heads, head size or dtype."""
    row_bytes = math.prod(row_shape) * element_size
    step = ALIGN // math.gcd(ALIGN, row_bytes) if row_bytes else 1
    return -(-min_rows // step) * step


def poisoned(torch, shape, dtype, pad, fill=None):
    """(full, view): view = rows [g, g + n) of a NaN-filled buffer (1-D: elements), where g is
    guard_rows(shape[1:], element size, pad): at least `pad` NaN rows on each side, and a
    16-byte aligned view."""
    g = guard_rows(shape[1:], torch.empty((), dtype=dtype).element_size(), pad)
    full = torch.full((shape[0] + 2 * g, *shape[1:]), float("nan"), dtype=dtype, device="cuda")
    view = full[g : g + shape[0]]
    assert view.data_ptr() % ALIGN == 0, f"guard rows left a view {view.data_ptr() % ALIGN} bytes off alignment"
    if fill is not None:
        view.copy_(fill)
    return full, view


def check_neighbours(torch, full, name, pad):
    """The NaN rows around a buffer made by poisoned(..., pad) are intact and every row inside
    it was written finite."""
    pad = guard_rows(full.shape[1:], full.element_size(), pad)
    n = full.shape[0] - 2 * pad
    assert torch.isnan(full[:pad].float()).all() and torch.isnan(full[pad + n :].float()).all(), (
        f"{name}: a kernel wrote outside its rows"
    )
    bad = (~torch.isfinite(full[pad : pad + n].float())).sum().item()
    assert bad == 0, f"{name}: {bad} non-finite values (unwritten rows or a NaN read from a neighbour)"


def rel_err(torch, a, ref):
    """max |a - ref| / max |ref| (0 for empty tensors)."""
    if ref.numel() == 0:
        return 0.0
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()

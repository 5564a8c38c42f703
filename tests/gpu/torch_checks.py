"""Shared by the GPU tests: NaN-poisoned neighbours, relative error, and the op rules."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def op_rules():
    """paddle_unpad/_op_rules.py, the tables paddle_unpad.ops re-exports (FMHA_GPU_TOLERANCE,
    ...), loaded by path: GPU machines have no Paddle, which importing the package needs."""
    spec = importlib.util.spec_from_file_location("paddle_unpad_op_rules",
                                                  os.path.join(ROOT, "paddle_unpad", "_op_rules.py"))
    rules = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rules)
    return rules


def poisoned(torch, shape, dtype, pad, fill=None):
    """(full, view): view = rows [pad, pad + n) of a NaN-filled buffer (1-D: elements)."""
    full = torch.full((shape[0] + 2 * pad, *shape[1:]), float("nan"), dtype=dtype, device="cuda")
    view = full[pad : pad + shape[0]]
    if fill is not None:
        view.copy_(fill)
    return full, view


def check_neighbours(torch, full, name, pad):
    """The NaN rows around a buffer are intact and every row inside it was written finite."""
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

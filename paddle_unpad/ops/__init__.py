"""One thin, documented function per custom operator, and its plain-Paddle reference.

Each public op calls the compiled operator when it is registered for the tensors'
device, and its ``*_reference`` twin otherwise (see ``ops_available()``). The
references are written for clarity, not speed; tests compare the two.

* :mod:`.attention`: :func:`fmha`, :func:`fmha_qkvpacked` (and references);
* :mod:`.fused`: :func:`bias_gelu`, :func:`bias_dropout_residual_layer_norm` (and references);
* :mod:`._call`: the path both take to a compiled operator (dispatch, Philox state, the
  operators' refusals as they wrote them).
"""

from .._runtime import native as _native

# The op rules as data, in a module without imports: tests/gpu read it where Paddle is missing.
from ._rules import (
    FMHA_GPU_TOLERANCE,
    FMHA_SUPPORT,
    FMHA_TOLERANCE,
    FUSED_OPS_GPU_TOLERANCE,
    FUSED_OPS_SUPPORT,
    FUSED_OPS_TOLERANCE,
    MODEL_TOLERANCE,
)
from ._names import REGISTERED
from . import _call, attention, fused  # noqa: F401  (the submodules, by name)
from .attention import fmha, fmha_qkvpacked, fmha_qkvpacked_reference, fmha_reference
from .fused import (
    bias_dropout_residual_layer_norm,
    bias_dropout_residual_layer_norm_reference,
    bias_gelu,
    bias_gelu_reference,
)

__all__ = [
    "fmha",
    "fmha_reference",
    "fmha_qkvpacked",
    "fmha_qkvpacked_reference",
    "ops_available",
    "bias_gelu",
    "bias_gelu_reference",
    "bias_dropout_residual_layer_norm",
    "bias_dropout_residual_layer_norm_reference",
    "FMHA_SUPPORT",
    "FMHA_TOLERANCE",
    "FMHA_GPU_TOLERANCE",
    "MODEL_TOLERANCE",
    "FUSED_OPS_SUPPORT",
    "FUSED_OPS_TOLERANCE",
    "FUSED_OPS_GPU_TOLERANCE",
]

# ops_available() lists these next to fmha (fmha_qkvpacked runs where fmha does).
_FUSED_OPS = ("bias_gelu", "bias_dropout_residual_layer_norm")


def ops_available():
    """Which native kernels are loaded, per op and device.

    Returns:
        dict, e.g. ``{"fmha": {"cpu": True, "gpu": False}}``. ``False`` means the op
        runs its plain-Paddle reference there. ``paddle_unpad._runtime.native.info()`` says why.
    """
    cpu = _native.has_op(REGISTERED["fmha"])
    return {"fmha": {"cpu": cpu, "gpu": cpu and _native.has_cuda_kernels()}, **_fused_ops_available()}


def _fused_ops_available():
    gpu = _native.has_cuda_kernels()
    out = {}
    for name in _FUSED_OPS:
        cpu = _native.has_op(REGISTERED[name])
        out[name] = {"cpu": cpu, "gpu": cpu and gpu}
    return out

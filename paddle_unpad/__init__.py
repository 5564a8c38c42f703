"""paddle_unpad: train BERT-like encoders on variable-length text without computing on padding.

Public API (see docs/api.md)::

    packed, indices, cu_seqlens, max_seqlen = unpad_input(x, attention_mask)
    x = pad_input(packed, indices, batch_size, seqlen)
    out = fmha(q, k, v, cu_seqlens, max_seqlen, dropout=0.0, scale=None, training=True)
    out = fmha_qkvpacked(qkv, cu_seqlens, max_seqlen, bias=None, dropout=0.0)
    ops_available(); info(); host_info()

Loaded on first use (so that inference loads no distributed code and no PaddleNLP):
``convert``, ``revert``, ``models``, ``trainer``, ``fleet``, ``distributed``.

Importing never needs compiled code: without the native operators every op runs its
plain-Paddle reference and ``ops_available()`` says so. What the import does to the process
is listed by ``info()``.
"""

import zlib  # noqa: F401  (before paddle: paddle-gpu 2.6's libpaddle clashes with a zlib loaded after it)

from . import _runtime

_runtime.start()

from . import balance, config, data, ops, varlen  # noqa: E402
from ._runtime.cpu_gemm import host_info  # noqa: E402
from ._runtime.process_changes import info  # noqa: E402
from .ops import fmha, fmha_qkvpacked, ops_available  # noqa: E402
from .varlen import cu_seqlens_from_lengths, pad_input, unpad_input  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "fmha",
    "fmha_qkvpacked",
    "ops_available",
    "info",
    "host_info",
    "unpad_input",
    "pad_input",
    "cu_seqlens_from_lengths",
    "balance",
    "config",
    "data",
    "ops",
    "varlen",
]

# name -> (module, attribute or None), imported when first read
_ON_FIRST_USE = {
    "distributed": ("paddle_unpad.distributed", None),
    "fleet": ("paddle_unpad.fleet", None),
    "models": ("paddle_unpad.models", None),
    "trainer": ("paddle_unpad.trainer", None),
    "convert": ("paddle_unpad.models", "convert"),
    "revert": ("paddle_unpad.models", "revert"),
}


def __getattr__(name):
    import importlib

    from ._runtime import aliases

    if name in aliases.MOVED:
        globals()[name] = aliases.resolve(name)  # warned once: ``from paddle_unpad import x`` reads it twice
        return globals()[name]
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module 'paddle_unpad' has no attribute {name!r}")
    module, attr = _ON_FIRST_USE[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_ON_FIRST_USE))

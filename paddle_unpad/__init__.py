"""paddle_unpad: train BERT-like encoders on variable-length text without computing on padding.

Public API (see docs/api.md)::

    packed, indices, cu_seqlens, max_seqlen = unpad_input(x, attention_mask)
    x = pad_input(packed, indices, batch_size, seqlen)
    out = fmha(q, k, v, cu_seqlens, max_seqlen, dropout=0.0, scale=None, training=True)
    out = fmha_qkvpacked(qkv, cu_seqlens, max_seqlen, bias=None, dropout=0.0)
    ops_available()

Importing this package never needs compiled code: when the native operators are
missing, every op runs its plain-Paddle reference and ``ops_available()`` says so.
When they are present, importing registers them with Paddle, so that an exported
(``paddle.jit.save``) converted model loads with ``paddle.jit.load`` or a
``paddle.inference`` predictor in any process that has imported this package.
"""
import zlib  # noqa: F401  (before paddle: paddle-gpu 2.6's libpaddle clashes with a zlib loaded after it)

from . import config, cpu_gemm, host_malloc

# MKL reads its kernel choice once, at its first GEMM, which any Paddle code may run: the one
# process-wide change made at import (host_malloc waits for the first training use)
cpu_gemm.configure()
from . import _native  # noqa: E402
from . import _paddle_compat  # noqa: E402

_paddle_compat.check_versions()
import importlib  # noqa: E402

from . import balance, data, ops, varlen  # noqa: E402,F401
from .ops import fmha, fmha_qkvpacked, ops_available  # noqa: E402
from .process_changes import info  # noqa: E402
from .varlen import cu_seqlens_from_lengths, pad_input, unpad_input  # noqa: E402

__version__ = "0.1.0"

_native.load_at_import()

# Imported on first use, so that inference (``import paddle_unpad``, an op, an exported model)
# loads no distributed code and no PaddleNLP: name -> (module, attribute or None)
_ON_FIRST_USE = {
    "distributed": ("paddle_unpad.distributed", None),
    "fleet": ("paddle_unpad.fleet", None),
    "models": ("paddle_unpad.models", None),
    "trainer": ("paddle_unpad.trainer", None),
    "convert": ("paddle_unpad.models", "convert"),
    "revert": ("paddle_unpad.models", "revert"),
}


def __getattr__(name):
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


__all__ = [
    "fmha",
    "fmha_qkvpacked",
    "ops_available",
    "info",
    "convert",
    "revert",
    "unpad_input",
    "pad_input",
    "cu_seqlens_from_lengths",
    "balance",
    "config",
    "cpu_gemm",
    "data",
    "host_malloc",
    "distributed",
    "fleet",
    "ops",
    "varlen",
]

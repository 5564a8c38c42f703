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
from . import balance, data, distributed, fleet, ops, varlen  # noqa: F401
from .models import convert, revert  # noqa: E402  (paddlenlp is imported only when convert() runs)
from .ops import fmha, fmha_qkvpacked, ops_available
from .process_changes import info
from .varlen import cu_seqlens_from_lengths, pad_input, unpad_input

__version__ = "0.1.0"

_native.load_at_import()

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

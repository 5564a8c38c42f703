"""Converted ``forward`` methods, generated from one table per model family.

Every converted forward has the parameters of the PaddleNLP forward it replaces, in the
same order and with the same defaults, plus the keyword-only packed inputs
(``cu_seqlens``, ``max_seqlen``, ``cu_seqlens_host``) and ``**extra`` for the bookkeeping
keys of a packed batch; it collects them into one dict and hands it to
:func:`paddle_unpad.models.heads.run` with the head's implementation.
"""
from __future__ import annotations

import linecache

from . import heads
from .common import PACKED_ARGS_ALL

__all__ = ["TOKEN_ARGS", "OUTPUT_FLAGS", "forward_args", "build_heads"]

# The leading and trailing parameters shared by every BERT / ERNIE / RoBERTa forward.
TOKEN_ARGS = ("input_ids", "token_type_ids", "position_ids", "attention_mask")
OUTPUT_FLAGS = ("output_hidden_states", "output_attentions", "return_dict")


def forward_args(*middle):
    """The original forward's parameter names: the shared leading ones, ``middle``, the output flags."""
    return TOKEN_ARGS + tuple(middle) + OUTPUT_FLAGS


def build_heads(spec, table, required=()):
    """``{original class: mixin class}`` for ``table`` rows ``(PaddleNLP class, head implementation,
    parameter names)``; the parameters in ``required`` have no default (as in the original)."""
    return {original: _mixin(spec, original, impl, params, required) for original, impl, params in table}


def _mixin(spec, original, impl, params, required):
    name = f"Unpad{original.__name__}"
    forward = _generate_forward(spec, impl, params, required, where=f"{__name__}.{name}")
    return type(name, (), {"forward": forward, "__module__": __name__, "__qualname__": name})


def _generate_forward(spec, impl, params, required, where):
    # Generated source rather than ``def forward(self, *args, **kwargs)`` with ``__signature__``:
    # paddle.jit.to_static re-parses the forward's source and binds input_spec positions to its
    # real parameters, and a wrong argument must fail as it does for the original forward
    # (TypeError naming it); ``__signature__`` alone would only satisfy inspect.
    positional = ", ".join(p if p in required else f"{p}=None" for p in params)
    packed = ", ".join(f"{p}=None" for p in PACKED_ARGS_ALL)
    collected = ", ".join(f"{p}={p}" for p in params + PACKED_ARGS_ALL)
    source = (f"def forward(self, {positional}, *, {packed}, **extra):\n"
              f"    return run(self, spec, impl, dict({collected}), extra)\n")
    filename = f"<generated {where}.forward>"
    namespace = {"run": heads.run, "spec": spec, "impl": impl}
    exec(compile(source, filename, "exec"), namespace)
    # inspect.getsource (used by to_static and by tracebacks) finds generated code only in linecache;
    # mtime None keeps linecache.checkcache from dropping the entry
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    forward = namespace["forward"]
    forward.__qualname__ = f"{where.rsplit('.', 1)[-1]}.forward"
    forward.__module__ = __name__
    return forward

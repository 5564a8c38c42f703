"""Writes :mod:`paddle_unpad.models.forwards_generated`, the converted ``forward`` methods.

Each family module (:mod:`~paddle_unpad.models.bert`, :mod:`~paddle_unpad.models.ernie`,
:mod:`~paddle_unpad.models.roberta`) lists its converted classes in ``FORWARDS``: rows
``(PaddleNLP class, head implementation, the original forward's parameter names)``, and in
``REQUIRED`` the parameters without a default. From them this module writes one mixin class
per row whose ``forward`` has the parameters of the PaddleNLP forward it replaces, in the
same order and with the same defaults, plus the keyword-only packed inputs (``cu_seqlens``,
``max_seqlen``, ``cu_seqlens_host``) and ``**extra`` for the bookkeeping keys of a packed
batch; it collects them into one dict and hands it to :func:`paddle_unpad.models.heads.run`.

The forwards are written out rather than ``def forward(self, *args, **kwargs)`` with a
``__signature__``: ``paddle.jit.to_static`` re-parses a forward's source and binds
``input_spec`` positions to its real parameters, and a wrong argument must fail as it does
for the original forward (a TypeError naming it).

Regenerate after changing a table (or for a new PaddleNLP whose forwards changed)::

    python -m paddle_unpad.models.forwards --write

Writing refuses a table whose parameters differ from the installed PaddleNLP forward.
"""
from __future__ import annotations

import inspect
import sys
import textwrap
from pathlib import Path

from .common import PACKED_ARGS_ALL

__all__ = ["TOKEN_ARGS", "OUTPUT_FLAGS", "forward_args", "render", "check_signature", "GENERATED_PATH"]

# The leading and trailing parameters shared by every BERT / ERNIE / RoBERTa forward.
TOKEN_ARGS = ("input_ids", "token_type_ids", "position_ids", "attention_mask")
OUTPUT_FLAGS = ("output_hidden_states", "output_attentions", "return_dict")
GENERATED_PATH = Path(__file__).with_name("forwards_generated.py")
_WIDTH = 118


def forward_args(*middle):
    """The original forward's parameter names: the shared leading ones, ``middle``, the output flags."""
    return TOKEN_ARGS + tuple(middle) + OUTPUT_FLAGS


def check_signature(original, params, required):
    """Raise ValueError when ``original.forward`` (PaddleNLP's) does not take exactly ``params``
    in that order, ``required`` without a default and the others defaulting to None."""
    got = [(p.name, p.default) for p in inspect.signature(original.forward).parameters.values()][1:]
    want = [(p, inspect.Parameter.empty if p in required else None) for p in params]
    if got != want:
        raise ValueError(f"paddle_unpad: {original.__name__}.forward of the installed PaddleNLP takes {got}, the converted forward's table lists {want}; update the table and regenerate (python -m paddle_unpad.models.forwards --write)")


def _families():
    from . import bert, ernie, roberta

    return (bert, ernie, roberta)


def _wrap(text, indent, first=None):
    return textwrap.fill(text, width=_WIDTH, initial_indent=indent if first is None else first,
                         subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def _forward_source(spec_of, original, impl, params, required):
    positional = ", ".join(p if p in required else f"{p}=None" for p in params)
    packed = ", ".join(f"{p}=None" for p in PACKED_ARGS_ALL)
    collected = ", ".join(f"{p}={p}" for p in params + PACKED_ARGS_ALL)
    signature = _wrap(f"def forward(self, {positional}, *, {packed}, **extra):", " " * 16, first=" " * 4)
    return (f"class Unpad{original.__name__}:\n"
            f'    """``{original.__name__}.forward`` on packed tokens (``heads.{impl.__name__}``)."""\n\n'
            f"{signature}\n"
            f"        return run(self, {spec_of}, {impl.__name__}, dict(\n"
            f"{_wrap(collected + '), extra)', ' ' * 12)}\n")


def _family_rows(fam):
    from . import heads

    name = fam.__name__.rsplit(".", 1)[-1]
    for original, impl, params in fam.FORWARDS:
        if getattr(heads, impl.__name__, None) is not impl:
            raise ValueError(f"paddle_unpad: {name}.FORWARDS names {impl!r}, which is not a function of heads")
        if getattr(fam.modeling, original.__name__, None) is not original:
            raise ValueError(f"paddle_unpad: {name}.FORWARDS names {original!r}, which is not in {name}.modeling")
        check_signature(original, params, fam.REQUIRED)
        yield name, original, impl, params


def render():
    """The text of ``forwards_generated.py`` for the tables and the installed PaddleNLP."""
    rows = [row for fam in _families() for row in _family_rows(fam)]
    impls = sorted({impl.__name__ for _, _, impl, _ in rows})
    fams = [fam.__name__.rsplit(".", 1)[-1] for fam in _families()]
    imports = _wrap("from .heads import (" + ", ".join(impls) + ", run)", " " * 19, first="")
    required = {fam.__name__.rsplit(".", 1)[-1]: fam.REQUIRED for fam in _families()}
    head = ('"""Converted ``forward`` methods of the PaddleNLP BERT, ERNIE and RoBERTa models.\n\n'
            "GENERATED by ``python -m paddle_unpad.models.forwards --write`` from the ``FORWARDS`` tables of\n"
            "bert.py, ernie.py and roberta.py; do not edit (tests/test_forwards_generated.py compares this\n"
            "file with a fresh rendering). See :mod:`paddle_unpad.models.forwards` for the conventions.\n"
            '"""\n'
            f"from . import {', '.join(fams)}\n"
            f"{imports}\n\n"
            '__all__ = ["HEADS"]\n')
    classes = [_forward_source(f"{name}.SPEC", original, impl, params, required[name])
               for name, original, impl, params in rows]
    heads_map = ["", "", "# family name -> {original class: mixin class whose forward replaces it}", "HEADS = {"]
    for name in fams:
        heads_map.append(f'    "{name}": {{')
        heads_map += [f"        {n}.modeling.{o.__name__}: Unpad{o.__name__}," for n, o, _, _ in rows if n == name]
        heads_map.append("    },")
    heads_map.append("}\n")
    return "\n\n".join([head] + classes) + "\n".join(heads_map)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--write"], ["--check"]):
        raise SystemExit("usage: python -m paddle_unpad.models.forwards [--write | --check]")
    text = render()
    if argv == ["--write"]:
        GENERATED_PATH.write_text(text)
        print(f"wrote {GENERATED_PATH}")
    elif argv == ["--check"]:
        same = GENERATED_PATH.read_text() == text
        print(f"{GENERATED_PATH} is {'up to date' if same else 'STALE: run with --write'}")
        return 0 if same else 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The exchange's wire format: what goes between ranks, as int64 buffers, never pickled objects.

Per step, every rank contributes

* a **header** of ``HDR`` int64 words (:class:`Header`; gathered, :class:`Headers`): one word
  per field of ``HEADER_FIELDS`` -- status, step, sample count, layout hash, planner settings
  fingerprint --, zeros up to word ``MSG_AT``, then the message (``MSG_WORDS`` words of
  UTF-8); status is one of ``OK``, ``END`` (its loader is done), ``ERROR`` (its loader or a
  sample failed: the message says why), ``ABORT`` (its training loop stopped iterating); with
  status ``OK`` the message slot carries the batch's layout as JSON (:func:`schema_text`)
  when it fits;
* ``(length, sample id)`` of each of its samples;
* the **samples that move**, each field's raw bytes padded to 8 bytes, in the order of the
  agreed layout (:func:`schema`: field name, per-token or per-sample, dtype, trailing shape).
  A receiver sizes every buffer from the gathered lengths and the layout; nothing else
  travels.

The planner-settings fingerprint (:func:`plan_settings`) lets every rank see at the first
step that a peer would compute another plan.
"""

from __future__ import annotations

import hashlib
import json
from typing import Dict, List, NamedTuple

import numpy as np

from ..balance.cost import CostModel, as_cost_fn
from ..data.collate import SampleError
from .errors import ExchangeError

OK, END, ERROR, ABORT = 0, 1, 2, 3
STATUS_TEXT = {END: "finished its epoch", ERROR: "failed", ABORT: "closed its loader"}


# ----------------------------------------------------------------------------- header
class Header(NamedTuple):
    """One rank's header of one step: its fields, in wire order, then the message text."""

    status: int
    step: int
    count: int  # samples in the rank's batch
    schema_hash: int  # of its batch's layout (:func:`schema_hash`); 0: no layout (no sample)
    plan_key: int  # its planner settings' fingerprint (:func:`plan_settings`)
    message: str = ""

    def encode(self) -> np.ndarray:
        words = np.zeros(HDR, dtype=np.int64)
        words[: len(HEADER_FIELDS)] = self[: len(HEADER_FIELDS)]
        text = self.message.encode("utf-8", "replace")[:MSG_BYTES]
        words[MSG_AT:] = np.frombuffer(text.ljust(MSG_BYTES, b"\0"), dtype=np.int64)
        return words


# one int64 word each, from word 0 (``Header``'s fields but the message, in their order)
HEADER_FIELDS = tuple(name for name in Header.__annotations__ if name != "message")
MSG_AT = 8  # the words between the fields and the message stay 0
MSG_WORDS = 48
MSG_BYTES = 8 * MSG_WORDS
HDR = MSG_AT + MSG_WORDS


class Headers(NamedTuple):
    """Every rank's header as gathered (``[ranks, HDR]`` words): each field of :class:`Header`
    a column, one value per rank; :meth:`message` decodes a rank's text."""

    status: np.ndarray
    step: np.ndarray
    count: np.ndarray
    schema_hash: np.ndarray
    plan_key: np.ndarray
    messages: np.ndarray  # [ranks, MSG_WORDS]

    @classmethod
    def decode(cls, words: np.ndarray) -> "Headers":
        return cls(*(words[:, i] for i in range(len(HEADER_FIELDS))), words[:, MSG_AT:])

    def message(self, rank: int) -> str:
        return self.messages[rank].tobytes().rstrip(b"\0").decode("utf-8", "replace")


# ----------------------------------------------------------------------------- layout
def schema(samples, token_fields, rank):
    """Field layout of a batch: tuple of (name, 't'|'s', dtype str, shape tail).

    ``samples`` come from :func:`normalize_batch`, which has checked that each one has
    the layout of the first: that layout is the batch's."""
    first = samples[0]
    sch = []
    for name in sorted(first):
        a = first[name]
        if np.dtype(a.dtype).kind not in "biufc":  # strings and objects: not what a model takes
            raise SampleError(
                f"paddle_unpad.distributed: rank {rank}: field {name!r} is not numeric (dtype {a.dtype}); the exchange sends numbers (bool, int, float) only"
            )
        if name in token_fields and a.ndim >= 1:
            sch.append((name, "t", a.dtype.str, tuple(a.shape[1:])))
        else:
            sch.append((name, "s", a.dtype.str, tuple(a.shape)))
    return tuple(sch)


def schema_text(sch, limit) -> str:
    """The layout as JSON for the header's message slot, or "" when it is longer than ``limit``
    bytes (it then travels by a collective of its own)."""
    if sch is None:
        return ""
    text = json.dumps([[name, kind, dt, list(tail)] for name, kind, dt, tail in sch], separators=(",", ":"))
    return text if len(text.encode("utf-8")) <= limit else ""


def schema_from_text(text):
    """:func:`schema_text` back into a layout; None for "" (it did not fit)."""
    if not text:
        return None
    return tuple((name, kind, dt, tuple(tail)) for name, kind, dt, tail in json.loads(text))


def describe_schema_difference(schemas) -> str:
    """First difference between the ranks' batch layouts, in words."""

    def fields(sch):
        return {
            name: (
                ("per-token" if kind == "t" else "per-sample"),
                np.dtype(dt).name,
                (["s"] if kind == "t" else []) + list(tail),
            )
            for name, kind, dt, tail in sch
        }

    ranks = [r for r, sch in enumerate(schemas) if sch is not None]
    r0 = ranks[0]
    f0 = fields(schemas[r0])
    for r in ranks[1:]:
        fr = fields(schemas[r])
        for name in sorted(set(f0) | set(fr)):
            if name not in fr:
                return f"rank {r0} has field {name!r}, rank {r} has not"
            if name not in f0:
                return f"rank {r} has field {name!r}, rank {r0} has not"
            if f0[name] != fr[name]:

                def say(v):
                    return f"{v[0]}, dtype {v[1]}, shape [{', '.join(str(d) for d in v[2])}]"

                return f"field {name!r} is {say(f0[name])} on rank {r0} but {say(fr[name])} on rank {r}"
    return "the layouts differ"


def schema_hash(sch) -> int:
    h = hashlib.blake2b(repr(sch).encode(), digest_size=8).digest()
    return (int.from_bytes(h, "little") & ((1 << 62) - 1)) | 1


def field_nbytes(kind, dt, tail, s):
    n = int(np.prod(tail, dtype=np.int64)) if tail else 1
    if kind == "t":
        n *= s
    nb = n * np.dtype(dt).itemsize
    return nb, (nb + 7) // 8 * 8


def encode(samples, lengths, schema) -> np.ndarray:
    """Raw bytes of every field of ``samples``, 8-byte aligned, as one int64 buffer.

    The receiver sizes its buffer from the gathered lengths and the agreed schema: a field
    of any other dtype or shape would arrive as the wrong bytes (or, larger, abort the
    receiver inside gloo).  ``normalize_batch`` and the schema agreement rule that out
    before the header; this is the last check before the wire."""
    parts = []
    for smp, s in zip(samples, lengths):
        for name, kind, dt, tail in schema:
            a = smp[name]
            shape = ((int(s),) + tuple(tail)) if kind == "t" else tuple(tail)
            if a.dtype.str != dt or tuple(a.shape) != shape:
                raise ExchangeError(
                    f"paddle_unpad.distributed: exchange: field {name!r} of a sample to send has dtype {a.dtype} and shape {list(a.shape)}, the agreed layout is {np.dtype(dt).name} {list(shape)}"
                )
            b = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
            parts.append(b)
            pad = (-b.size) % 8
            if pad:
                parts.append(np.zeros(pad, dtype=np.uint8))
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(parts).view(np.int64)


def words(lengths, schema) -> int:
    total = 0
    for s in lengths:
        for _, kind, dt, tail in schema:
            total += field_nbytes(kind, dt, tail, int(s))[1]
    return total // 8


def transfer_words(dest, starts, lens, schema, world) -> np.ndarray:
    """``W[s, d]``: int64 words rank ``s`` sends rank ``d`` this step (0 on the diagonal), from the
    plan (``dest``: every sample's destination, rank ``s``'s at ``starts[s]:starts[s + 1]``), the
    gathered lengths and the agreed layout: every rank computes the same matrix."""
    W = np.zeros((world, world), np.int64)
    for s in range(world):
        d_of = dest[starts[s] : starts[s + 1]]
        for d in np.unique(d_of):
            if d != s:
                W[s, int(d)] = words(lens[s][d_of == d], schema)
    return W


def decode(buf: np.ndarray, lengths, schema) -> List[Dict[str, np.ndarray]]:
    want = words(lengths, schema)
    if buf.size != want:
        raise ExchangeError(f"paddle_unpad.distributed: exchange: received {buf.size} words, expected {want}")
    raw = buf.view(np.uint8)
    out, off = [], 0
    for s in lengths:
        smp = {}
        for name, kind, dt, tail in schema:
            nb, padded = field_nbytes(kind, dt, tail, int(s))
            shape = ((int(s),) + tuple(tail)) if kind == "t" else tuple(tail)
            smp[name] = raw[off : off + nb].view(dt).reshape(shape).copy()
            off += padded
        out.append(smp)
    return out


def summary(exc, limit=MSG_BYTES) -> str:
    """``Type: message`` for the header; of a multi-line message (a DataLoader worker's
    carries a traceback) the first and the last line, where the cause is."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = " ... ".join([lines[0], lines[-1]]) if len(lines) > 1 else (lines[0] if lines else "")
    out = f"{type(exc).__name__}: {text}"
    b = out.encode("utf-8", "replace")
    return out if len(b) <= limit else b[: limit - 3].decode("utf-8", "ignore") + "..."


# lengths at which a cost is evaluated to tell cost models apart (0, 1, odd, powers of two +-1)
COST_PROBES = np.array(
    [0, 1, 2, 3, 7, 31, 63, 64, 65, 127, 128, 129, 255, 256, 384, 511, 512, 513, 1024, 4096], dtype=np.int64
)


def plan_settings(cost, counts, tol):
    """A fingerprint (int) of the settings the plan depends on, identical on ranks that plan alike,
    and their description. A cost is fingerprinted by its values at fixed lengths, so a name, a
    CostModel and a callable that give the same costs agree."""
    try:
        values = np.asarray(as_cost_fn(cost)(COST_PROBES), dtype=np.float64)
        cost_part = values.tobytes()
    except Exception as e:  # noqa: BLE001 -- a callable that refuses some probe lengths: compare that instead
        cost_part = f"raises {type(e).__name__} on probe lengths".encode()
    counts_part = repr(list(counts) if isinstance(counts, (list, tuple)) else counts).encode()
    tol_part = repr(float(tol)).encode()
    h = hashlib.blake2b(cost_part + b"|" + counts_part + b"|" + tol_part, digest_size=8).digest()
    desc = f"cost={describe_cost(cost)}, counts={counts!r}, tol={float(tol):g}"
    return int.from_bytes(h, "little") & ((1 << 62) - 1), desc


def describe_cost(cost):
    if cost is None or isinstance(cost, str) or isinstance(cost, CostModel):
        return repr(cost)
    return getattr(cost, "__qualname__", type(cost).__name__)

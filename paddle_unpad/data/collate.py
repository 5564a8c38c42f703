"""Packing collator: a list of variable-length samples -> one packed (unpadded) batch.

A *sample* is a dict of arrays (numpy, lists, or paddle tensors):

* per-token fields, shape ``[s, ...]``: ``input_ids`` (required; its length is the
  sample's length ``s``), ``token_type_ids``, ``position_ids``, ``labels`` /
  ``masked_lm_labels`` / ``mlm_labels`` when they are 1-D or more (a 0-d ``labels`` is a
  per-sample label), and any name listed in ``token_fields``;
* per-sample fields: everything else (e.g. a classification label, ``next_sentence_label``);
* the sample id: ``sample_id`` (or ``id`` / ``idx``), an int; when absent, an id is made
  from the position: :class:`PackingCollator` uses the sample's index in its call, the
  distributed loader ``rank << 40 | batch << 20 | index``;
* ``label`` / ``label_ids`` are renamed ``labels`` (by :class:`PackingCollator`,
  :func:`sample_list_collate` and UnpadTrainer's collators), as PaddleNLP's collators
  rename them; a sample with both ``labels`` and one of them is refused;
* ``attention_mask`` (1 = keep), if present, is applied to every per-token field and then
  dropped, so padded samples can be fed as they are.

The packed batch (dict) has:

=====================  ====================================================================
``input_ids``          ``[T]`` int64 tensor (``T`` = total tokens)
``cu_seqlens``         ``[B+1]`` int32 tensor: 0, s0, s0+s1, ..., T
``cu_seqlens_host``    the same, numpy int32 (host copy: no device->host sync needed)
``seqlens_host``       ``[B]`` numpy int32
``max_seqlen``         Python int (0 for an empty batch)
``position_ids``       ``[T]`` int64: from the samples, else 0..s-1 per sample
``token_type_ids``     ``[T]`` int64: from the samples, else zeros
``labels`` ...         per-token fields ``[T, ...]``; per-sample fields ``[B, ...]``
``masked_positions``   ``[M]`` int64: packed rows whose MLM label (``masked_lm_labels`` /
                       ``mlm_labels``, per token) is >= 0 -- only with such a field
``masked_labels``      ``[M]`` int64: those labels, so an MLM head computes only M rows
``sample_ids``         ``[B]`` numpy int64
``num_samples``        B
``global_num_samples`` samples in the global batch of this step (B in a single process)
=====================  ====================================================================

Every sample of a batch must have the same fields, each with the same dtype, the same
number of dimensions and the same trailing shape (a per-token field's ``[s, ...]`` differs
only in ``s``); ``input_ids``, ``token_type_ids``, ``position_ids`` and MLM labels must hold
integers.  Any other batch, empty (length-0) samples and samples longer than
``max_seqlen`` raise :class:`SampleError` (a ``ValueError``) naming the sample's index in
its batch, its id, the rank and the field.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "PackingCollator",
    "pack_samples",
    "normalize_batch",
    "to_paddle",
    "sample_list_collate",
    "DEFAULT_TOKEN_FIELDS",
    "BATCH_BOOKKEEPING_KEYS",
    "SampleError",
    "check_max_seqlen",
    "LABEL_ALIASES",
    "rename_label_keys",
]

DEFAULT_TOKEN_FIELDS = (
    "input_ids",
    "token_type_ids",
    "position_ids",
    "labels",
    "masked_lm_labels",
    "mlm_labels",
    "special_tokens_mask",
)
_ID_KEYS = ("sample_id", "id", "idx")
_HOST_KEYS = ("cu_seqlens_host", "seqlens_host", "sample_ids")
#: keys of a packed batch that describe it rather than feed the model (models ignore them)
BATCH_BOOKKEEPING_KEYS = (
    "seqlens_host",
    "sample_ids",
    "num_samples",
    "global_num_samples",
    "step",
    "plan_hash",
    "moved_in",
)
#: per-token MLM labels (negative = not masked) from which masked rows are listed
MLM_LABEL_FIELDS = ("masked_lm_labels", "mlm_labels")
#: fields that are token indices: packed as int64, so they must hold integers
_INTEGER_FIELDS = ("input_ids", "token_type_ids", "position_ids") + MLM_LABEL_FIELDS
_SAME_LAYOUT = "every sample of a batch needs the same dtype, number of dimensions and trailing shape per field"
_NEEDS_LISTS = "the balanced loader (distributed_loader) needs lists of samples"
_LIST_COLLATE = "build the DataLoader with collate_fn=pu.data.sample_list_collate"
_NOT_A_TENSOR = "which a paddle tensor cannot hold; drop it from the samples, or pack with return_tensors='np'"


class SampleError(ValueError):
    """A sample that cannot be trained on (empty, too long, inconsistent fields)."""


def sample_list_collate(batch):
    """``collate_fn`` for ``paddle.io.DataLoader`` that keeps the list of samples (what
    :func:`paddle_unpad.fleet.distributed_loader` expects), each field as a numpy array.

    Why arrays: a DataLoader whose collate output holds Python lists of ints stops at
    once, silently (paddle 3.3.1) -- and tokenizers return lists. ``label`` / ``label_ids``
    become ``labels`` (:func:`rename_label_keys`), as PaddleNLP's collators rename them.
    """
    out = []
    for k, smp in enumerate(batch):
        if isinstance(smp, Mapping):
            smp = {
                n: (v if isinstance(v, np.ndarray) or hasattr(v, "numpy") else np.asarray(v))
                for n, v in rename_label_keys(smp, f"sample {k} of the DataLoader batch").items()
            }
        out.append(smp)
    return out


def _to_numpy(v):
    if isinstance(v, np.ndarray):
        return v
    if hasattr(v, "numpy") and callable(v.numpy):  # paddle.Tensor
        return np.asarray(v.numpy())
    return np.asarray(v)


def _sid(sample, pos, where="a sample"):
    """The sample's own id (its first id field), else ``pos``. ``where`` names the sample in errors."""
    for k in _ID_KEYS:
        if k in sample:
            v = _to_numpy(sample[k]).reshape(-1)
            if v.size != 1 or not np.issubdtype(v.dtype, np.integer):
                # int() would take "7" or 2.5 without a word, and fail on "abc" naming nothing
                got = f"shape {list(v.shape)}" if v.size != 1 else f"{v[0]!r} (dtype {v.dtype})"
                raise SampleError(f"paddle_unpad.data: {where}: id field {k!r} must be a single int, got {got}")
            return int(v[0])
    return pos


#: Sample keys that PaddleNLP's collators (``DataCollatorWithPadding``,
#: ``default_data_collator``) hand to the model as ``labels``, in this order (a later one wins).
LABEL_ALIASES = ("label", "label_ids")


def rename_label_keys(sample, where="a sample"):
    """``sample`` with ``label`` / ``label_ids`` renamed to ``labels`` (and None-valued ones
    dropped), as PaddleNLP's collators do; other samples are returned as they are. A sample
    that also has ``labels`` is refused (:class:`SampleError` naming ``where``): which of the
    two the model should train on is not ours to guess."""
    if not isinstance(sample, Mapping) or not any(k in sample for k in LABEL_ALIASES):
        return sample
    given = [k for k in LABEL_ALIASES if sample.get(k) is not None]
    if given and sample.get("labels") is not None:
        raise SampleError(
            f"paddle_unpad.data: {where} has both 'labels' and {given[0]!r}; PaddleNLP's collators rename {given[0]!r} to 'labels', so keep only one of them"
        )
    out = {k: v for k, v in sample.items() if k not in LABEL_ALIASES}
    for alias in given:
        out["labels"] = sample[alias]
    return out


def _is_token_field(name, arr, token_fields):
    return name in token_fields and arr.ndim >= 1


def check_max_seqlen(value, name: str = "max_seqlen", where: str = "data.check_lengths"):
    """``value`` as an int >= 1, or None (no limit); anything else raises TypeError (not an
    int) or ValueError (< 1), naming ``where`` (the public name, after ``paddle_unpad.``)."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"paddle_unpad.{where}: {name} must be a positive int or None (no limit), got {value!r}")
    if value < 1:
        raise ValueError(f"paddle_unpad.{where}: {name} must be a positive int or None (no limit), got {value!r}")
    return int(value)


def _layout(name, arr, token_fields):
    """What must agree between the samples of one batch for field ``name``."""
    # strings differ in width from sample to sample, and numpy stacks them to the widest
    dt = np.dtype(arr.dtype.kind).str if arr.dtype.kind in "US" else arr.dtype.str
    if _is_token_field(name, arr, token_fields):
        return ("per-token", dt, tuple(arr.shape[1:]))
    return ("per-sample", dt, tuple(arr.shape))


def _describe(layout):
    kind, dt, tail = layout
    shape = ["s", *tail] if kind == "per-token" else list(tail)
    return f"{kind}, dtype {np.dtype(dt).name}, shape [{', '.join(str(d) for d in shape)}]"


def _check_same_layout(samples, lengths, sids, rank, token_fields):
    """Every sample must match the batch's first one: same fields, dtypes, numbers of
    dimensions and trailing shapes.

    Checked before a batch is packed or sent: mismatched samples would otherwise be
    concatenated wrongly here, or give a peer a buffer of the wrong size.  Empty samples
    are left to :func:`check_lengths` (``[]`` has numpy's float dtype)."""
    kept = [k for k in range(len(samples)) if lengths[k] > 0]
    if len(kept) < 2:
        return
    r0 = kept[0]
    ref = {name: _layout(name, arr, token_fields) for name, arr in samples[r0].items()}
    first = f"sample {r0} (id {sids[r0]})"
    for k in kept[1:]:
        smp = samples[k]
        where = f"sample {k} (id {sids[k]}) on rank {rank}"
        for name in ref:
            if name not in smp:
                raise SampleError(
                    f"paddle_unpad.data: {where} has no field {name!r}, which {first} of the same batch has: every sample of a batch needs the same fields"
                )
        for name, arr in smp.items():
            if name not in ref:
                raise SampleError(
                    f"paddle_unpad.data: {where} has a field {name!r} that {first} of the same batch lacks: every sample of a batch needs the same fields"
                )
            got = _layout(name, arr, token_fields)
            if got != ref[name]:
                raise SampleError(
                    f"paddle_unpad.data: {where}: field {name!r} is {_describe(got)}, but in {first} of the same batch it is {_describe(ref[name])}; {_SAME_LAYOUT}"
                )


def normalize_batch(
    batch,
    rank: int = 0,
    step: int = 0,
    token_fields: Sequence[str] = DEFAULT_TOKEN_FIELDS,
) -> Tuple[List[Dict[str, np.ndarray]], np.ndarray, np.ndarray]:
    """Turn what a user's DataLoader yields into ``(samples, lengths, ids)``.

    ``batch`` is a list of sample dicts, or a dict of padded arrays ``[B, S, ...]`` with an
    ``attention_mask [B, S]``.  Every returned sample is a dict of numpy arrays without
    id or attention mask; ``lengths`` and ``ids`` are int64 arrays.
    """
    if isinstance(batch, Mapping):
        batch = _split_padded(batch, token_fields)
    if not isinstance(batch, (list, tuple)):
        raise TypeError(
            f"paddle_unpad.data: a batch must be a list of sample dicts (use collate_fn=pu.data.sample_list_collate) or a dict of padded arrays with an attention_mask; got {type(batch).__name__}"
        )
    samples, lengths, ids = [], [], []
    for k, smp in enumerate(batch):
        if not isinstance(smp, Mapping):
            raise TypeError(
                f"paddle_unpad.data: sample {k} on rank {rank} is a {type(smp).__name__}, expected a dict with at least 'input_ids'"
            )
        sid = _sid(smp, (rank << 40) | ((step & 0xFFFFF) << 20) | k)
        if "input_ids" not in smp:
            raise SampleError(f"paddle_unpad.data: sample id {sid} on rank {rank} has no 'input_ids'")
        out = {}
        mask = None
        if "attention_mask" in smp:
            mask = _to_numpy(smp["attention_mask"]).reshape(-1).astype(bool)
        for name, v in smp.items():
            if name in _ID_KEYS or name == "attention_mask":
                continue
            arr = _to_numpy(v)
            if _is_token_field(name, arr, token_fields) and mask is not None:
                if arr.shape[0] != mask.shape[0]:
                    raise SampleError(
                        f"paddle_unpad.data: sample id {sid} on rank {rank}: field {name!r} has {arr.shape[0]} positions but attention_mask has {mask.shape[0]}"
                    )
                arr = arr[mask]
            # (np.ascontiguousarray would turn a 0-d label into shape [1])
            out[name] = arr if arr.flags.c_contiguous else arr.copy(order="C")
        ids_arr = out["input_ids"]
        if ids_arr.ndim != 1:
            raise SampleError(
                f"paddle_unpad.data: sample id {sid} on rank {rank}: input_ids must be 1-D, got shape {ids_arr.shape}"
            )
        s = int(ids_arr.shape[0])
        for name, arr in out.items():
            if _is_token_field(name, arr, token_fields) and arr.shape[0] != s:
                raise SampleError(
                    f"paddle_unpad.data: sample id {sid} on rank {rank}: per-token field {name!r} has {arr.shape[0]} entries, input_ids has {s}"
                )
            if name in _INTEGER_FIELDS and arr.size and not np.issubdtype(arr.dtype, np.integer):
                # packed as int64: a float id would be truncated without a word
                raise SampleError(
                    f"paddle_unpad.data: sample {k} (id {sid}) on rank {rank}: field {name!r} must hold integers, got dtype {arr.dtype}"
                )
        samples.append(out)
        lengths.append(s)
        ids.append(sid)
    _check_same_layout(samples, lengths, ids, rank, token_fields)
    return samples, np.array(lengths, dtype=np.int64), np.array(ids, dtype=np.int64)


def _split_padded(batch, token_fields):
    if "attention_mask" not in batch or "input_ids" not in batch:
        keys = sorted(map(str, batch))
        if "cu_seqlens" in batch or "cu_seqlens_host" in batch:  # a PackingCollator as the DataLoader's collate_fn
            raise TypeError(
                f"paddle_unpad.data: the batch is already packed (keys {keys}); {_NEEDS_LISTS}, and packs after balancing: {_LIST_COLLATE}"
            )
        raise TypeError(
            f"paddle_unpad.data: a batch must be a list of sample dicts -- {_NEEDS_LISTS}: {_LIST_COLLATE} -- or a dict of padded 'input_ids' and 'attention_mask' [B, S]; got a dict with keys {keys}"
        )
    arrs = {k: _to_numpy(v) for k, v in batch.items()}
    B = arrs["input_ids"].shape[0]
    out = []
    for b in range(B):
        out.append({k: v[b] for k, v in arrs.items()})
    return out


def check_lengths(lengths, ids, rank: int, max_seqlen: Optional[int]):
    """Raise :class:`SampleError` for an empty or over-long sample."""
    lengths = np.asarray(lengths)
    if lengths.size == 0:
        return
    max_seqlen = check_max_seqlen(max_seqlen)
    bad = np.nonzero((lengths <= 0) | ((lengths > max_seqlen) if max_seqlen is not None else False))[0]
    if bad.size:
        k = int(bad[0])
        s = int(lengths[k])
        why = "is empty (0 tokens)" if s <= 0 else f"has {s} tokens, more than max_seqlen={max_seqlen}"
        raise SampleError(f"paddle_unpad.data: sample id {int(ids[k])} on rank {rank} {why}")


def pack_samples(
    samples: List[Dict[str, np.ndarray]],
    lengths,
    ids,
    token_fields: Sequence[str] = DEFAULT_TOKEN_FIELDS,
    global_num_samples: Optional[int] = None,
    schema=None,
) -> Dict[str, object]:
    """Pack normalised samples into numpy arrays (see the module docstring).

    ``schema`` (tuple of ``(name, 't'|'s', dtype str, shape tail)``) only matters for an
    empty batch: its fields are then present, with 0 rows."""
    lengths = np.asarray(lengths, dtype=np.int64)
    B = len(samples)
    cu = np.zeros(B + 1, dtype=np.int32)
    if B:
        np.cumsum(lengths, out=cu[1:])
    T = int(cu[-1])
    out: Dict[str, object] = {}
    if B == 0:
        for name, _kind, dt, tail in schema or (("input_ids", "t", "<i8", ()),):
            out[name] = np.zeros((0,) + tuple(tail), dtype=dt)
    for name in list(samples[0].keys()) if B else []:
        vals = [smp[name] for smp in samples]
        if _is_token_field(name, vals[0], token_fields):
            out[name] = np.concatenate(vals, axis=0) if B > 1 else vals[0]
        else:
            out[name] = np.stack(vals, axis=0)
    if "position_ids" not in out:
        out["position_ids"] = (
            np.arange(T, dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lengths)
            if T
            else np.zeros(0, dtype=np.int64)
        )
    if "token_type_ids" not in out:
        out["token_type_ids"] = np.zeros(T, dtype=np.int64)
    for name in ("input_ids", "position_ids", "token_type_ids"):
        out[name] = np.ascontiguousarray(out[name], dtype=np.int64)
    for name in MLM_LABEL_FIELDS:
        if name in out:  # listed on the host: the device never has to find the masked rows
            lab = np.asarray(out[name]).reshape(-1)
            pos = np.nonzero(lab >= 0)[0].astype(np.int64)
            out["masked_positions"] = pos
            out["masked_labels"] = lab[pos].astype(np.int64)
            break
    out["cu_seqlens_host"] = cu
    out["seqlens_host"] = lengths.astype(np.int32)
    out["max_seqlen"] = int(lengths.max()) if B else 0
    out["sample_ids"] = np.asarray(ids, dtype=np.int64).reshape(-1)
    out["num_samples"] = B
    out["global_num_samples"] = B if global_num_samples is None else int(global_num_samples)
    return out


def to_paddle(packed: Dict[str, object], place=None) -> Dict[str, object]:
    """numpy arrays of a packed batch -> paddle tensors (host copies stay numpy)."""
    import paddle

    out = {}
    for k, v in packed.items():
        if isinstance(v, np.ndarray) and k not in _HOST_KEYS:
            out[k] = paddle.to_tensor(v, place=place)
        else:
            out[k] = v
    out["cu_seqlens"] = paddle.to_tensor(packed["cu_seqlens_host"], dtype="int32", place=place)
    return out


class PackingCollator:
    """``collate_fn`` that packs a list of samples (single process, no balancing).

    ``PackingCollator(max_seqlen=512)(samples)`` -> packed batch of paddle tensors (or of
    numpy arrays with ``return_tensors="np"``).  ``rank`` only names the rank in errors.
    ``label`` / ``label_ids`` become ``labels`` (:func:`rename_label_keys`). A sample
    without an id field gets its index in the call as its id, in ``sample_ids`` and in
    errors, so every call's ids start at 0.
    """

    def __init__(
        self,
        max_seqlen: Optional[int] = 512,
        token_fields: Sequence[str] = DEFAULT_TOKEN_FIELDS,
        return_tensors: str = "pd",
        place=None,
        rank: int = 0,
    ):
        if return_tensors not in ("pd", "np"):
            raise ValueError(
                f"paddle_unpad.data.PackingCollator: return_tensors must be 'pd' or 'np', got {return_tensors!r}"
            )
        self.max_seqlen = check_max_seqlen(max_seqlen, "max_seqlen", "data.PackingCollator")
        self.token_fields = tuple(token_fields)
        self.return_tensors = return_tensors
        self.place = place
        self.rank = rank

    def __call__(self, batch):
        if isinstance(batch, Mapping):
            batch = _split_padded(batch, self.token_fields)
        if isinstance(batch, (list, tuple)):
            batch = [self._prepare(k, smp) for k, smp in enumerate(batch)]
        samples, lengths, ids = normalize_batch(batch, self.rank, 0, self.token_fields)
        check_lengths(lengths, ids, self.rank, self.max_seqlen)
        if self.return_tensors == "pd":
            _check_tensor_dtypes(samples, ids, self.rank)
        packed = pack_samples(samples, lengths, ids, self.token_fields)
        return packed if self.return_tensors == "np" else to_paddle(packed, self.place)

    def _prepare(self, k, smp):
        """Sample ``k`` of a call with its id (its own, checked here, else ``k``) and ``labels``."""
        if not isinstance(smp, Mapping):
            return smp  # normalize_batch names it
        where = f"sample {k} on rank {self.rank}"
        if any(key in smp for key in _ID_KEYS):
            where = f"sample {k} (id {_sid(smp, k, where)}) on rank {self.rank}"
        else:
            smp = dict(smp, sample_id=k)
        return rename_label_keys(smp, where)


def _check_tensor_dtypes(samples, ids, rank):
    """A field paddle cannot hold (strings, objects) is refused naming it, not by paddle's
    ``tensor.set()`` error, which names neither the field nor the sample."""
    for k, smp in enumerate(samples):
        for name, arr in smp.items():
            if arr.dtype.kind in "USOV":
                what = "text" if arr.dtype.kind in "US" else "Python objects"
                raise SampleError(
                    f"paddle_unpad.data: sample {k} (id {int(ids[k])}) on rank {rank}: field {name!r} holds {what} (dtype {arr.dtype}), {_NOT_A_TENSOR}"
                )

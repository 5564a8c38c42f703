"""Moving between padded ``[B, S, ...]`` batches and packed ``[T, ...]`` token tensors.

Notation used in every docstring below:

* ``B`` -- batch size (number of sequences), ``S`` -- padded sequence length.
* ``T`` -- total number of real (kept) tokens in the batch, ``T = sum(lengths)``.
* ``...`` -- any trailing feature dimensions (e.g. ``hidden`` or ``heads, head_dim``).
* ``cu_seqlens`` -- int32 ``[B + 1]``: ``cu_seqlens[0] = 0``, ``cu_seqlens[b + 1] =
  cu_seqlens[b] + length_b``, so sequence ``b`` occupies packed rows
  ``cu_seqlens[b]:cu_seqlens[b + 1]``. Zero-length sequences are legal.
* ``max_seqlen`` -- Python ``int``, the longest length (0 for an empty batch).

All functions are plain Paddle and differentiable where it makes sense:
``unpad_input`` passes gradients to ``x``, ``pad_input`` to ``packed``.
The helpers that build ``cu_seqlens`` from host-side lengths never read device memory.
"""

from __future__ import annotations

import numbers

import numpy as np
import paddle

from ._runtime import paddle_compat as _compat

__all__ = [
    "unpad_input",
    "pad_input",
    "cu_seqlens_from_lengths",
    "cu_seqlens_host",
]

_INT32_MAX = 2**31 - 1


def _shape(t):
    return [int(d) for d in t.shape]


def _check_tensor(fn, name, t):
    if not isinstance(t, paddle.Tensor):
        raise TypeError(f"paddle_unpad.{fn}: {name} must be a paddle.Tensor, got {type(t).__name__}")


def _check_nonneg_int(fn, name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"paddle_unpad.{fn}: {name} must be a non-negative int, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"paddle_unpad.{fn}: {name} must be a non-negative int, got {value!r}")
    return int(value)


def unpad_input(x, attention_mask):
    """Remove padding: gather the kept tokens of a padded batch into one packed tensor.

    Args:
        x: ``[B, S, ...]`` tensor of any dtype (typically float32 ``[B, S, hidden]``).
        attention_mask: ``[B, S]`` tensor, bool or any int/float dtype; a token is kept
            where the mask is non-zero (1/True = keep). Kept tokens need not be
            left-aligned: any pattern is accepted.

    Returns:
        A tuple ``(packed, indices, cu_seqlens, max_seqlen)``:

        * ``packed`` -- ``[T, ...]``, same dtype as ``x``: the kept tokens in row-major
          order (sequence by sequence, left to right inside a sequence).
          Differentiable w.r.t. ``x`` (pads receive zero gradient).
        * ``indices`` -- int64 ``[T]``: flat indices into ``B * S`` of the kept tokens,
          ascending; ``packed[i] == x.reshape([B * S, ...])[indices[i]]``.
        * ``cu_seqlens`` -- int32 ``[B + 1]`` from the per-row kept counts.
        * ``max_seqlen`` -- Python int, the largest per-row count (0 when ``B == 0``).
          Reading it is one device-to-host copy; when lengths are known on the host,
          prefer :func:`cu_seqlens_from_lengths`. Under static graph mode (where no
          value exists yet) it is returned as an int32 scalar tensor.

    Raises:
        TypeError: ``x`` or ``attention_mask`` is not a tensor.
        ValueError: ``x`` has fewer than 2 dims, ``attention_mask`` is not 2-D, or
            ``attention_mask.shape != x.shape[:2]``.
    """
    _check_tensor("unpad_input", "x", x)
    _check_tensor("unpad_input", "attention_mask", attention_mask)
    if len(x.shape) < 2:
        raise ValueError(
            f"paddle_unpad.unpad_input: x must have shape [batch, seqlen, ...] (rank >= 2), got shape {_shape(x)}"
        )
    if len(attention_mask.shape) != 2:
        raise ValueError(
            f"paddle_unpad.unpad_input: attention_mask must have shape [batch, seqlen] (rank 2), got shape {_shape(attention_mask)}"
        )
    xs, ms = _shape(x), _shape(attention_mask)
    for dim, (a, b) in enumerate(zip(xs[:2], ms)):
        if a >= 0 and b >= 0 and a != b:
            raise ValueError(
                f"paddle_unpad.unpad_input: attention_mask shape {ms} does not match x shape {xs} in dim {dim} (expected attention_mask.shape == x.shape[:2])"
            )

    _compat.refuse_empty("unpad_input", "attention_mask", attention_mask)
    keep = attention_mask != 0 if attention_mask.dtype != paddle.bool else attention_mask
    keep_i32 = keep.astype("int32")
    seqlens = keep_i32.sum(axis=1, dtype="int32")  # [B]
    # indices of kept tokens in the flattened [B * S] batch, row-major (ascending)
    indices = paddle.nonzero(keep.flatten()).flatten()  # [T] int64
    cu_seqlens = paddle.concat([paddle.zeros([1], dtype="int32"), paddle.cumsum(seqlens, axis=0).astype("int32")])
    if paddle.in_dynamic_mode():
        max_seqlen = int(seqlens.max()) if xs[0] > 0 else 0
    else:  # static graph: no value yet
        max_seqlen = paddle.max(paddle.concat([seqlens, paddle.zeros([1], dtype="int32")]))
    packed = paddle.gather(paddle.flatten(x, 0, 1), indices, axis=0)  # [T, ...]
    return packed, indices, cu_seqlens, max_seqlen


def pad_input(packed, indices, batch_size, seqlen):
    """Put packed tokens back into a zero-padded batch (inverse of :func:`unpad_input`).

    Args:
        packed: ``[T, ...]`` tensor of any dtype.
        indices: integer ``[T]`` tensor (int64 as returned by :func:`unpad_input`; int32
            also accepted): for each packed row, its flat position in ``[0, B * S)``.
            Indices must be distinct.  On the CPU (eager mode) this is checked; on a
            device it is not (the check would need a device-to-host copy).
        batch_size: Python int ``B >= 0``.
        seqlen: Python int ``S >= 0``.

    Returns:
        ``[B, S, ...]`` tensor, dtype of ``packed``: ``out.reshape([B * S, ...])[indices[i]]
        == packed[i]`` and zeros everywhere else. Differentiable w.r.t. ``packed``
        (the gradient of ``packed[i]`` is the output gradient at ``indices[i]``).

    Raises:
        TypeError: ``packed`` or ``indices`` is not a tensor, ``indices`` is not of an
            integer dtype, or ``batch_size`` / ``seqlen`` is not an int.
        ValueError: ``indices`` is not 1-D, its length differs from ``packed.shape[0]``,
            ``batch_size`` / ``seqlen`` is negative, or (CPU) an index is out of
            ``[0, B * S)`` or repeated.
    """
    _check_tensor("pad_input", "packed", packed)
    _check_tensor("pad_input", "indices", indices)
    batch_size = _check_nonneg_int("pad_input", "batch_size", batch_size)
    seqlen = _check_nonneg_int("pad_input", "seqlen", seqlen)
    if len(packed.shape) < 1:
        raise ValueError(
            f"paddle_unpad.pad_input: packed must have shape [total_tokens, ...] (rank >= 1), got shape {_shape(packed)}"
        )
    if len(indices.shape) != 1:
        raise ValueError(f"paddle_unpad.pad_input: indices must be 1-D [total_tokens], got shape {_shape(indices)}")
    if indices.dtype not in (paddle.int64, paddle.int32):
        raise TypeError(f"paddle_unpad.pad_input: indices must be int64 or int32, got {indices.dtype}")
    n_idx, n_packed = int(indices.shape[0]), int(packed.shape[0])
    if n_idx >= 0 and n_packed >= 0 and n_idx != n_packed:
        raise ValueError(
            f"paddle_unpad.pad_input: indices has {n_idx} entries but packed has {n_packed} rows (shape {_shape(packed)}); they must match"
        )
    if n_packed > batch_size * seqlen:
        raise ValueError(
            f"paddle_unpad.pad_input: packed has {n_packed} rows, more than batch_size * seqlen = {batch_size} * {seqlen}"
        )
    if indices.dtype != paddle.int64:
        indices = indices.astype("int64")
    if paddle.in_dynamic_mode() and n_idx > 0 and indices.place.is_cpu_place():
        _check_pad_indices(indices.numpy(), batch_size * seqlen)
    rest = list(packed.shape[1:])
    zeros = paddle.zeros([batch_size * seqlen] + rest, dtype=packed.dtype)
    if n_packed == 0:  # nothing to place (and Paddle 2.6's scatter cannot take empty updates)
        return zeros.reshape([batch_size, seqlen] + rest)
    out = paddle.scatter(zeros, indices, packed, overwrite=True)  # [B * S, ...]
    return out.reshape([batch_size, seqlen] + rest)


def _check_pad_indices(idx, limit):
    """Indices must be distinct positions in [0, B * S): paddle.scatter would wrap -1 to
    the last row and let a duplicate overwrite another token without a word."""
    bad = np.flatnonzero((idx < 0) | (idx >= limit))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"paddle_unpad.pad_input: indices[{i}] = {int(idx[i])} is out of range: positions must be in [0, batch_size * seqlen = {limit})"
        )
    order = np.argsort(idx, kind="stable")
    dup = np.flatnonzero(idx[order][1:] == idx[order][:-1])
    if dup.size:
        a, b = sorted((int(order[dup[0]]), int(order[dup[0] + 1])))
        raise ValueError(
            f"paddle_unpad.pad_input: indices must be distinct, but indices[{a}] = indices[{b}] = {int(idx[a])}"
        )


def cu_seqlens_host(lengths):
    """Cumulative sequence lengths, computed on the host.

    Args:
        lengths: Python list/tuple, 1-D numpy integer array, or CPU paddle integer tensor
            of ``B`` non-negative ints (``B`` may be 0).

    Returns:
        numpy int32 ``[B + 1]``: ``[0, l0, l0 + l1, ..., sum(lengths)]``.

    Raises:
        TypeError: ``lengths`` is not a sequence, or holds a non-integer value.
        ValueError: ``lengths`` is not 1-D, holds a negative value, sums past the int32
            range, or is a tensor on a device (reading it would force a device-to-host
            copy; pass the host-side lengths instead).
    """
    return _cu_seqlens(_lengths_array(lengths, "varlen.cu_seqlens_host"), "varlen.cu_seqlens_host")


def _cu_seqlens(arr, fn):
    if arr.size and int(arr.max()) > _INT32_MAX:
        # checked before summing: a sum of such lengths can wrap around int64
        i = int(arr.argmax())
        raise ValueError(
            f"paddle_unpad.{fn}: lengths[{i}] = {int(arr[i])} is more than int32 cu_seqlens can hold ({_INT32_MAX})"
        )
    cu = np.zeros(arr.shape[0] + 1, dtype=np.int64)
    np.cumsum(arr, out=cu[1:])  # at most B * (2**31 - 1): no int64 overflow below 2**32 sequences
    if cu[-1] > _INT32_MAX:
        raise ValueError(f"paddle_unpad.{fn}: lengths sum to {int(cu[-1])} tokens, more than int32 cu_seqlens can hold")
    return cu.astype(np.int32)


def cu_seqlens_from_lengths(lengths, place=None):
    """Build ``cu_seqlens`` and ``max_seqlen`` from host-side lengths, without any device sync.

    Args:
        lengths: Python list/tuple or 1-D numpy integer array of ``B`` non-negative ints
            (a CPU paddle integer tensor is accepted too).
        place: where to put ``cu_seqlens`` (``paddle.CPUPlace()``, ``"cpu"``,
            ``"gpu:0"``, ...); default CPU.

    Returns:
        ``(cu_seqlens, max_seqlen)``: int32 paddle tensor ``[B + 1]`` on ``place`` and a
        Python int (0 for an empty batch).

    Raises:
        ValueError / TypeError: as :func:`cu_seqlens_host`.
    """
    arr = _lengths_array(lengths, "cu_seqlens_from_lengths")
    cu = _cu_seqlens(arr, "cu_seqlens_from_lengths")
    max_seqlen = int(arr.max()) if arr.shape[0] > 0 else 0
    if place is None:
        place = paddle.CPUPlace()
    return paddle.to_tensor(cu, dtype="int32", place=place), max_seqlen


def check_cu_seqlens(cu_seqlens, total, max_seqlen=None, *, who=".ops.fmha", tokens="q.shape[0]"):
    """Refuse ``cu_seqlens`` values that do not describe ``total`` packed tokens.

    The rules and the words of the C++ check the fmha operator runs where it reads the values
    (custom_ops/kernels/common/cu_seqlens_checks.h), so a caller sees the same message
    whichever side refuses: this one serves the Python code that reads them on the host (the
    plain-Paddle reference, the models' packed inputs).

    Args:
        cu_seqlens: host values (numpy array, list, or CPU tensor).
        total: the number of packed tokens, named ``tokens`` in the messages.
        max_seqlen: an int bound on every length; ``None``: not checked.
        who: what follows ``paddle_unpad`` in the messages: ``".ops.fmha"`` (the op), or ``""``
            (a converted model's forward).
    Returns:
        int, the longest sequence (0 without sequences).
    Raises:
        ValueError naming the argument and the value.
    """
    if _compat.is_tensor(cu_seqlens):
        cu_seqlens = cu_seqlens.numpy()
    cu = np.asarray(cu_seqlens).astype(np.int64, copy=False)
    if cu.ndim != 1:
        raise ValueError(f"paddle_unpad{who}: cu_seqlens must be 1-D [batch + 1], got shape {list(cu.shape)}")
    if cu.size < 1:
        raise ValueError(f"paddle_unpad{who}: cu_seqlens must have at least one element (0), got none")
    if cu[0] != 0:
        raise ValueError(f"paddle_unpad{who}: cu_seqlens[0] must be 0, got {cu[0]}")
    lengths = np.diff(cu)
    bad = np.flatnonzero(lengths < 0)
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"paddle_unpad{who}: cu_seqlens must be non-decreasing, but cu_seqlens[{b + 1}] = {cu[b + 1]} < cu_seqlens[{b}] = {cu[b]}"
        )
    if cu[-1] != total:
        raise ValueError(
            f"paddle_unpad{who}: cu_seqlens[-1] = {cu[-1]} must equal the number of packed tokens {tokens} = {total}"
        )
    longest = int(lengths.max()) if lengths.size else 0
    if max_seqlen is not None and longest > max_seqlen:
        raise ValueError(
            f"paddle_unpad{who}: max_seqlen = {max_seqlen} is smaller than the longest sequence in cu_seqlens ({longest})"
        )
    return longest


_FIRST_TOKEN = "needs at least the first ([CLS]) token of every sequence; drop empty sequences from the batch (per-token outputs accept them)"


def check_no_empty_sequences(cu_seqlens, reader, *, who=""):
    """Refuse ``cu_seqlens`` holding an empty sequence where ``reader`` takes one row per
    sequence (its first token: a pooler, a sequence-level head).

    Per-token outputs are defined for empty sequences (they have no rows); a per-sequence
    output is not: there is no [CLS] row to read, and reading ``x[cu_seqlens[b]]`` would
    give the next sequence's first token, or run past the last row. The first empty
    sequence is named, wherever it is in the batch.

    Args:
        cu_seqlens: host values (numpy array, list, or CPU tensor), already checked by
            :func:`check_cu_seqlens`.
        reader: what needs the rows, for the message (e.g. ``"BertModel's pooler"``).
        who: what follows ``paddle_unpad`` in the message (``""``: a converted model's forward).
    Raises:
        ValueError naming ``cu_seqlens``, the empty sequence's index and its offset.
    """
    if _compat.is_tensor(cu_seqlens):
        cu_seqlens = cu_seqlens.numpy()
    cu = np.asarray(cu_seqlens).astype(np.int64, copy=False).reshape(-1)
    empty = np.flatnonzero(cu[1:] == cu[:-1])
    if empty.size:
        b = int(empty[0])
        raise ValueError(
            f"paddle_unpad{who}: sequence {b} of {cu.size - 1} is empty (cu_seqlens[{b}] == cu_seqlens[{b + 1}] == {int(cu[b])}): {reader} {_FIRST_TOKEN}"
        )


def _lengths_array(lengths, fn):
    """Validate ``lengths`` and return it as a 1-D numpy int64 array."""
    if isinstance(lengths, paddle.Tensor):
        if not lengths.place.is_cpu_place():
            raise ValueError(
                f"paddle_unpad.{fn}: lengths must be host data (list, tuple, numpy array or CPU tensor), got a tensor on {lengths.place}: reading it would force a device-to-host copy"
            )
        lengths = lengths.numpy()
    if isinstance(lengths, (str, bytes)) or np.isscalar(lengths):
        raise TypeError(f"paddle_unpad.{fn}: lengths must be a 1-D sequence of non-negative ints, got {lengths!r}")
    if isinstance(lengths, (list, tuple)):
        for i, v in enumerate(lengths):
            if isinstance(v, (list, tuple, np.ndarray, paddle.Tensor)):
                raise ValueError(
                    f"paddle_unpad.{fn}: lengths must be 1-D, got a nested sequence at lengths[{i}] = {v!r}"
                )
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
                raise TypeError(
                    f"paddle_unpad.{fn}: lengths must hold non-negative ints, got lengths[{i}] = {v!r} ({type(v).__name__})"
                )
        arr = np.asarray(lengths, dtype=np.int64).reshape(-1) if len(lengths) else np.zeros(0, np.int64)
    else:
        arr = np.asarray(lengths)
        if arr.ndim != 1:
            raise ValueError(f"paddle_unpad.{fn}: lengths must be 1-D, got an array of shape {list(arr.shape)}")
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            if arr.size == 0:
                arr = np.zeros(0, np.int64)
            else:
                raise TypeError(
                    f"paddle_unpad.{fn}: lengths must hold non-negative ints, got dtype {arr.dtype}: {arr!r}"
                )
        if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
            raise ValueError(f"paddle_unpad.{fn}: lengths value {int(arr.max())} is too large")
        arr = arr.astype(np.int64)
    if arr.size:
        neg = np.flatnonzero(arr < 0)
        if neg.size:
            i = int(neg[0])
            raise ValueError(f"paddle_unpad.{fn}: lengths must be non-negative, got lengths[{i}] = {int(arr[i])}")
    return arr

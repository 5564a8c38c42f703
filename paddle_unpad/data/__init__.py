"""Packing collators: lists of variable-length samples -> packed, unpadded batches."""

from .collate import (
    DEFAULT_TOKEN_FIELDS,
    LABEL_ALIASES,
    PackingCollator,
    SampleError,
    check_lengths,
    normalize_batch,
    pack_samples,
    rename_label_keys,
    sample_list_collate,
    to_paddle,
)

__all__ = [
    "PackingCollator",
    "pack_samples",
    "normalize_batch",
    "check_lengths",
    "to_paddle",
    "sample_list_collate",
    "SampleError",
    "DEFAULT_TOKEN_FIELDS",
    "LABEL_ALIASES",
    "rename_label_keys",
]

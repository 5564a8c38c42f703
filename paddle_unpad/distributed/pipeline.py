"""What becomes of a rank's batch: the user's samples in, a packed batch of paddle tensors out.

Four stages, in this order: read (:func:`paddle_unpad.data.normalize_batch`), check the
lengths, pack, convert to tensors. One process runs them in a row (:meth:`Pipeline.local`);
the exchange runs the same stages around its collectives -- it reads the rank's batch, checks
every rank's gathered lengths (the same check, so the same message, on every rank) and packs
the samples the plan gives the rank.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

from ..data.collate import check_lengths, normalize_batch, pack_samples, to_paddle


class Pipeline(NamedTuple):
    """The stages, with what they depend on: the per-token fields, the longest legal sample
    and where the tensors go."""

    token_fields: Tuple[str, ...]
    max_seqlen: Optional[int]
    place: Any = None

    def read(self, batch, rank: int, step: int):
        """``(samples, lengths, ids)`` of a batch of the user's loader; a batch or sample that
        cannot be read raises, naming the sample and the rank."""
        return normalize_batch(batch, rank, step, self.token_fields)

    def check(self, lengths, ids, rank: int):
        """Refuse an empty sample or one longer than ``max_seqlen`` of rank ``rank``'s."""
        check_lengths(lengths, ids, rank, self.max_seqlen)

    def pack(self, samples, lengths, ids, step: int, global_num_samples=None, schema=None, **extra):
        """The packed batch of checked samples as paddle tensors, with ``step`` and ``extra``
        (host values) added."""
        packed = pack_samples(
            samples, lengths, ids, self.token_fields, global_num_samples=global_num_samples, schema=schema
        )
        packed.update(step=step, **extra)
        return to_paddle(packed, self.place)

    def local(self, batch, rank: int, step: int):
        """The four stages in a row: the packed batch of a rank that keeps its own samples."""
        samples, lengths, ids = self.read(batch, rank, step)
        self.check(lengths, ids, rank)
        return self.pack(samples, lengths, ids, step)

"""PaddleNLP ``Trainer`` on packed, load-balanced batches.

Two changed lines in a PaddleNLP Trainer script::

    from paddle_unpad.trainer import UnpadTrainer     # 1
    trainer = UnpadTrainer(model=model, args=training_args,   # 2: was Trainer(...)
                           train_dataset=train_ds, eval_dataset=dev_ds, ...)

``UnpadTrainer`` converts the model (``paddle_unpad.convert``, in place), packs every
training batch (no padding is built at all), and, under fleetrun with more than one rank,
balances the training samples across ranks with the exchange of
``paddle_unpad.fleet.distributed_loader``. Evaluation and prediction batches are padded
(with an attention mask, which the converted model unpads internally): the Trainer's
evaluation loop gathers predictions across ranks by batch shape, which packed tensors
(``[T, ...]``, T differing per rank) would break. Datasets yield samples as dicts of
unpadded fields (``input_ids``, ``token_type_ids``, ``labels``, ...), as they do for the
stock Trainer before its padding collator; ``label`` and ``label_ids`` are renamed
``labels`` as PaddleNLP's collators do. Under fleetrun, resuming from a checkpoint
(``resume_from_checkpoint``) replays the same data order as an uninterrupted run: the
training loader is a ``paddle.io.DataLoader`` to the Trainer, so its epoch and skip logic
apply. A checkpoint saved by another number of ranks is refused by ``train()`` on every rank,
naming both numbers (:func:`check_resume_world_size`): each global step takes ``batch x
ranks`` samples, so the steps it skips would not be the steps it trained; with
``ignore_data_skip=True`` (no replay) it resumes. Checkpoints are unchanged: ``save_model`` /
``save_pretrained`` output loads in unmodified PaddleNLP.
"""

import json
import os
import re

import numpy as np
import paddle

from . import models as _models
from .distributed import groups as _groups
from .distributed import options as _balance_options
from .data import sample_list_collate
from .data.collate import DEFAULT_TOKEN_FIELDS, LABEL_ALIASES, normalize_batch, rename_label_keys

__all__ = [
    "UnpadTrainer",
    "PadCollator",
    "LABEL_ALIASES",
    "rename_label_keys",
    "checkpoint_world_size",
    "check_resume_world_size",
]


# PaddleNLP (2.8 and 3.0) saves a checkpoint's random states as rng_state_<ranks>.pth (every
# rank's, in a job of several) or rng_state.pth (one process): the one record of the ranks
_RNG_STATE_FILE = re.compile(r"rng_state(?:_(\d+))?\.pth")


def checkpoint_world_size(folder):
    """The number of ranks that saved the PaddleNLP Trainer checkpoint ``folder`` (an int), read
    from the name of its random-state file (the newest, if a later run saved the same step
    again); None when it has none (not a Trainer checkpoint, or not readable here)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    found = [
        (os.path.getmtime(os.path.join(folder, n)), int(m.group(1) or 1))
        for n, m in ((n, _RNG_STATE_FILE.fullmatch(n)) for n in names)
        if m
    ]
    return max(found)[1] if found else None


_NO_REPLAY = "its data order cannot be replayed on another number of ranks (each global step takes per_device_train_batch_size x ranks samples, so the steps skipped would not be the steps trained)"
_SKIP_REPLAY = "pass ignore_data_skip=True to continue without replaying the data order"


def check_resume_world_size(folder, world, where="trainer.UnpadTrainer.train", timeout=None):
    """Refuse, on every rank, to resume the Trainer checkpoint ``folder`` on ``world`` ranks when
    it was saved by another number: PaddleNLP's Trainer skips the global steps the checkpoint
    trained by counting batches of ``batch x ranks`` samples, so on another number of ranks it
    would skip other samples than it trained (some never trained in that epoch, some twice).
    The ranks compare what they read through the job's store (a rank that cannot read the
    folder takes the others' reading). ``ValueError`` naming both numbers."""
    saved = checkpoint_world_size(folder)
    if world > 1:
        from .distributed import groups as _dist_groups

        limit = timeout or 300.0
        values, missing = _dist_groups.agree("trainer-resume", json.dumps(saved), limit)
        if missing:
            waited = max(limit, _dist_groups.AGREE_MIN_S)
            raise RuntimeError(
                f"paddle_unpad.{where}: rank(s) {missing} did not start train(resume_from_checkpoint={folder!r}) within {waited:g} s: every rank must resume from the same checkpoint at the same point"
            )
        seen = {json.loads(v) for v in values or []} - {None}
        saved = max(seen) if seen else saved
    if saved is not None and saved != world:
        raise ValueError(
            f"paddle_unpad.{where}: the checkpoint {folder!r} was saved by {saved} rank(s), this run has {world}: {_NO_REPLAY}: resume on {saved} rank(s), or {_SKIP_REPLAY}"
        )


def train_collate(batch):
    """``collate_fn`` of UnpadTrainer's training DataLoader: the list of samples (label keys
    renamed by :func:`~paddle_unpad.data.sample_list_collate`) that the exchange balances and packs."""
    return sample_list_collate(batch)


def _trainer_base():
    from paddlenlp.trainer import Trainer

    from ._runtime.paddle_compat import check_paddlenlp_version

    check_paddlenlp_version()

    return Trainer


class PadCollator:
    """Pads a list of samples to the batch maximum: ``[B, S]`` tensors plus an
    ``attention_mask``; per-token labels are padded with ``label_pad`` (ignored by
    PaddleNLP's losses), per-sample fields are stacked; ``label`` / ``label_ids`` become
    ``labels`` (:func:`rename_label_keys`). ``pad_to``: pad every batch to
    this length instead (PaddleNLP's ``padding="max_length"``)."""

    def __init__(self, pad_token_id=0, label_pad=-100, pad_to=None):
        if pad_to is not None and (isinstance(pad_to, bool) or not isinstance(pad_to, int)):
            raise TypeError(f"paddle_unpad.trainer.PadCollator: pad_to must be a positive int or None, got {pad_to!r}")
        if pad_to is not None and pad_to < 1:
            raise ValueError(f"paddle_unpad.trainer.PadCollator: pad_to must be a positive int or None, got {pad_to!r}")
        self.pad_token_id, self.label_pad, self.pad_to = pad_token_id, label_pad, pad_to

    def __call__(self, batch):
        samples, lengths, _ = normalize_batch([rename_label_keys(smp) for smp in batch])
        B, S = len(samples), int(lengths.max()) if len(samples) else 0
        if self.pad_to is not None:
            if S > self.pad_to:
                raise ValueError(
                    f"paddle_unpad.trainer.PadCollator: a sample of length {S} is longer than pad_to={self.pad_to}"
                )
            S = self.pad_to
        out = {"attention_mask": np.zeros((B, S), np.int64)}
        for b, n in enumerate(lengths):
            out["attention_mask"][b, :n] = 1
        for name in samples[0] if B else ():
            vals = [smp[name] for smp in samples]
            if name in DEFAULT_TOKEN_FIELDS and vals[0].ndim >= 1:
                fill = self.pad_token_id if name == "input_ids" else (self.label_pad if "label" in name else 0)
                arr = np.full((B, S) + vals[0].shape[1:], fill, dtype=vals[0].dtype)
                for b, v in enumerate(vals):
                    arr[b, : len(v)] = v
                out[name] = arr
            else:
                out[name] = np.stack(vals)
        return {k: paddle.to_tensor(v) for k, v in out.items()}


class _BalancedTrainLoader(paddle.io.DataLoader):
    """The balanced loader, as the Trainer's training DataLoader.

    A ``paddle.io.DataLoader`` subclass because PaddleNLP's Trainer resumes only a loader
    that passes ``isinstance(loader, paddle.io.DataLoader)``: it then calls
    ``batch_sampler.set_epoch(epoch)`` (the shuffle of a resumed epoch >= 1) and
    ``set_epoch(consumed_samples=...)`` for PaddleNLP's own sampler. Both reach the wrapped
    loader's sampler, which feeds the exchange; nothing of ``DataLoader.__init__`` is used.
    """

    def __init__(self, balanced, loader):  # no super().__init__: it would build a second loader
        self._balanced, self._loader = balanced, loader

    def __iter__(self):
        return iter(self._balanced)

    def __call__(self):
        return self.__iter__()

    def __len__(self):
        return len(self._balanced)

    def __getattr__(self, name):  # batch_sampler (set_epoch), dataset, ...
        if name in ("_balanced", "_loader"):  # not yet set (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)


def _make_class():
    Trainer = _trainer_base()

    class UnpadTrainer(Trainer):
        """``paddlenlp.trainer.Trainer`` that trains the unpadded model on packed batches.

        Extra keyword arguments:
            unpad_configs: dict of balancer options (:data:`paddle_unpad.distributed.options.OPTIONS`,
                checked here); ``{"balance": False}`` packs each rank's own batches without
                exchanging samples.
            max_seqlen: longest legal sample (default: the model's max positions).
            token_loss: ``"mean"`` / ``"stock"``, the per-token loss scaling of
                ``paddle_unpad.convert``; None (default) keeps that of a model converted
                beforehand, else ``"mean"``.
        """

        def __init__(self, model=None, *args, unpad_configs=None, max_seqlen=None, token_loss=None, **kwargs):
            if model is None:
                raise ValueError("paddle_unpad.trainer.UnpadTrainer: model is required (it is converted in place)")
            if not _models.is_converted(model):
                _models.convert(model, token_loss=token_loss or "mean")
            elif token_loss is not None:  # keep the other options of the earlier convert()
                opts = _models.common.options_of(_models._unwrap(model))
                _models.convert(model, on_unsupported=opts.get("on_unsupported", "raise"), token_loss=token_loss)
            cfg = dict(unpad_configs or {})
            if max_seqlen is None:
                config = getattr(model, "config", None) or getattr(getattr(model, "bert", None), "config", None)
                max_seqlen = getattr(config, "max_position_embeddings", 512)
            cfg.setdefault("max_seqlen", max_seqlen)
            self._unpad_configs = _balance_options.resolve(cfg, "trainer.UnpadTrainer", "unpad_configs")  # fails here
            _balance_options.check_counts_per_rank(
                self._unpad_configs, "trainer.UnpadTrainer", _groups.launched_world(), "unpad_configs"
            )
            if kwargs.get("data_collator") is None:  # eval / predict batches (see module doc)
                pad_id = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
                kwargs["data_collator"] = PadCollator(pad_token_id=pad_id)
            # the Trainer (and the balanced loader after it) may make gloo groups: each gets its
            # own rendezvous store; the settings are compared at the first one, since a job
            # that balances nothing may make none, and need not wait for the other ranks
            _groups.install_group_stores(check=False)
            super().__init__(model, *args, **kwargs)

        def train(self, resume_from_checkpoint=None, *args, **kwargs):
            """``Trainer.train``; a checkpoint saved by another number of ranks is refused on every
            rank (:func:`check_resume_world_size`) unless ``ignore_data_skip`` (no replay)."""
            folder = resume_from_checkpoint
            if isinstance(folder, bool):  # True: the newest checkpoint of output_dir, as the Trainer reads it
                from paddlenlp.trainer.trainer_utils import get_last_checkpoint

                out = self.args.output_dir
                folder = get_last_checkpoint(out) if folder and os.path.isdir(out) else None
            if folder and not self.args.ignore_data_skip:
                check_resume_world_size(folder, int(self.args.world_size), timeout=self._unpad_configs["timeout"])
            return super().train(resume_from_checkpoint, *args, **kwargs)

        def get_train_dataloader(self):
            from .distributed import BalancedLoader

            eval_collator = self.data_collator
            self.data_collator = train_collate  # the exchange packs after balancing
            try:
                loader = super().get_train_dataloader()
            finally:
                self.data_collator = eval_collator
            balanced = BalancedLoader.from_options(loader, self._unpad_configs)
            return _BalancedTrainLoader(balanced, loader)

    return UnpadTrainer


UnpadTrainer: type  # declared for __all__, not bound: __getattr__ makes the class at its first use


def __getattr__(name):  # paddlenlp is imported only when the Trainer is asked for
    if name == "UnpadTrainer":
        cls = _make_class()
        globals()["UnpadTrainer"] = cls
        return cls
    raise AttributeError(name)

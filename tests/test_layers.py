"""paddle_unpad.layers: the unpadded encoder layer / encoder against paddle.nn.TransformerEncoder.

The reference is Paddle's own (PaddleNLP-patched) padded TransformerEncoder run with a
padding mask; the unpadded layers must reuse its parameter objects and match it at real
tokens, forward and backward.
"""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import paddle_unpad as pu
from paddle_unpad import layers, ops

pytestmark = [pytest.mark.usefixtures("native_ops"), pytest.mark.paddle_gpu_stage]

pytest.importorskip("paddlenlp.transformers")  # the encoder forwards PaddleNLP patches in

# float32 layers chain fmha and the fused ops: the larger of their budgets
RTOL = max(ops.FMHA_TOLERANCE["float32"], ops.FUSED_OPS_TOLERANCE["float32"])


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max(initial=0.0) / max(np.abs(b).max(initial=0.0), 1e-30))


def make_encoder(
    hidden=64,
    heads=4,
    ffn=128,
    n=2,
    dropout=0.0,
    act="gelu",
    cls=paddle.nn.TransformerEncoder,
    layer_cls=paddle.nn.TransformerEncoderLayer,
    seed=0,
):
    paddle.seed(seed)
    layer = layer_cls(hidden, heads, ffn, dropout=dropout, activation=act, attn_dropout=dropout, act_dropout=0)
    enc = cls(layer, n)
    for name, p in enc.named_parameters():  # non-trivial biases and LayerNorm affine parameters
        if name.endswith("bias") or "norm" in name:
            p.set_value(paddle.randn(p.shape) * 0.1 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    for layer in enc.layers:
        layer.norm1._epsilon = layer.norm2._epsilon = 1e-12
    return enc


def padded_batch(lengths, hidden, seed=0):
    rng = np.random.default_rng(seed)
    B, S = len(lengths), max(lengths)
    x = rng.standard_normal((B, S, hidden)).astype(np.float32)
    mask = np.zeros((B, S), np.int64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    return x, mask


def reference_padded(enc, x, mask):
    add = paddle.to_tensor(((1 - mask) * -1e4).astype(np.float32)[:, None, None, :])
    return enc(x, src_mask=add)


@pytest.mark.parametrize("hidden,heads,act", [(64, 4, "gelu"), (96, 3, "relu"), (32, 1, "gelu")])
def test_encoder_matches_padded_reference(hidden, heads, act):
    lengths = [1, 6, 13, 2]
    enc = make_encoder(hidden, heads, 2 * hidden, act=act)
    enc.eval()
    x_np, mask = padded_batch(lengths, hidden)
    valid = mask.reshape(-1).astype(bool)
    cu, mx = pu.cu_seqlens_from_lengths(lengths)

    x_ref = paddle.to_tensor(x_np, stop_gradient=False)
    out_ref = reference_padded(enc, x_ref, mask)
    x_pk = paddle.to_tensor(x_np.reshape(-1, hidden)[valid], stop_gradient=False)
    out_pk, _ = layers.encoder_forward(enc, x_pk, cu, mx)

    rng = np.random.default_rng(1)
    w = rng.standard_normal((int(valid.sum()), hidden)).astype(np.float32)
    ref_rows = out_ref.reshape([-1, hidden]).numpy()[valid]
    assert rel_err(out_pk.numpy(), ref_rows) < RTOL

    grads = {}
    for tag, out, idx in (
        ("ref", out_ref.reshape([-1, hidden]), paddle.to_tensor(np.flatnonzero(valid))),
        ("pk", out_pk, None),
    ):
        rows = paddle.gather(out, idx) if idx is not None else out
        enc.clear_gradients()
        (rows * paddle.to_tensor(w)).sum().backward()
        grads[tag] = {n: p.grad.numpy().copy() for n, p in enc.named_parameters()}
    for n in grads["ref"]:
        if n.endswith("k_proj.bias"):  # mathematically zero (softmax shift invariance): rounding noise
            scale = max(np.abs(g).max() for g in grads["ref"].values())
            assert np.abs(grads["pk"][n] - grads["ref"][n]).max() < RTOL * scale
            continue
        assert rel_err(grads["pk"][n], grads["ref"][n]) < RTOL, n
    gx_ref = x_ref.grad.numpy().reshape(-1, hidden)[valid]
    assert rel_err(x_pk.grad.numpy(), gx_ref) < RTOL


def test_same_parameter_objects_and_one_qkv_gemm(monkeypatch):
    enc = make_encoder()
    layer = enc.layers[0]
    w, b = layers.qkv_weight_and_bias(layer.self_attn)
    assert list(w.shape) == [64, 192] and list(b.shape) == [192]
    np.testing.assert_array_equal(w.numpy()[:, 64:128], layer.self_attn.k_proj.weight.numpy())
    # the layer makes exactly one GEMM with the [h, 3h] weight for q, k and v, and hands its
    # output and the [3, heads, head_dim] bias to the packed attention
    calls, attn = [], []
    real_matmul, real_attn = layers.paddle.matmul, layers._ops.fmha_qkvpacked

    def spy(x, y, *a, **kw):
        calls.append(list(y.shape))
        return real_matmul(x, y, *a, **kw)

    def attn_spy(qkv, cu_seqlens, max_seqlen, bias=None, **kw):
        attn.append((list(qkv.shape), None if bias is None else list(bias.shape)))
        return real_attn(qkv, cu_seqlens, max_seqlen, bias=bias, **kw)

    monkeypatch.setattr(layers.paddle, "matmul", spy)
    monkeypatch.setattr(layers._ops, "fmha_qkvpacked", attn_spy)
    cu, mx = pu.cu_seqlens_from_lengths([3, 5])
    layers.encoder_layer_forward(layer, paddle.randn([8, 64]), cu, mx)
    monkeypatch.undo()
    assert [c for c in calls if c[1] == 192] == [[64, 192]]
    assert attn == [([8, 3, 4, 16], [3, 4, 16])]
    # gradients reach the original q/k/v parameters through the concatenation
    out = layers.encoder_layer_forward(layer, paddle.randn([8, 64]), cu, mx)
    out.sum().backward()
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert getattr(layer.self_attn, proj).weight.grad is not None


def test_fused_ops_are_used(monkeypatch):
    """The layer calls ops.bias_gelu once and ops.bias_dropout_residual_layer_norm twice per layer,
    and the real ops agree with the same math in plain Paddle."""
    enc = make_encoder()
    enc.eval()
    cu, mx = pu.cu_seqlens_from_lengths([4, 1, 7])
    x = paddle.randn([12, 64])
    counts = {"bias_gelu": 0, "bias_dropout_residual_layer_norm": 0}

    def gelu_spy(x, bias):
        counts["bias_gelu"] += 1
        return F.gelu(x + bias)

    def bdrln_spy(x, bias, residual, ln_weight, ln_bias, dropout=0.0, epsilon=1e-12, training=True, *, rng_state=None):
        counts["bias_dropout_residual_layer_norm"] += 1
        return F.layer_norm(residual + x + bias, [x.shape[-1]], ln_weight, ln_bias, epsilon)

    monkeypatch.setattr(ops, "bias_gelu", gelu_spy)
    monkeypatch.setattr(ops, "bias_dropout_residual_layer_norm", bdrln_spy)
    out_spy, _ = layers.encoder_forward(enc, x, cu, mx)
    assert counts == {"bias_gelu": 2, "bias_dropout_residual_layer_norm": 4}
    monkeypatch.undo()
    out_ops, _ = layers.encoder_forward(enc, x, cu, mx)
    assert rel_err(out_ops.numpy(), out_spy.numpy()) < RTOL


def test_unpad_encoder_classes_packed_and_padded():
    enc_ref = make_encoder()
    enc = make_encoder(cls=layers.UnpadTransformerEncoder, layer_cls=layers.UnpadTransformerEncoderLayer)
    enc.set_state_dict(enc_ref.state_dict())
    enc.eval(), enc_ref.eval()
    lengths = [5, 2, 9]
    x_np, mask = padded_batch(lengths, 64)
    valid = mask.reshape(-1).astype(bool)
    cu, mx = pu.cu_seqlens_from_lengths(lengths)
    ref = reference_padded(enc_ref, paddle.to_tensor(x_np), mask)
    out = enc(paddle.to_tensor(x_np.reshape(-1, 64)[valid]), cu_seqlens=cu, max_seqlen=mx)
    assert rel_err(out.numpy(), ref.reshape([-1, 64]).numpy()[valid]) < RTOL
    out_h, hidden = enc(
        paddle.to_tensor(x_np.reshape(-1, 64)[valid]), cu_seqlens=cu, max_seqlen=mx, output_hidden_states=True
    )
    assert len(hidden) == 3
    # without cu_seqlens: the padded parent forward, unchanged
    padded = reference_padded(enc, paddle.to_tensor(x_np), mask)
    np.testing.assert_array_equal(padded.numpy(), ref.numpy())
    one = enc.layers[0](paddle.to_tensor(x_np.reshape(-1, 64)[valid]), cu_seqlens=cu, max_seqlen=mx)
    assert list(one.shape) == [int(valid.sum()), 64]
    with pytest.raises(ValueError, match="max_seqlen"):
        enc(paddle.to_tensor(x_np.reshape(-1, 64)[valid]), cu_seqlens=cu)


def test_convert_encoder_in_place_and_revert():
    enc = make_encoder()
    params = [id(p) for p in enc.parameters()]
    keys = list(enc.state_dict().keys())
    layers.convert_encoder(enc)
    assert isinstance(enc, layers.UnpadTransformerEncoder) is False  # a swapped class, same name
    assert type(enc).__name__ == "TransformerEncoder" and layers.is_swapped(enc)
    assert [id(p) for p in enc.parameters()] == params and list(enc.state_dict().keys()) == keys
    cu, mx = pu.cu_seqlens_from_lengths([2, 3])
    assert list(enc(paddle.randn([5, 64]), cu_seqlens=cu, max_seqlen=mx).shape) == [5, 64]
    layers.convert_encoder(enc)  # idempotent
    layers.revert_encoder(enc)
    assert type(enc) is paddle.nn.TransformerEncoder
    assert all(type(layer) is paddle.nn.TransformerEncoderLayer for layer in enc.layers)


def test_unsupported_layers_are_refused():
    paddle.seed(0)
    pre_ln = paddle.nn.TransformerEncoder(paddle.nn.TransformerEncoderLayer(64, 4, 128, normalize_before=True), 1)
    with pytest.raises(NotImplementedError, match="normalize_before"):
        layers.convert_encoder(pre_ln)
    enc = make_encoder(n=1)
    enc.layers[0].self_attn.need_weights = True
    with pytest.raises(NotImplementedError, match="need_weights"):
        layers.convert_encoder(enc)
    enc = make_encoder(cls=layers.UnpadTransformerEncoder, layer_cls=layers.UnpadTransformerEncoderLayer, n=1)
    cu, mx = pu.cu_seqlens_from_lengths([2, 3])
    with pytest.raises(NotImplementedError, match="src_mask"):
        enc(paddle.randn([5, 64]), src_mask=paddle.zeros([1, 1, 5, 5]), cu_seqlens=cu, max_seqlen=mx)


def test_recompute_gives_the_same_gradients():
    enc = make_encoder()
    enc.train()
    cu, mx = pu.cu_seqlens_from_lengths([3, 8, 1])
    x_np = np.random.default_rng(0).standard_normal((12, 64)).astype(np.float32)
    grads = []
    for recompute in (False, True):
        enc.enable_recompute = recompute
        enc.clear_gradients()
        x = paddle.to_tensor(x_np, stop_gradient=False)
        out, _ = layers.encoder_forward(enc, x, cu, mx)
        (out * out).sum().backward()
        grads.append({n: p.grad.numpy().copy() for n, p in enc.named_parameters()})
    for n in grads[0]:
        if not n.endswith("k_proj.bias"):
            assert rel_err(grads[1][n], grads[0][n]) < RTOL, n


def test_dropout_in_training_is_seeded_and_off_in_eval():
    enc = make_encoder(dropout=0.2, n=1)
    cu, mx = pu.cu_seqlens_from_lengths([6, 10])
    x = paddle.randn([16, 64])
    enc.eval()
    e1, _ = layers.encoder_forward(enc, x, cu, mx)
    e2, _ = layers.encoder_forward(enc, x, cu, mx)
    np.testing.assert_array_equal(e1.numpy(), e2.numpy())
    enc.train()
    paddle.seed(5)
    t1, _ = layers.encoder_forward(enc, x, cu, mx)
    paddle.seed(5)
    t2, _ = layers.encoder_forward(enc, x, cu, mx)
    t3, _ = layers.encoder_forward(enc, x, cu, mx)
    np.testing.assert_array_equal(t1.numpy(), t2.numpy())
    assert not np.allclose(t1.numpy(), e1.numpy()) and not np.allclose(t2.numpy(), t3.numpy())

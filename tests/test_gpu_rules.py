"""A converted model trains in every GPU training mode -- float32, AMP O1 and O2 with float16
and bfloat16 -- under paddle_unpad's GPU dispatch, run on the CPU (tests/gpu_rules.py: the
package's own dispatch code sees GPU tensors and a CUDA build; the CUDA kernels, compiled for
the CPU emulation, serve the operators) with Paddle's AMP emulated for CPU tensors
(tests/amp_emulation.py: Paddle's own auto_cast / decorate and its eager cast rules).

Each mode trains the stock PaddleNLP model and its converted twin (same weights, same padded
batch, no dropout) for three SGD steps in that mode and compares losses and every gradient
within paddle_unpad.ops.MODEL_TOLERANCE; it also checks which kernel served each op (the fused
LayerNorm kernel under O1 and O2 with AMP's dtypes, the CUDA attention kernel for half, the
plain-Paddle bucketed attention for float32).

Not a GPU run: GEMMs run in float32 on the CPU and are rounded to the AMP dtype, as a GPU's
half kernels round on store; the device's own accumulation order is not modelled.
"""

import contextlib
import math

import numpy as np
import paddle
import pytest

import amp_emulation
import gpu_rules
from paddle_unpad.ops import MODEL_TOLERANCE
from test_convert import _is_key_bias, _loss_inputs, call, make_pair, ragged_batch

pytestmark = [pytest.mark.build, pytest.mark.usefixtures("native_ops")]

MODES = {
    "fp32": (None, "float32"),
    "O1-fp16": ("O1", "float16"),
    "O1-bf16": ("O1", "bfloat16"),
    "O2-fp16": ("O2", "float16"),
    "O2-bf16": ("O2", "bfloat16"),
}
HEADS = 2  # hidden 64 / 2 heads = head size 32, a size the CUDA attention kernel has
LR = 0.05
# float16 training scales the loss (GradScaler; PaddleNLP's Trainer starts at 2^15) so that small
# gradients do not underflow float16; Paddle's GradScaler is off on a CPU, so the tests scale
# by hand (a power of two: exact) and unscale before the step.
LOSS_SCALE = {"float32": 1.0, "bfloat16": 1.0, "float16": 2.0**12}
STEPS = 3
BDRLN = "pu_bias_dropout_residual_layer_norm"


def _train(kind, level, dtype, calls):
    """Three steps of the stock and the converted model in one mode: per step, each model's
    loss and float32 gradients by parameter name; and the kernel calls of the converted one."""
    ref, model = make_pair("bert", kind, token_loss="stock", num_attention_heads=HEADS)
    ids, tt, mask = ragged_batch("bert")
    labels = _loss_inputs("bert", kind, ids, mask, np.random.default_rng(6))
    runs = []
    for m in (ref, model):
        opt = paddle.optimizer.SGD(learning_rate=LR, parameters=m.parameters())
        if level == "O2":
            m, opt = paddle.amp.decorate(models=m, optimizers=opt, level="O2", dtype=dtype)
        first = len(calls)
        steps = []
        for _ in range(STEPS):
            amp = paddle.amp.auto_cast(level=level, dtype=dtype) if level else contextlib.nullcontext()
            with amp:
                loss = call(m, "bert", kind, ids, tt, mask, dict(labels, return_dict=True)).loss
            (loss * LOSS_SCALE[dtype]).backward()
            grads = {
                n: p.grad.astype("float32").numpy() / LOSS_SCALE[dtype]
                for n, p in m.named_parameters()
                if p.grad is not None
            }
            for p in m.parameters():
                if p.grad is not None:
                    p.grad.set_value((p.grad.astype("float32") / LOSS_SCALE[dtype]).astype(p.grad.dtype))
            steps.append((float(loss.astype("float32")), grads, str(loss.dtype)))
            opt.step()
            opt.clear_grad()
        runs.append((steps, calls[first:]))
    return runs


def _compare(mode, dtype, stock, ours):
    tol = MODEL_TOLERANCE[dtype]
    for step, ((l_ref, g_ref, _), (l_new, g_new, _)) in enumerate(zip(stock, ours)):
        assert abs(l_new - l_ref) <= tol["loss"] * max(abs(l_ref), 1.0), (mode, step, l_new, l_ref)
        assert g_ref.keys() == g_new.keys(), (mode, set(g_ref) ^ set(g_new))
        scale_all = max(np.abs(g).max(initial=0.0) for g in g_ref.values())
        bad = {}
        for name, g in g_ref.items():
            # a key bias has a gradient of exactly zero in exact arithmetic (softmax ignores a
            # per-row shift): both sides hold rounding noise, compared with every gradient's scale
            scale = scale_all if _is_key_bias(name) else max(np.abs(g).max(initial=0.0), 1e-30)
            err = float(np.abs(g_new[name] - g).max(initial=0.0)) / scale
            if err > tol["grad"]:
                bad[name] = err
        assert not bad, f"{mode} step {step}: gradients differ (max abs / max |stock|): {bad}"


@pytest.mark.parametrize("kind", ["seqcls", "pretrain"])
@pytest.mark.parametrize("mode", list(MODES))
def test_trains_in_every_gpu_mode_like_the_stock_model(mode, kind):
    level, dtype = MODES[mode]
    with amp_emulation.emulated_amp(), gpu_rules.gpu_rules(pytest) as calls:
        (stock, _), (ours, ours_calls) = _train(kind, level, dtype, calls)
    _compare(mode, dtype, stock, ours)
    assert all(np.isfinite(loss) for loss, _, _ in ours)
    ops = [op for op, _ in ours_calls]
    layers = 2 * STEPS  # converted layers run, forward passes
    # the fused LayerNorm kernel serves both residual blocks of every layer in every mode
    ln = [dts for op, dts in ours_calls if op == BDRLN]
    assert len(ln) == 2 * layers, (mode, ops)
    if level is None:
        assert "pu_fmha" not in ops, "float32 attention on a GPU takes the bucketed Paddle path"
        assert all(set(dts) == {"float32"} for dts in ln), ln
        return
    fmha = [dts for op, dts in ours_calls if op == "pu_fmha"]
    assert fmha == [(dtype,) * 3] * layers, fmha
    # AMP's dtypes reach the kernel as they are: half x (and its bias, cast like a linear's),
    # the residual's and LayerNorm parameters' own dtypes
    assert all(dts[0] == dtype and dts[1] == dtype for dts in ln), ln
    assert any(dts[3] == "float32" for dts in ln) == (dtype == "float16" or level == "O1"), ln
    assert ops.count("pu_bias_gelu") == layers, ops


TRAINER_MODES = {
    "O1-fp16": ("O1", "float16"),
    "O1-bf16": ("O1", "bfloat16"),
    "O2-fp16": ("O2", "float16"),
    "O2-bf16": ("O2", "bfloat16"),
}


def _trainer_losses(trainer_cls, model, dataset, tmp_path, level, dtype, **kw):
    from paddlenlp.trainer import TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=len(dataset),
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        evaluation_strategy="no",
        seed=42,
        disable_tqdm=True,
        report_to=[],
        fp16=dtype == "float16",
        bf16=dtype == "bfloat16",
        fp16_opt_level=level,
        dataloader_drop_last=False,
    )
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, **kw)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("mode", list(TRAINER_MODES))
def test_unpad_trainer_in_amp_modes_like_the_stock_trainer(mode, tmp_path):
    """PaddleNLP's Trainer with fp16=True / bf16=True at O1 and O2 (its own auto_cast, decorate
    and custom lists): UnpadTrainer's per-step losses match the stock Trainer's, and the
    converted layers run the fused LayerNorm and attention kernels in AMP's dtypes."""
    from paddlenlp.trainer import Trainer

    from paddle_unpad.trainer import PadCollator, UnpadTrainer

    level, dtype = TRAINER_MODES[mode]
    ids, tt, mask = ragged_batch("bert")
    rng = np.random.default_rng(8)
    dataset = [
        {"input_ids": ids[b, :n].tolist(), "token_type_ids": tt[b, :n].tolist(), "labels": int(rng.integers(0, 3))}
        for b, n in enumerate(mask.sum(1))
    ]
    with amp_emulation.emulated_amp(), gpu_rules.gpu_rules(pytest) as calls:
        ref, model = make_pair("bert", "seqcls", token_loss="stock", num_attention_heads=HEADS)
        stock = _trainer_losses(Trainer, ref, dataset, tmp_path / "stock", level, dtype, data_collator=PadCollator())
        first = len(calls)
        ours = _trainer_losses(UnpadTrainer, model, dataset, tmp_path / "unpad", level, dtype)
        ours_calls = calls[first:]
    tol = MODEL_TOLERANCE[dtype]["loss"]
    assert len(stock) == len(ours) == STEPS, (stock, ours)
    for a, b in zip(ours, stock):
        assert abs(a - b) <= tol * max(abs(b), 1.0), (mode, ours, stock)
    ln = [dts for op, dts in ours_calls if op == BDRLN]
    assert len(ln) == 2 * 2 * STEPS and all(dts[0] == dtype for dts in ln), ln
    assert [dts for op, dts in ours_calls if op == "pu_fmha"] == [(dtype,) * 3] * (2 * STEPS)


# ------------------------------------------------------------------------------ op by op


def _leaf(a, dtype):
    t = paddle.to_tensor(np.asarray(a, np.float32)).astype(dtype)
    t.stop_gradient = False
    return t


def _f64(t):
    return t.astype("float32").numpy().astype(np.float64)


def _close(name, got, ref, dtype, kind):
    from paddle_unpad.ops import FUSED_OPS_GPU_TOLERANCE

    err = np.abs(_f64(got) - ref).max(initial=0.0) / max(np.abs(ref).max(initial=0.0), 1e-6)
    assert err <= FUSED_OPS_GPU_TOLERANCE[dtype][kind], f"{name}: {err:.2e}"


# (x, residual, LayerNorm parameters) as AMP hands them over -> the dtypes the kernel gets
# (the bias always takes x's) and y's dtype. A half residual next to a float32 x is cast up.
LN_MIXES = {
    "O1": ("half", "float32", "float32"),
    "O2-fp16": ("half", "half", "float32"),
    "O2-bf16": ("half", "half", "half"),
    "half-residual": ("float32", "half", "float32"),
}


@pytest.mark.parametrize("mix", list(LN_MIXES))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_ops_take_amps_dtype_mixes(dtype, mix):
    import test_fused_ops as ref_ops
    from paddle_unpad import ops

    x_dt, r_dt, w_dt = (dtype if d == "half" else d for d in LN_MIXES[mix])
    rng = np.random.default_rng(4)
    rows, cols = 9, 64
    x, res, dy = (
        _leaf(rng.standard_normal((rows, cols)), x_dt),
        _leaf(rng.standard_normal((rows, cols)), r_dt),
        rng.standard_normal((rows, cols)),
    )
    bias = _leaf(rng.standard_normal(cols) * 0.5, "float32")  # a float32 parameter, as under O1
    w, b = _leaf(1 + rng.standard_normal(cols) * 0.2, w_dt), _leaf(rng.standard_normal(cols) * 0.2, w_dt)
    with amp_emulation.emulated_amp(), gpu_rules.gpu_rules(pytest) as calls:
        y = ops.bias_dropout_residual_layer_norm(x, bias, res, w, b, epsilon=1e-12)
        g = ops.bias_gelu(x, bias)
    y_dt = x_dt if r_dt == x_dt else "float32"
    assert str(y.dtype) == f"paddle.{y_dt}" and str(g.dtype) == f"paddle.{x_dt}"
    assert calls == [(BDRLN, (x_dt, x_dt, y_dt, w_dt, w_dt)), ("pu_bias_gelu", (x_dt, x_dt))], calls
    (y.astype("float32") * paddle.to_tensor(dy.astype(np.float32))).sum().backward()
    xr, br = _f64(x), _f64(bias.astype(x_dt))  # the kernel saw the bias in x's dtype
    ry, rdx, rdb, rdres, rdw, rdlb = ref_ops.ln_reference(
        xr, br, _f64(res.astype(y_dt)), _f64(w), _f64(b), _f64(paddle.to_tensor(dy).astype(y_dt)), 0.0, None
    )
    _close("y", y, ry, y_dt if y_dt != "float32" else x_dt, "out")
    for name, t, r in (
        ("dx", x, rdx),
        ("dresidual", res, rdres),
        ("dbias", bias, rdb),
        ("dln_weight", w, rdw),
        ("dln_bias", b, rdlb),
    ):
        assert t.grad.dtype == t.dtype, name  # each gradient in its parameter's own dtype
        _close(name, t.grad, r, dtype, "grad")


def test_float64_mixes_are_refused_naming_both():
    from paddle_unpad import ops

    x, v = paddle.ones([2, 8]), paddle.ones([8], dtype="float64")
    with pytest.raises(
        TypeError,
        match=r"^paddle_unpad\.ops\.bias_dropout_residual_layer_norm: ln_weight dtype "
        r"float64 differs from x dtype float32 \(mixed dtypes are lined up",
    ):
        ops.bias_dropout_residual_layer_norm(x, None, x, v, None)
    with pytest.raises(
        TypeError,
        match=r"^paddle_unpad\.ops\.bias_gelu: bias dtype float64 differs from x dtype "
        r"float32",
    ):
        ops.bias_gelu(x, v)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_attention_without_a_kernel_size_takes_the_bucketed_path(dtype):
    """Head size 48 has no CUDA kernel: plain-Paddle attention in the AMP dtype, one warning."""
    from paddle_unpad import ops
    from paddle_unpad._runtime import warn as _warn
    from paddle_unpad.ops import FMHA_GPU_TOLERANCE
    from test_fmha import make_inputs, reference

    q, k, v, dout, cu = make_inputs([5, 0, 33, 1], 2, 48, seed=3)
    tq, tk, tv = (_leaf(a, dtype) for a in (q, k, v))
    ref = reference(*(_f64(t) for t in (tq, tk, tv)), cu, 1.0 / math.sqrt(48), 0.0, None, dout)
    with amp_emulation.emulated_amp(), gpu_rules.gpu_rules(pytest) as calls:
        with pytest.warns(RuntimeWarning, match="head sizes 32, 64, 128, not 48"):
            _warn.forget()
            out = ops.fmha(tq, tk, tv, paddle.to_tensor(cu), 33)
        (out.astype("float32") * paddle.to_tensor(dout)).sum().backward()
    assert calls == [] and out.dtype == tq.dtype
    tol = FMHA_GPU_TOLERANCE[dtype]
    for name, got, r, kind in (
        ("out", out, ref[0], "out"),
        ("dq", tq.grad, ref[1], "grad"),
        ("dk", tk.grad, ref[2], "grad"),
        ("dv", tv.grad, ref[3], "grad"),
    ):
        err = np.abs(_f64(got) - r).max() / np.abs(r).max()
        assert err <= tol[kind], f"{name}: {err:.2e}"

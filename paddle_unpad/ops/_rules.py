"""What each custom op accepts and how close it must come to its reference, as plain data.

``paddle_unpad.ops`` re-exports these tables, its argument checks read them, and every test
that compares an op with a reference takes its tolerance from here. This module imports
nothing, so tests/gpu load it by path on machines that have PyTorch but no Paddle.

Tolerances are the max abs error against a float64 reference, relative to the reference's
max abs value (per tensor), unless said otherwise.
"""

# fmha. "head_dim": the head sizes (q.shape[2]) with kernels; the C++ side states the same
# limits (kFmhaMaxHeadDim in kernels/cpu/fmha_cpu.h, kFmhaCudaHeadDims in
# kernels/cuda/fmha_cuda.cuh), and tests/test_fmha.py checks that they agree.
FMHA_SUPPORT = {
    "cpu": {"dtypes": ("float32",), "head_dim": range(1, 257)},
    "gpu": {"dtypes": ("float16", "bfloat16"), "head_dim": (32, 64, 128)},
}
FMHA_TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
# The CUDA kernels (fp16 / bf16 in, fp32 accumulation) against a reference fed the same
# rounded inputs, per output kind; "lse" (natural log) as an absolute error.
FMHA_GPU_TOLERANCE = {
    "float16": {"out": 2e-3, "grad": 4e-3, "lse": 5e-3},
    "bfloat16": {"out": 1.6e-2, "grad": 2.5e-2, "lse": 5e-3},
}

# bias_gelu and bias_dropout_residual_layer_norm. The GPU kernels compute in fp32 whatever
# the dtype; they exist only in builds with CUDA (see ops.ops_available()).
FUSED_OPS_SUPPORT = {
    "cpu": {"dtypes": ("float32",)},
    "gpu": {"dtypes": ("float16", "bfloat16", "float32")},
}
# float16 / bfloat16: the rounding of the result, against a reference fed the same rounded inputs.
FUSED_OPS_TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
# The CUDA kernels per output kind: "out" (y, and the fp32 mean / 1/std per row) and "grad"
# (input and vector gradients: the vector ones are column sums over every row).
FUSED_OPS_GPU_TOLERANCE = {
    "float32": {"out": 1e-5, "grad": 3e-5},
    "float16": {"out": 2e-3, "grad": 4e-3},
    "bfloat16": {"out": 1.6e-2, "grad": 2.5e-2},
}

# A converted model against the stock PaddleNLP model in the same training mode (same weights,
# same batch, no dropout; float32, or AMP O1 / O2 in float16 / bfloat16, float16 with loss
# scaling): the loss (absolute, relative to max(|loss|, 1)) and each parameter's gradient (max
# abs difference relative to the stock gradient's max abs). In AMP both models round to the
# AMP dtype, at different points -- the stock model after every op (linear, bias add, dropout,
# residual add), the fused operators once per block after computing it in float32 -- so the
# bounds are multiples of the dtype's unit roundoff u (2^-11, 2^-8): 8 u for the loss, 32 u
# for gradients, which pass through two encoder layers and back. float32: the same order of
# error as the converted model's CPU path (tests/test_convert.py), reductions in another order.
_UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
MODEL_TOLERANCE = {
    "float32": {"loss": 1e-5, "grad": 2e-5},
    **{dt: {"loss": 8 * u, "grad": 32 * u} for dt, u in _UNIT_ROUNDOFF.items()},
}

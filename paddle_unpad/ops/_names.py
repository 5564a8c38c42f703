"""The names of the custom operators, as plain data: the name each is registered under with
Paddle and the public name its messages start with.

custom_ops/paddle/op_names.h lists the same for the C++ side; tests/test_op_names.py checks
that the two agree. Like ``_rules``, this module imports nothing.
"""

# Public op (``paddle_unpad.ops.<op>``) -> the custom operator registered for it.
REGISTERED = {
    "fmha": "pu_fmha",
    "fmha_qkvpacked": "pu_fmha_qkv",
    "bias_gelu": "pu_bias_gelu",
    "bias_dropout_residual_layer_norm": "pu_bias_dropout_residual_layer_norm",
}

# Each op's name after ``paddle_unpad.``: its messages, Python's and the operator's, start
# with ``paddle_unpad.<this>: ``.
WHERE = {op: f"ops.{op}" for op in REGISTERED}

# How an operator's own message starts (Paddle wraps it in a C++ trace).
MESSAGE_PREFIXES = tuple(f"paddle_unpad.{where}: " for where in WHERE.values())

// The names of the custom operators, listed once for the C++ side: the name each is
// registered under with Paddle (what paddle_unpad/ops/_names.py calls) and the public name
// every one of its messages starts with, "paddle_unpad.ops.<op>: ", which the Python side
// looks for to raise the operator's line as written. tests/test_op_names.py checks that
// this listing and paddle_unpad/ops/_names.py agree.
#pragma once

// Registered names, one per public op: PU_OP_<OP> for paddle_unpad.ops.<op>.
#define PU_OP_FMHA pu_fmha
#define PU_OP_FMHA_QKVPACKED pu_fmha_qkv
#define PU_OP_BIAS_GELU pu_bias_gelu
#define PU_OP_BIAS_DROPOUT_RESIDUAL_LAYER_NORM pu_bias_dropout_residual_layer_norm

// PD_BUILD_OP stringizes its argument as written; one more macro level lets a PU_OP_*
// name expand to the registered identifier first.
#define PU_BUILD_OP(name) PD_BUILD_OP(name)
#define PU_BUILD_GRAD_OP(name) PD_BUILD_GRAD_OP(name)

namespace paddle_unpad {
namespace glue {

// The public names, each followed by ": " in the operator's messages.
constexpr const char* kFmha = "paddle_unpad.ops.fmha";
constexpr const char* kFmhaQkvpacked = "paddle_unpad.ops.fmha_qkvpacked";
constexpr const char* kBiasGelu = "paddle_unpad.ops.bias_gelu";
constexpr const char* kBdrln = "paddle_unpad.ops.bias_dropout_residual_layer_norm";

}  // namespace glue
}  // namespace paddle_unpad

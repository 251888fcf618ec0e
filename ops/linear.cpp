// Column- and row-parallel linear layers (Megatron-LM's two halves of a
// sharded MLP or attention block).
//
// column_parallel_linear: the input is replicated over the group, the weight
// and the output are sharded along the output features. Each rank's input
// gradient covers only its output slice, so the backward all-reduces it.
//
// row_parallel_linear: the input and the weight are sharded along the input
// features; the forward all-reduces the partial products and adds the
// (replicated) bias once. The output gradient is the same on every rank, so
// the backward needs no communication.

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "collectives.h"
#include "common.h"
#include "tp_ops.h"

namespace smp::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool hasBias(const std::optional<at::Tensor>& bias) {
  return bias.has_value() && bias->defined();
}

void checkLinear(const char* op, const at::Tensor& input,
                 const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias) {
  checkFloating(op, "input", input);
  checkSameDtypeAndDevice(op, "input", input, "weight", weight);
  TORCH_CHECK(input.dim() >= 1, op,
              ": input must have at least one dimension, got a 0-d tensor");
  TORCH_CHECK(weight.dim() == 2, op,
              ": weight must be 2-D [out_features, in_features], got shape ",
              weight.sym_sizes());
  TORCH_CHECK(input.sym_size(-1) == weight.sym_size(1), op,
              ": the input's last dimension (", input.sym_size(-1),
              ") must equal weight.size(1) (", weight.sym_size(1),
              "); input shape ", input.sym_sizes(), ", weight shape ",
              weight.sym_sizes());
  if (hasBias(bias)) {
    checkSameDtypeAndDevice(op, "input", input, "bias", *bias);
    TORCH_CHECK(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), op,
                ": bias must have shape [", weight.sym_size(0),
                "] (weight.size(0)), got shape ", bias->sym_sizes());
  }
}

// Gradients of y = x @ w^T + b for the local weight and bias.
void linearWeightGrads(AutogradContext* ctx, const at::Tensor& grad,
                       const at::Tensor& input, bool has_bias,
                       variable_list& grads) {
  if (ctx->needs_input_grad(1)) {
    grads[1] = weightGrad(grad, input);
  }
  if (has_bias && ctx->needs_input_grad(2)) {
    grads[2] = biasGrad(grad);
  }
}

class ColumnParallelLinearFn
    : public torch::autograd::Function<ColumnParallelLinearFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias,
                            const std::string& group_name) {
    ctx->save_for_backward({input, weight});
    ctx->saved_data["has_bias"] = hasBias(bias);
    ctx->saved_data["group_name"] = group_name;
    return columnParallelLinear(input, weight, bias, group_name);
  }

  static variable_list backward(AutogradContext* ctx,
                                const variable_list& grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& grad = grad_outputs[0];
    variable_list grads(4);
    if (ctx->needs_input_grad(0)) {
      // Each rank holds a slice of the output features: its input gradient
      // is partial.
      grads[0] = allReduce(grad.matmul(weight), "sum",
                           ctx->saved_data["group_name"].toStringRef());
    }
    linearWeightGrads(ctx, grad, input, ctx->saved_data["has_bias"].toBool(),
                      grads);
    return grads;
  }
};

class RowParallelLinearFn
    : public torch::autograd::Function<RowParallelLinearFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias,
                            const std::string& group_name) {
    ctx->save_for_backward({input, weight});
    ctx->saved_data["has_bias"] = hasBias(bias);
    return rowParallelLinear(input, weight, bias, group_name);
  }

  static variable_list backward(AutogradContext* ctx,
                                const variable_list& grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& grad = grad_outputs[0];  // the same on every rank
    variable_list grads(4);
    if (ctx->needs_input_grad(0)) {
      grads[0] = grad.matmul(weight);
    }
    linearWeightGrads(ctx, grad, input, ctx->saved_data["has_bias"].toBool(),
                      grads);
    return grads;
  }
};

// The Autograd kernels check their arguments before Function::apply builds
// any autograd state (a node, edges to the inputs' gradient accumulators):
// bad arguments throw with nothing half-built over them. The plain forwards
// check again, for calls that reach them without autograd.
at::Tensor columnParallelLinearAutograd(const at::Tensor& input,
                                        const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias,
                                        const std::string& group_name) {
  checkLinear("smp::column_parallel_linear", input, weight, bias);
  return ColumnParallelLinearFn::apply(input, weight, bias, group_name);
}

at::Tensor rowParallelLinearAutograd(const at::Tensor& input,
                                     const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias,
                                     const std::string& group_name) {
  checkLinear("smp::row_parallel_linear", input, weight, bias);
  return RowParallelLinearFn::apply(input, weight, bias, group_name);
}

}  // namespace

at::Tensor columnParallelLinear(const at::Tensor& input,
                                const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias,
                                const std::string& /*group_name*/) {
  // No communication in the forward.
  checkLinear("smp::column_parallel_linear", input, weight, bias);
  return ownOutput(at::linear(input, weight, bias).contiguous());
}

at::Tensor rowParallelLinear(const at::Tensor& input, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias,
                             const std::string& group_name) {
  checkLinear("smp::row_parallel_linear", input, weight, bias);
  at::Tensor out = allReduce(at::linear(input, weight), "sum", group_name);
  // The bias is replicated: add it once, after the reduction.
  return hasBias(bias) ? out.add(*bias) : ownOutput(out);
}

}  // namespace smp::ops

TORCH_LIBRARY_IMPL(smp, CPU, m) {
  m.impl("column_parallel_linear", &smp::ops::columnParallelLinear);
  m.impl("row_parallel_linear", &smp::ops::rowParallelLinear);
}

TORCH_LIBRARY_IMPL(smp, CUDA, m) {
  m.impl("column_parallel_linear", &smp::ops::columnParallelLinear);
  m.impl("row_parallel_linear", &smp::ops::rowParallelLinear);
}

TORCH_LIBRARY_IMPL(smp, Autograd, m) {
  m.impl("column_parallel_linear", &smp::ops::columnParallelLinearAutograd);
  m.impl("row_parallel_linear", &smp::ops::rowParallelLinearAutograd);
}

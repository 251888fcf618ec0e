// The schemas of smp's tensor-parallel ops. Kernels: CPU and CUDA (the plain
// forwards, used without autograd), Autograd (torch::autograd::Functions
// whose forward and backward call ATen ops and torch's functional
// collectives through the dispatcher), beside each op's code; fake kernels in
// python/smp/ops.py.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

TORCH_LIBRARY(smp, m) {
  // Fake (meta) kernels live in Python; this names the module to import.
  m.set_python_module("smp.ops");
  const std::vector<at::Tag> tags = {at::Tag::pt2_compliant_tag};
  m.def(
      "column_parallel_linear(Tensor input, Tensor weight, Tensor? bias, "
      "str group_name) -> Tensor",
      tags);
  m.def(
      "row_parallel_linear(Tensor input, Tensor weight, Tensor? bias, "
      "str group_name) -> Tensor",
      tags);
  m.def(
      "vocab_parallel_embedding(Tensor indices, Tensor weight, "
      "int vocab_start, int padding_idx, str group_name) -> Tensor",
      tags);
  m.def(
      "vocab_parallel_cross_entropy(Tensor logits, Tensor target, "
      "int vocab_start, int ignore_index, str group_name) -> Tensor",
      tags);
  m.def("tp_gather(Tensor input, int dim, str group_name) -> Tensor", tags);
  m.def(
      "tp_split(Tensor input, int dim, float grad_scale, str group_name) "
      "-> Tensor",
      tags);
  m.def("tp_reduce(Tensor input, str group_name) -> Tensor", tags);
  m.def("tp_copy(Tensor input, str group_name) -> Tensor", tags);
  m.def(
      "moe_dispatch(Tensor hidden, Tensor top_k_index, int num_experts, "
      "str group_name) -> (Tensor, Tensor, Tensor)",
      tags);
  m.def(
      "moe_combine(Tensor expert_out, Tensor top_k_weights, Tensor route, "
      "str group_name) -> (Tensor, Tensor)",
      tags);
}

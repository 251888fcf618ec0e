// The schemas of smp's context-parallel ops (a fragment of the smp library;
// kernels beside each op's code in cp_attention.cpp and cp_comm.cpp, fake
// kernels in python/smp/cp_ops.py).

#include <ATen/core/Tensor.h>
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(smp, m) {
  m.set_python_module("smp.cp_ops");
  const std::vector<at::Tag> tags = {at::Tag::pt2_compliant_tag};
  m.def(
      "cp_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, "
      "bool is_causal, float scale, str comm, str group_name) -> Tensor",
      tags);
  m.def(
      "cp_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? mask, "
      "bool is_causal, float scale, str comm, str group_name) "
      "-> (Tensor, Tensor)",
      tags);
  m.def(
      "cp_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, "
      "Tensor? mask, Tensor out, Tensor lse, bool is_causal, float scale, "
      "str comm, str group_name) -> (Tensor, Tensor, Tensor)",
      tags);
  m.def("cp_gather(Tensor input, int dim, str group_name) -> Tensor", tags);
  m.def("cp_reduce(Tensor input, str group_name) -> Tensor", tags);
  m.def(
      "cp_to_heads(Tensor input, int seq_dim, int head_dim, str group_name) "
      "-> Tensor",
      tags);
  m.def(
      "cp_to_seq(Tensor input, int seq_dim, int head_dim, str group_name) "
      "-> Tensor",
      tags);
}

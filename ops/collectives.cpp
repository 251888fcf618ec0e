#include "collectives.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "common.h"

namespace smp::ops {
namespace {

// The functional collectives are called boxed: their schemas changed across
// the supported torch versions (reduce_op and group_name are `str` in torch
// 2.11, `Any` in 2.15), and a boxed call with string IValues fits both.
c10::OperatorHandle functionalOp(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor callBoxed(const c10::OperatorHandle& op, torch::jit::Stack stack) {
  op.callBoxed(stack);
  TORCH_INTERNAL_ASSERT(stack.size() == 1 && stack[0].isTensor());
  return std::move(stack[0]).toTensor();
}

at::Tensor waitTensor(const at::Tensor& t) {
  static const c10::OperatorHandle op =
      functionalOp("_c10d_functional::wait_tensor");
  return callBoxed(op, {t});
}

}  // namespace

int64_t groupSize(const std::string& group_name) {
  return c10d::resolve_process_group(group_name)->getSize();
}

int64_t groupRank(const std::string& group_name) {
  return c10d::resolve_process_group(group_name)->getRank();
}

at::Tensor allReduce(const at::Tensor& input, const std::string& reduce_op,
                     const std::string& group_name) {
  static const c10::OperatorHandle op =
      functionalOp("_c10d_functional::all_reduce");
  return waitTensor(callBoxed(op, {input, reduce_op, group_name}));
}

at::Tensor allGather(const at::Tensor& input, int64_t dim,
                     const std::string& group_name) {
  static const c10::OperatorHandle op =
      functionalOp("_c10d_functional::all_gather_into_tensor");
  const int64_t size = groupSize(group_name);
  // all_gather_into_tensor stacks the ranks' tensors along dim 0: move `dim`
  // there and back, so the blocks land side by side along `dim`.
  at::Tensor moved = dim == 0 ? input : input.movedim(dim, 0);
  at::Tensor gathered =
      waitTensor(callBoxed(op, {moved.contiguous(), size, group_name}));
  if (dim == 0) {
    return gathered;
  }
  at::Tensor back = gathered.movedim(0, dim);
  // Where the dims it moves past are all of size 1, `back` is already in
  // order: the gathered tensor itself, reshaped (contiguous strides, no copy,
  // and not a view to autograd: see ownOutput).
  return back.is_contiguous()
             ? ownOutput(gathered.view_symint(back.sym_sizes()))
             : back.contiguous();
}

at::Tensor allToAll(const at::Tensor& input,
                    const std::vector<int64_t>& output_splits,
                    const std::vector<int64_t>& input_splits,
                    const std::string& group_name) {
  static const c10::OperatorHandle op =
      functionalOp("_c10d_functional::all_to_all_single");
  return waitTensor(callBoxed(
      op, {input.contiguous(), output_splits, input_splits, group_name}));
}

at::Tensor reduceScatter(const at::Tensor& input, int64_t dim,
                         const std::string& group_name) {
  static const c10::OperatorHandle op =
      functionalOp("_c10d_functional::reduce_scatter_tensor");
  const int64_t size = groupSize(group_name);
  // reduce_scatter_tensor scatters along dim 0: move `dim` there and back.
  at::Tensor moved = dim == 0 ? input : input.movedim(dim, 0);
  at::Tensor mine = waitTensor(callBoxed(
      op, {moved.contiguous(), std::string("sum"), size, group_name}));
  return dim == 0 ? mine : mine.movedim(0, dim).contiguous();
}

at::Tensor allToAll(const at::Tensor& input, const std::string& group_name) {
  static const c10::OperatorHandle op =
      functionalOp("_c10d_functional::all_to_all_single");
  const int64_t size = groupSize(group_name);
  const c10::SymInt block = input.sym_size(0) / size;
  std::vector<c10::SymInt> splits(size, block);
  return waitTensor(callBoxed(op, {input.contiguous(), c10::IValue(splits),
                                   c10::IValue(splits), group_name}));
}

}  // namespace smp::ops

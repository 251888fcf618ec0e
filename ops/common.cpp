#include "common.h"

#include <ATen/ATen.h>

namespace smp::ops {

int64_t wrapDim(const char* op, int64_t dim, const at::Tensor& t) {
  const int64_t ndim = t.dim();
  TORCH_CHECK_INDEX(ndim > 0 && dim >= -ndim && dim < ndim, op, ": dim ", dim,
                    " is out of range for a tensor of ", ndim,
                    " dimension(s) (shape ", t.sym_sizes(),
                    "); expected a dim in [", -ndim, ", ", ndim - 1, "]");
  return dim < 0 ? dim + ndim : dim;
}

void checkFloating(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": ", name,
              " must be a floating-point tensor (float32, float64, bfloat16 "
              "or float16), got ",
              t.scalar_type());
}

void checkSameDtypeAndDevice(const char* op, const char* a_name,
                             const at::Tensor& a, const char* b_name,
                             const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": ", b_name,
              " has dtype ", b.scalar_type(), " but ", a_name, " has dtype ",
              a.scalar_type(), "; they must match");
  TORCH_CHECK(a.device() == b.device(), op, ": ", b_name, " is on ", b.device(),
              " but ", a_name, " is on ", a.device(),
              "; they must be on the same device");
}

LocalIds localIds(const at::Tensor& ids, int64_t start,
                  const c10::SymInt& count) {
  at::Tensor shifted = ids - start;
  at::Tensor outside = shifted.lt(0).logical_or(shifted.ge(count));
  return {shifted.masked_fill(outside, 0), outside};
}

at::Tensor ownOutput(const at::Tensor& t) {
  // _unsafe_view is at::matmul's way out of the same problem: it is not a
  // view op to autograd.
  return t.is_view() ? at::_unsafe_view_symint(t, t.sym_sizes()) : t;
}

at::Tensor weightGrad(const at::Tensor& grad, const at::Tensor& input) {
  at::Tensor g = grad.reshape_symint({-1, grad.sym_size(-1)});
  at::Tensor x = input.reshape_symint({-1, input.sym_size(-1)});
  return g.t().mm(x);
}

at::Tensor biasGrad(const at::Tensor& grad) {
  return grad.reshape_symint({-1, grad.sym_size(-1)}).sum(0);
}

}  // namespace smp::ops

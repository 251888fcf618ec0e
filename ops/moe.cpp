// Expert parallelism's token exchange (mixture of experts): moe_dispatch
// sends every (token, chosen expert) pair to the rank holding that expert,
// moe_combine brings the experts' outputs back and sums each token's top-k of
// them weighted by its router weights. Dropless: every pair travels, so the
// uneven all-to-alls carry exactly the routed tokens and the result equals one
// process running every expert.
//
// The group's ranks hold consecutive blocks of the experts: rank r holds
// experts [r * local, (r + 1) * local), local = num_experts / group size.
// A route tensor (int64, on the tokens' device) carries what both ops and
// their backwards need: send counts [E] (pairs this rank sends to each
// expert), receive counts [E] (pairs each source rank sends to each of this
// rank's experts, source-major), and the stable sort of the flat (token, k)
// slots by expert [N * k]. Only the routed tokens' count is data dependent.

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "collectives.h"
#include "common.h"
#include "tp_ops.h"

namespace smp::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What a route says, with the counts on the host (the all-to-alls' splits).
struct Route {
  int64_t ranks = 0;
  int64_t local = 0;          // experts per rank
  std::vector<int64_t> send;  // [E]: pairs sent to each expert
  std::vector<int64_t> recv;  // [ranks * local]: source-major
  at::Tensor perm;            // [N * k]: sorted position -> flat slot

  // Rows this rank sends to (or receives from) each rank.
  std::vector<int64_t> sendSplits() const { return perRank(send); }
  std::vector<int64_t> recvSplits() const { return perRank(recv); }

  std::vector<int64_t> perRank(const std::vector<int64_t>& counts) const {
    std::vector<int64_t> splits(ranks, 0);
    for (int64_t r = 0; r < ranks; ++r) {
      for (int64_t e = 0; e < local; ++e) {
        splits[r] += counts[r * local + e];
      }
    }
    return splits;
  }

  // Received rows arrive source-major (within a source, by expert); the
  // experts want them expert-major. order[i] = the received row at expert-
  // major position i.
  at::Tensor expertOrder(const at::Device& device) const {
    std::vector<int64_t> start(ranks * local, 0);
    int64_t offset = 0;
    for (int64_t i = 0; i < ranks * local; ++i) {
      start[i] = offset;
      offset += recv[i];
    }
    std::vector<int64_t> order;
    order.reserve(offset);
    for (int64_t e = 0; e < local; ++e) {
      for (int64_t r = 0; r < ranks; ++r) {
        for (int64_t j = 0; j < recv[r * local + e]; ++j) {
          order.push_back(start[r * local + e] + j);
        }
      }
    }
    return at::tensor(order, at::kLong).to(device);
  }
};

std::vector<int64_t> toVector(const at::Tensor& t) {
  const at::Tensor host = t.to(at::kCPU, at::kLong).contiguous();
  const int64_t* data = host.const_data_ptr<int64_t>();
  return std::vector<int64_t>(data, data + host.numel());
}

Route readRoute(const at::Tensor& route, int64_t slots,
                const std::string& group_name) {
  const int64_t ranks = groupSize(group_name);
  const int64_t experts = (route.numel() - slots) / 2;
  TORCH_CHECK(route.dim() == 1 && route.scalar_type() == at::kLong &&
                  experts > 0 && 2 * experts + slots == route.numel() &&
                  experts % ranks == 0,
              "smp::moe_combine: route must be the int64 route moe_dispatch "
              "returned for these tokens (2 x experts + tokens x top-k = ",
              route.numel(), " entries, ", slots, " slots), got shape ",
              route.sizes(), " of ", route.scalar_type());
  Route out;
  out.ranks = ranks;
  out.local = experts / ranks;
  const std::vector<int64_t> counts = toVector(route.narrow(0, 0, 2 * experts));
  out.send.assign(counts.begin(), counts.begin() + experts);
  out.recv.assign(counts.begin() + experts, counts.end());
  out.perm = route.narrow(0, 2 * experts, slots);
  int64_t sent = 0;
  for (const int64_t c : out.send) {
    sent += c;
  }
  TORCH_CHECK(sent == slots,
              "smp::moe_combine: route must be the int64 route moe_dispatch "
              "returned for these tokens: it sends ",
              sent, " (token, expert) pairs, the weights have ", slots);
  return out;
}

int64_t received(const Route& route) {
  int64_t total = 0;
  for (const int64_t c : route.recv) {
    total += c;
  }
  return total;
}

// rows[order[i]] = x[i]: expert-major rows back to the order they came in.
at::Tensor unorder(const at::Tensor& x, const at::Tensor& order) {
  return at::empty_like(x).index_copy_(0, order, x);
}

void checkDispatch(const at::Tensor& hidden, const at::Tensor& top_k_index,
                   int64_t num_experts, const std::string& group_name) {
  const char* op = "smp::moe_dispatch";
  checkFloating(op, "hidden", hidden);
  TORCH_CHECK(hidden.dim() == 2, op,
              ": hidden must be [tokens, hidden], got shape ", hidden.sizes());
  TORCH_CHECK(top_k_index.dim() == 2 && top_k_index.size(0) == hidden.size(0) &&
                  !at::isFloatingType(top_k_index.scalar_type()),
              op,
              ": top_k_index must be integer [tokens, top_k] with the "
              "hidden states' tokens, got shape ",
              top_k_index.sizes(), " of ", top_k_index.scalar_type(),
              " for hidden ", hidden.sizes());
  const int64_t ranks = groupSize(group_name);
  TORCH_CHECK(num_experts > 0 && num_experts % ranks == 0, op, ": ",
              num_experts, " experts do not divide among the group's ", ranks,
              " ranks; choose an expert parallel degree that divides the "
              "number of experts");
  if (top_k_index.numel() > 0) {
    const int64_t low = top_k_index.min().item<int64_t>();
    const int64_t high = top_k_index.max().item<int64_t>();
    TORCH_CHECK(low >= 0 && high < num_experts, op,
                ": expert ids must be in [0, ", num_experts, "), got ids in [",
                low, ", ", high, "]");
  }
}

struct Dispatched {
  at::Tensor routed;
  at::Tensor tokensPerExpert;
  at::Tensor route;
};

Dispatched dispatch(const at::Tensor& hidden, const at::Tensor& top_k_index,
                    int64_t num_experts, const std::string& group_name) {
  checkDispatch(hidden, top_k_index, num_experts, group_name);
  const int64_t ranks = groupSize(group_name);
  const int64_t top_k = top_k_index.size(1);
  const at::Tensor flat = top_k_index.reshape({-1}).to(at::kLong);
  // Stable: pairs of one expert keep their token order, as in one process.
  const at::Tensor perm = std::get<1>(flat.sort(/*stable=*/true, 0, false));
  const at::Tensor send = at::bincount(flat, {}, num_experts).to(at::kLong);
  const std::vector<int64_t> equal(ranks, num_experts / ranks);
  const at::Tensor recv = allToAll(send, equal, equal, group_name);
  Route route;
  route.ranks = ranks;
  route.local = num_experts / ranks;
  route.send = toVector(send);
  route.recv = toVector(recv);
  route.perm = perm;
  const at::Tensor tokens = hidden.index_select(0, perm.div(top_k, "floor"));
  const at::Tensor received =
      allToAll(tokens, route.recvSplits(), route.sendSplits(), group_name);
  const at::Tensor order = route.expertOrder(hidden.device());
  Dispatched out;
  out.routed = received.index_select(0, order);
  out.tokensPerExpert = recv.view({ranks, route.local}).sum(0);
  out.route = at::cat({send, recv, perm});
  return out;
}

// The pairs' expert outputs back at their tokens, [N * k, H] token-major.
at::Tensor gatherBack(const at::Tensor& expert_out, const Route& route,
                      const at::Tensor& order, int64_t slots,
                      const std::string& group_name) {
  const at::Tensor back =
      allToAll(unorder(expert_out, order), route.sendSplits(),
               route.recvSplits(), group_name);
  return at::empty({slots, expert_out.size(1)}, expert_out.options())
      .index_copy_(0, route.perm, back);
}

// sum_j weights[n, j] * y[n, j] in the weights' and outputs' promoted dtype.
at::Tensor weightedSum(const at::Tensor& y, const at::Tensor& weights) {
  const int64_t n = weights.size(0);
  const int64_t k = weights.size(1);
  const at::ScalarType acc =
      at::promote_types(y.scalar_type(), weights.scalar_type());
  return (y.view({n, k, y.size(1)}).to(acc) * weights.to(acc).unsqueeze(-1))
      .sum(1)
      .to(y.scalar_type());
}

void checkCombine(const at::Tensor& expert_out, const at::Tensor& weights) {
  const char* op = "smp::moe_combine";
  checkFloating(op, "expert_out", expert_out);
  checkFloating(op, "top_k_weights", weights);
  TORCH_CHECK(expert_out.dim() == 2, op,
              ": expert_out must be [routed tokens, hidden], got shape ",
              expert_out.sizes());
  TORCH_CHECK(weights.dim() == 2, op,
              ": top_k_weights must be [tokens, top_k], got shape ",
              weights.sizes());
}

// The forwards go through the dispatcher below autograd, not straight to the
// kernels: under FakeTensorMode (torch.export, torch.compile) that reaches
// the fake kernels, which know the routed count is data dependent.
std::tuple<at::Tensor, at::Tensor, at::Tensor> redispatchDispatch(
    const at::Tensor& hidden, const at::Tensor& top_k_index,
    int64_t num_experts, const std::string& group_name) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("smp::moe_dispatch", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, int64_t,
              const std::string&)>();
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(hidden, top_k_index, num_experts, group_name);
}

std::tuple<at::Tensor, at::Tensor> redispatchCombine(
    const at::Tensor& expert_out, const at::Tensor& weights,
    const at::Tensor& route, const std::string& group_name) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("smp::moe_combine", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(
                                 const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const std::string&)>();
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(expert_out, weights, route, group_name);
}

class MoeDispatchFn : public torch::autograd::Function<MoeDispatchFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden,
                               const at::Tensor& top_k_index,
                               int64_t num_experts,
                               const std::string& group_name) {
    auto [routed, counts, route] =
        redispatchDispatch(hidden, top_k_index, num_experts, group_name);
    ctx->saved_data["group_name"] = group_name;
    ctx->saved_data["tokens"] = hidden.size(0);
    ctx->saved_data["top_k"] = top_k_index.size(1);
    ctx->save_for_backward({route});
    ctx->mark_non_differentiable({counts, route});
    return {routed, counts, route};
  }

  static variable_list backward(AutogradContext* ctx,
                                const variable_list& grad_outputs) {
    const std::string group_name = ctx->saved_data["group_name"].toStringRef();
    const int64_t tokens = ctx->saved_data["tokens"].toInt();
    const int64_t top_k = ctx->saved_data["top_k"].toInt();
    const at::Tensor route_tensor = ctx->get_saved_variables()[0];
    const Route route = readRoute(route_tensor, tokens * top_k, group_name);
    const at::Tensor& grad = grad_outputs[0];
    const at::Tensor order = route.expertOrder(grad.device());
    // Each pair's gradient back to its rank, then summed into its token.
    const at::Tensor back =
        allToAll(unorder(grad.contiguous(), order), route.sendSplits(),
                 route.recvSplits(), group_name);
    at::Tensor grad_hidden =
        at::zeros({tokens, grad.size(1)}, grad.options())
            .index_add_(0, route.perm.div(top_k, "floor"), back);
    return {grad_hidden, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class MoeCombineFn : public torch::autograd::Function<MoeCombineFn> {
 public:
  static variable_list forward(AutogradContext* ctx,
                               const at::Tensor& expert_out,
                               const at::Tensor& weights,
                               const at::Tensor& route,
                               const std::string& group_name) {
    auto [out, gathered] =
        redispatchCombine(expert_out, weights, route, group_name);
    ctx->saved_data["group_name"] = group_name;
    ctx->save_for_backward({gathered, weights, route});
    ctx->mark_non_differentiable({gathered});
    return {out, gathered};
  }

  static variable_list backward(AutogradContext* ctx,
                                const variable_list& grad_outputs) {
    const std::string group_name = ctx->saved_data["group_name"].toStringRef();
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& y = saved[0];
    const at::Tensor& weights = saved[1];
    const int64_t n = weights.size(0);
    const int64_t k = weights.size(1);
    const Route route = readRoute(saved[2], n * k, group_name);
    const at::Tensor& grad = grad_outputs[0];
    const at::ScalarType acc =
        at::promote_types(y.scalar_type(), weights.scalar_type());
    const at::Tensor grad_acc = grad.to(acc).unsqueeze(1);  // [N, 1, H]
    at::Tensor grad_weights;
    if (ctx->needs_input_grad(1)) {
      grad_weights = (y.view({n, k, y.size(1)}).to(acc) * grad_acc)
                         .sum(-1)
                         .to(weights.scalar_type());
    }
    at::Tensor grad_out;
    if (ctx->needs_input_grad(0)) {
      const at::Tensor grad_y = (weights.to(acc).unsqueeze(-1) * grad_acc)
                                    .to(y.scalar_type())
                                    .reshape({n * k, y.size(1)});
      const at::Tensor sent =
          allToAll(grad_y.index_select(0, route.perm), route.recvSplits(),
                   route.sendSplits(), group_name);
      grad_out = sent.index_select(0, route.expertOrder(grad.device()));
    }
    return {grad_out, grad_weights, at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> moeDispatchAutograd(
    const at::Tensor& hidden, const at::Tensor& top_k_index,
    int64_t num_experts, const std::string& group_name) {
  variable_list out =
      MoeDispatchFn::apply(hidden, top_k_index, num_experts, group_name);
  return {out[0], out[1], out[2]};
}

std::tuple<at::Tensor, at::Tensor> moeCombineAutograd(
    const at::Tensor& expert_out, const at::Tensor& weights,
    const at::Tensor& route, const std::string& group_name) {
  checkCombine(expert_out, weights);
  variable_list out =
      MoeCombineFn::apply(expert_out, weights, route, group_name);
  return {out[0], out[1]};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> moeDispatch(
    const at::Tensor& hidden, const at::Tensor& top_k_index,
    int64_t num_experts, const std::string& group_name) {
  Dispatched d = dispatch(hidden, top_k_index, num_experts, group_name);
  return {d.routed, d.tokensPerExpert, d.route};
}

std::tuple<at::Tensor, at::Tensor> moeCombine(const at::Tensor& expert_out,
                                              const at::Tensor& weights,
                                              const at::Tensor& route,
                                              const std::string& group_name) {
  checkCombine(expert_out, weights);
  const int64_t slots = weights.numel();
  const Route parsed = readRoute(route, slots, group_name);
  TORCH_CHECK(expert_out.size(0) == received(parsed),
              "smp::moe_combine: expert_out must have one row per pair "
              "moe_dispatch routed to this rank (",
              received(parsed), "), got ", expert_out.size(0));
  const at::Tensor order = parsed.expertOrder(expert_out.device());
  at::Tensor gathered =
      gatherBack(expert_out.contiguous(), parsed, order, slots, group_name);
  return {weightedSum(gathered, weights), gathered};
}

}  // namespace smp::ops

TORCH_LIBRARY_IMPL(smp, CPU, m) {
  m.impl("moe_dispatch", &smp::ops::moeDispatch);
  m.impl("moe_combine", &smp::ops::moeCombine);
}

TORCH_LIBRARY_IMPL(smp, CUDA, m) {
  m.impl("moe_dispatch", &smp::ops::moeDispatch);
  m.impl("moe_combine", &smp::ops::moeCombine);
}

TORCH_LIBRARY_IMPL(smp, Autograd, m) {
  m.impl("moe_dispatch", &smp::ops::moeDispatchAutograd);
  m.impl("moe_combine", &smp::ops::moeCombineAutograd);
}

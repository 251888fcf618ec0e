// Attention over a sequence cut between the ranks of a context-parallel group
// (the load-balanced layout of cp_layout.h), without ever holding the whole
// sequence's keys and values at once ("p2p", ring attention) or holding them
// only inside the op ("all_gather").
//
// q [B, H, Lq, D], k and v [B, Hkv, Lq, D] (Hkv divides H: grouped-query
// attention) hold this rank's two segments of the sequence. Each block of
// keys and values (every rank's, in turn) is attended to in float32 (float64
// inputs in float64: accType); the
// blocks' outputs are merged by their log-sum-exps (the online softmax), so
// the result equals attention over the whole sequence. A mask, where given,
// covers this rank's rows against the whole sequence's columns: bool (true:
// attend) or additive, broadcastable to [B, H, Lq, S]. With is_causal the
// rows and columns are compared by their positions in the sequence, and the
// pairs of chunks that are wholly masked are skipped.
//
// "p2p": keys and values travel around the ring (send to the next rank,
// receive from the previous), the next block in flight while this one is
// computed; in the backward their gradients travel with them, each rank
// adding its share, and arrive home after a last hop. "all_gather": every
// block gathered up front; the gradients reduce-scattered home.

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <limits>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "collectives.h"
#include "common.h"
#include "cp_layout.h"

namespace smp::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kInf = std::numeric_limits<double>::infinity();
// "local": this rank's whole sequence alone, no group (what Ulysses attends
// to after its all-to-all): the same fused kernel and mask simplification.
const char* const kLocal = "local";
constexpr int kKvTag = 7001;    // keys and values around the ring
constexpr int kGradTag = 7002;  // their gradients, in flight at the same time

// What every block of one call shares.
struct Call {
  at::Tensor q;     // [B, H, Lq, D], this rank's rows
  at::Tensor mask;  // undefined, or this rank's rows x all columns
  bool causal;
  double scale;
  int64_t rank;
  int64_t size;
  int64_t chunk;  // rows per segment: Lq / 2
};

// The rows and columns of one pair of chunks: q's segment `qs` against the
// segment `ks` of the keys rank `src` holds.
struct Pair {
  int64_t qs, ks, src;
};

// Whether a pair is computed at all, and whether causally on its diagonal.
enum class PairKind { kSkip, kFull, kDiagonal };

PairKind kindOf(const Call& c, const Pair& p) {
  if (!c.causal) {
    return PairKind::kFull;
  }
  const int64_t row = chunkOf(c.rank, p.qs, c.size);
  const int64_t col = chunkOf(p.src, p.ks, c.size);
  return col > row ? PairKind::kSkip
                   : (col == row ? PairKind::kDiagonal : PairKind::kFull);
}

// The mask's block for a pair (undefined without a mask).
at::Tensor maskBlock(const Call& c, const Pair& p) {
  if (!c.mask.defined()) {
    return c.mask;
  }
  at::Tensor m = c.mask;
  if (m.size(-2) != 1) {
    m = m.narrow(-2, p.qs * c.chunk, c.chunk);
  }
  if (m.size(-1) != 1) {
    m = m.narrow(-1, chunkOf(p.src, p.ks, c.size) * c.chunk, c.chunk);
  }
  return m;
}

// A block the mask hides entirely contributes nothing: skipped like a causal
// pair above the diagonal.
bool hidden(const at::Tensor& mask) {
  if (!mask.defined()) {
    return false;
  }
  at::Tensor open = mask.scalar_type() == at::kBool ? mask : mask.gt(-kInf);
  return !open.any().item<bool>();
}

// A mask block that says no more than the pair's kind: dropped (undefined),
// the pair then causal where the block is exactly the causal triangle. A
// captured graph of a Hugging Face model holds the causal mask materialized
// (transformers builds it whenever it is traced, where eagerly it passes
// is_causal), so without this every pair carried an [L, L] mask and missed
// the fused kernel. A block with padding or a window stays as it is.
void simplify(at::Tensor& mask, PairKind& kind) {
  if (!mask.defined() || mask.scalar_type() != at::kBool) {
    return;
  }
  if (mask.all().item<bool>()) {
    mask = at::Tensor();
    return;
  }
  const int64_t n = mask.size(-1);
  if (kind != PairKind::kSkip && mask.size(-2) == n) {
    at::Tensor below = at::ones({n, n}, mask.options()).tril();
    if (mask.eq(below).all().item<bool>()) {
      mask = at::Tensor();
      kind = PairKind::kDiagonal;
    }
  }
}

// The type the blocks are computed and merged in: float32, or float64 for
// float64 inputs.
at::ScalarType accType(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Grouped heads: q's H heads as [B, Hkv, g * L, D] so that a matmul against
// [B, Hkv, ., .] pairs every head with its key/value head (h -> h / g, as
// repeat_kv and enable_gqa do).
at::Tensor grouped(const at::Tensor& t, int64_t kv_heads) {
  return t.reshape({t.size(0), kv_heads, -1, t.size(-1)});
}

at::Tensor ungrouped(const at::Tensor& t, int64_t heads) {
  return t.reshape({t.size(0), heads, -1, t.size(-1)});
}

// Scaled, masked scores of q rows [B, H, L, D] against k [B, Hkv, L, D], in
// accType: [B, H, L, L].
at::Tensor scores(const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& mask, PairKind kind, double scale) {
  const int64_t heads = q.size(1);
  at::Tensor s = ungrouped(grouped(q.to(accType(q)), k.size(1))
                               .matmul(k.to(accType(k)).transpose(-2, -1)),
                           heads)
                     .mul_(scale);
  if (kind == PairKind::kDiagonal) {
    const int64_t n = s.size(-1);
    at::Tensor above = at::ones({n, n}, s.options().dtype(at::kBool)).triu(1);
    s.masked_fill_(above, -kInf);
  }
  if (mask.defined()) {
    if (mask.scalar_type() == at::kBool) {
      s.masked_fill_(mask.logical_not(), -kInf);
    } else {
      s.add_(mask.to(accType(k)));
    }
  }
  return s;
}

// out [B, H, L, D] and lse [B, H, L] (accType) of the rows against one block,
// merged into the running (out, lse) of those rows in place.
// Whether a pair runs on ATen's fused CPU flash-attention kernel (blocked, no
// [L, L] scores in memory): float32 on the CPU without a mask, where every
// row of the pair sees at least one column (a full pair, or a causal diagonal
// one), so the kernel's log-sum-exp is finite and merges as the blocks' do.
// Measured: the materialized form made cp=2 1.5-1.7x slower than data
// parallelism on the same tokens per rank (docs/benchmarks.md, "Context
// parallelism"). float64 keeps the exact form (the tests' reference), and
// reduced precision too: the kernel would round each block's output to bf16
// before the merge.
bool fused(const at::Tensor& q, const at::Tensor& mask) {
  return q.device().is_cpu() && q.scalar_type() == at::kFloat &&
         !mask.defined();
}

// k or v [B, Hkv, L, D] with each key/value head repeated for its query heads
// (the fused kernel pairs heads one to one): [B, H, L, D].
at::Tensor perQueryHead(const at::Tensor& t, int64_t heads) {
  const int64_t groups = heads / t.size(1);
  return groups == 1 ? t : t.repeat_interleave(groups, 1);
}

// The sum over each key/value head's query heads of a [B, H, L, D] gradient.
at::Tensor perKvHead(const at::Tensor& t, int64_t kv_heads) {
  if (t.size(1) == kv_heads) {
    return t;
  }
  return t.reshape({t.size(0), kv_heads, -1, t.size(2), t.size(3)}).sum(2);
}

// One pair's output [B, H, L, D] and log-sum-exp [B, H, L], both in accType.
std::tuple<at::Tensor, at::Tensor> attendBlock(const at::Tensor& q,
                                               const at::Tensor& k,
                                               const at::Tensor& v,
                                               const at::Tensor& mask,
                                               PairKind kind, double scale) {
  if (fused(q, mask)) {
    const int64_t heads = q.size(1);
    auto [o, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
        q, perQueryHead(k, heads), perQueryHead(v, heads), 0.0,
        kind == PairKind::kDiagonal, std::nullopt, scale);
    return {o, lse};
  }
  at::Tensor s = scores(q, k, mask, kind, scale);
  at::Tensor m = s.amax(-1, true);
  m.masked_fill_(m.eq(-kInf), 0.0);  // a row the block wholly masks
  at::Tensor p = s.sub_(m).exp_();
  at::Tensor l = p.sum(-1, true);
  at::Tensor o =
      ungrouped(grouped(p, k.size(1)).matmul(v.to(accType(v))), q.size(1))
          .div_(l.masked_fill(l.eq(0.0), 1.0));
  return {o, m.add_(l.log()).squeeze(-1)};  // lse -inf: nothing seen
}

void attendAndMerge(const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, const at::Tensor& mask, PairKind kind,
                    double scale, at::Tensor out, at::Tensor lse) {
  auto [o, block_lse] = attendBlock(q, k, v, mask, kind, scale);
  at::Tensor merged = at::logaddexp(lse, block_lse);
  at::Tensor base = merged.masked_fill(merged.eq(-kInf), 0.0);
  at::Tensor keep = (lse - base).exp_().unsqueeze(-1);
  at::Tensor add = (block_lse - base).exp_().unsqueeze(-1);
  out.mul_(keep).add_(o.mul_(add));
  lse.copy_(merged);
}

// Gradients of one block from the final out's log-sum-exp `lse` (+inf where
// nothing was seen) and delta = rowsum(dout * out): dq of the rows added in
// place, and dk, dv of the block added in place.
// With the fused kernel, the pair's gradients come from its backward given
// the whole output `out` and its final log-sum-exp: its P = exp(S - lse) and
// delta = rowsum(dout * out) are then the whole attention's, as here.
void blockBackward(const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& mask, PairKind kind,
                   double scale, const at::Tensor& dout, const at::Tensor& out,
                   const at::Tensor& lse, const at::Tensor& delta,
                   at::Tensor dq, at::Tensor dk, at::Tensor dv) {
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  if (fused(q, mask)) {
    auto [dqb, dkb, dvb] =
        at::_scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, perQueryHead(k, heads), perQueryHead(v, heads), out, lse,
            0.0, kind == PairKind::kDiagonal, std::nullopt, scale);
    dq.add_(dqb);
    dk.add_(perKvHead(dkb, kv_heads));
    dv.add_(perKvHead(dvb, kv_heads));
    return;
  }
  at::Tensor p = scores(q, k, mask, kind, scale).sub_(lse.unsqueeze(-1)).exp_();
  at::Tensor pg = grouped(p, kv_heads);
  at::Tensor dout_g = grouped(dout, kv_heads);
  dv.add_(pg.transpose(-2, -1).matmul(dout_g));
  at::Tensor dp =
      ungrouped(dout_g.matmul(v.to(accType(v)).transpose(-2, -1)), heads);
  at::Tensor ds = p.mul_(dp.sub_(delta.unsqueeze(-1)));
  at::Tensor ds_g = grouped(ds, kv_heads);
  dq.add_(ungrouped(ds_g.matmul(k.to(accType(k))), heads).mul_(scale));
  dk.add_(ds_g.transpose(-2, -1)
              .matmul(grouped(q.to(accType(q)), kv_heads))
              .mul_(scale));
}

// The rows of segment `s` of a [B, H, Lq, ...] tensor (a view).
at::Tensor rows(const at::Tensor& t, int64_t segment, int64_t chunk) {
  return t.narrow(2, segment * chunk, chunk);
}

// Tensors in flight to the next rank and from the previous one.
struct Exchange {
  std::vector<at::Tensor> received;
  c10::intrusive_ptr<c10d::Work> work;

  void wait() {
    if (work) {
      work->wait();
    }
  }
};

Exchange startExchange(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                       const std::vector<at::Tensor>& sent, int tag) {
  const int rank = pg->getRank(), size = pg->getSize();
  Exchange ex;
  const c10::DeviceType device = sent.front().device().type();
  pg->startCoalescing(device);
  for (const at::Tensor& t : sent) {
    std::vector<at::Tensor> one = {t.contiguous()};
    pg->send(one, (rank + 1) % size, tag);
  }
  for (const at::Tensor& t : sent) {
    ex.received.push_back(at::empty_like(t, at::MemoryFormat::Contiguous));
    std::vector<at::Tensor> one = {ex.received.back()};
    pg->recv(one, (rank + size - 1) % size, tag);
  }
  ex.work = pg->endCoalescing(device);
  return ex;
}

// Runs `visit(src, k, v)` over every rank's block of keys and values: this
// rank's first, then around the ring (or from one all_gather).
template <typename Visit>
void forEachBlock(const std::string& comm, const std::string& group_name,
                  const at::Tensor& k, const at::Tensor& v, Visit&& visit) {
  if (comm == kLocal) {
    visit(0, k, v);
    return;
  }
  auto pg = c10d::resolve_process_group(group_name);
  const int64_t rank = pg->getRank(), size = pg->getSize();
  if (comm == "all_gather") {
    at::Tensor ks = allGather(k, 2, group_name),
               vs = allGather(v, 2, group_name);
    const int64_t n = k.size(2);
    for (int64_t step = 0; step < size; ++step) {
      const int64_t src = (rank + size - step) % size;
      visit(src, ks.narrow(2, src * n, n), vs.narrow(2, src * n, n));
    }
    return;
  }
  at::Tensor kc = k.contiguous(), vc = v.contiguous();
  for (int64_t step = 0; step < size; ++step) {
    Exchange next;
    if (step + 1 < size) {
      next = startExchange(pg, {kc, vc}, kKvTag);
    }
    visit((rank + size - step) % size, kc, vc);
    if (step + 1 < size) {
      next.wait();
      kc = next.received[0];
      vc = next.received[1];
    }
  }
}

// The mask as the call's kind where it says no more than causality: a bool
// mask that is exactly "column <= row" by the rows' positions (what a traced
// Hugging Face model materializes for is_causal, see simplify) makes the call
// causal without a mask, checked once here rather than per pair and pass.
void causalFromMask(Call& c) {
  const at::Tensor& m = c.mask;
  if (!m.defined() || m.scalar_type() != at::kBool || m.dim() < 2 ||
      m.size(-2) != 2 * c.chunk || m.size(-1) != 2 * c.chunk * c.size) {
    return;
  }
  const at::TensorOptions index = m.options().dtype(at::kLong);
  at::Tensor rows =
      at::cat({at::arange(chunkOf(c.rank, 0, c.size) * c.chunk,
                          (chunkOf(c.rank, 0, c.size) + 1) * c.chunk, index),
               at::arange(chunkOf(c.rank, 1, c.size) * c.chunk,
                          (chunkOf(c.rank, 1, c.size) + 1) * c.chunk, index)});
  at::Tensor causal =
      at::arange(m.size(-1), index).unsqueeze(0).le(rows.unsqueeze(1));
  if (m.eq(causal).all().item<bool>()) {
    c.mask = at::Tensor();
    c.causal = true;
  }
}

Call callOf(const at::Tensor& q, const std::optional<at::Tensor>& mask,
            bool is_causal, double scale, const std::string& comm,
            const std::string& group_name) {
  const bool local = comm == kLocal;
  Call c{q,
         mask.has_value() ? *mask : at::Tensor(),
         is_causal,
         scale,
         local ? 0 : groupRank(group_name),
         local ? 1 : groupSize(group_name),
         q.size(2) / 2};
  causalFromMask(c);
  return c;
}

void checkArgs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const std::optional<at::Tensor>& mask, const std::string& comm) {
  const char* op = "smp::cp_attention";
  checkFloating(op, "q", q);
  checkSameDtypeAndDevice(op, "q", q, "k", k);
  checkSameDtypeAndDevice(op, "q", q, "v", v);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
              ": q, k and v must be [batch, heads, sequence, head_dim], got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2) && k.size(3) == q.size(3),
              op, ": k and v ", k.sizes(), " do not match q ", q.sizes());
  TORCH_CHECK(q.size(1) % k.size(1) == 0, op, ": the ", k.size(1),
              " key/value heads do not divide the ", q.size(1), " query heads");
  TORCH_CHECK(q.size(2) % 2 == 0, op, ": this rank's sequence (", q.size(2),
              ") is not two segments of equal length");
  TORCH_CHECK(comm == "p2p" || comm == "all_gather" || comm == kLocal, op,
              ": comm must be 'p2p', 'all_gather' or 'local', got '", comm,
              "'");
  TORCH_CHECK(!mask.has_value() || !mask->requires_grad(), op,
              ": the mask must not require a gradient");
}

// Runs `visit(qs, ks, kind, mask)` over the pairs of this rank's query
// segments and block `src`'s key segments that contribute: causally above the
// diagonal or entirely masked are skipped. Forward and backward both go
// through here so that they skip the same pairs: a backward that visited a
// pair the forward skipped (or the other way round) would compute gradients of
// a different attention than the one that produced the output.
template <typename Visit>
void forEachPair(const Call& c, int64_t src, Visit&& visit) {
  for (int64_t qs = 0; qs < 2; ++qs) {
    for (int64_t ks = 0; ks < 2; ++ks) {
      const Pair p{qs, ks, src};
      PairKind kind = kindOf(c, p);
      at::Tensor m = maskBlock(c, p);
      if (kind == PairKind::kSkip || hidden(m)) {
        continue;
      }
      simplify(m, kind);
      visit(qs, ks, kind, m);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> cpAttentionForward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& mask, bool is_causal, double scale,
    const std::string& comm, const std::string& group_name) {
  checkArgs(q, k, v, mask, comm);
  const Call c = callOf(q, mask, is_causal, scale, comm, group_name);
  at::Tensor out = at::zeros(q.sizes(), q.options().dtype(accType(q)));
  at::Tensor lse = at::full({q.size(0), q.size(1), q.size(2)}, -kInf,
                            q.options().dtype(accType(q)));
  forEachBlock(
      comm, group_name, k, v,
      [&](int64_t src, const at::Tensor& kb, const at::Tensor& vb) {
        forEachPair(
            c, src,
            [&](int64_t qs, int64_t ks, PairKind kind, const at::Tensor& m) {
              attendAndMerge(rows(q, qs, c.chunk), rows(kb, ks, c.chunk),
                             rows(vb, ks, c.chunk), m, kind, scale,
                             rows(out, qs, c.chunk),
                             lse.narrow(2, qs * c.chunk, c.chunk));
            });
      });
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpAttentionBackward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& mask,
    const at::Tensor& out, const at::Tensor& lse, bool is_causal, double scale,
    const std::string& comm, const std::string& group_name) {
  checkArgs(q, k, v, mask, comm);
  const Call c = callOf(q, mask, is_causal, scale, comm, group_name);
  at::Tensor dout = grad_out.to(accType(q));
  at::Tensor delta = dout.mul(out.to(accType(q))).sum(-1);
  at::Tensor lse_safe = lse.masked_fill(lse.eq(-kInf), kInf);  // p = 0 there
  at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(accType(q)));
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  if (comm == "p2p" && c.size > 1) {
    pg = c10d::resolve_process_group(group_name);
  }
  const at::TensorOptions acc = k.options().dtype(accType(k));
  std::vector<at::Tensor> gathered_dk, gathered_dv;  // all_gather: by source
  Exchange carried;  // p2p: the gradients of the block in hand, in flight
  int64_t step = 0;
  forEachBlock(
      comm, group_name, k, v,
      [&](int64_t src, const at::Tensor& kb, const at::Tensor& vb) {
        at::Tensor dk = at::zeros(kb.sizes(), acc),
                   dv = at::zeros(vb.sizes(), acc);
        forEachPair(
            c, src,
            [&](int64_t qs, int64_t ks, PairKind kind, const at::Tensor& m) {
              blockBackward(rows(q, qs, c.chunk), rows(kb, ks, c.chunk),
                            rows(vb, ks, c.chunk), m, kind, scale,
                            rows(dout, qs, c.chunk), rows(out, qs, c.chunk),
                            lse_safe.narrow(2, qs * c.chunk, c.chunk),
                            delta.narrow(2, qs * c.chunk, c.chunk),
                            rows(dq, qs, c.chunk), rows(dk, ks, c.chunk),
                            rows(dv, ks, c.chunk));
            });
        if (comm == "all_gather") {
          gathered_dk.push_back(dk);
          gathered_dv.push_back(dv);
        } else if (c.size > 1) {
          // The block's gradients so far came with it from the previous
          // rank; with this rank's share they go on to the next (after the
          // last step: home, to the rank that holds the block).
          if (step > 0) {
            carried.wait();
            dk.add_(carried.received[0]);
            dv.add_(carried.received[1]);
          }
          carried = startExchange(pg, {dk, dv}, kGradTag);
        } else {
          gathered_dk.push_back(dk);
          gathered_dv.push_back(dv);
        }
        ++step;
      });
  at::Tensor dk, dv;
  if (comm == "all_gather" && c.size > 1) {
    // Blocks came in ring order (src = rank, rank - 1, ...): put them in rank
    // order and reduce-scatter each rank's home.
    std::vector<at::Tensor> by_rank_k(c.size), by_rank_v(c.size);
    for (int64_t i = 0; i < c.size; ++i) {
      const int64_t src = (c.rank + c.size - i) % c.size;
      by_rank_k[src] = gathered_dk[i];
      by_rank_v[src] = gathered_dv[i];
    }
    dk = reduceScatter(at::cat(by_rank_k, 2), 2, group_name);
    dv = reduceScatter(at::cat(by_rank_v, 2), 2, group_name);
  } else if (c.size > 1) {
    carried.wait();
    dk = carried.received[0];
    dv = carried.received[1];
  } else {
    dk = gathered_dk[0];
    dv = gathered_dv[0];
  }
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()),
          dv.to(v.scalar_type())};
}

class CpAttentionFn : public torch::autograd::Function<CpAttentionFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask,
                            bool is_causal, double scale,
                            const std::string& comm,
                            const std::string& group_name) {
    // Through the dispatcher: under torch.compile the forward and the
    // backward are each one opaque op with a fake kernel.
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("smp::cp_attention_forward", "")
                         .typed<decltype(cpAttentionForward)>();
    auto [out, lse] =
        op.call(q, k, v, mask, is_causal, scale, comm, group_name);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["mask"] =
        mask.has_value() ? c10::IValue(*mask) : c10::IValue();
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["group_name"] = group_name;
    return out;
  }

  static variable_list backward(AutogradContext* ctx,
                                const variable_list& grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("smp::cp_attention_backward", "")
                         .typed<decltype(cpAttentionBackward)>();
    const variable_list saved = ctx->get_saved_variables();
    const c10::IValue& m = ctx->saved_data["mask"];
    std::optional<at::Tensor> mask =
        m.isTensor() ? std::optional<at::Tensor>(m.toTensor()) : std::nullopt;
    auto [dq, dk, dv] =
        op.call(grads[0].contiguous(), saved[0], saved[1], saved[2], mask,
                saved[3], saved[4], ctx->saved_data["is_causal"].toBool(),
                ctx->saved_data["scale"].toDouble(),
                ctx->saved_data["comm"].toStringRef(),
                ctx->saved_data["group_name"].toStringRef());
    return {dq,           dk,           dv,           at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor cpAttention(const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v,
                       const std::optional<at::Tensor>& mask, bool is_causal,
                       double scale, const std::string& comm,
                       const std::string& group_name) {
  return std::get<0>(
      cpAttentionForward(q, k, v, mask, is_causal, scale, comm, group_name));
}

at::Tensor cpAttentionAutograd(const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v,
                               const std::optional<at::Tensor>& mask,
                               bool is_causal, double scale,
                               const std::string& comm,
                               const std::string& group_name) {
  checkArgs(q, k, v, mask, comm);
  return CpAttentionFn::apply(q, k, v, mask, is_causal, scale, comm,
                              group_name);
}

}  // namespace
}  // namespace smp::ops

TORCH_LIBRARY_IMPL(smp, CPU, m) {
  m.impl("cp_attention", &smp::ops::cpAttention);
  m.impl("cp_attention_forward", &smp::ops::cpAttentionForward);
  m.impl("cp_attention_backward", &smp::ops::cpAttentionBackward);
}

TORCH_LIBRARY_IMPL(smp, CUDA, m) {
  m.impl("cp_attention", &smp::ops::cpAttention);
  m.impl("cp_attention_forward", &smp::ops::cpAttentionForward);
  m.impl("cp_attention_backward", &smp::ops::cpAttentionBackward);
}

TORCH_LIBRARY_IMPL(smp, Autograd, m) {
  m.impl("cp_attention", &smp::ops::cpAttentionAutograd);
}

#pragma once

// The "smp" c10d backend: one object serves CPU and CUDA tensors of a process
// group, routing CPU work to torch's Gloo backend and CUDA work to torch's
// NCCL backend (both built over the same store by the Python creator), with a
// throttle on outstanding operations per device. No transport of its own.

#include <chrono>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <vector>

#include "throttle.h"

namespace smp {

struct BackendConfig {
  std::string group_name;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  int64_t nccl_limit = 8;  // SMP_NCCL_THROTTLE_LIMIT
  int64_t cpu_limit = -1;  // SMP_GLOO_THROTTLE_LIMIT
};

class SmpBackend : public c10d::Backend {
 public:
  // `cuda` may be null (no GPU, or CUDA not built): CUDA tensors then fail
  // with a clear error.
  SmpBackend(int rank, int size, c10::intrusive_ptr<c10d::Backend> cpu,
             c10::intrusive_ptr<c10d::Backend> cuda, BackendConfig config);

  const std::string getBackendName() const override { return "smp"; }

  ThrottleStats stats(c10::DeviceType device);
  bool hasCuda() const { return cuda_.backend != nullptr; }

  // --- collectives -------------------------------------------------------
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
      std::vector<int64_t>& inputSplits,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors,
                                      int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors,
                                      int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts) override;

  // --- coalescing (batch_isend_irecv) -------------------------------------
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // --- group management, forwarded to the inner backends -------------------
  void setTimeout(std::chrono::milliseconds timeout) override;
  void setGroupUid(const std::string& pg_uid) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts,
                        bool waitAllRanks) override;
  uint64_t getSequenceNumberForGroup() override;
  void abort() override;
  void shutdown() override;

 private:
  struct Route {
    c10::intrusive_ptr<c10d::Backend> backend;
    std::unique_ptr<Throttle> throttle;
    std::shared_ptr<const std::string> label;  // for the Work handed out
  };

  // A collective, and a send or receive: they differ in how the throttle
  // admits them (throttle.h says why).
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> run(const char* op, const at::Device& device,
                                     bool asyncOp, Call&& call);
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> runPointToPoint(const char* op,
                                                 const at::Device& device,
                                                 Call&& call);
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> dispatch(const char* op, OpKind kind,
                                          const at::Device& device,
                                          bool asyncOp, Call&& call);
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> joinBatch(const char* op, OpKind kind,
                                           const at::Device& device,
                                           Route& route, Call&& call);
  Route& routeFor(const char* op, const at::Device& device);
  std::shared_ptr<Completion> completionFor(
      const c10::intrusive_ptr<c10d::Work>& work, const at::Device& device,
      bool asyncOp);
  template <typename F>
  void forEachInner(F&& f);
  c10::intrusive_ptr<c10d::Work> unevenAlltoallOnGloo(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts);

  BackendConfig config_;
  Route cpu_;
  Route cuda_;

  // The batch between startCoalescing and endCoalescing (batch_isend_irecv,
  // _coalescing_manager): one unit to the throttle on either device. NCCL
  // coalesces natively and is started lazily, because startCoalescing() is
  // not told the device; Gloo has no coalescing, so its operations are
  // issued one by one and completed together (GroupWork).
  struct Batch {
    bool open = false;
    OpKind kind = OpKind::kCollective;  // kPointToPoint once one joins
    bool nccl = false;                  // NCCL coalescing started
    at::Device ncclDevice{c10::kCUDA};
    bool gloo = false;  // an operation went to Gloo
    std::vector<c10::intrusive_ptr<c10d::Work>> glooWorks;
  };
  Batch batch_;
};

}  // namespace smp

#pragma once

// Work handles the smp backend returns to callers.

#include <atomic>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

namespace smp {

// Forwards to the inner backend's Work and names the operation and the group
// in any error it raises, so a failure deep in Gloo or NCCL says which
// collective of which group broke. A successful wait() is remembered, so the
// work reads as completed even where the inner work never says so.
class NamedWork : public c10d::Work {
 public:
  NamedWork(c10::intrusive_ptr<c10d::Work> inner, const char* op,
            std::shared_ptr<const std::string> label);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout) override;
  void abort() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  float getDuration() const override;
  uint64_t getSequencenumber() const override;

 private:
  template <typename F>
  auto named(F&& f) -> decltype(f());

  c10::intrusive_ptr<c10d::Work> inner_;
  const char* op_;
  std::shared_ptr<const std::string> label_;  // shared: no copy per op
  std::atomic<bool> waited_{false};
};

// The works of CPU operations issued between startCoalescing and
// endCoalescing (batch_isend_irecv), completed together: Gloo has no
// coalescing of its own, so they run individually and are awaited as one.
class GroupWork : public c10d::Work {
 public:
  explicit GroupWork(std::vector<c10::intrusive_ptr<c10d::Work>> works);

  bool isCompleted() override;
  std::exception_ptr exception() const override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout) override;
  void abort() override;

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

}  // namespace smp

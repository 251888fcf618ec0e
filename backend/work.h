#pragma once

// Work handles the smp backend returns to callers.

#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

namespace smp {

// Forwards to the inner backend's Work and names the operation and the group
// in any error it raises, so a failure deep in Gloo or NCCL says which
// collective of which group broke.
//
// A failed wait() is remembered and every later wait() raises it at once.
// On the host (Gloo) a successful one is remembered too: Gloo's send and recv
// works must not be waited twice (each wait consumes one completion of the
// underlying buffer, so a second blocks until the timeout), and the
// remembered outcome makes the work read as completed where the inner work
// never says so itself. On CUDA (NCCL) it is not: wait() only makes the
// caller's stream wait, so the GPU may still run the operation (isCompleted
// keeps asking the inner work, for the throttle), and another thread's wait
// must order its own stream.
class NamedWork : public c10d::Work {
 public:
  NamedWork(c10::intrusive_ptr<c10d::Work> inner, const char* op,
            std::shared_ptr<const std::string> label, bool onDevice);

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
  const bool onDevice_;  // a CUDA operation: a successful wait is not final
  std::mutex waitMu_;    // one wait on the inner work at a time
  // Set once a wait() is final; error_ is written before, read after it.
  std::atomic<bool> finished_{false};
  std::exception_ptr error_;  // the named error of the first wait, if any
};

// The works of CPU operations issued between startCoalescing and
// endCoalescing (batch_isend_irecv), completed together: Gloo has no
// coalescing of its own, so they run individually and are awaited as one.
// They are NamedWorks, so waiting on the batch and on its members in any
// order and any number of times waits on each inner work once.
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

// Work completed by a future (the uneven CPU all_to_all, finished by its
// copy-back). torch's Work::create_from_future cannot wait with a finite
// timeout, which the throttle and wait(timeout) need. Like Gloo's work, it
// throws when the timeout passes.
class FutureWork : public c10d::Work {
 public:
  FutureWork(c10::intrusive_ptr<c10::ivalue::Future> future, const char* op);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override {}
  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  // Set by the future's callback, which may outlive this work.
  struct Done {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  const char* op_;
  std::shared_ptr<Done> done_;
};

}  // namespace smp

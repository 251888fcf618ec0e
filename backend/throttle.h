#pragma once

// A per-process-group limiter on outstanding communication operations.
//
// NCCL keeps the buffers of every enqueued collective alive until it
// completes, so an unbounded queue of small collectives (tensor parallelism
// issues many) grows memory. The throttle bounds the queue: at the limit, the
// next launch blocks its caller until the oldest outstanding operation
// completes (FIFO, as FSDP's _FreeEventQueue does). It knows nothing about
// torch: operations are seen through the Completion interface, so the unit is
// tested with fake handles.

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>

namespace smp {

// A launched operation as the throttle sees it.
class Completion {
 public:
  virtual ~Completion() = default;
  // Non-blocking. True once the operation has finished; throws if it failed.
  virtual bool poll() = 0;
  // Blocks until finished or `timeout` passes. False on timeout; throws if
  // the operation failed.
  virtual bool wait(std::chrono::milliseconds timeout) = 0;
};

struct ThrottleStats {
  int64_t limit = 0;  // -1: disabled
  int64_t launched = 0;
  int64_t outstanding = 0;
  int64_t peak_outstanding = 0;
  int64_t throttle_waits = 0;  // launches that had to block
  double seconds_blocked = 0.0;
};

// Parses a throttle-limit setting: a positive integer, or -1 (disabled).
// `value == nullptr` (unset) gives `fallback`. Anything else throws
// std::invalid_argument naming the variable, the value and what is allowed.
int64_t parseThrottleLimit(const std::string& variable, const char* value,
                           int64_t fallback);

class Throttle {
 public:
  // `label` names the group and device in error messages, e.g.
  // "process group 'default_pg' (cuda/nccl)"; `setting` names the variable
  // that set the limit, for the timeout message.
  Throttle(int64_t limit, std::chrono::milliseconds timeout, std::string label,
           std::string setting);

  // Admits one operation: reaps finished operations, blocks on the oldest
  // while the limit is reached, then calls `launch` and tracks what it
  // returns. A null completion means the operation finished synchronously.
  // A failed or timed-out outstanding operation gives up its slot and its
  // error is thrown here, naming the operation and the group.
  template <typename Launch>
  void launch(const char* op, Launch&& launch) {
    std::lock_guard<std::mutex> guard(mu_);  // admit and track as one step
    admit();
    track(op, launch());
  }

  ThrottleStats stats();
  bool enabled() const { return limit_ > 0; }
  const std::string& label() const { return label_; }

 private:
  struct Entry {
    const char* op;
    std::shared_ptr<Completion> completion;
  };

  // All of these require mu_.
  void admit();
  void track(const char* op, std::shared_ptr<Completion> completion);
  void reapFinished();
  void waitForOldest();
  [[noreturn]] void rethrowFor(const Entry& entry);

  const int64_t limit_;
  const std::chrono::milliseconds timeout_;
  const std::string label_;
  const std::string setting_;

  std::mutex mu_;  // serializes launches of one group, guards all below
  std::deque<Entry> outstanding_;
  ThrottleStats stats_;
};

}  // namespace smp

#pragma once

// A per-process-group limiter on outstanding communication operations.
//
// NCCL keeps the buffers of every enqueued collective alive until it
// completes, so an unbounded queue of small collectives (tensor parallelism
// issues many) grows memory. The throttle bounds the queue: at the limit, the
// next collective blocks its caller until the oldest outstanding collective
// completes (FIFO, as FSDP's _FreeEventQueue does). It knows nothing about
// torch: operations are seen through the Completion interface, so the unit is
// tested with fake handles.
//
// Why point-to-point operations take no slot
// ------------------------------------------
// A throttle that blocks a launch adds a wait edge: "this rank issues nothing
// more until its oldest slot holder completes". That is only safe if the
// holder can complete without anything this rank issues later.
//
// - A collective completes once every rank of the group has launched it, and
//   every rank launches the group's collectives in one common order (c10d
//   requires it). Let C be the earliest collective, in that order, that has
//   not completed. A rank blocked in the throttle waits for its oldest slot
//   holder, which is C or later (all earlier ones completed), so it has
//   launched C; a rank that had not launched C could only be blocked by a
//   holder earlier than C, which has completed. So no rank blocked in the
//   throttle keeps C from completing, and waiting on collectives alone never
//   deadlocks.
// - A send or receive completes once its peer posts the matching operation,
//   and the peer may post it after any of its own operations: no order is
//   shared. Gloo's send is rendezvous (it completes only when the receive is
//   posted), as is NCCL's in general, so neither receives nor sends may be
//   waited on: both ranks posting a receive and then a send, or two sends and
//   then two receives, would each wait for an operation the other cannot
//   issue. So a point-to-point operation never waits for a slot, never holds
//   one, and no launch ever waits on it. With no wait edge into or out of
//   point-to-point operations, no admission order of them can deadlock, and
//   the argument for collectives above is unchanged by them.
//
// What remains is the throttle's contract: at most `limit` collectives of a
// group are in flight on a rank, so a program in which a peer needs an
// operation this rank issues after its k-th collective before the peer
// launches collective k - limit cannot run throttled (it needs a deeper
// queue; raise or disable the limit).
//
// A coalesced batch (batch_isend_irecv, _coalescing_manager) is one unit: it
// is counted once, and holds one slot if it holds collectives only, none if
// it holds a point-to-point operation.

#include <atomic>
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
  // the operation failed (some transports throw on timeout too).
  virtual bool wait(std::chrono::milliseconds timeout) = 0;
};

// How an operation completes, which decides how the throttle treats it (see
// the comment at the top of this file).
enum class OpKind {
  kCollective,    // holds a slot; waits for one when the limit is reached
  kPointToPoint,  // send, recv, or a batch holding one: counted, never waits
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

  // Launches one operation. A collective first reaps finished operations and
  // blocks on the oldest while the limit is reached, then `launch` runs and
  // what it returns is tracked; a null completion means it finished
  // synchronously. A failed or timed-out outstanding operation gives up its
  // slot and the error is thrown here, naming the operation and the group
  // (and, when the throttle was waiting, the operation that was blocked).
  // A point-to-point operation runs `launch` at once and is only counted:
  // what it returns is dropped, and it takes no lock a blocked launch holds.
  template <typename Launch>
  void launch(const char* op, OpKind kind, Launch&& launch) {
    if (kind == OpKind::kPointToPoint) {
      launch();
      untrackedLaunched_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    std::lock_guard<std::mutex> guard(mu_);  // admit and track as one step
    admit(op);
    track(op, launch());
  }

  // A coalesced batch whose operations are issued one by one (Gloo's): the
  // caller calls admitBatch before issuing the first, if that is a
  // collective, then endBatch once after the last. Every launch on the
  // group in between joins the batch, so the slot admitBatch found free is
  // still free at endBatch.
  void admitBatch(const char* op);
  void endBatch(const char* op, OpKind kind,
                std::shared_ptr<Completion> completion);

  ThrottleStats stats();
  bool enabled() const { return limit_ > 0; }
  const std::string& label() const { return label_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Entry {
    const char* op;
    std::shared_ptr<Completion> completion;
    int64_t number;  // 1-based launch count of the group, for messages
    Clock::time_point launchedAt;
  };

  // All of these require mu_.
  void admit(const char* op);
  void track(const char* op, std::shared_ptr<Completion> completion);
  void reapFinished();
  void waitForOldest(const char* blocked);
  [[noreturn]] void failedWhileReaping(const std::string& what);
  [[noreturn]] void failedWhileWaiting(const char* blocked,
                                       Clock::time_point waitStart,
                                       const std::string& what, bool threw);
  std::string describe(const Entry& entry, Clock::time_point now) const;

  const int64_t limit_;
  const std::chrono::milliseconds timeout_;
  const std::string label_;
  const std::string setting_;

  std::mutex mu_;  // serializes collective launches, guards all below
  std::deque<Entry> outstanding_;
  ThrottleStats stats_;
  // Point-to-point launches, counted without mu_: one must never wait
  // behind a collective launch that is blocked in the throttle.
  std::atomic<int64_t> untrackedLaunched_{0};
};

}  // namespace smp

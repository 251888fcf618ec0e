// Unit tests of the throttle over fake completion handles: no torch, no
// processes. Blocking is observed through the fakes (a launcher blocked on
// the oldest operation is inside its wait()), never through sleeps.

#include "throttle.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace smp {
namespace {

using std::chrono::milliseconds;

constexpr milliseconds kLongTimeout{60000};
constexpr milliseconds kHangGuard{20000};

class FakeOp : public Completion {
 public:
  FakeOp() = default;
  // Gloo's work throws on timeout instead of returning false.
  explicit FakeOp(bool throwOnTimeout) : throwOnTimeout_(throwOnTimeout) {}

  bool poll() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_ && !error_.empty()) {
      throw std::runtime_error(error_);
    }
    return done_;
  }

  bool wait(milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    ++waits_;
    cv_.notify_all();
    cv_.wait_for(lock, timeout, [&] { return done_; });
    if (!done_) {
      if (throwOnTimeout_) {
        throw std::runtime_error("Timed out waiting " +
                                 std::to_string(timeout.count()) + "ms");
      }
      return false;
    }
    if (!error_.empty()) {
      throw std::runtime_error(error_);
    }
    return true;
  }

  void finish(const std::string& error = "") {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = error;
    cv_.notify_all();
  }

  // Blocks until some thread is inside wait() on this op.
  bool awaitWaiter() {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kHangGuard, [&] { return waits_ > 0; });
  }

  int waits() {
    std::lock_guard<std::mutex> lock(mu_);
    return waits_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
  int waits_ = 0;
  bool throwOnTimeout_ = false;
};

std::shared_ptr<FakeOp> launchFake(Throttle& throttle) {
  auto op = std::make_shared<FakeOp>();
  throttle.launch("all_reduce", OpKind::kCollective, [&] { return op; });
  return op;
}

Throttle makeThrottle(int64_t limit, milliseconds timeout = kLongTimeout) {
  return Throttle(limit, timeout, "process group 'tp' (cuda/nccl)",
                  "SMP_NCCL_THROTTLE_LIMIT");
}

TEST(Throttle, AdmitsExactlyLimitWithoutBlocking) {
  Throttle throttle = makeThrottle(3);
  std::vector<std::shared_ptr<FakeOp>> ops;
  for (int i = 0; i < 3; ++i) {
    ops.push_back(launchFake(throttle));
  }
  const ThrottleStats stats = throttle.stats();
  EXPECT_EQ(stats.launched, 3);
  EXPECT_EQ(stats.outstanding, 3);
  EXPECT_EQ(stats.peak_outstanding, 3);
  EXPECT_EQ(stats.throttle_waits, 0);
  for (auto& op : ops) {
    EXPECT_EQ(op->waits(), 0);
  }
}

TEST(Throttle, LaunchAtLimitBlocksUntilOldestCompletes) {
  Throttle throttle = makeThrottle(2);
  auto first = launchFake(throttle);
  auto second = launchFake(throttle);
  auto third = std::make_shared<FakeOp>();
  std::atomic<bool> launched{false};
  auto blocked = std::async(std::launch::async, [&] {
    throttle.launch("all_reduce", OpKind::kCollective, [&] {
      launched = true;
      return third;
    });
  });
  ASSERT_TRUE(first->awaitWaiter());  // blocked on the oldest...
  EXPECT_FALSE(launched.load());      // ...before launching
  EXPECT_EQ(second->waits(), 0);
  first->finish();
  ASSERT_EQ(blocked.wait_for(kHangGuard), std::future_status::ready);
  blocked.get();
  EXPECT_TRUE(launched.load());
  const ThrottleStats stats = throttle.stats();
  EXPECT_EQ(stats.throttle_waits, 1);
  EXPECT_EQ(stats.peak_outstanding, 2);
  EXPECT_EQ(stats.outstanding, 2);
  EXPECT_GE(stats.seconds_blocked, 0.0);
}

TEST(Throttle, ReleasesInFifoOrder) {
  Throttle throttle = makeThrottle(2);
  std::vector<std::shared_ptr<FakeOp>> ops{launchFake(throttle),
                                           launchFake(throttle)};
  // The younger op finishing does not free a slot: the oldest is waited on.
  ops[1]->finish();
  auto blocked = std::async(std::launch::async, [&] { launchFake(throttle); });
  ASSERT_TRUE(ops[0]->awaitWaiter());
  EXPECT_EQ(ops[1]->waits(), 0);
  ops[0]->finish();
  ASSERT_EQ(blocked.wait_for(kHangGuard), std::future_status::ready);
  blocked.get();
  // Both finished ops were reaped; only the new one is outstanding.
  EXPECT_EQ(throttle.stats().outstanding, 1);
}

TEST(Throttle, FinishedOperationsAreReapedWithoutBlocking) {
  Throttle throttle = makeThrottle(2);
  auto first = launchFake(throttle);
  auto second = launchFake(throttle);
  first->finish();
  launchFake(throttle);
  EXPECT_EQ(first->waits(), 0);
  EXPECT_EQ(throttle.stats().throttle_waits, 0);
  EXPECT_EQ(throttle.stats().outstanding, 2);
}

TEST(Throttle, DisabledNeverBlocks) {
  Throttle throttle = makeThrottle(-1);
  EXPECT_FALSE(throttle.enabled());
  std::vector<std::shared_ptr<FakeOp>> ops;
  for (int i = 0; i < 100; ++i) {
    ops.push_back(launchFake(throttle));
  }
  const ThrottleStats stats = throttle.stats();
  EXPECT_EQ(stats.limit, -1);
  EXPECT_EQ(stats.launched, 100);
  EXPECT_EQ(stats.peak_outstanding, 100);
  EXPECT_EQ(stats.throttle_waits, 0);
  for (auto& op : ops) {
    EXPECT_EQ(op->waits(), 0);
  }
}

TEST(Throttle, FailedOperationReleasesSlotAndRaisesOnCaller) {
  Throttle throttle = makeThrottle(1);
  auto failing = launchFake(throttle);
  auto blocked = std::async(std::launch::async, [&] { launchFake(throttle); });
  ASSERT_TRUE(failing->awaitWaiter());
  failing->finish("Connection closed by peer");
  ASSERT_EQ(blocked.wait_for(kHangGuard), std::future_status::ready);
  try {
    blocked.get();
    FAIL() << "expected the failure to reach the caller";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("all_reduce"), std::string::npos) << what;
    EXPECT_NE(what.find("process group 'tp' (cuda/nccl)"), std::string::npos)
        << what;
    EXPECT_NE(what.find("Connection closed by peer"), std::string::npos)
        << what;
  }
  EXPECT_EQ(throttle.stats().outstanding, 0);
  // The slot is free again: the next launch goes through at once.
  auto next = launchFake(throttle);
  EXPECT_EQ(throttle.stats().outstanding, 1);
}

TEST(Throttle, FailureSeenWhileReapingRaisesAndReleases) {
  Throttle throttle = makeThrottle(4);
  auto failing = launchFake(throttle);
  failing->finish("NCCL error: unhandled system error");
  EXPECT_THROW(launchFake(throttle), std::runtime_error);
  EXPECT_EQ(throttle.stats().outstanding, 0);
  EXPECT_NO_THROW(launchFake(throttle));
}

TEST(Throttle, TimedOutOperationReleasesSlotAndRaises) {
  Throttle throttle = makeThrottle(1, milliseconds(20));
  auto stuck = launchFake(throttle);
  try {
    launchFake(throttle);
    FAIL() << "expected a timeout";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("did not complete within 20 ms"), std::string::npos)
        << what;
    EXPECT_NE(what.find("SMP_NCCL_THROTTLE_LIMIT=1"), std::string::npos)
        << what;
    EXPECT_NE(what.find("all_reduce"), std::string::npos) << what;
  }
  EXPECT_EQ(throttle.stats().outstanding, 0);
}

TEST(Throttle, SynchronousOperationsCountAsLaunched) {
  Throttle throttle = makeThrottle(2);
  throttle.launch("barrier", OpKind::kCollective,
                  [] { return std::shared_ptr<Completion>(); });
  const ThrottleStats stats = throttle.stats();
  EXPECT_EQ(stats.launched, 1);
  EXPECT_EQ(stats.outstanding, 0);
}

TEST(Throttle, ManyLaunchersWithAsyncCompletionNeverDeadlockOrExceedLimit) {
  constexpr int kLimit = 4;
  constexpr int kOps = 2000;
  Throttle throttle = makeThrottle(kLimit);
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<FakeOp>> pending;
  bool stop = false;
  // Completes operations in launch order, as one NCCL stream does.
  std::thread completer([&] {
    std::unique_lock<std::mutex> lock(mu);
    while (true) {
      cv.wait(lock, [&] { return stop || !pending.empty(); });
      if (pending.empty()) {
        return;
      }
      auto op = pending.front();
      pending.pop_front();
      lock.unlock();
      op->finish();
      lock.lock();
    }
  });
  auto launcher = [&] {
    for (int i = 0; i < kOps / 2; ++i) {
      throttle.launch("all_reduce", OpKind::kCollective, [&] {
        auto op = std::make_shared<FakeOp>();
        std::lock_guard<std::mutex> lock(mu);
        pending.push_back(op);
        cv.notify_all();
        return op;
      });
    }
  };
  auto a = std::async(std::launch::async, launcher);
  auto b = std::async(std::launch::async, launcher);
  const bool finished = a.wait_for(kHangGuard) == std::future_status::ready &&
                        b.wait_for(kHangGuard) == std::future_status::ready;
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
    cv.notify_all();
  }
  completer.join();
  ASSERT_TRUE(finished) << "launchers deadlocked";
  const ThrottleStats stats = throttle.stats();
  EXPECT_EQ(stats.launched, kOps);
  EXPECT_LE(stats.peak_outstanding, kLimit);
}

// --- point-to-point operations and batches ----------------------------------

// Finishes `oldest` (failing it with `error`, if given), which `blocked` (a
// launch on another thread) is blocked on, and returns what that launch then
// raised: "" if nothing, "still blocked" if it does not return.
std::string finishAndJoin(FakeOp& oldest, std::future<void>& blocked,
                          const std::string& error = "") {
  oldest.finish(error);
  if (blocked.wait_for(kHangGuard) != std::future_status::ready) {
    return "still blocked";
  }
  try {
    blocked.get();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::shared_ptr<FakeOp> launchP2P(Throttle& throttle, const char* op) {
  auto fake = std::make_shared<FakeOp>();
  throttle.launch(op, OpKind::kPointToPoint, [&] { return fake; });
  return fake;
}

TEST(Throttle, PointToPointNeitherWaitsNorHoldsASlot) {
  Throttle throttle = makeThrottle(1);
  auto collective = launchFake(throttle);  // the only slot is taken
  std::vector<std::shared_ptr<FakeOp>> p2p;
  for (int i = 0; i < 10; ++i) {
    p2p.push_back(launchP2P(throttle, i % 2 ? "send" : "recv"));
  }
  ThrottleStats stats = throttle.stats();
  EXPECT_EQ(stats.launched, 11);
  EXPECT_EQ(stats.outstanding, 1);
  EXPECT_EQ(stats.peak_outstanding, 1);
  EXPECT_EQ(stats.throttle_waits, 0);
  EXPECT_EQ(collective->waits(), 0);
  // A collective launched now waits on the oldest collective, never on the
  // (unfinished) point-to-point operations launched after it.
  collective->finish();
  launchFake(throttle);
  for (auto& op : p2p) {
    EXPECT_EQ(op->waits(), 0);
  }
  stats = throttle.stats();
  EXPECT_EQ(stats.launched, 12);
  EXPECT_EQ(stats.outstanding, 1);
}

TEST(Throttle, CollectiveNeverWaitsOnPointToPointLaunchedBeforeIt) {
  Throttle throttle = makeThrottle(1);
  auto recv = launchP2P(throttle, "recv");  // never finishes
  auto first = launchFake(throttle);
  EXPECT_EQ(recv->waits(), 0);
  auto blocked = std::async(std::launch::async, [&] { launchFake(throttle); });
  ASSERT_TRUE(first->awaitWaiter());  // the oldest collective, not the recv
  EXPECT_EQ(finishAndJoin(*first, blocked), "");
  EXPECT_EQ(recv->waits(), 0);
}

TEST(Throttle, PointToPointNeverWaitsBehindABlockedLaunch) {
  Throttle throttle = makeThrottle(1);
  auto oldest = launchFake(throttle);
  auto blocked = std::async(std::launch::async, [&] { launchFake(throttle); });
  ASSERT_TRUE(oldest->awaitWaiter());  // that launch holds the throttle
  // Another thread's send goes through at once: it may be what lets the
  // peer reach the collective the blocked launch waits for.
  auto send = std::async(std::launch::async,
                         [&] { return launchP2P(throttle, "send"); });
  ASSERT_EQ(send.wait_for(kHangGuard), std::future_status::ready);
  send.get();
  EXPECT_EQ(finishAndJoin(*oldest, blocked), "");
  EXPECT_EQ(throttle.stats().launched, 3);
}

TEST(Throttle, CollectiveBatchIsOneUnitHoldingOneSlot) {
  Throttle throttle = makeThrottle(2);
  auto first = launchFake(throttle);
  throttle.admitBatch("coalesced");  // a slot is free: no wait
  auto batch = std::make_shared<FakeOp>();
  throttle.endBatch("coalesced", OpKind::kCollective, batch);
  ThrottleStats stats = throttle.stats();
  EXPECT_EQ(stats.launched, 2);
  EXPECT_EQ(stats.outstanding, 2);
  EXPECT_EQ(stats.throttle_waits, 0);
  // The limit is reached: the next batch waits before its first operation
  // is issued, on the oldest outstanding operation.
  std::atomic<bool> admitted{false};
  auto next = std::async(std::launch::async, [&] {
    throttle.admitBatch("coalesced");
    admitted = true;
  });
  ASSERT_TRUE(first->awaitWaiter());
  EXPECT_FALSE(admitted.load());
  EXPECT_EQ(finishAndJoin(*first, next), "");
  EXPECT_EQ(throttle.stats().throttle_waits, 1);
}

TEST(Throttle, PointToPointBatchIsCountedOnceAndHoldsNoSlot) {
  Throttle throttle = makeThrottle(1);
  auto collective = launchFake(throttle);
  throttle.endBatch("coalesced", OpKind::kPointToPoint,
                    std::make_shared<FakeOp>());
  const ThrottleStats stats = throttle.stats();
  EXPECT_EQ(stats.launched, 2);
  EXPECT_EQ(stats.outstanding, 1);
  EXPECT_EQ(stats.throttle_waits, 0);
}

// --- error messages
// ------------------------------------------------------------

TEST(Throttle, TimeoutWhileWaitingNamesTheBlockedAndTheOldestOperation) {
  for (const bool throwOnTimeout : {false, true}) {
    Throttle throttle = makeThrottle(1, milliseconds(50));
    auto stuck = std::make_shared<FakeOp>(throwOnTimeout);
    throttle.launch("all_reduce", OpKind::kCollective, [&] { return stuck; });
    try {
      throttle.launch("broadcast", OpKind::kCollective,
                      [] { return std::make_shared<FakeOp>(); });
      FAIL() << "expected a timeout";
    } catch (const std::runtime_error& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.rfind("smp: broadcast on process group 'tp' (cuda/nccl) "
                           "timed out while the throttle "
                           "(SMP_NCCL_THROTTLE_LIMIT=1) waited for the oldest "
                           "outstanding operation (all_reduce, operation #1",
                           0),
                0)
          << what;
      EXPECT_NE(what.find("did not complete within 50 ms"), std::string::npos)
          << what;
      EXPECT_NE(what.find("broadcast was not launched"), std::string::npos)
          << what;
      EXPECT_EQ(what.find("smp: all_reduce on"), std::string::npos) << what;
    }
    const ThrottleStats stats = throttle.stats();
    EXPECT_EQ(stats.outstanding, 0);
    EXPECT_EQ(stats.launched, 1);  // the blocked broadcast never launched
    EXPECT_EQ(stats.throttle_waits, 1);
    EXPECT_GT(stats.seconds_blocked, 0.0);
  }
}

TEST(Throttle, FailureWhileWaitingSaysTheThrottleWasWaiting) {
  Throttle throttle = makeThrottle(1);
  auto failing = launchFake(throttle);
  auto blocked = std::async(std::launch::async, [&] {
    throttle.launch("barrier", OpKind::kCollective,
                    [] { return std::make_shared<FakeOp>(); });
  });
  ASSERT_TRUE(failing->awaitWaiter());
  const std::string what =
      finishAndJoin(*failing, blocked, "Connection closed by peer");
  EXPECT_EQ(what.rfind("smp: barrier on process group 'tp' (cuda/nccl) failed "
                       "while the throttle (SMP_NCCL_THROTTLE_LIMIT=1) waited "
                       "for the oldest outstanding operation (all_reduce",
                       0),
            0)
      << what;
  EXPECT_NE(what.find("which failed: Connection closed by peer"),
            std::string::npos)
      << what;
}

class NamedErrorOp : public Completion {
 public:
  bool poll() override {
    throw std::runtime_error(
        "smp: all_reduce on process group 'tp' (cuda/nccl) failed: boom");
  }
  bool wait(milliseconds) override { return poll(); }
};

TEST(Throttle, ErrorAlreadyNamedIsNotNamedTwice) {
  Throttle throttle = makeThrottle(4);
  throttle.launch("all_reduce", OpKind::kCollective,
                  [] { return std::make_shared<NamedErrorOp>(); });
  try {
    launchFake(throttle);
    FAIL() << "expected the failure";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(
        e.what(),
        "smp: all_reduce on process group 'tp' (cuda/nccl) failed: boom");
  }
}

// --- a two-rank model: no admission order deadlocks
// ---------------------------
//
// Two ranks, each with its own throttle, over a fake transport with the
// completion rules of Gloo and NCCL: a send and its receive both complete
// when the second of the pair is posted (rendezvous, matched in order per
// direction); the k-th collective completes when both ranks posted it. Every
// interleaving of a small program runs at limits 1 and 2, every handle waited
// only at the end ("late wait()"). A deadlock shows as a throttle timeout.

class Fabric {
 public:
  // Posts rank's next operation of `kind` ('S' send, 'R' recv, 'C'
  // collective) and returns its handle.
  std::shared_ptr<FakeOp> post(int rank, char kind) {
    auto op = std::make_shared<FakeOp>();
    std::lock_guard<std::mutex> lock(mu_);
    if (kind == 'C') {
      auto& slot = collectives_[posted_[rank]['C']++];
      slot.push_back(op);
      if (slot.size() == 2) {
        for (auto& o : slot) o->finish();
      }
      return op;
    }
    // Channel from sender to receiver: rank 0 -> 1 is 0, 1 -> 0 is 1.
    const int channel = kind == 'S' ? rank : 1 - rank;
    auto& mine = kind == 'S' ? sends_[channel] : recvs_[channel];
    auto& theirs = kind == 'S' ? recvs_[channel] : sends_[channel];
    if (!theirs.empty()) {
      theirs.front()->finish();
      theirs.pop_front();
      op->finish();
    } else {
      mine.push_back(op);
    }
    return op;
  }

 private:
  std::mutex mu_;
  std::map<int, std::vector<std::shared_ptr<FakeOp>>> collectives_;
  std::map<int, std::map<char, int>> posted_;
  std::deque<std::shared_ptr<FakeOp>> sends_[2];
  std::deque<std::shared_ptr<FakeOp>> recvs_[2];
};

// Runs both programs; returns an empty string, or what went wrong.
std::string runModel(const std::string& program0, const std::string& program1,
                     int64_t limit, bool pointToPointHoldsSlots) {
  Fabric fabric;
  auto rank = [&](int r, const std::string& program) -> std::string {
    Throttle throttle(limit, milliseconds(300),
                      "process group 'pp' (rank " + std::to_string(r) + ")",
                      "SMP_GLOO_THROTTLE_LIMIT");
    std::vector<std::shared_ptr<FakeOp>> handles;
    try {
      for (const char kind : program) {
        const bool p2p = kind != 'C' && !pointToPointHoldsSlots;
        const char* name = kind == 'S' ? "send" : kind == 'R' ? "recv" : "bar";
        throttle.launch(name, p2p ? OpKind::kPointToPoint : OpKind::kCollective,
                        [&] {
                          handles.push_back(fabric.post(r, kind));
                          return handles.back();
                        });
      }
      for (auto& handle : handles) {
        if (!handle->wait(milliseconds(300))) {
          return "rank " + std::to_string(r) + ": a wait() timed out";
        }
      }
      const ThrottleStats stats = throttle.stats();
      if (limit > 0 && stats.peak_outstanding > limit) {
        return "rank " + std::to_string(r) + ": exceeded the limit";
      }
    } catch (const std::exception& e) {
      return "rank " + std::to_string(r) + ": " + e.what();
    }
    return "";
  };
  auto other = std::async(std::launch::async, rank, 1, program1);
  const std::string mine = rank(0, program0);
  const std::string theirs = other.get();
  return mine + theirs;
}

// Every order of the letters of `ops` (with repeats).
std::vector<std::string> orders(std::string ops) {
  std::sort(ops.begin(), ops.end());
  std::vector<std::string> all;
  do {
    all.push_back(ops);
  } while (std::next_permutation(ops.begin(), ops.end()));
  return all;
}

TEST(ThrottleModel, NoOrderOfSendsAndReceivesDeadlocks) {
  int runs = 0;
  for (const int64_t limit : {1, 2}) {
    for (const auto& p0 : orders("SSRR")) {
      for (const auto& p1 : orders("SSRR")) {
        EXPECT_EQ(runModel(p0, p1, limit, false), "")
            << "limit " << limit << ": rank 0 " << p0 << ", rank 1 " << p1;
        ++runs;
      }
    }
  }
  EXPECT_EQ(runs, 2 * 6 * 6);
}

TEST(ThrottleModel, NoInterleavingOfCollectivesAndPointToPointDeadlocks) {
  // Collectives in the same order on both ranks (c10d requires it), sends
  // and receives anywhere around them.
  for (const int64_t limit : {1, 2}) {
    for (const auto& p0 : orders("CCSR")) {
      for (const auto& p1 : orders("CCSR")) {
        EXPECT_EQ(runModel(p0, p1, limit, false), "")
            << "limit " << limit << ": rank 0 " << p0 << ", rank 1 " << p1;
      }
    }
  }
}

TEST(ThrottleModel, PointToPointHoldingSlotsWouldDeadlock) {
  // Why send and recv take no slot: if they held one (the behaviour before),
  // both ranks posting a receive before their send deadlock at limit 1, and
  // so do two sends before two receives at limit 1 (sends are rendezvous).
  EXPECT_NE(runModel("RS", "RS", 1, true), "");
  EXPECT_NE(runModel("SSRR", "SSRR", 1, true), "");
  EXPECT_EQ(runModel("RS", "RS", 1, false), "");
  EXPECT_EQ(runModel("SSRR", "SSRR", 1, false), "");
}

TEST(ParseThrottleLimit, AcceptsPositiveIntegersAndMinusOne) {
  const std::string var = "SMP_NCCL_THROTTLE_LIMIT";
  EXPECT_EQ(parseThrottleLimit(var, nullptr, 8), 8);
  EXPECT_EQ(parseThrottleLimit(var, "1", 8), 1);
  EXPECT_EQ(parseThrottleLimit(var, "16", 8), 16);
  EXPECT_EQ(parseThrottleLimit(var, "-1", 8), -1);
}

TEST(ParseThrottleLimit, RejectsEverythingElseNamingVariableAndValue) {
  const std::string var = "SMP_NCCL_THROTTLE_LIMIT";
  for (const char* bad :
       {"0", "abc", "-5", "", "8x", " 8", "1.5", "99999999999999999999"}) {
    try {
      parseThrottleLimit(var, bad, 8);
      FAIL() << "accepted '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(var + "='" + bad + "'"), std::string::npos) << what;
      EXPECT_NE(what.find("positive integer"), std::string::npos) << what;
      EXPECT_NE(what.find("-1 to disable"), std::string::npos) << what;
    }
  }
}

}  // namespace
}  // namespace smp

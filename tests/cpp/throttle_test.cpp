// Unit tests of the throttle over fake completion handles: no torch, no
// processes. Blocking is observed through the fakes (a launcher blocked on
// the oldest operation is inside its wait()), never through sleeps.

#include "throttle.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
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
};

std::shared_ptr<FakeOp> launchFake(Throttle& throttle) {
  auto op = std::make_shared<FakeOp>();
  throttle.launch("all_reduce", [&] { return op; });
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
    throttle.launch("all_reduce", [&] {
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
  throttle.launch("barrier", [] { return std::shared_ptr<Completion>(); });
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
      throttle.launch("all_reduce", [&] {
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

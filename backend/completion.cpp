#include "completion.h"

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <functional>
#include <stdexcept>
#include <thread>
#include <utility>

namespace smp {
namespace {

// Blocks until `done()` is true or `timeout` passes; returns the last value.
bool pollUntil(std::chrono::milliseconds timeout,
               const std::function<bool()>& done) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  // Collectives often finish within microseconds of the first poll: spin a
  // little before sleeping, then sleep with a capped exponential backoff so a
  // long wait costs little CPU but is noticed within a millisecond.
  constexpr int kSpins = 64;
  std::chrono::microseconds pause(10);
  for (int i = 0;; ++i) {
    if (done()) {
      return true;
    }
    if (Clock::now() >= deadline) {
      return done();
    }
    if (i < kSpins) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }
}

// Runs `f`; a c10::Error it raises is raised again without its C++
// backtrace, because the throttle quotes the message inside its own.
template <typename F>
auto withoutBacktrace(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    throw std::runtime_error(e.what_without_backtrace());
  }
}

}  // namespace

WorkCompletion::WorkCompletion(c10::intrusive_ptr<c10d::Work> work, Block block)
    : work_(std::move(work)), block_(block) {}

bool WorkCompletion::poll() {
  return withoutBacktrace([&] {
    if (!work_->isCompleted()) {
      return false;
    }
    if (auto error = work_->exception()) {
      std::rethrow_exception(error);
    }
    return true;
  });
}

bool WorkCompletion::wait(std::chrono::milliseconds timeout) {
  if (block_ == Block::kWait) {
    // Throws on failure and on timeout.
    return withoutBacktrace([&] { return work_->wait(timeout); });
  }
  return pollUntil(timeout, [this] { return poll(); });
}

namespace {

class EventCompletion : public Completion {
 public:
  explicit EventCompletion(c10::Device device)
      : event_(device.type(), c10::EventFlag::PYTORCH_DEFAULT) {
    const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
    event_.record(impl->getStream(device));
  }

  bool poll() override { return event_.query(); }

  bool wait(std::chrono::milliseconds timeout) override {
    return pollUntil(timeout, [this] { return event_.query(); });
  }

 private:
  c10::Event event_;
};

}  // namespace

std::shared_ptr<Completion> completionOnCurrentStream(c10::Device device) {
  return std::make_shared<EventCompletion>(device);
}

}  // namespace smp

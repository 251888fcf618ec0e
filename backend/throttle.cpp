#include "throttle.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <utility>

namespace smp {

int64_t parseThrottleLimit(const std::string& variable, const char* value,
                           int64_t fallback) {
  if (value == nullptr) {
    return fallback;
  }
  const std::string text(value);
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(text.c_str(), &end, 10);
  // strtoll skips leading blanks; a setting with them is still rejected.
  const bool whole = !text.empty() &&
                     (std::isdigit(text[0]) || text[0] == '-') &&
                     end != nullptr && *end == '\0';
  if (whole && errno == 0 && (parsed > 0 || parsed == -1)) {
    return parsed;
  }
  throw std::invalid_argument(
      variable + "='" + text +
      "' is not a valid throttle limit: use a positive integer (the most "
      "outstanding operations per process group, default " +
      std::to_string(fallback) + ") or -1 to disable throttling");
}

Throttle::Throttle(int64_t limit, std::chrono::milliseconds timeout,
                   std::string label, std::string setting)
    : limit_(limit),
      timeout_(timeout),
      label_(std::move(label)),
      setting_(std::move(setting)) {
  stats_.limit = limit_;
}

void Throttle::admit() {
  reapFinished();
  if (enabled() && static_cast<int64_t>(outstanding_.size()) >= limit_) {
    const auto start = std::chrono::steady_clock::now();
    ++stats_.throttle_waits;
    // Record the blocked time even when the oldest operation throws.
    struct Timer {
      ThrottleStats& stats;
      std::chrono::steady_clock::time_point start;
      ~Timer() {
        stats.seconds_blocked += std::chrono::duration<double>(
                                     std::chrono::steady_clock::now() - start)
                                     .count();
      }
    } timer{stats_, start};
    while (static_cast<int64_t>(outstanding_.size()) >= limit_) {
      waitForOldest();
    }
  }
}

void Throttle::track(const char* op, std::shared_ptr<Completion> completion) {
  ++stats_.launched;
  if (completion) {
    outstanding_.push_back(Entry{op, std::move(completion)});
    const auto now = static_cast<int64_t>(outstanding_.size());
    if (now > stats_.peak_outstanding) {
      stats_.peak_outstanding = now;
    }
  } else if (stats_.peak_outstanding == 0) {
    stats_.peak_outstanding = 1;  // it was outstanding while it ran
  }
}

ThrottleStats Throttle::stats() {
  std::lock_guard<std::mutex> guard(mu_);
  try {
    reapFinished();
  } catch (const std::exception&) {
    // A failure surfaces on the next launch or on the caller's wait();
    // reading statistics must not throw.
  }
  ThrottleStats copy = stats_;
  copy.outstanding = static_cast<int64_t>(outstanding_.size());
  return copy;
}

// Operations of one group finish in launch order on every transport we wrap
// (one NCCL stream; Gloo's queue), so scanning stops at the first unfinished.
void Throttle::reapFinished() {
  while (!outstanding_.empty()) {
    Entry& oldest = outstanding_.front();
    bool done = false;
    try {
      done = oldest.completion->poll();
    } catch (...) {
      rethrowFor(oldest);
    }
    if (!done) {
      return;
    }
    outstanding_.pop_front();
  }
}

void Throttle::waitForOldest() {
  Entry& oldest = outstanding_.front();
  bool done = false;
  try {
    done = oldest.completion->wait(timeout_);
  } catch (...) {
    rethrowFor(oldest);
  }
  if (!done) {
    const std::string op = oldest.op;
    outstanding_.pop_front();
    throw std::runtime_error(
        "smp: " + op + " on " + label_ + " did not complete within " +
        std::to_string(timeout_.count()) +
        " ms while the throttle waited for a free slot (" + setting_ + "=" +
        std::to_string(limit_) +
        "); its slot is released. A peer may have died or be stuck; raise "
        "the group's timeout if the operation is legitimately slow.");
  }
  outstanding_.pop_front();
}

// Called from a catch block: drops the failed entry and rethrows its error
// with the operation and the group named.
void Throttle::rethrowFor(const Entry& entry) {
  const std::string op = entry.op;
  std::string what = "unknown error";
  try {
    throw;
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  outstanding_.pop_front();
  throw std::runtime_error("smp: " + op + " on " + label_ + " failed: " + what);
}

}  // namespace smp

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

void Throttle::admit(const char* op) {
  reapFinished();
  if (enabled() && static_cast<int64_t>(outstanding_.size()) >= limit_) {
    const auto start = Clock::now();
    ++stats_.throttle_waits;
    // Record the blocked time even when the oldest operation throws.
    struct Timer {
      ThrottleStats& stats;
      Clock::time_point start;
      ~Timer() {
        stats.seconds_blocked +=
            std::chrono::duration<double>(Clock::now() - start).count();
      }
    } timer{stats_, start};
    while (static_cast<int64_t>(outstanding_.size()) >= limit_) {
      waitForOldest(op);
    }
  }
}

void Throttle::track(const char* op, std::shared_ptr<Completion> completion) {
  ++stats_.launched;
  if (completion) {
    const int64_t number =
        stats_.launched + untrackedLaunched_.load(std::memory_order_relaxed);
    outstanding_.push_back(
        Entry{op, std::move(completion), number, Clock::now()});
    const auto now = static_cast<int64_t>(outstanding_.size());
    if (now > stats_.peak_outstanding) {
      stats_.peak_outstanding = now;
    }
  } else if (stats_.peak_outstanding == 0) {
    stats_.peak_outstanding = 1;  // it was outstanding while it ran
  }
}

void Throttle::admitBatch(const char* op) {
  std::lock_guard<std::mutex> guard(mu_);
  admit(op);
}

void Throttle::endBatch(const char* op, OpKind kind,
                        std::shared_ptr<Completion> completion) {
  if (kind == OpKind::kPointToPoint) {
    untrackedLaunched_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  std::lock_guard<std::mutex> guard(mu_);
  track(op, std::move(completion));
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
  copy.launched += untrackedLaunched_.load(std::memory_order_relaxed);
  copy.outstanding = static_cast<int64_t>(outstanding_.size());
  return copy;
}

namespace {

// The message of the exception being handled.
std::string currentWhat() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

// Collectives of one group finish in launch order on every transport we wrap
// (one NCCL stream; Gloo's queue), so scanning stops at the first unfinished.
void Throttle::reapFinished() {
  while (!outstanding_.empty()) {
    bool done = false;
    try {
      done = outstanding_.front().completion->poll();
    } catch (...) {
      failedWhileReaping(currentWhat());
    }
    if (!done) {
      return;
    }
    outstanding_.pop_front();
  }
}

void Throttle::waitForOldest(const char* blocked) {
  const auto waitStart = Clock::now();
  bool done = false;
  try {
    done = outstanding_.front().completion->wait(timeout_);
  } catch (...) {
    failedWhileWaiting(blocked, waitStart, currentWhat(), /*threw=*/true);
  }
  if (!done) {
    failedWhileWaiting(blocked, waitStart, "", /*threw=*/false);
  }
  outstanding_.pop_front();
}

std::string Throttle::describe(const Entry& entry,
                               Clock::time_point now) const {
  const auto age = std::chrono::duration_cast<std::chrono::milliseconds>(
      now - entry.launchedAt);
  return std::string(entry.op) + ", operation #" +
         std::to_string(entry.number) + " of this group, launched " +
         std::to_string(age.count()) + " ms earlier";
}

// An outstanding operation failed while the throttle reaped finished ones:
// drops it and raises its error, named. Errors of the backend's work handles
// are already named; they are not named twice.
void Throttle::failedWhileReaping(const std::string& what) {
  const std::string op = outstanding_.front().op;
  outstanding_.pop_front();
  const std::string prefix = "smp: " + op + " on " + label_ + " failed";
  if (what.rfind(prefix, 0) == 0) {
    throw std::runtime_error(what);
  }
  throw std::runtime_error(prefix + ": " + what);
}

// The oldest operation failed or timed out while the launch of `blocked`
// waited for its slot: drops it (its slot is released) and raises on the
// blocked launch, naming both and saying the throttle was waiting.
void Throttle::failedWhileWaiting(const char* blocked,
                                  Clock::time_point waitStart,
                                  const std::string& what, bool threw) {
  const auto now = Clock::now();
  const std::string oldest = describe(outstanding_.front(), now);
  outstanding_.pop_front();
  // Transports that throw on timeout (Gloo's) do so once the timeout passed.
  const bool timedOut = !threw || now - waitStart >= timeout_;
  const std::string limit = std::to_string(limit_);
  std::string message = "smp: " + std::string(blocked) + " on " + label_ +
                        (timedOut ? " timed out" : " failed") +
                        " while the throttle (" + setting_ + "=" + limit +
                        ") waited for the oldest outstanding operation (" +
                        oldest + "), which ";
  if (timedOut) {
    message +=
        "did not complete within " + std::to_string(timeout_.count()) + " ms";
  } else {
    message += "failed";
  }
  if (!what.empty()) {
    message += ": " + what;
  }
  message += ". " + std::string(blocked) +
             " was not launched; the oldest operation's slot is released.";
  if (timedOut) {
    message +=
        " A peer may have died or be stuck, or may be waiting for an "
        "operation this rank issues only after " +
        std::string(blocked) + ": at most " + limit +
        " collective(s) of this group can be outstanding (raise " + setting_ +
        ", or set it to -1 to disable the throttle). Raise the group's "
        "timeout if the operation is legitimately slow.";
  }
  throw std::runtime_error(message);
}

}  // namespace smp

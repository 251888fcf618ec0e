#include "work.h"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <utility>

namespace smp {

NamedWork::NamedWork(c10::intrusive_ptr<c10d::Work> inner, const char* op,
                     std::shared_ptr<const std::string> label, bool onDevice)
    : inner_(std::move(inner)),
      op_(op),
      label_(std::move(label)),
      onDevice_(onDevice) {}

template <typename F>
auto NamedWork::named(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (c10::Error& e) {
    // Keeps the error's Python type (RuntimeError, DistBackendError, ...).
    e.add_context(std::string("smp: ") + op_ + " on " + *label_ + " failed");
    throw;
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("smp: ") + op_ + " on " + *label_ +
                             " failed: " + e.what());
  }
}

bool NamedWork::isCompleted() {
  return finished_.load(std::memory_order_acquire) ||
         named([&] { return inner_->isCompleted(); });
}

bool NamedWork::isSuccess() const { return inner_->isSuccess(); }

std::exception_ptr NamedWork::exception() const {
  if (finished_.load(std::memory_order_acquire) && error_) {
    return error_;
  }
  return inner_->exception();
}

int NamedWork::sourceRank() const { return inner_->sourceRank(); }

std::vector<at::Tensor> NamedWork::result() { return inner_->result(); }

void NamedWork::synchronize() {
  named([&] { inner_->synchronize(); });
}

bool NamedWork::wait(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(waitMu_);
  if (finished_.load(std::memory_order_acquire)) {
    if (error_) {
      std::rethrow_exception(error_);  // named already
    }
    return true;
  }
  try {
    const bool done = named([&] {
      const bool ok = inner_->wait(timeout);
      // Future-backed work (torch's FutureWrappingWork) does not throw from
      // wait() when its future failed; a failure must never pass silently.
      if (auto error = inner_->exception()) {
        std::rethrow_exception(error);
      }
      return ok;
    });
    if (done && !onDevice_) {  // see the class comment
      finished_.store(true, std::memory_order_release);
    }
    return done;
  } catch (...) {
    // A failed or timed-out wait is final too: waiting again would wait on
    // a broken (Gloo: drained) inner work for another full timeout.
    error_ = std::current_exception();
    finished_.store(true, std::memory_order_release);
    throw;
  }
}

void NamedWork::abort() { inner_->abort(); }

c10::intrusive_ptr<c10::ivalue::Future> NamedWork::getFuture() {
  return inner_->getFuture();
}

float NamedWork::getDuration() const { return inner_->getDuration(); }

uint64_t NamedWork::getSequencenumber() const {
  return inner_->getSequencenumber();
}

GroupWork::GroupWork(std::vector<c10::intrusive_ptr<c10d::Work>> works)
    : works_(std::move(works)) {}

bool GroupWork::isCompleted() {
  for (auto& work : works_) {
    if (!work->isCompleted()) {
      return false;
    }
  }
  return true;
}

std::exception_ptr GroupWork::exception() const {
  for (const auto& work : works_) {
    if (auto error = work->exception()) {
      return error;
    }
  }
  return nullptr;
}

void GroupWork::synchronize() {
  for (auto& work : works_) {
    work->synchronize();
  }
}

bool GroupWork::wait(std::chrono::milliseconds timeout) {
  // One deadline for the whole batch, not one timeout per member.
  const bool bounded = timeout != ::kNoTimeout;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool all = true;
  for (auto& work : works_) {
    auto left = timeout;
    if (bounded) {
      left = std::max(std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now()),
                      std::chrono::milliseconds(1));
    }
    all = work->wait(left) && all;
  }
  return all;
}

void GroupWork::abort() {
  for (auto& work : works_) {
    work->abort();
  }
}

FutureWork::FutureWork(c10::intrusive_ptr<c10::ivalue::Future> future,
                       const char* op)
    : future_(std::move(future)), op_(op), done_(std::make_shared<Done>()) {
  future_->addCallback([done = done_](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(done->mu);
    done->done = true;
    done->cv.notify_all();
  });
}

bool FutureWork::isCompleted() { return future_->completed(); }

bool FutureWork::isSuccess() const {
  return future_->completed() && !future_->hasError();
}

std::exception_ptr FutureWork::exception() const {
  return future_->completed() && future_->hasError() ? future_->exception_ptr()
                                                     : nullptr;
}

std::vector<at::Tensor> FutureWork::result() {
  return future_->value().toTensorVector();
}

bool FutureWork::wait(std::chrono::milliseconds timeout) {
  if (timeout == ::kNoTimeout) {
    future_->wait();
  } else {
    std::unique_lock<std::mutex> lock(done_->mu);
    if (!done_->cv.wait_for(lock, timeout, [&] { return done_->done; })) {
      C10_THROW_ERROR(DistBackendError, std::string("Timed out waiting ") +
                                            std::to_string(timeout.count()) +
                                            "ms for " + op_ + " to complete");
    }
  }
  if (future_->hasError()) {
    std::rethrow_exception(future_->exception_ptr());
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> FutureWork::getFuture() {
  return future_;
}

}  // namespace smp

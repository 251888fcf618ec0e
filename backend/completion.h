#pragma once

// Adapters that let the throttle see torch's work handles and CUDA streams.

#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <memory>

#include "throttle.h"

namespace smp {

// Polls a c10d::Work. Used for Gloo work (finished by Gloo's threads) and for
// asynchronous NCCL work (isCompleted() queries its end event, never blocks).
class WorkCompletion : public Completion {
 public:
  explicit WorkCompletion(c10::intrusive_ptr<c10d::Work> work);
  bool poll() override;
  bool wait(std::chrono::milliseconds timeout) override;

 private:
  c10::intrusive_ptr<c10d::Work> work_;
};

// Tracks work enqueued on the current stream of `device` by recording an event
// after it. Synchronous NCCL operations run on the current stream and may
// return no Work at all, so they are tracked this way. Built on the
// device-generic c10::Event, so this file needs no CUDA headers.
std::shared_ptr<Completion> completionOnCurrentStream(c10::Device device);

// Blocks until `done()` is true or `timeout` passes, backing off from
// spinning to short sleeps. Returns the last value of `done()`.
bool pollUntil(std::chrono::milliseconds timeout,
               const std::function<bool()>& done);

}  // namespace smp

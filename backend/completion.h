#pragma once

// Adapters that let the throttle see torch's work handles and CUDA streams.

#include <c10/core/Device.h>

#include <memory>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "throttle.h"

namespace smp {

// Sees a c10d::Work. poll() asks isCompleted(). How to block differs:
// - CPU (Gloo) work: Work::wait blocks the CPU, and some Gloo work (torch
//   2.15's reduce_scatter) never reports isCompleted() at all, so it must be
//   waited on.
// - asynchronous NCCL work: wait() only orders streams; isCompleted() queries
//   the end event without blocking, so it is polled.
class WorkCompletion : public Completion {
 public:
  enum class Block { kWait, kPoll };
  WorkCompletion(c10::intrusive_ptr<c10d::Work> work, Block block);
  bool poll() override;
  bool wait(std::chrono::milliseconds timeout) override;

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  Block block_;
};

// Tracks work enqueued on the current stream of `device` by recording an event
// after it. Synchronous NCCL operations run on the current stream and may
// return no Work at all, so they are tracked this way. Built on the
// device-generic c10::Event, so this file needs no CUDA headers.
std::shared_ptr<Completion> completionOnCurrentStream(c10::Device device);

}  // namespace smp

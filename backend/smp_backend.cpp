#include "smp_backend.h"

#include <c10/util/Exception.h>

#include <utility>

#include "completion.h"
#include "work.h"

namespace smp {

namespace {

using c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;

at::Device deviceOf(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK_VALUE(!tensors.empty(), "smp: ", op,
                    " was given no tensors; pass at least one tensor");
  return tensors.front().device();
}

bool sameSizes(const std::vector<at::Tensor>& outputs,
               const std::vector<at::Tensor>& inputs) {
  for (const auto* list : {&outputs, &inputs}) {
    for (const auto& t : *list) {
      if (t.sizes() != inputs.front().sizes()) {
        return false;
      }
    }
  }
  return true;
}

std::string label(const std::string& group, const char* transport) {
  return "process group '" + group + "' (" + transport + ")";
}

// Runs `f`, adding the operation and the group to a c10::Error it raises
// (which keeps its Python type).
template <typename F>
auto withContext(const char* op, const std::string& label, F&& f)
    -> decltype(f()) {
  try {
    return f();
  } catch (c10::Error& e) {
    e.add_context("smp: " + std::string(op) + " on " + label + " failed");
    throw;
  }
}

}  // namespace

SmpBackend::SmpBackend(int rank, int size,
                       c10::intrusive_ptr<c10d::Backend> cpu,
                       c10::intrusive_ptr<c10d::Backend> cuda,
                       BackendConfig config)
    : Backend(rank, size), config_(std::move(config)) {
  TORCH_CHECK(cpu, "smp: the Gloo backend for CPU tensors is missing");
  cpu_.backend = std::move(cpu);
  cpu_.label = std::make_shared<const std::string>(
      label(config_.group_name, "cpu/gloo"));
  cuda_.label = std::make_shared<const std::string>(
      label(config_.group_name, "cuda/nccl"));
  cpu_.throttle =
      std::make_unique<Throttle>(config_.cpu_limit, config_.timeout,
                                 *cpu_.label, "SMP_GLOO_THROTTLE_LIMIT");
  cuda_.backend = std::move(cuda);
  cuda_.throttle =
      std::make_unique<Throttle>(config_.nccl_limit, config_.timeout,
                                 *cuda_.label, "SMP_NCCL_THROTTLE_LIMIT");
}

ThrottleStats SmpBackend::stats(c10::DeviceType device) {
  TORCH_CHECK_VALUE(device == c10::kCPU || device == c10::kCUDA,
                    "smp: statistics exist for 'cpu' and 'cuda', not '",
                    c10::DeviceTypeName(device, true), "'");
  return device == c10::kCPU ? cpu_.throttle->stats() : cuda_.throttle->stats();
}

SmpBackend::Route& SmpBackend::routeFor(const char* op,
                                        const at::Device& device) {
  if (device.is_cpu()) {
    return cpu_;
  }
  TORCH_CHECK_VALUE(device.is_cuda(), "smp: ", op, " got a tensor on device '",
                    device.str(),
                    "'; the smp backend carries cpu and cuda tensors only");
  TORCH_CHECK(cuda_.backend, "smp: ", op,
              " got a CUDA tensor, but process group '", config_.group_name,
              "' has no NCCL backend because CUDA was not available when the "
              "group was created. Move the tensor to the CPU, or create the "
              "group on a machine where torch.cuda.is_available().");
  // torch binds the group to a device (init_process_group(device_id=...)) on
  // this object; setBoundDeviceId is not virtual before torch 2.15, so it is
  // passed on to NCCL here rather than by overriding it.
  if (!cuda_.backend->getBoundDeviceId() && getBoundDeviceId()) {
    cuda_.backend->setBoundDeviceId(getBoundDeviceId());
  }
  return cuda_;
}

std::shared_ptr<Completion> SmpBackend::completionFor(const WorkPtr& work,
                                                      const at::Device& device,
                                                      bool asyncOp) {
  if (device.is_cuda() && (!asyncOp || !work)) {
    // Synchronous NCCL work runs on the current stream, maybe with no Work.
    return completionOnCurrentStream(device);
  }
  if (!work) {
    return nullptr;
  }
  return std::make_shared<WorkCompletion>(
      work, device.is_cpu() ? WorkCompletion::Block::kWait
                            : WorkCompletion::Block::kPoll);
}

template <typename Call>
WorkPtr SmpBackend::run(const char* op, const at::Device& device, bool asyncOp,
                        Call&& call) {
  return dispatch(op, OpKind::kCollective, device, asyncOp,
                  std::forward<Call>(call));
}

template <typename Call>
WorkPtr SmpBackend::runPointToPoint(const char* op, const at::Device& device,
                                    Call&& call) {
  return dispatch(op, OpKind::kPointToPoint, device, /*asyncOp=*/true,
                  std::forward<Call>(call));
}

template <typename Call>
WorkPtr SmpBackend::dispatch(const char* op, OpKind kind,
                             const at::Device& device, bool asyncOp,
                             Call&& call) {
  Route& route = routeFor(op, device);
  if (batch_.open) {
    return joinBatch(op, kind, device, route, std::forward<Call>(call));
  }
  c10d::Backend& backend = *route.backend;
  WorkPtr named;
  withContext(op, *route.label, [&] {
    route.throttle->launch(op, kind, [&]() -> std::shared_ptr<Completion> {
      WorkPtr work = call(backend);
      if (work) {
        named = c10::make_intrusive<NamedWork>(work, op, route.label,
                                               device.is_cuda());
      }
      if (kind == OpKind::kPointToPoint) {
        return nullptr;  // tracked by nobody: see throttle.h
      }
      return completionFor(named, device, asyncOp);
    });
  });
  return named;
}

// An operation issued inside a coalesced batch: the batch, not the
// operation, goes through the throttle.
template <typename Call>
WorkPtr SmpBackend::joinBatch(const char* op, OpKind kind,
                              const at::Device& device, Route& route,
                              Call&& call) {
  c10d::Backend& backend = *route.backend;
  if (kind == OpKind::kPointToPoint) {
    batch_.kind = OpKind::kPointToPoint;
  }
  if (device.is_cuda()) {
    // NCCL enqueues the whole batch at endCoalescing: admitted there.
    if (!batch_.nccl) {
      backend.startCoalescing();
      batch_.nccl = true;
      batch_.ncclDevice = device;
    }
    return call(backend);
  }
  if (!batch_.gloo) {
    batch_.gloo = true;
    // Gloo starts each operation as it is issued, so a batch that starts
    // with a collective waits for its slot before the first one.
    if (kind == OpKind::kCollective) {
      route.throttle->admitBatch("coalesced");
    }
  }
  WorkPtr work = withContext(op, *route.label, [&] { return call(backend); });
  if (!work) {
    return work;
  }
  WorkPtr named = c10::make_intrusive<NamedWork>(work, op, route.label,
                                                 /*onDevice=*/false);
  batch_.glooWorks.push_back(named);
  return named;
}

template <typename F>
void SmpBackend::forEachInner(F&& f) {
  f(*cpu_.backend);
  if (cuda_.backend) {
    f(*cuda_.backend);
  }
}

// --- collectives -----------------------------------------------------------

WorkPtr SmpBackend::broadcast(std::vector<at::Tensor>& tensors,
                              const c10d::BroadcastOptions& opts) {
  return run("broadcast", deviceOf(tensors, "broadcast"), opts.asyncOp,
             [&](c10d::Backend& b) { return b.broadcast(tensors, opts); });
}

WorkPtr SmpBackend::allreduce(std::vector<at::Tensor>& tensors,
                              const c10d::AllreduceOptions& opts) {
  return run("all_reduce", deviceOf(tensors, "all_reduce"), opts.asyncOp,
             [&](c10d::Backend& b) { return b.allreduce(tensors, opts); });
}

WorkPtr SmpBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  return run("all_reduce_coalesced", deviceOf(tensors, "all_reduce_coalesced"),
             opts.asyncOp, [&](c10d::Backend& b) {
               return b.allreduce_coalesced(tensors, opts);
             });
}

WorkPtr SmpBackend::reduce(std::vector<at::Tensor>& tensors,
                           const c10d::ReduceOptions& opts) {
  return run("reduce", deviceOf(tensors, "reduce"), opts.asyncOp,
             [&](c10d::Backend& b) { return b.reduce(tensors, opts); });
}

WorkPtr SmpBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                              std::vector<at::Tensor>& inputs,
                              const c10d::AllgatherOptions& opts) {
  return run(
      "all_gather", deviceOf(inputs, "all_gather"), opts.asyncOp,
      [&](c10d::Backend& b) { return b.allgather(outputs, inputs, opts); });
}

WorkPtr SmpBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                    const c10d::AllgatherOptions& opts) {
  return run(
      "all_gather_into_tensor", input.device(), opts.asyncOp,
      [&](c10d::Backend& b) { return b._allgather_base(output, input, opts); });
}

WorkPtr SmpBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  return run("all_gather_coalesced", deviceOf(inputs, "all_gather_coalesced"),
             opts.asyncOp, [&](c10d::Backend& b) {
               return b.allgather_coalesced(outputs, inputs, opts);
             });
}

WorkPtr SmpBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return run("all_gather_into_tensor_coalesced",
             deviceOf(inputs, "all_gather_into_tensor_coalesced"), opts.asyncOp,
             [&](c10d::Backend& b) {
               return b.allgather_into_tensor_coalesced(outputs, inputs, opts);
             });
}

WorkPtr SmpBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                           std::vector<at::Tensor>& inputs,
                           const c10d::GatherOptions& opts) {
  return run("gather", deviceOf(inputs, "gather"), opts.asyncOp,
             [&](c10d::Backend& b) { return b.gather(outputs, inputs, opts); });
}

WorkPtr SmpBackend::scatter(std::vector<at::Tensor>& outputs,
                            std::vector<std::vector<at::Tensor>>& inputs,
                            const c10d::ScatterOptions& opts) {
  return run(
      "scatter", deviceOf(outputs, "scatter"), opts.asyncOp,
      [&](c10d::Backend& b) { return b.scatter(outputs, inputs, opts); });
}

WorkPtr SmpBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                   std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ReduceScatterOptions& opts) {
  return run("reduce_scatter", deviceOf(outputs, "reduce_scatter"),
             opts.asyncOp, [&](c10d::Backend& b) {
               return b.reduce_scatter(outputs, inputs, opts);
             });
}

WorkPtr SmpBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  return run("reduce_scatter_tensor", input.device(), opts.asyncOp,
             [&](c10d::Backend& b) {
               return b._reduce_scatter_base(output, input, opts);
             });
}

WorkPtr SmpBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return run("reduce_scatter_tensor_coalesced",
             deviceOf(inputs, "reduce_scatter_tensor_coalesced"), opts.asyncOp,
             [&](c10d::Backend& b) {
               return b.reduce_scatter_tensor_coalesced(outputs, inputs, opts);
             });
}

WorkPtr SmpBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                  std::vector<int64_t>& outputSplits,
                                  std::vector<int64_t>& inputSplits,
                                  const c10d::AllToAllOptions& opts) {
  return run(
      "all_to_all_single", input.device(), opts.asyncOp, [&](c10d::Backend& b) {
        return b.alltoall_base(output, input, outputSplits, inputSplits, opts);
      });
}

WorkPtr SmpBackend::alltoall(std::vector<at::Tensor>& outputs,
                             std::vector<at::Tensor>& inputs,
                             const c10d::AllToAllOptions& opts) {
  const at::Device device = deviceOf(inputs, "all_to_all");
  if (device.is_cpu() && !sameSizes(outputs, inputs)) {
    return unevenAlltoallOnGloo(outputs, inputs, opts);
  }
  return run(
      "all_to_all", deviceOf(inputs, "all_to_all"), opts.asyncOp,
      [&](c10d::Backend& b) { return b.alltoall(outputs, inputs, opts); });
}

// Gloo's list all_to_all needs equal sizes; NCCL's does not. On CPU, uneven
// lists go through one flat all_to_all_single and are copied back into the
// output list as soon as it completes (from Gloo's thread, via the future).
WorkPtr SmpBackend::unevenAlltoallOnGloo(std::vector<at::Tensor>& outputs,
                                         std::vector<at::Tensor>& inputs,
                                         const c10d::AllToAllOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(),
                    "smp: all_to_all needs one output per input, got ",
                    outputs.size(), " outputs and ", inputs.size(), " inputs");
  std::vector<at::Tensor> flatInputs;
  std::vector<int64_t> inSplits;
  std::vector<int64_t> outSplits;
  int64_t outTotal = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK_VALUE(outputs[i].scalar_type() == inputs[0].scalar_type() &&
                          inputs[i].scalar_type() == inputs[0].scalar_type(),
                      "smp: all_to_all needs one dtype for all tensors");
    flatInputs.push_back(inputs[i].reshape({-1}));
    inSplits.push_back(inputs[i].numel());
    outSplits.push_back(outputs[i].numel());
    outTotal += outputs[i].numel();
  }
  at::Tensor flatIn = at::cat(flatInputs);
  at::Tensor flatOut = at::empty({outTotal}, flatIn.options());
  return run(
      "all_to_all", flatIn.device(), opts.asyncOp, [&](c10d::Backend& b) {
        // Gloo consumes the split vectors: keep a copy for the copy-back.
        std::vector<int64_t> sizes = outSplits;
        WorkPtr flat =
            b.alltoall_base(flatOut, flatIn, outSplits, inSplits, opts);
        auto copied = flat->getFuture()->then(
            [flatOut, flatIn, outputs, sizes](c10::ivalue::Future& done) {
              done.value();  // rethrows the transport's error
              auto pieces = flatOut.split_with_sizes(sizes);
              for (size_t i = 0; i < outputs.size(); ++i) {
                outputs[i].copy_(pieces[i].view(outputs[i].sizes()));
              }
              return c10::IValue(outputs);
            },
            c10::ListType::ofTensors());
        return c10::make_intrusive<FutureWork>(copied, "all_to_all");
      });
}

WorkPtr SmpBackend::send(std::vector<at::Tensor>& tensors, int dstRank,
                         int tag) {
  return runPointToPoint(
      "send", deviceOf(tensors, "send"),
      [&](c10d::Backend& b) { return b.send(tensors, dstRank, tag); });
}

WorkPtr SmpBackend::recv(std::vector<at::Tensor>& tensors, int srcRank,
                         int tag) {
  return runPointToPoint(
      "recv", deviceOf(tensors, "recv"),
      [&](c10d::Backend& b) { return b.recv(tensors, srcRank, tag); });
}

WorkPtr SmpBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return runPointToPoint(
      "recv_anysource", deviceOf(tensors, "recv_anysource"),
      [&](c10d::Backend& b) { return b.recvAnysource(tensors, tag); });
}

WorkPtr SmpBackend::barrier(const c10d::BarrierOptions& opts) {
  // A barrier has no tensor: it runs where torch asked for it (the group's
  // bound device or the current accelerator), falling back to Gloo.
  const at::Device device =
      opts.device.has_value() && opts.device->is_cuda() && hasCuda()
          ? *opts.device
          : at::Device(c10::kCPU);
  return run("barrier", device, opts.asyncOp,
             [&](c10d::Backend& b) { return b.barrier(opts); });
}

// --- coalescing ------------------------------------------------------------

void SmpBackend::startCoalescing() {
  TORCH_CHECK(!batch_.open,
              "smp: startCoalescing called twice on process group '",
              config_.group_name, "' without endCoalescing in between");
  batch_ = Batch{};
  batch_.open = true;
}

WorkPtr SmpBackend::endCoalescing() {
  TORCH_CHECK(batch_.open, "smp: endCoalescing on process group '",
              config_.group_name, "' without startCoalescing");
  Batch batch = std::move(batch_);
  batch_ = Batch{};
  if (batch.nccl) {
    TORCH_CHECK(!batch.gloo,
                "smp: one coalesced batch mixed CPU and CUDA tensors on "
                "process group '",
                config_.group_name, "'; batch them separately per device");
    WorkPtr named;
    const at::Device device = batch.ncclDevice;
    cuda_.throttle->launch(
        "coalesced", batch.kind, [&]() -> std::shared_ptr<Completion> {
          WorkPtr work = cuda_.backend->endCoalescing();
          if (work) {
            named =
                c10::make_intrusive<NamedWork>(work, "coalesced", cuda_.label,
                                               /*onDevice=*/true);
          }
          if (batch.kind == OpKind::kPointToPoint) {
            return nullptr;
          }
          return completionFor(named, device, /*asyncOp=*/true);
        });
    return named;
  }
  WorkPtr group = c10::make_intrusive<GroupWork>(std::move(batch.glooWorks));
  if (batch.gloo) {
    cpu_.throttle->endBatch(
        "coalesced", batch.kind,
        batch.kind == OpKind::kCollective
            ? completionFor(group, at::Device(c10::kCPU), /*asyncOp=*/true)
            : nullptr);
  }
  return group;
}

// --- group management ------------------------------------------------------

void SmpBackend::setTimeout(std::chrono::milliseconds timeout) {
  forEachInner([&](c10d::Backend& b) { b.setTimeout(timeout); });
}

void SmpBackend::setGroupUid(const std::string& pg_uid) {
  Backend::setGroupUid(pg_uid);
  forEachInner([&](c10d::Backend& b) { b.setGroupUid(pg_uid); });
}

void SmpBackend::monitoredBarrier(const c10d::BarrierOptions& opts,
                                  bool waitAllRanks) {
  cpu_.backend->monitoredBarrier(opts, waitAllRanks);
}

uint64_t SmpBackend::getSequenceNumberForGroup() {
  return cpu_.backend->getSequenceNumberForGroup();
}

void SmpBackend::abort() {
  forEachInner([](c10d::Backend& b) { b.abort(); });
}

void SmpBackend::shutdown() {
  forEachInner([](c10d::Backend& b) { b.shutdown(); });
}

}  // namespace smp

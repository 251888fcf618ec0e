// Python bindings of the smp backend: the extension module smp._C.

#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstdlib>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "smp_backend.h"
#include "throttle.h"

namespace py = pybind11;

namespace smp {

// Holder that drops the GIL while the backend is destroyed, as torch's own
// backends do: destroying ProcessGroupGloo joins its worker threads, which
// may need the GIL to free Python-owned tensors of finished work. Holding
// the GIL there deadlocks. Same layout as c10::intrusive_ptr, which pybind
// relies on when torch returns a Backend that is an SmpBackend.
template <typename T>
class NoGilDestructor {
 public:
  NoGilDestructor() = default;
  NoGilDestructor(const NoGilDestructor&) = default;
  NoGilDestructor(NoGilDestructor&&) noexcept = default;
  NoGilDestructor& operator=(const NoGilDestructor&) = default;
  NoGilDestructor& operator=(NoGilDestructor&&) noexcept = default;
  // NOLINTNEXTLINE(google-explicit-constructor): pybind factories convert.
  NoGilDestructor(c10::intrusive_ptr<T> impl) : impl_(std::move(impl)) {}
  explicit NoGilDestructor(T* raw)
      : impl_(c10::intrusive_ptr<T>::unsafe_reclaim_from_nonowning(raw)) {}
  ~NoGilDestructor() {
    if (impl_ && PyGILState_Check()) {
      py::gil_scoped_release release;
      impl_.reset();
    }
  }
  T& operator*() const noexcept { return *impl_; }
  T* operator->() const noexcept { return impl_.get(); }
  T* get() const noexcept { return impl_.get(); }

 private:
  c10::intrusive_ptr<T> impl_;
};

}  // namespace smp

PYBIND11_DECLARE_HOLDER_TYPE(T, smp::NoGilDestructor<T>, true)

namespace smp {
namespace {

constexpr int64_t kDefaultNcclLimit = 8;
constexpr int64_t kDefaultCpuLimit = -1;  // CPU throttling is opt-in

int64_t limitFromEnv(const char* variable, int64_t fallback) {
  return parseThrottleLimit(variable, std::getenv(variable), fallback);
}

py::dict statsDict(const ThrottleStats& s) {
  py::dict d;
  d["limit"] = s.limit;
  d["launched"] = s.launched;
  d["outstanding"] = s.outstanding;
  d["peak_outstanding"] = s.peak_outstanding;
  d["throttle_waits"] = s.throttle_waits;
  d["seconds_blocked"] = s.seconds_blocked;
  return d;
}

c10::intrusive_ptr<SmpBackend> create(
    int rank, int size, c10::intrusive_ptr<c10d::Backend> cpu,
    std::optional<c10::intrusive_ptr<c10d::Backend>> cuda,
    const std::string& group_name, double timeout_seconds) {
  BackendConfig config;
  config.group_name = group_name;
  config.timeout =
      std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000.0));
  // Read when the group is created, so a bad value fails there.
  config.nccl_limit =
      limitFromEnv("SMP_NCCL_THROTTLE_LIMIT", kDefaultNcclLimit);
  config.cpu_limit = limitFromEnv("SMP_GLOO_THROTTLE_LIMIT", kDefaultCpuLimit);
  return c10::make_intrusive<SmpBackend>(
      rank, size, std::move(cpu), cuda.has_value() ? std::move(*cuda) : nullptr,
      std::move(config));
}

}  // namespace
}  // namespace smp

PYBIND11_MODULE(_C, m) {
  m.doc() = "smp C++ extension: the 'smp' c10d backend and its throttle";
  // Backend's Python type lives in torch's module; it must exist first.
  py::module_::import("torch.distributed");

  py::class_<smp::SmpBackend, c10d::Backend,
             smp::NoGilDestructor<smp::SmpBackend>>(m, "SmpBackend")
      .def(py::init(&smp::create), py::arg("rank"), py::arg("size"),
           py::arg("cpu"), py::arg("cuda"), py::arg("group_name"),
           py::arg("timeout_seconds"))
      .def(
          "stats",
          [](smp::SmpBackend& self, const std::string& device) {
            return smp::statsDict(self.stats(c10::Device(device).type()));
          },
          py::arg("device"))
      .def_property_readonly("has_cuda", &smp::SmpBackend::hasCuda);
}

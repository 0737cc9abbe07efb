// Policies written in Python: any object with the concept's methods, run as a
// DispatchedModel of one of two C++ policies that hold it and call it, the GIL taken per
// decision. `dispatch_mode = "synchronous"`: compute_device() and chunk_rows(batch), once
// per call; "asynchronous": next_chunk(rows_in_flight, remaining) -> (device, rows) or
// None, on_dispatched(device, rows), on_completed(device, rows, seconds), under the
// model's lock (so the object may keep its own state, as a C++ policy's state_type).
// This file only converts and forwards: what the answers mean, and their checks, are the
// protocol's (neml2/detail/policy_protocol.hpp), so a Python policy is asked and refused as a
// C++ one; only a value of the wrong Python type is refused here.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <neml2/dispatch.hpp>

#include "bindings.hpp"

namespace neml2::python {
namespace {

// The result of a policy's method, checked: a FatalError names the method and what it
// returned.
template <class R>
R convert(py::handle value, const char* name);

template <>
std::string convert<std::string>(py::handle value, const char* name) {
  if (!PyUnicode_Check(value.ptr()))
    throw FatalError(std::string("the Python policy's ") + name + "() returned a " +
                     py::str(py::type::of(value).attr("__name__")).cast<std::string>() +
                     "; it must return a device string such as 'cpu'");
  return value.cast<std::string>();
}

template <>
std::int64_t convert<std::int64_t>(py::handle value, const char* name) {
  if (!PyLong_Check(value.ptr()))
    throw FatalError(std::string("the Python policy's ") + name + "() returned a " +
                     py::str(py::type::of(value).attr("__name__")).cast<std::string>() +
                     "; it must return an int");
  int overflow = 0;
  const auto n = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (overflow != 0)
    throw FatalError(std::string("the Python policy's ") + name + "() returned " +
                     py::repr(value).cast<std::string>() + ", beyond a 64-bit integer");
  return static_cast<std::int64_t>(n);
}

template <>
std::optional<ChunkChoice> convert<std::optional<ChunkChoice>>(py::handle value, const char* name) {
  if (value.is_none())
    return std::nullopt;
  if (!PyTuple_Check(value.ptr()) || PyTuple_Size(value.ptr()) != 2 ||
      !PyLong_Check(PyTuple_GET_ITEM(value.ptr(), 0)) ||
      !PyLong_Check(PyTuple_GET_ITEM(value.ptr(), 1)))
    throw FatalError(std::string("the Python policy's ") + name + "() returned " +
                     py::repr(value).cast<std::string>() +
                     "; it must return (device index, rows) or None to wait");
  // Below 0 wraps, as a C++ policy's would: the protocol refuses it, naming it as given.
  return ChunkChoice{
      static_cast<std::size_t>(convert<std::int64_t>(PyTuple_GET_ITEM(value.ptr(), 0), name)),
      convert<std::int64_t>(PyTuple_GET_ITEM(value.ptr(), 1), name)};
}

// Calls object.name(args...) as a callback: a Python exception becomes a FatalError that
// names the method.
template <class R, class... Args>
R call(const Interrupts& pending, const Held& object, const char* name, Args&&... args) {
  return run_callback(
      "the Python policy's " + std::string(name) + "()",
      [&]() -> R {
        auto result = object->attr(name)(std::forward<Args>(args)...);
        if constexpr (!std::is_void_v<R>)
          return convert<R>(result, name);
      },
      pending.get());
}

std::vector<Device> devices_of(const py::object& object) {
  auto listed = object.attr("devices");
  if (PyCallable_Check(listed.ptr()))
    listed = listed();
  std::vector<Device> devices;
  for (const auto& d : listed)
    devices.emplace_back(py::str(d).cast<std::string>());
  return devices;
}

// Its validate(), when it has one.
void validate_object(const Held& object) {
  if (py::gil_scoped_acquire gil; !py::hasattr(*object, "validate"))
    return;
  call<void>(nullptr, object, "validate");
}

// Its cpu_lanes (an int, or a method returning one), read once at load as its devices are; 0
// (torch's intra-op count) without one. Its range is the protocol's to check.
std::int64_t cpu_lanes_of(const py::object& object) {
  if (!py::hasattr(object, "cpu_lanes"))
    return 0;
  auto lanes = object.attr("cpu_lanes");
  if (PyCallable_Check(lanes.ptr()))
    lanes = lanes();
  return convert<std::int64_t>(lanes, "cpu_lanes");
}

// What both modes share: the object, its model's interrupts, validate(), chunks_in_flight()
// (1 when the object has none, as for a C++ policy without the member) and cpu_lanes().
struct PythonPolicy {
  Held object;
  bool has_chunks_in_flight = false;
  Interrupts pending;     // its model's (null in simulate)
  std::int64_t lanes = 0; // its cpu_lanes, read at load

  void validate() const { validate_object(object); }
  [[nodiscard]] std::int64_t cpu_lanes() const { return lanes; }
  [[nodiscard]] std::int64_t chunks_in_flight(std::size_t d) const {
    return has_chunks_in_flight ? call<std::int64_t>(pending, object, "chunks_in_flight", d) : 1;
  }
};

/// A synchronous policy in Python.
struct PythonSynchronousPolicy : PythonPolicy {
  using dispatch_mode = synchronous;

  std::vector<Device> listed;

  [[nodiscard]] const std::vector<Device>& devices() const { return listed; }
  [[nodiscard]] Device compute_device() const {
    return Device(call<std::string>(pending, object, "compute_device"));
  }
  [[nodiscard]] std::int64_t chunk_rows(std::int64_t batch) const {
    return call<std::int64_t>(pending, object, "chunk_rows", batch);
  }
};
static_assert(DispatchPolicy<PythonSynchronousPolicy>);

/// An asynchronous policy in Python: its state is the object's own (the hooks are called
/// one at a time, under the model's lock).
struct PythonAsynchronousPolicy : PythonPolicy {
  using dispatch_mode = asynchronous;

  std::vector<Device> devices;

  [[nodiscard]] std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t> rows_in_flight,
                                                      std::int64_t remaining, no_state&) const {
    const std::vector<std::int64_t> loads(rows_in_flight.begin(), rows_in_flight.end());
    return call<std::optional<ChunkChoice>>(pending, object, "next_chunk", loads, remaining);
  }
  void on_dispatched(std::size_t device, std::int64_t rows, no_state&) const {
    call<void>(pending, object, "on_dispatched", device, rows);
  }
  void on_completed(std::size_t device, std::int64_t rows, double seconds, no_state&) const {
    call<void>(pending, object, "on_completed", device, rows, seconds);
  }
};
static_assert(DispatchPolicy<PythonAsynchronousPolicy>);

void require(const py::object& policy, const char* mode, std::initializer_list<const char*> names) {
  std::string missing;
  for (const auto* name : names)
    if (!py::hasattr(policy, name) || !PyCallable_Check(policy.attr(name).ptr()))
      missing += std::string(missing.empty() ? "" : ", ") + name + "()";
  if (!missing.empty())
    throw FatalError(std::string("a Python policy with dispatch_mode = '") + mode +
                     "' must provide " + missing + " (docs/python.md#policies-written-in-python)");
}

} // namespace

bool is_python_policy(const py::object& policy) {
  return py::hasattr(policy, "dispatch_mode");
}

namespace {

// The C++ policy that holds `policy` and calls it, after checking what its mode needs.
std::variant<PythonSynchronousPolicy, PythonAsynchronousPolicy> wrap(const Held& held,
                                                                     Interrupts pending = {}) {
  const auto& policy = *held;
  const auto mode = py::str(policy.attr("dispatch_mode")).cast<std::string>();
  if (mode != "synchronous" && mode != "asynchronous")
    throw FatalError("a Python policy's dispatch_mode is '" + mode +
                     "'; it must be 'synchronous' or 'asynchronous'");
  if (!py::hasattr(policy, "devices"))
    throw FatalError("a Python policy must provide devices (a list of device strings, or a "
                     "method returning one): the devices it may use");
  PythonPolicy common{held, py::hasattr(policy, "chunks_in_flight"), std::move(pending),
                      cpu_lanes_of(policy)};
  auto devices = devices_of(policy);
  if (mode == "synchronous") {
    require(policy, "synchronous", {"compute_device", "chunk_rows"});
    return PythonSynchronousPolicy{std::move(common), std::move(devices)};
  }
  require(policy, "asynchronous", {"next_chunk", "on_dispatched", "on_completed"});
  return PythonAsynchronousPolicy{std::move(common), std::move(devices)};
}

} // namespace

AnyDispatchedModel load_python_policy(std::shared_ptr<const Artifact> artifact, const Held& policy,
                                      c10::ScalarType dtype, Interrupts pending) {
  return std::visit(
      [&](auto p) {
        py::gil_scoped_release nogil;
        return AnyDispatchedModel(
            DispatchedModel<decltype(p)>(std::move(artifact), std::move(p), dtype));
      },
      wrap(policy, std::move(pending)));
}

std::string simulate_python_policy(const py::object& policy,
                                   const std::vector<SimulatedDevice>& devices, std::int64_t batch,
                                   std::size_t calls) {
  return std::visit(
      [&](const auto& p) {
        return simulation_json(simulate(p, devices, batch, calls),
                               device_strings(listed_devices(p)));
      },
      wrap(hold(policy)));
}

} // namespace neml2::python

#pragma once

// What the binding's translation units share: torch's pybind11 (its headers and its
// at::Tensor / torch.dtype casters, from the torch wheel) and the error family.

#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/Device.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <neml2/any_dispatched_model.hpp>
#include <neml2/errors.hpp>
#include <neml2/simulate.hpp>

// A device given as text ("cuda:1") or as a torch.device, wherever the module takes one;
// given back as text.
template <>
struct pybind11::detail::type_caster<neml2::Device> {
  PYBIND11_TYPE_CASTER(neml2::Device, const_name("str | torch.device"));
  bool load(handle src, bool) {
    if (PyUnicode_Check(src.ptr())) {
      value = neml2::Device(src.cast<std::string>());
      return true;
    }
    if (THPDevice_Check(src.ptr())) {
      value = neml2::Device(reinterpret_cast<THPDevice*>(src.ptr())->device);
      return true;
    }
    return false;
  }
  static handle cast(const neml2::Device& device, return_value_policy, handle) {
    return pybind11::str(device.str()).release();
  }
};

namespace neml2::python {

namespace py = pybind11;

/// Creates the exception family (Error, FatalError, ConvergenceError, AggregateError) in
/// `m` and translates every neml2::Exception (and torch's c10::Error) into it.
void register_errors(py::module_& m);

class PendingInterrupt;

/// The models whose callbacks (an observer, a Python policy's method) this thread is
/// running, by their PendingInterrupt: a configuration of one of them from there would
/// wait for the very call that runs it, so it is refused. Other models may be configured.
extern thread_local std::vector<const PendingInterrupt*> in_callback;

/// Marks the current thread as in a callback of `model` for its lifetime.
struct CallbackMark {
  explicit CallbackMark(const PendingInterrupt* model) { in_callback.push_back(model); }
  ~CallbackMark() { in_callback.pop_back(); }
  CallbackMark(const CallbackMark&) = delete;
  CallbackMark& operator=(const CallbackMark&) = delete;
};

/// A Python object the library keeps (a callback, a policy), shared by its copies and
/// released with the GIL taken, from whichever thread lets go of it last.
using Held = std::shared_ptr<py::object>;
inline Held hold(py::object object) {
  return {new py::object(std::move(object)), [](py::object* p) {
            py::gil_scoped_acquire gil;
            delete p;
          }};
}

/// A BaseException that is not an Exception (KeyboardInterrupt, SystemExit, GeneratorExit)
/// raised by a callback during a model's call: kept while the library fails and cleans up
/// the call as it does for any callback error, then raised unchanged by the call itself
/// (Model::call), so that `except Exception` does not swallow a Ctrl-C. The first one wins.
class PendingInterrupt {
public:
  void keep(py::error_already_set error);
  /// Raises the kept one, if any (the GIL held).
  void raise_if_kept();

private:
  std::mutex _mutex;
  std::optional<py::error_already_set> _error;
};
using Interrupts = std::shared_ptr<PendingInterrupt>;

/// Records which thread is Python's main thread (at import; signals.cpp).
void init_signal_watch();
/// A call starts on this thread: its first question puts the SIGINT handler in front
/// again if `signal.signal` replaced it (signals.cpp).
void starting_call() noexcept;
/// A model's interrupt check: between chunks, once a SIGINT came, Python's signal handlers
/// run (the GIL taken, on the main thread only); what they raise is kept in `pending` and
/// stops the call, which raises it unchanged (signals.cpp).
InterruptCheck python_interrupt_check(Interrupts pending);

/// Runs `f` (Python code the library calls back) with the GIL taken and the thread marked
/// as in a callback of `pending`'s model: a Python Exception becomes a FatalError "<who>
/// raised <message>"; any other BaseException is kept in `pending` (a FatalError fails the
/// call, the call raises it) or, without one, leaves as it is.
template <class F>
auto run_callback(const std::string& who, F&& f, PendingInterrupt* pending = nullptr) {
  py::gil_scoped_acquire gil;
  CallbackMark mark(pending);
  try {
    return f();
  } catch (py::error_already_set& e) {
    if (e.matches(PyExc_Exception))
      throw FatalError(who + " raised " + e.what());
    if (!pending)
      throw;
    const auto what = who + " raised " + e.what() + "; the call stopped and raises it";
    pending->keep(std::move(e));
    throw FatalError(what);
  }
}

/// The name of `value`'s type, for messages.
std::string type_name(py::handle value);

// Conversions (conversions.cpp): the caller's tensors in, the library's out, never copied.

/// A torch.Tensor as the library's tensor; a FatalError naming `where` for anything else.
at::Tensor to_tensor(py::handle value, const std::string& where);
/// A dict of tensors keyed by name as the library's map (the same tensors, no copy); a
/// FatalError naming `what` for anything else.
TensorMap to_map(py::handle value, const char* what);
/// A dict of dicts of tensors (Jacobian blocks J[out][in]).
VariablePairJacobian to_blocks(py::handle value, const char* what);
/// A list or tuple of tensors, in a prepared call's order.
std::vector<at::Tensor> to_list(py::handle value, const char* what);
/// Results as a dict by name, blocks as a dict of dicts: the names in `order` first, in
/// that order (the artifact's outputs, inputs), then any other by name.
py::dict to_dict(const TensorMap& map, const std::vector<std::string>& order = {});
py::dict to_dict(const VariablePairJacobian& blocks, const std::vector<std::string>& outer,
                 const std::vector<std::string>& inner = {});
/// Tensors, or shapes as lists of int, as a Python list.
py::list to_py_list(const std::vector<at::Tensor>& tensors);
py::list to_py_list(const std::vector<Shape>& shapes);

/// Devices as strings.
std::vector<std::string> device_strings(const std::vector<Device>& devices);

/// The artifact of model `name` (optional for one-model stubs) at `path` (model.cpp).
std::shared_ptr<const Artifact> load_artifact(const std::filesystem::path& path,
                                              const std::optional<std::string>& name);

// The module's parts, each adding its classes and functions to `m`.

/// SyncChunking and GreedyPriorityCapacity (value_types.cpp).
void bind_policies(py::module_& m);
/// SolverConfig and KrylovConfig (value_types.cpp).
void bind_solver_config(py::module_& m);
/// Model, PreparedCall, ChunkEvent and load_model (model.cpp).
void bind_model(py::module_& m);

struct Model; // model.hpp
/// PreparedCall, what Model.prepare returns (model_calls.cpp).
void bind_prepared_call(py::module_& m);
/// Model's calls: the five operations in their forms (Model.<op>, Model.<op>_into),
/// _with_parameters and prepare (model_calls.cpp).
void bind_model_calls(py::class_<Model>& model);
/// tuned_policy, artifact info, the tuner and the simulator (tools.cpp).
void bind_tools(py::module_& m);

/// True for an object that declares `dispatch_mode` (a policy written in Python).
bool is_python_policy(const py::object& policy);

/// A model of `artifact` dispatched by a policy written in Python (python_policy.cpp).
AnyDispatchedModel load_python_policy(std::shared_ptr<const Artifact> artifact, const Held& policy,
                                      c10::ScalarType dtype, Interrupts pending);

/// simulate() of a policy written in Python on `devices` (the GIL held throughout), as
/// simulation_json's text.
std::string simulate_python_policy(const py::object& policy,
                                   const std::vector<SimulatedDevice>& devices, std::int64_t batch,
                                   std::size_t calls);

} // namespace neml2::python

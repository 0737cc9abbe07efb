// The model class: Model holds an AnyDispatchedModel of any policy (built-in, or written in
// Python: python_policy.cpp); every call converts its dicts (no copy: the tensors are the
// caller's), releases the GIL for the whole of the library call, and converts the results
// back (no copy either). Configuration (set_parameter, set_solver_config, set_observer)
// waits for running calls to finish (a shared lock), so no Python thread overlaps a call
// with a change forbidden then. Also PreparedCall, ChunkEvent and load_model.

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/grad_mode.h>
#include <pybind11/stl/filesystem.h>

#include <neml2/dispatch.hpp>

#include "bindings.hpp"

namespace neml2::python {

using namespace pybind11::literals;

std::shared_ptr<const Artifact> load_artifact(const std::filesystem::path& path,
                                              const std::optional<std::string>& name) {
  return std::make_shared<const Artifact>(
      read_artifact(name ? resolve_artifact_root(path, *name) : resolve_artifact_root(path)));
}

namespace {

// A Python callable as a ChunkObserver: called with the GIL taken, from whichever thread
// runs the chunk; released under the GIL too. A Python exception becomes a C++ one (its
// message kept), which fails the chunk as any observer error does.
ChunkObserver as_observer(Held callable, Interrupts pending) {
  return [held = std::move(callable), pending = std::move(pending)](const ChunkEvent& event) {
    run_callback(
        "the observer", [&] { (*held)(event); }, pending.get());
  };
}

struct Model {
  Model(AnyDispatchedModel m, py::object p, Interrupts i)
      : model(std::move(m))
      , policy(std::move(p))
      , pending(std::move(i)) {}

  AnyDispatchedModel model;
  py::object policy;               // a copy of a built-in policy; a Python policy itself
  Interrupts pending;              // what its callbacks raise that a call raises again
  mutable std::shared_mutex guard; // calls shared; configuration exclusive
  // The Python objects the library holds for it (a Python policy, the observer), shown to
  // the garbage collector, so that a cycle through them is collected. Changed only with
  // the GIL held.
  Held policy_held, observer_held;

  // tp_traverse: each Python reference the model owns, once.
  int traverse(visitproc visit, void* arg) const {
    Py_VISIT(policy.ptr());
    if (policy_held)
      Py_VISIT(policy_held->ptr());
    if (observer_held)
      Py_VISIT(observer_held->ptr());
    return 0;
  }
  // tp_clear: the references it can drop without touching the library (the callables'
  // own references are then cleared by the collector, which breaks the cycle).
  void clear() {
    policy = py::none();
    policy_held.reset();
    observer_held.reset();
  }

  // f() with the GIL released, beside any other call, after any configuration; a
  // KeyboardInterrupt (or other BaseException) a callback raised leaves unchanged.
  template <class F>
  auto call(F&& f) const {
    starting_call();
    if (alone.load(std::memory_order_relaxed) && in_own_callback())
      throw FatalError("a chunk observer or a Python policy called its model during a call "
                       "that runs alone (a backward with its forward's parameter values), "
                       "which would wait for that call for ever; call it after the call "
                       "returns");
    try {
      py::gil_scoped_release nogil;
      std::shared_lock lock(guard);
      return f();
    } catch (...) {
      pending->raise_if_kept();
      throw;
    }
  }

  // call() as a callable, for the calls' bodies.
  auto runner() const {
    return [this](auto&& f) { return call(f); };
  }

  // f() as call() runs it, but with `given` in place of the model's own parameter values
  // (the operators' backward after a set_parameter runs with its forward's values): alone,
  // no other call running meanwhile, the model's own values put back however f ends.
  template <class F>
  auto call_with_parameters(const TensorMap& given, F&& f) {
    refuse_from_own_callback("ran a backward of its model with other parameter values");
    starting_call();
    try {
      py::gil_scoped_release nogil;
      std::unique_lock lock(guard);
      const ParameterSwap swap(model.named_parameters(), given, alone);
      return f();
    } catch (...) {
      pending->raise_if_kept();
      throw;
    }
  }

  // f() with the GIL released, once no call is running.
  template <class F>
  void configure(F&& f) {
    refuse_from_own_callback("changed its model's configuration (set_parameter, "
                             "set_solver_config or set_observer)");
    py::gil_scoped_release nogil;
    std::unique_lock lock(guard);
    f();
  }

private:
  // Whether this thread runs one of this model's callbacks (an observer, a Python policy).
  bool in_own_callback() const {
    return std::find(in_callback.begin(), in_callback.end(), pending.get()) != in_callback.end();
  }
  // What waits for every call of the model to end, from inside one: refused.
  void refuse_from_own_callback(const std::string& what) const {
    if (in_own_callback())
      throw FatalError("a chunk observer or a Python policy " + what +
                       " during a call, which would wait for that call for ever; do it "
                       "after the call returns");
  }

  // Set while a call runs alone with other parameter values (call_with_parameters).
  std::atomic<bool> alone{false};

  // Other parameter values in the model's map for one call, its own put back after. A
  // given value over the same memory as the model's own (the same tensor, or a view of
  // it with the same layout) is left alone.
  class ParameterSwap {
  public:
    ParameterSwap(TensorMap& params, const TensorMap& given, std::atomic<bool>& flag)
        : _params(params)
        , _flag(flag) {
      for (const auto& [name, value] : given)
        if (!params.count(name))
          throw FatalError("a parameter value given for '" + name +
                           "', which is not a promoted parameter of this model");
      _kept.reserve(given.size());
      for (const auto& [name, value] : given) {
        auto& own = params.at(name);
        if (!same_memory(own, value))
          _kept.emplace_back(name, std::exchange(own, value));
      }
      _flag = true;
    }
    ~ParameterSwap() {
      for (auto& [name, own] : _kept)
        _params.at(name) = std::move(own);
      _flag = false;
    }
    ParameterSwap(const ParameterSwap&) = delete;
    ParameterSwap& operator=(const ParameterSwap&) = delete;

  private:
    static bool same_memory(const at::Tensor& a, const at::Tensor& b) {
      return a.is_same(b) || (a.defined() && b.defined() && a.is_alias_of(b) &&
                              a.storage_offset() == b.storage_offset() && a.sizes() == b.sizes() &&
                              a.strides() == b.strides() && a.dtype() == b.dtype() &&
                              a.is_neg() == b.is_neg() && a.is_conj() == b.is_conj());
    }
    TensorMap& _params;
    std::atomic<bool>& _flag;
    std::vector<std::pair<std::string, at::Tensor>> _kept;
  };
};

// A prepared call, keeping its model alive.
struct Prepared {
  PreparedCall call;
  py::object owner; // the Python Model
  const Model* model;

  // The model, unless the collector cleared this call (only a finalizer could still reach
  // it then).
  const Model& live() const {
    if (owner.is_none())
      throw FatalError("this prepared call's model was collected; prepare the call again");
    return *model;
  }
  int traverse(visitproc visit, void* arg) const {
    Py_VISIT(owner.ptr());
    return 0;
  }
  void clear() { owner = py::none(); } // PreparedCall's destructor never reads the model

  // f() as its model's call, once the inputs and parameters are checked: a prepared call
  // records no graph (NoGraph).
  template <class F>
  auto run(const char* name, const std::vector<at::Tensor>& inputs, F&& f) const;
};

bool has_dict(PyObject* self) {
  return Py_TYPE(self)->tp_dictoffset != 0 ||
         PyType_HasFeature(Py_TYPE(self), Py_TPFLAGS_MANAGED_DICT);
}

// A class whose objects take part in garbage collection: the collector asks T::traverse
// for the Python objects one holds and T::clear to drop them (a cycle through them is
// collected). With py::dynamic_attr, the instance's __dict__ too (pybind11's own
// traverse and clear, which this replaces, visit only that).
template <class T>
py::custom_type_setup collected() {
  return py::custom_type_setup([](PyHeapTypeObject* heap_type) {
    auto* type = &heap_type->ht_type;
    type->tp_flags |= Py_TPFLAGS_HAVE_GC;
    type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) {
      if (has_dict(self)) {
        if (const int stop = py::detail::pybind11_traverse(self, visit, arg))
          return stop; // it visits the type too
      } else {
        Py_VISIT(Py_TYPE(self));
      }
      if (!py::detail::is_holder_constructed(self))
        return 0;
      return py::cast<const T&>(py::handle(self)).traverse(visit, arg);
    };
    type->tp_clear = [](PyObject* self) {
      if (has_dict(self))
        py::detail::pybind11_clear(self);
      if (py::detail::is_holder_constructed(self))
        py::cast<T&>(py::handle(self)).clear();
      return 0;
    };
  });
}

// The evaluation calls' bodies, each running the library's call through `run`: Model::call,
// or Model::call_with_parameters (the operators' backward, _ops.py).
template <class Run>
py::dict forward_call(const Model& self, Run&& run, py::handle inputs,
                      NewtonFactors* factors = nullptr) {
  const auto in = to_map(inputs, "inputs");
  return to_dict(run([&] { return factors ? self.model.forward(in, *factors)
                                          : self.model.forward(in); }),
                 self.model.output_names());
}

template <class Run>
py::tuple jvp_call(const Model& self, Run&& run, py::handle inputs, py::handle tangents) {
  const auto in = to_map(inputs, "inputs");
  const auto t = to_map(tangents, "tangents");
  auto [out, d] = run([&] { return self.model.jvp(in, t); });
  const auto& names = self.model.output_names();
  return py::make_tuple(to_dict(out, names), to_dict(d, names));
}

template <class Run>
py::tuple jacobian_call(const Model& self, Run&& run, py::handle inputs,
                        NewtonFactors* factors = nullptr) {
  const auto in = to_map(inputs, "inputs");
  auto [out, J] =
      run([&] { return factors ? self.model.jacobian(in, *factors) : self.model.jacobian(in); });
  const auto& names = self.model.output_names();
  return py::make_tuple(to_dict(out, names), to_dict(J, names, self.model.input_names()));
}

template <class Run>
py::tuple param_jacobian_call(const Model& self, Run&& run, py::handle inputs) {
  const auto in = to_map(inputs, "inputs");
  auto [out, P] = run([&] { return self.model.param_jacobian(in); });
  const auto& names = self.model.output_names();
  return py::make_tuple(to_dict(out, names), to_dict(P, names));
}

template <class Run>
py::dict param_vjp_call(const Model& self, Run&& run, py::handle inputs, py::handle cotangents) {
  const auto in = to_map(inputs, "inputs");
  const auto c = to_map(cotangents, "cotangents");
  return to_dict(run([&] { return self.model.param_vjp(in, c); }));
}

// torch's rule for out= arguments: a call that writes into given tensors (or a prepared
// call, the library's call alone) records no autograd graph, so while grad mode is on an
// argument that requires grad is refused, before anything is written. Asked inside the
// call (grad mode is the calling thread's), under the model's lock.
class NoGraph {
public:
  NoGraph(std::string call, const char* graph_call)
      : _call(std::move(call))
      , _graph_call(graph_call) {}

  void check(const TensorMap& tensors, const char* what) const {
    if (!at::GradMode::is_enabled())
      return;
    for (const auto& [name, t] : tensors)
      if (t.requires_grad())
        refuse(std::string(what) + "['" + name + "']", "detach it");
  }
  void check(const std::vector<at::Tensor>& tensors, const char* what) const {
    if (!at::GradMode::is_enabled())
      return;
    for (std::size_t k = 0; k < tensors.size(); ++k)
      if (tensors[k].requires_grad())
        refuse(std::string(what) + "[" + std::to_string(k) + "]", "detach it");
  }
  void check_parameters(const AnyDispatchedModel& model) const {
    if (!at::GradMode::is_enabled())
      return;
    for (const auto& [name, t] : model.named_parameters())
      if (t.requires_grad())
        refuse("the model's parameter '" + name + "'", "call requires_grad_(False) on it");
  }

private:
  [[noreturn]] void refuse(const std::string& argument, const char* untie) const {
    throw FatalError(_call + ": " + argument +
                     " requires grad while grad mode is on, but this call records no "
                     "autograd graph (it is the library's call alone; as torch's out= "
                     "arguments, it doesn't support automatic differentiation); call " +
                     _graph_call + " for results with a graph, or " + untie +
                     " (or call under torch.no_grad()) for results without one. Nothing "
                     "was written");
  }
  std::string _call;
  const char* _graph_call;
};

// A NoGraph for `call` that has refused `inputs` and the model's parameters that require
// grad (then the call's other arguments, by check()).
template <class Inputs>
NoGraph no_graph(std::string call, const char* graph_call, const AnyDispatchedModel& model,
                 const Inputs& inputs) {
  NoGraph refusal(std::move(call), graph_call);
  refusal.check(inputs, "inputs");
  refusal.check_parameters(model);
  return refusal;
}

template <class F>
auto Prepared::run(const char* name, const std::vector<at::Tensor>& inputs, F&& f) const {
  const auto& model = live();
  return model.call([&] {
    no_graph(std::string("PreparedCall.") + name, "Model.forward()", model.model, inputs);
    return f();
  });
}

template <class Policy>
bool holds(py::handle policy) {
  return py::isinstance<Policy>(policy);
}

std::unique_ptr<Model> load(const std::filesystem::path& path, py::object name, py::object policy,
                            c10::ScalarType dtype) {
  // load_model(stub, policy): the name left out, as in C++.
  if (!name.is_none() && !PyUnicode_Check(name.ptr()) && policy.is_none()) {
    policy = name;
    name = py::none();
  }
  if (!name.is_none() && !PyUnicode_Check(name.ptr()))
    throw FatalError("load_model(): name is a " + type_name(name) + "; it must be a str or None");
  const auto model_name = name.is_none() ? std::nullopt : std::optional(name.cast<std::string>());
  if (policy.is_none())
    policy = py::cast(SyncChunking{});
  auto pending = std::make_shared<PendingInterrupt>();
  const auto artifact = [&] { return load_artifact(path, model_name); };
  // Loaded with the GIL released; Ctrl-C stops its calls between chunks (signals.cpp).
  const auto made = [&](auto&& make, py::object kept) {
    auto model = std::make_unique<Model>(
        [&] {
          py::gil_scoped_release nogil;
          return AnyDispatchedModel(make());
        }(),
        std::move(kept), pending);
    model->model.set_interrupt_check(python_interrupt_check(pending));
    return model;
  };
  if (holds<SyncChunking>(policy)) {
    auto p = policy.cast<SyncChunking>();
    return made([&] { return DispatchedModel<SyncChunking>(artifact(), p, dtype); }, py::cast(p));
  }
  if (holds<GreedyPriorityCapacity>(policy)) {
    auto p = policy.cast<GreedyPriorityCapacity>();
    return made([&] { return DispatchedModel<GreedyPriorityCapacity>(artifact(), p, dtype); },
                py::cast(p));
  }
  if (is_python_policy(policy)) { // a policy written in Python (python_policy.cpp)
    auto held = hold(policy);
    auto model = std::make_unique<Model>(
        load_python_policy(load_artifact(path, model_name), held, dtype, pending), policy, pending);
    model->model.set_interrupt_check(python_interrupt_check(pending));
    model->policy_held = std::move(held);
    return model;
  }
  throw FatalError("load_model(): policy is a " + type_name(policy) +
                   "; give a neml2_dispatch.SyncChunking or GreedyPriorityCapacity (or "
                   "tuned_policy(...) of one), or a policy written in Python (an object "
                   "with dispatch_mode, devices and the methods of its mode)");
}

} // namespace

void bind_model(py::module_& m) {
  py::class_<ChunkEvent>(m, "ChunkEvent", "One chunk of a call, reported when it completes.")
      .def_readonly("index", &ChunkEvent::index, "Order of assignment within the call.")
      .def_readonly("device_index", &ChunkEvent::device_index,
                    "Position of the device in the policy's list.")
      .def_property_readonly(
          "device", [](const ChunkEvent& e) { return e.device.str(); },
          "That device, as the policy listed it.")
      .def_readonly("first", &ChunkEvent::first, "First row of the batch.")
      .def_readonly("rows", &ChunkEvent::rows, "Number of rows.")
      .def_readonly("seconds", &ChunkEvent::seconds, "From taking the rows to the results.")
      .def_readonly("lane", &ChunkEvent::lane,
                    "The CPU lane that ran it: 0 is the calling thread (and every chunk off "
                    "the CPU); a chunk cut into pieces over the lanes (a whole batch, "
                    "GreedyPriorityCapacity's CPU chunk) is one event, of lane 0.")
      .def("__repr__", [](const ChunkEvent& e) {
        return "ChunkEvent(index=" + std::to_string(e.index) + ", device='" + e.device.str() +
               "', first=" + std::to_string(e.first) + ", rows=" + std::to_string(e.rows) +
               ", lane=" + std::to_string(e.lane) + ")";
      });

  py::class_<Prepared>(m, "PreparedCall",
                       "A call bound once to input names (Model.prepare): tensors in "
                       "`input_names` order, outputs in the model's `output_names` order.",
                       collected<Prepared>())
      .def(
          "forward",
          [](const Prepared& p, py::object inputs) {
            const auto in = to_list(inputs, "inputs");
            return to_py_list(p.run("forward()", in, [&] { return p.call.forward(in); }));
          },
          "inputs"_a,
          "The outputs, in the model's output_names order. No autograd graph: an input or "
          "parameter that requires grad is refused while grad mode is on (Model.forward "
          "records one).")
      .def(
          "forward_into",
          [](const Prepared& p, py::object inputs, py::object outputs) {
            const auto in = to_list(inputs, "inputs");
            const auto out = to_list(outputs, "outputs");
            p.run("forward_into()", in, [&] { p.call.forward_into(in, out); });
          },
          "inputs"_a, "outputs"_a,
          "Into the caller's tensors, one per output in order; refused as forward() is for "
          "arguments that require grad.")
      .def_property_readonly(
          "input_names", [](const Prepared& p) { return p.call.input_names(); },
          "The input names this call takes, in order.");

  py::class_<Model>(m, "Model",
                    "A compiled model dispatched by a policy (load_model). Tensors go in and "
                    "come out as dicts keyed by name, never copied; the GIL is released "
                    "for the whole of every call.",
                    // A model whose observer or policy refers to the model is collected.
                    // Its __dict__ holds what the operators of _ops.py read (torch.compile
                    // traces attributes, not C++ calls).
                    py::dynamic_attr(), collected<Model>())
      .def(
          "forward",
          [](const Model& self, py::object inputs, NewtonFactors* factors) {
            return forward_call(self, self.runner(), inputs, factors);
          },
          "inputs"_a, "factors"_a = py::none(),
          "The outputs by name. With `factors` (NewtonFactors), each point's Newton factor "
          "is kept from call to call: the chord.")
      .def(
          "jvp",
          [](const Model& self, py::object inputs, py::object tangents) {
            return jvp_call(self, self.runner(), inputs, tangents);
          },
          "inputs"_a, "tangents"_a, "(outputs, d(outputs)) along `tangents` (missing = 0).")
      .def(
          "jacobian",
          [](const Model& self, py::object inputs, NewtonFactors* factors) {
            return jacobian_call(self, self.runner(), inputs, factors);
          },
          "inputs"_a, "factors"_a = py::none(),
          "(outputs, J), J[out][in] of shape (B, *in_sub_batch, *out_base, *in_base); a block "
          "that is the same for every row is an expanded view of one. `factors`: as "
          "forward()'s.")
      .def(
          "param_jacobian",
          [](const Model& self, py::object inputs) {
            return param_jacobian_call(self, self.runner(), inputs);
          },
          "inputs"_a, "(outputs, P), P[out][parameter] of shape (B, *out_base, *param_base).")
      .def(
          "param_vjp",
          [](const Model& self, py::object inputs, py::object cotangents) {
            return param_vjp_call(self, self.runner(), inputs, cotangents);
          },
          "inputs"_a, "cotangents"_a,
          "dL/d(parameter) for L = sum of <cotangent, output>, summed over the batch (per row "
          "for a batched parameter).")
      .def(
          "_with_parameters",
          [](Model& self, const std::string& call, py::object parameters,
             py::args args) -> py::object {
            const auto given = to_map(parameters, "parameters");
            const auto run = [&](auto&& f) { return self.call_with_parameters(given, f); };
            const auto arg = [&](std::size_t k) -> py::handle {
              if (k >= args.size())
                throw FatalError("_with_parameters(): " + call +
                                 " takes its arguments after "
                                 "the parameters; " +
                                 std::to_string(args.size()) + " given");
              return args[k];
            };
            if (call == "forward")
              return forward_call(self, run, arg(0));
            if (call == "jvp")
              return jvp_call(self, run, arg(0), arg(1));
            if (call == "jacobian")
              return jacobian_call(self, run, arg(0));
            if (call == "param_jacobian")
              return param_jacobian_call(self, run, arg(0));
            if (call == "param_vjp")
              return param_vjp_call(self, run, arg(0), arg(1));
            throw FatalError("_with_parameters(): no call '" + call + "'");
          },
          "call"_a, "parameters"_a,
          "The library's `call` with `parameters` ({name: tensor}) in place of the model's "
          "own values, alone (no other call of the model meanwhile), the model's own put "
          "back after: what the operators of _ops.py run when they are given values other "
          "than the model's (a backward after set_parameter).")
      .def(
          "forward_into",
          [](const Model& self, py::object inputs, py::object outputs) {
            const auto in = to_map(inputs, "inputs");
            const auto out = to_map(outputs, "outputs");
            self.call([&] {
              no_graph("forward_into()", "forward()", self.model, in);
              self.model.forward_into(in, out);
            });
          },
          "inputs"_a, "outputs"_a,
          "forward(), into the caller's tensors; no autograd graph (an argument that "
          "requires grad is refused while grad mode is on).")
      .def(
          "jvp_into",
          [](const Model& self, py::object inputs, py::object tangents, py::object outputs,
             py::object output_tangents) {
            const auto in = to_map(inputs, "inputs");
            const auto t = to_map(tangents, "tangents");
            const auto out = to_map(outputs, "outputs");
            const auto d = to_map(output_tangents, "output_tangents");
            self.call([&] {
              no_graph("jvp_into()", "jvp()", self.model, in).check(t, "tangents");
              self.model.jvp_into(in, t, out, d);
            });
          },
          "inputs"_a, "tangents"_a, "outputs"_a, "output_tangents"_a,
          "jvp(), into the caller's tensors; no autograd graph, as forward_into().")
      .def(
          "jacobian_into",
          [](const Model& self, py::object inputs, py::object outputs, py::object J) {
            const auto in = to_map(inputs, "inputs");
            const auto out = to_map(outputs, "outputs");
            const auto blocks = to_blocks(J, "J");
            self.call([&] {
              no_graph("jacobian_into()", "jacobian()", self.model, in);
              self.model.jacobian_into(in, out, blocks);
            });
          },
          "inputs"_a, "outputs"_a, "J"_a,
          "jacobian(), into the caller's tensors (a block that is the same for every row: "
          "batched, as jacobian() returns it, or one, unbatched); no autograd graph, as "
          "forward_into().")
      .def(
          "param_jacobian_into",
          [](const Model& self, py::object inputs, py::object outputs, py::object P) {
            const auto in = to_map(inputs, "inputs");
            const auto out = to_map(outputs, "outputs");
            const auto blocks = to_blocks(P, "P");
            self.call([&] {
              no_graph("param_jacobian_into()", "param_jacobian()", self.model, in);
              self.model.param_jacobian_into(in, out, blocks);
            });
          },
          "inputs"_a, "outputs"_a, "P"_a,
          "param_jacobian(), into the caller's tensors; no autograd graph, as forward_into().")
      .def(
          "param_vjp_into",
          [](const Model& self, py::object inputs, py::object cotangents, py::object gradients) {
            const auto in = to_map(inputs, "inputs");
            const auto c = to_map(cotangents, "cotangents");
            const auto g = to_map(gradients, "gradients");
            self.call([&] {
              no_graph("param_vjp_into()", "param_vjp()", self.model, in).check(c, "cotangents");
              self.model.param_vjp_into(in, c, g);
            });
          },
          "inputs"_a, "cotangents"_a, "gradients"_a,
          "param_vjp(), into the caller's tensors; no autograd graph, as forward_into().")
      .def(
          "prepare",
          [](py::object owner, std::optional<std::vector<std::string>> names) {
            const auto& self = owner.cast<const Model&>();
            auto call = self.model.prepare(names.value_or(std::vector<std::string>{}));
            return Prepared{std::move(call), owner, &self};
          },
          "names"_a = py::none(),
          "A call bound once to `names` (default: input_names), for hosts that call with "
          "the same inputs over and over.")
      .def(
          "set_observer",
          [](Model& self, py::object observer) {
            if (!observer.is_none() && !PyCallable_Check(observer.ptr()))
              throw FatalError("set_observer(): observer is a " + type_name(observer) +
                               "; give a callable that takes a ChunkEvent, or None");
            auto held = observer.is_none() ? Held{} : hold(std::move(observer));
            auto fn = held ? as_observer(held, self.pending) : ChunkObserver{};
            self.configure([&] { self.model.set_observer(std::move(fn)); });
            self.observer_held = std::move(held);
          },
          "observer"_a,
          "Calls observer(ChunkEvent) once per chunk, from the thread that ran it (the GIL "
          "taken for it); None turns it off. An exception it raises fails that chunk.")
      .def(
          "named_parameters", [](Model& self) { return to_dict(self.model.named_parameters()); },
          "The promoted parameters by name: the model's own tensors (an in-place change is "
          "seen by the next call).")
      .def(
          "set_parameter",
          [](Model& self, const std::string& name, py::object value) {
            const auto t = to_tensor(value, "set_parameter(): value");
            self.configure([&] { self.model.set_parameter(name, t); });
          },
          "name"_a, "value"_a, "Replaces parameter `name` (its base shape, or batched).")
      .def(
          "solver_config", [](const Model& self) { return self.model.solver_config(); },
          "The Newton settings in force (a copy).")
      .def(
          "set_solver_config",
          [](Model& self, const SolverConfig& config) {
            self.configure([&] { self.model.set_solver_config(config); });
          },
          "config"_a, "Replaces the Newton settings on every device's session (checked first).")
      .def_property_readonly(
          "input_names", [](const Model& self) { return self.model.input_names(); },
          "The inputs' names, in master order.")
      .def_property_readonly(
          "output_names", [](const Model& self) { return self.model.output_names(); },
          "The outputs' names, in master order.")
      .def_property_readonly(
          "input_base_shapes",
          [](const Model& self) { return to_py_list(self.model.input_base_shapes()); },
          "Each input's base shape, as input_names.")
      .def_property_readonly(
          "output_base_shapes",
          [](const Model& self) { return to_py_list(self.model.output_base_shapes()); },
          "Each output's base shape, as output_names.")
      .def_property_readonly(
          "input_sub_batch_shapes",
          [](const Model& self) {
            std::vector<Shape> shapes;
            for (const auto& v : self.model.artifact().inputs)
              shapes.push_back(v.sub_batch_shape);
            return to_py_list(shapes);
          },
          "Each input's sub-batch shape (axes between the batch axis and the base shape, "
          "compiled with --example-batch-shape; [] for most), as input_names.")
      .def_property_readonly(
          "output_shapes", [](const Model& self) { return to_py_list(self.model.output_shapes()); },
          "Each output's shape per row, its sub-batch axes included, as output_names.")
      .def_property_readonly(
          "parameter_base_shapes",
          [](const Model& self) {
            py::dict shapes;
            for (const auto& [name, s] : self.model.parameter_base_shapes())
              shapes[py::str(name)] = std::vector<std::int64_t>(s.begin(), s.end());
            return shapes;
          },
          "Each promoted parameter's base shape, by name.")
      .def_property_readonly(
          "_derivative_pairs",
          [](const Model& self) {
            const auto& a = self.model.artifact();
            const auto public_name = [](const auto& specs, const std::string& name) {
              for (const auto& s : specs)
                if (s.name == name)
                  return s.public_name;
              return name;
            };
            const auto base_of = [](const auto& specs, const std::string& name) {
              for (const auto& s : specs)
                if (s.public_name == name)
                  return s.base_shape;
              return Shape{};
            };
            const auto concat = [](Shape head, const Shape& tail) {
              head.insert(head.end(), tail.begin(), tail.end());
              return head;
            };
            // Each block's shape per row and whether one block serves every row (returned
            // unbatched), as the session's slots hold them (src/session/loading.cpp): a
            // forward segment's pairs (*in_sub_batch, *out_base, *in_base), in its order;
            // a chain's (*out_base, *in_base), each row its own.
            py::list inputs, parameters;
            const auto pairs = self.model.sessions().front().jacobian_pairs();
            for (std::size_t k = 0; k < pairs.size(); ++k) {
              const auto& [o, i] = pairs[k];
              auto shape = concat(base_of(a.outputs, o), base_of(a.inputs, i));
              bool shared = false;
              if (a.single_forward()) {
                const auto& pair =
                    std::get<ForwardSegment>(a.segments.front()).jacobian_pairs.at(k);
                shape = concat(concat(pair.in_sub_batch_shape, pair.out_base_shape),
                               pair.in_base_shape);
                shared = pair.batch_independent;
              }
              inputs.append(py::make_tuple(o, i, shape, shared));
            }
            for (const auto& [o, p] : a.parameter_derivatives)
              parameters.append(
                  py::make_tuple(public_name(a.outputs, o), public_name(a.parameters, p)));
            return py::make_tuple(inputs, parameters);
          },
          "The (output, input, block shape per row, one block for every row) and (output, "
          "parameter) pairs the artifact has derivatives of, by the names callers use (for "
          "the operators of _ops.py).")
      .def_property_readonly(
          "device", [](const Model& self) { return self.model.device().str(); },
          "The first listed device, resolved.")
      .def_property_readonly(
          "devices",
          [](const Model& self) {
            std::vector<std::string> out;
            for (const auto& s : self.model.sessions())
              out.push_back(s.device().str());
            return out;
          },
          "Every listed device, in the policy's order.")
      .def_property_readonly(
          "dtype", [](const Model& self) { return self.model.dtype(); },
          "The dtype the graphs compute in.")
      .def_property_readonly(
          "policy", [](const Model& self) { return self.policy; },
          "The model's copy of a built-in policy; a policy written in Python itself.");

  m.def(
      "load_model",
      [](const std::filesystem::path& path, py::object name, py::object policy,
         c10::ScalarType dtype) { return load(path, std::move(name), std::move(policy), dtype); },
      "path"_a, "name"_a = py::none(), "policy"_a = py::none(), "dtype"_a = c10::kDouble,
      "Loads model `name` from a stub (or an artifact root; the name may be left out when "
      "the stub holds one model), dispatched by `policy` (default: SyncChunking(), whole "
      "batches on the CPU), computing in `dtype`.");
}

} // namespace neml2::python

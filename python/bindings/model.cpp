// The model's Python object: Model (model.hpp) and the function that loads one, its
// configuration, its metadata, and the ChunkEvent its observer gets. Its evaluation calls
// and PreparedCall are in model_calls.cpp.

#include "model.hpp"

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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

// ChunkEvent: what an observer (Model.set_observer) is called with, once per chunk.
void bind_chunk_event(py::module_& m) {
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
}

// The (output, input, block shape per row, one block for every row) and (output,
// parameter) pairs the artifact has derivatives of, by the names callers use
// (Model._derivative_pairs).
py::tuple derivative_pairs(const Model& self) {
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
      const auto& pair = std::get<ForwardSegment>(a.segments.front()).jacobian_pairs.at(k);
      shape = concat(concat(pair.in_sub_batch_shape, pair.out_base_shape), pair.in_base_shape);
      shared = pair.batch_independent;
    }
    inputs.append(py::make_tuple(o, i, shape, shared));
  }
  for (const auto& [o, p] : a.parameter_derivatives)
    parameters.append(py::make_tuple(public_name(a.outputs, o), public_name(a.parameters, p)));
  return py::make_tuple(inputs, parameters);
}

// Model's configuration: its observer, its promoted parameters, its Newton settings.
void bind_configuration(py::class_<Model>& model) {
  model
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
          "config"_a, "Replaces the Newton settings on every device's session (checked first).");
}

// Model's read-only properties: names and shapes, the derivatives it has, devices, dtype
// and policy.
void bind_properties(py::class_<Model>& model) {
  model
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
          "_derivative_pairs", [](const Model& self) { return derivative_pairs(self); },
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
}

} // namespace

void bind_model(py::module_& m) {
  bind_chunk_event(m);
  bind_prepared_call(m); // before Model: Model.prepare's signature names it
  py::class_<Model> model(m, "Model",
                          "A compiled model dispatched by a policy (load_model). Tensors go in and "
                          "come out as dicts keyed by name, never copied; the GIL is released "
                          "for the whole of every call.",
                          // A model whose observer or policy refers to the model is collected.
                          // Its __dict__ holds what the operators of _ops.py read (torch.compile
                          // traces attributes, not C++ calls).
                          py::dynamic_attr(), collected<Model>());
  bind_model_calls(model);
  bind_configuration(model);
  bind_properties(model);

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

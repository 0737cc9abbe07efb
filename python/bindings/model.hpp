#pragma once

// The model's Python object, shared by model.cpp (the object: loading, configuration,
// metadata) and model_calls.cpp (its evaluation calls and PreparedCall's). Model holds an
// AnyDispatchedModel of any policy (built-in, or written in Python: python_policy.cpp);
// configuration (set_parameter, set_solver_config, set_observer) waits for running calls
// to finish (a shared lock), so no Python thread overlaps a call with a change forbidden
// then.

#include <algorithm>
#include <atomic>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"

namespace neml2::python {

// A loaded model as Python holds it (the Model class; load_model makes one).
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
  // records no graph (NoGraph, model_calls.cpp).
  template <class F>
  auto run(const char* name, const std::vector<at::Tensor>& inputs, F&& f) const;
};

// Whether `self`'s type gives its objects a __dict__ (py::dynamic_attr).
inline bool has_dict(PyObject* self) {
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

} // namespace neml2::python

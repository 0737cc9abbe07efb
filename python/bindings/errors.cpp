// The library's error family as Python exceptions: neml2_dispatch.Error (a RuntimeError)
// and its leaves FatalError, ConvergenceError, AggregateError, each carrying the library's
// message and what the C++ error carries (recoverable, details, the converged mask, why
// each row failed and the results, the parts of an aggregate).

#include <cmath>
#include <exception>
#include <string>

#include <c10/util/Exception.h>

#include <neml2/errors.hpp>

#include "bindings.hpp"

namespace neml2::python {
namespace {

const char* const module_name = "neml2_dispatch._core";

py::object error_type(const char* name) {
  return py::module_::import(module_name).attr(name);
}

py::object instance(const char* type, const std::string& message, bool recoverable,
                    const std::string& details) {
  auto error = error_type(type)(message);
  error.attr("recoverable") = recoverable;
  error.attr("details") = details;
  return error;
}

// The Python error for a C++ one (the GIL held); an error that is not ours is rethrown.
py::object as_python_error(const std::exception_ptr& caught) {
  try {
    std::rethrow_exception(caught);
  } catch (const ConvergenceError& e) {
    auto error = instance("ConvergenceError", e.what(), e.recoverable(), e.details());
    error.attr("per_row") = e.per_row();
    error.attr("converged_mask") = e.per_row() ? py::cast(e.converged_mask()) : py::none();
    error.attr("failed_rows") = e.failed_rows();
    error.attr("worst_residual") = e.worst_residual();
    error.attr("reasons") = e.per_row() ? py::cast(e.reasons()) : py::none();
    error.attr("residual_norms") = e.per_row() ? py::cast(e.residual_norms()) : py::none();
    py::dict outputs;
    for (const auto& [name, value] : e.outputs())
      outputs[py::str(name)] = value;
    error.attr("outputs") = outputs;
    py::list results;
    for (const auto& value : e.results())
      results.append(value.defined() ? py::cast(value) : py::none());
    error.attr("results") = results;
    return error;
  } catch (const AggregateError& e) {
    auto error = instance("AggregateError", e.what(), e.recoverable(), e.details());
    py::list parts;
    for (const auto& part : e.errors())
      parts.append(as_python_error(part));
    error.attr("errors") = parts;
    return error;
  } catch (const FatalError& e) {
    return instance("FatalError", e.what(), false, e.details());
  } catch (const Exception& e) {
    return instance("Error", e.what(), e.recoverable(), e.details());
  } catch (const c10::Error& e) {
    // Torch's, from the binding's own tensor work: as the library translates foreign errors.
    const auto fatal = detail::foreign("neml2_dispatch", e);
    return instance("FatalError", fatal.what(), false, fatal.details());
  } catch (const std::exception& e) { // an AggregateError's part that is not ours
    const auto fatal = detail::foreign("neml2_dispatch", e);
    return instance("FatalError", fatal.what(), false, fatal.details());
  }
}

void raise(const py::object& error) {
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
}

py::object new_type(py::module_& m, const char* name, const char* doc, PyObject* base) {
  const auto qualified = std::string("neml2_dispatch.") + name;
  auto type = py::reinterpret_steal<py::object>(
      PyErr_NewExceptionWithDoc(qualified.c_str(), doc, base, nullptr));
  if (!type)
    throw py::error_already_set();
  m.add_object(name, type);
  return type;
}

} // namespace

void PendingInterrupt::keep(py::error_already_set error) {
  const std::lock_guard lock(_mutex);
  if (!_error)
    _error.emplace(std::move(error));
}

void PendingInterrupt::raise_if_kept() {
  std::optional<py::error_already_set> error;
  {
    const std::lock_guard lock(_mutex);
    error.swap(_error);
  }
  if (error)
    throw std::move(*error); // pybind11 restores the Python exception as it was
}

void register_errors(py::module_& m) {
  auto error = new_type(m, "Error",
                        "Base of every error neml2_dispatch raises: the library's message, "
                        "`recoverable` (a retry with other inputs, a smaller step, can "
                        "succeed) and `details` (the full text of a foreign error).",
                        PyExc_RuntimeError);
  error.attr("recoverable") = false;
  error.attr("details") = "";
  new_type(m, "FatalError",
           "A retry would fail the same way: bad input, a malformed artifact, a foreign error.",
           error.ptr());
  auto convergence =
      new_type(m, "ConvergenceError",
               "A nonlinear solve did not converge (recoverable). When `per_row`, "
               "`converged_mask` is the (B,) bool mask of the rows that converged, `outputs` the "
               "outputs by name (converged rows valid, failed rows NaN), `results` the call's "
               "results in the library's positional order, `failed_rows` and `worst_residual` "
               "what failed, `reasons` the (B,) int8 codes of why each row failed (names in "
               "`reason_names`: none, not_converged, non_finite, singular) and `residual_norms` "
               "each failed row's last residual norm ((B,) float64; NaN where not finite, 0 "
               "where the row converged).",
               error.ptr());
  convergence.attr("per_row") = false;
  convergence.attr("converged_mask") = py::none();
  convergence.attr("failed_rows") = 0;
  convergence.attr("worst_residual") = py::float_(std::nan(""));
  convergence.attr("reasons") = py::none();
  convergence.attr("residual_norms") = py::none();
  py::list reason_names; // indexed by the codes of `reasons` (RowFailure)
  for (const auto reason :
       {RowFailure::none, RowFailure::not_converged, RowFailure::non_finite, RowFailure::singular})
    reason_names.append(py::str(std::string(to_string(reason))));
  convergence.attr("reason_names") = py::tuple(reason_names);
  convergence.attr("outputs") = py::dict();
  convergence.attr("results") = py::list();
  auto aggregate = new_type(m, "AggregateError",
                            "Several errors at once (concurrent chunks), in chunk order in "
                            "`errors`; recoverable only if all are.",
                            error.ptr());
  aggregate.attr("errors") = py::list();

  // Local: torch's own functions (same pybind11 internals) keep their translation.
  py::register_local_exception_translator([](std::exception_ptr caught) {
    try {
      if (caught)
        std::rethrow_exception(caught);
    } catch (const Exception&) {
      raise(as_python_error(caught));
    } catch (const c10::Error&) {
      raise(as_python_error(caught));
    } catch (const py::cast_error& e) { // a value pybind11 could not convert: ours too
      raise(as_python_error(std::make_exception_ptr(FatalError(
          std::string("neml2_dispatch: a value of a type it does not take: ") + e.what()))));
    }
  });
}

} // namespace neml2::python

// neml2_dispatch._core: the compiled library from Python. The module's parts: the error
// family (errors.cpp), the value types (value_types.cpp), the model class (model.cpp; its
// calls in model_calls.cpp), the tools (tools.cpp); conversions between Python and the
// library in conversions.cpp.

#include <neml2/version.hpp>

#include "bindings.hpp"

namespace neml2::python {

thread_local std::vector<const PendingInterrupt*> in_callback;

} // namespace neml2::python

PYBIND11_MODULE(_core, m) {
  using namespace neml2::python;
  m.doc() = "neml2_dispatch's compiled core (import neml2_dispatch instead).";
  m.attr("__version__") = neml2::dispatch_version;
  register_errors(m);
  init_signal_watch();
  bind_policies(m);
  bind_solver_config(m);
  bind_model(m);
  bind_tools(m);
}

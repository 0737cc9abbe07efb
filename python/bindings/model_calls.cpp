// The model's evaluation calls: the five operations (forward, jvp, jacobian, param_jacobian,
// param_vjp), each bound from one row of `operations` in its two forms (Model.<op>, which
// returns the results, and Model.<op>_into, which writes them into the caller's tensors),
// the operators' _with_parameters, and prepared calls (Model.prepare, PreparedCall). Every
// call converts its dicts (no copy: the tensors are the caller's), releases the GIL for the
// whole of the library call (Model::call) and converts the results back (no copy either).

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/grad_mode.h>

#include <neml2/dispatch.hpp>

#include "bindings.hpp"
#include "model.hpp"

namespace neml2::python {

using namespace pybind11::literals;

namespace {

// torch's rule for out= arguments: a call that writes into given tensors (or a prepared
// call, the library's call alone) records no autograd graph, so while grad mode is on an
// argument that requires grad is refused, before anything is written. Asked inside the
// call (grad mode is the calling thread's), under the model's lock.
class NoGraph {
public:
  NoGraph(std::string call, std::string graph_call)
      : _call(std::move(call))
      , _graph_call(std::move(graph_call)) {}

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
  std::string _graph_call;
};

// A NoGraph for `call` that has refused `inputs` and the model's parameters that require
// grad (then the call's other arguments, by check()).
template <class Inputs>
NoGraph no_graph(std::string call, std::string graph_call, const AnyDispatchedModel& model,
                 const Inputs& inputs) {
  NoGraph refusal(std::move(call), std::move(graph_call));
  refusal.check(inputs, "inputs");
  refusal.check_parameters(model);
  return refusal;
}

// ---- the five operations, from one table -----------------------------------------------

// Where an argument of an operation's call goes, or a result comes from, in CallArguments.
enum class Slot { inputs, along, factors, values, tangents, blocks };
// The names a result's keys come first in (to_dict's order); by_name: none, only by name.
enum class KeyOrder { by_name, outputs, inputs };

// One Python argument of an operation's form: its name (also the name a conversion error
// gives it), its slot and, for a result, the order of its keys (and of a block's inner
// keys).
struct Argument {
  const char* name = nullptr;
  Slot slot = Slot::inputs;
  KeyOrder order = KeyOrder::outputs;
  KeyOrder inner = KeyOrder::by_name;
};

// An operation as Model binds it: Model.<name>(inputs[, <along>][, factors=None]) returns
// its results (one dict, or a tuple of two); Model.<name>_into(inputs[, <along>],
// <results>...) writes them into the caller's tensors.
struct OperationForms {
  Operation op;
  const char* name;
  const char* along = nullptr; // the dict it takes after inputs (tangents, cotangents)
  bool factors = false;        // the allocating form takes the chord's NewtonFactors
  std::array<Argument, 2> results{};
  const char* doc = nullptr;      // Model.<name>
  const char* into_doc = nullptr; // Model.<name>_into
};

constexpr std::array operations{
    OperationForms{
        .op = Operation::forward,
        .name = "forward",
        .factors = true,
        .results = {{{"outputs", Slot::values}}},
        .doc = "The outputs by name. With `factors` (NewtonFactors), each point's Newton factor "
               "is kept from call to call: the chord.",
        .into_doc = "forward(), into the caller's tensors; no autograd graph (an argument that "
                    "requires grad is refused while grad mode is on)."},
    OperationForms{.op = Operation::jvp,
                   .name = "jvp",
                   .along = "tangents",
                   .results = {{{"outputs", Slot::values}, {"output_tangents", Slot::tangents}}},
                   .doc = "(outputs, d(outputs)) along `tangents` (missing = 0).",
                   .into_doc =
                       "jvp(), into the caller's tensors; no autograd graph, as forward_into()."},
    OperationForms{
        .op = Operation::jacobian,
        .name = "jacobian",
        .factors = true,
        .results = {{{"outputs", Slot::values},
                     {"J", Slot::blocks, KeyOrder::outputs, KeyOrder::inputs}}},
        .doc = "(outputs, J), J[out][in] of shape (B, *in_sub_batch, *out_base, *in_base); a block "
               "that is the same for every row is an expanded view of one. `factors`: as "
               "forward()'s.",
        .into_doc =
            "jacobian(), into the caller's tensors (a block that is the same for every row: "
            "batched, as jacobian() returns it, or one, unbatched); no autograd graph, as "
            "forward_into()."},
    OperationForms{
        .op = Operation::param_jacobian,
        .name = "param_jacobian",
        .results = {{{"outputs", Slot::values}, {"P", Slot::blocks}}},
        .doc = "(outputs, P), P[out][parameter] of shape (B, *out_base, *param_base).",
        .into_doc =
            "param_jacobian(), into the caller's tensors; no autograd graph, as forward_into()."},
    OperationForms{
        .op = Operation::param_vjp,
        .name = "param_vjp",
        .along = "cotangents",
        .results = {{{"gradients", Slot::values, KeyOrder::by_name}}},
        .doc = "dL/d(parameter) for L = sum of <cotangent, output>, summed over the batch (per row "
               "for a batched parameter).",
        .into_doc =
            "param_vjp(), into the caller's tensors; no autograd graph, as forward_into()."},
};

// A form's Python arguments, in order.
struct Arguments {
  std::array<Argument, 4> list{};
  std::size_t size = 0;

  constexpr void add(const Argument& a) { list[size++] = a; }
};

// Model.<name>(inputs[, along][, factors]), or with `into` Model.<name>_into(inputs[,
// along], results...).
constexpr Arguments arguments(const OperationForms& op, bool into) {
  Arguments a;
  a.add({"inputs", Slot::inputs});
  if (op.along)
    a.add({op.along, Slot::along});
  if (into) {
    for (const auto& r : op.results)
      if (r.name)
        a.add(r);
  } else if (op.factors) {
    a.add({"factors", Slot::factors});
  }
  return a;
}

// One call's arguments, converted: what the library's calls of every operation take, and
// their results (given by the caller for an _into form, or returned by the library).
struct CallArguments {
  TensorMap inputs;
  TensorMap along; // jvp's tangents, param_vjp's cotangents
  NewtonFactors* factors = nullptr;
  TensorMap values;            // the outputs; param_vjp's gradients
  TensorMap tangents;          // jvp's output tangents
  VariablePairJacobian blocks; // jacobian's J, param_jacobian's P
};

// CallArguments' dict of tensors in slot `s` (any slot but blocks and factors).
TensorMap& dict_in(CallArguments& call, Slot s) {
  switch (s) {
  case Slot::inputs:
    return call.inputs;
  case Slot::along:
    return call.along;
  case Slot::tangents:
    return call.tangents;
  case Slot::values:
  case Slot::blocks: // not a dict of tensors: never asked
  case Slot::factors:
    break;
  }
  return call.values;
}

// Converts the Python argument `a` into its slot (a FatalError naming it for a wrong one).
void take(CallArguments& call, const Argument& a, py::handle value) {
  if (a.slot == Slot::blocks)
    call.blocks = to_blocks(value, a.name);
  else
    dict_in(call, a.slot) = to_map(value, a.name);
}
void take(CallArguments& call, const Argument&, NewtonFactors* factors) {
  call.factors = factors;
}

// The library's call of `op` (the slots it reads and writes are CallArguments').
void run_library_call(const AnyDispatchedModel& model, Operation op, CallArguments& c) {
  switch (op) {
  case Operation::forward:
    c.values = c.factors ? model.forward(c.inputs, *c.factors) : model.forward(c.inputs);
    return;
  case Operation::jvp:
    std::tie(c.values, c.tangents) = model.jvp(c.inputs, c.along);
    return;
  case Operation::jacobian:
    std::tie(c.values, c.blocks) =
        c.factors ? model.jacobian(c.inputs, *c.factors) : model.jacobian(c.inputs);
    return;
  case Operation::param_jacobian:
    std::tie(c.values, c.blocks) = model.param_jacobian(c.inputs);
    return;
  case Operation::param_vjp:
    c.values = model.param_vjp(c.inputs, c.along);
    return;
  }
}

// The library's `_into` call of `op`, into the caller's tensors in `c`.
void run_library_call_into(const AnyDispatchedModel& model, Operation op, const CallArguments& c) {
  switch (op) {
  case Operation::forward:
    return model.forward_into(c.inputs, c.values);
  case Operation::jvp:
    return model.jvp_into(c.inputs, c.along, c.values, c.tangents);
  case Operation::jacobian:
    return model.jacobian_into(c.inputs, c.values, c.blocks);
  case Operation::param_jacobian:
    return model.param_jacobian_into(c.inputs, c.values, c.blocks);
  case Operation::param_vjp:
    return model.param_vjp_into(c.inputs, c.along, c.values);
  }
}

// The names `order` puts first (to_dict's order); none for by_name.
const std::vector<std::string>& key_names(const AnyDispatchedModel& model, KeyOrder order) {
  static const std::vector<std::string> by_name;
  switch (order) {
  case KeyOrder::outputs:
    return model.output_names();
  case KeyOrder::inputs:
    return model.input_names();
  case KeyOrder::by_name:
    break;
  }
  return by_name;
}

// Result `r` of a call as a dict (blocks as a dict of dicts).
py::dict result_dict(const AnyDispatchedModel& model, CallArguments& c, const Argument& r) {
  if (r.slot == Slot::blocks)
    return to_dict(c.blocks, key_names(model, r.order), key_names(model, r.inner));
  return to_dict(dict_in(c, r.slot), key_names(model, r.order));
}

// The allocating form's body (and _with_parameters'): the library's call of `op` through
// `run` (Model::call, or Model::call_with_parameters), its results as one dict or a tuple
// of two.
template <class Run>
py::object evaluate(const Model& self, const OperationForms& op, Run&& run, CallArguments& c) {
  run([&] { run_library_call(self.model, op.op, c); });
  if (!op.results[1].name)
    return result_dict(self.model, c, op.results[0]);
  return py::make_tuple(result_dict(self.model, c, op.results[0]),
                        result_dict(self.model, c, op.results[1]));
}

// The _into form's body: no autograd graph, so an argument that requires grad is refused
// (the inputs, the parameters, then tangents or cotangents) before anything is written.
void evaluate_into(const Model& self, const OperationForms& op, const CallArguments& c) {
  self.call([&] {
    const std::string name = op.name;
    auto refusal = no_graph(name + "_into()", name + "()", self.model, c.inputs);
    if (op.along)
      refusal.check(c.along, op.along);
    run_library_call_into(self.model, op.op, c);
  });
}

// Row k of `operations` in one form, as compile-time values: the Python signature of the
// bound function (its parameter and return types, its arguments) is made from them.
template <std::size_t k, bool into>
constexpr Arguments arguments_of = arguments(operations[k], into);

template <std::size_t k, bool into, std::size_t i>
using Parameter = std::conditional_t<arguments_of<k, into>.list[i].slot == Slot::factors,
                                     NewtonFactors*, py::object>;

template <std::size_t k, bool into>
using Return = std::conditional_t<
    into, void, std::conditional_t<operations[k].results[1].name != nullptr, py::tuple, py::dict>>;

template <std::size_t k, bool into, std::size_t i>
auto python_argument() {
  constexpr Argument a = arguments_of<k, into>.list[i];
  if constexpr (a.slot == Slot::factors)
    return py::arg(a.name) = py::none();
  else
    return py::arg(a.name);
}

// Binds operation k's form: Model.<name>, or Model.<name>_into.
template <std::size_t k, bool into, std::size_t... i>
void bind_form(py::class_<Model>& model, std::index_sequence<i...>) {
  constexpr const OperationForms& op = operations[k];
  const std::string name = into ? std::string(op.name) + "_into" : std::string(op.name);
  model.def(
      name.c_str(),
      [](const Model& self, Parameter<k, into, i>... given) -> Return<k, into> {
        CallArguments c;
        (take(c, arguments_of<k, into>.list[i], given), ...); // in order: the first wrong is named
        if constexpr (into)
          evaluate_into(self, operations[k], c);
        else
          return Return<k, into>(evaluate(self, operations[k], self.runner(), c));
      },
      python_argument<k, into, i>()..., into ? op.into_doc : op.doc);
}

// Binds every operation's form `into`, in the table's order.
template <bool into, std::size_t... k>
void bind_forms(py::class_<Model>& model, std::index_sequence<k...>) {
  (bind_form<k, into>(model, std::make_index_sequence<arguments_of<k, into>.size>()), ...);
}

// ---- the other calls -------------------------------------------------------------------

// Model._with_parameters(call, parameters, *args): an allocating form without factors,
// with other parameter values (Model::call_with_parameters).
void bind_with_parameters(py::class_<Model>& model) {
  model.def(
      "_with_parameters",
      [](Model& self, const std::string& call, py::object parameters, py::args args) -> py::object {
        const auto given = to_map(parameters, "parameters");
        const auto run = [&](auto&& f) { return self.call_with_parameters(given, f); };
        for (const auto& op : operations) {
          if (call != op.name)
            continue;
          const auto taken = arguments(op, false);
          const std::size_t dicts = taken.size - (op.factors ? 1 : 0); // factors (last): none
          if (args.size() < dicts)
            throw FatalError("_with_parameters(): " + call +
                             " takes its arguments after the parameters; " +
                             std::to_string(args.size()) + " given");
          CallArguments c;
          for (std::size_t k = 0; k < dicts; ++k)
            take(c, taken.list[k], args[k]);
          return evaluate(self, op, run, c);
        }
        throw FatalError("_with_parameters(): no call '" + call + "'");
      },
      "call"_a, "parameters"_a,
      "The library's `call` with `parameters` ({name: tensor}) in place of the model's "
      "own values, alone (no other call of the model meanwhile), the model's own put "
      "back after: what the operators of _ops.py run when they are given values other "
      "than the model's (a backward after set_parameter).");
}

} // namespace

template <class F>
auto Prepared::run(const char* name, const std::vector<at::Tensor>& inputs, F&& f) const {
  const auto& model = live();
  return model.call([&] {
    no_graph(std::string("PreparedCall.") + name, "Model.forward()", model.model, inputs);
    return f();
  });
}

void bind_prepared_call(py::module_& m) {
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
}

void bind_model_calls(py::class_<Model>& model) {
  constexpr auto each_operation = std::make_index_sequence<operations.size()>();
  bind_forms<false>(model, each_operation);
  bind_with_parameters(model);
  bind_forms<true>(model, each_operation);
  model.def(
      "prepare",
      [](py::object owner, std::optional<std::vector<std::string>> names) {
        const auto& self = owner.cast<const Model&>();
        auto call = self.model.prepare(names.value_or(std::vector<std::string>{}));
        return Prepared{std::move(call), owner, &self};
      },
      "names"_a = py::none(),
      "A call bound once to `names` (default: input_names), for hosts that call with "
      "the same inputs over and over.");
}

} // namespace neml2::python

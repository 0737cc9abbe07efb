#pragma once

// Checks written once for anything with the model surface (Session, DispatchedModel<P>):
// each operation against the eager-NEML2 reference values of one case.

#include <functional>
#include <stdexcept>

#include "reference.hpp"

namespace test {

template <class Model>
void check_forward(const Model& m, const Reference& ref, const std::string& c,
                   double rtol = 1e-10) {
  check_close(m.forward(ref.group(c + "/in")), ref.group(c + "/out"), c + " forward", rtol);
}

template <class Model>
void check_jacobian(const Model& m, const Reference& ref, const std::string& c) {
  const auto [out, J] = m.jacobian(ref.group(c + "/in"));
  check_close(out, ref.group(c + "/out"), c + " jacobian outputs");
  std::size_t blocks = 0;
  for (const auto& o : m.output_names())
    for (const auto& i : m.input_names()) {
      const auto& expected = ref[c + "/jac/" + o + "/" + i];
      const auto& actual = J.at(o).at(i);
      // A batch-independent block comes back unbatched; the eager one is per row.
      check_close(actual, expected, c + " d" + o + "/d" + i, 1e-10, actual.dim() < expected.dim());
      ++blocks;
    }
  CHECK(blocks > 0);
}

template <class Model>
void check_jvp(const Model& m, const Reference& ref, const std::string& c) {
  const auto [out, tangent_out] = m.jvp(ref.group(c + "/in"), ref.group(c + "/tangent"));
  check_close(out, ref.group(c + "/out"), c + " jvp outputs");
  check_close(tangent_out, ref.group(c + "/jvp"), c + " jvp");
}

template <class Model>
void check_param_jacobian(const Model& m, const Reference& ref, const std::string& c) {
  const auto [out, P] = m.param_jacobian(ref.group(c + "/in"));
  check_close(out, ref.group(c + "/out"), c + " param_jacobian outputs");
  for (const auto& o : m.output_names())
    for (const auto& [p, value] : m.named_parameters())
      check_close(P.at(o).at(p), ref[c + "/pjac/" + o + "/" + p], c + " d" + o + "/d" + p);
}

template <class Model>
void check_param_vjp(const Model& m, const Reference& ref, const std::string& c) {
  check_close(m.param_vjp(ref.group(c + "/in"), ref.group(c + "/cot")), ref.group(c + "/pvjp"),
              c + " param_vjp");
}

/// The first parameter batched (one value per row): forward, the parameter Jacobian, and
/// param_vjp per row for it, summed for the unbatched rest.
template <class Model>
void check_batched_parameter(Model& m, const Reference& ref) {
  for (const auto& [name, value] : ref.group("pbatch/param"))
    m.set_parameter(name, value);
  check_forward(m, ref, "pbatch");
  check_param_jacobian(m, ref, "pbatch");
  const auto grads = m.param_vjp(ref.group("pbatch/in"), ref.group("pbatch/cot"));
  check_close(grads.at("elasticity.E"), ref["pbatch/pvjp_rows/elasticity.E"], "per-row dL/dE");
  check_close(grads.at("elasticity.nu"), ref["pbatch/pvjp/elasticity.nu"], "summed dL/dnu");
}

/// Every operation the artifact has graphs for, at batches 1, 2, 7 and 33.
template <class Model>
void check_all_batches(const Model& m, const Reference& ref, bool derivatives, bool parameters) {
  for (const auto* c : {"b1", "b2", "b7", "b33"}) {
    check_forward(m, ref, c);
    if (derivatives) {
      check_jacobian(m, ref, c);
      check_jvp(m, ref, c);
    }
    if (parameters) {
      check_param_jacobian(m, ref, c);
      check_param_vjp(m, ref, c);
    }
  }
}

/// Inputs of batch 0 (or any size) filled with zeros.
template <class Model>
neml2::TensorMap zeros_inputs(const Model& m, std::int64_t batch) {
  neml2::TensorMap inputs;
  for (std::size_t i = 0; i < m.input_names().size(); ++i) {
    auto shape = m.input_base_shapes()[i];
    shape.insert(shape.begin(), batch);
    inputs.emplace(m.input_names()[i], at::zeros(shape, at::kDouble));
  }
  return inputs;
}

/// Batch 0: empty results of the right shapes.
template <class Model>
void check_empty_batch(const Model& m, bool derivatives) {
  const auto inputs = zeros_inputs(m, 0);
  const auto out = m.forward(inputs);
  for (std::size_t o = 0; o < m.output_names().size(); ++o) {
    auto shape = m.output_base_shapes()[o];
    shape.insert(shape.begin(), 0);
    CHECK(out.at(m.output_names()[o]).sizes() == c10::IntArrayRef(shape));
  }
  if (derivatives) {
    const auto [values, J] = m.jacobian(inputs);
    for (const auto& [o, blocks] : J)
      for (const auto& [i, block] : blocks) {
        CHECK(block.size(0) == 0);
        CHECK(block.numel() == 0);
      }
  }
}

/// Every other row's strain `E` (rows 0, 2, ...) cut to a thousandth: in a viscoplastic
/// model's first step those rows stay elastic (converged in a few iterations), the others
/// need many. Returns which rows were cut.
inline at::Tensor every_other_row_elastic(neml2::TensorMap& inputs) {
  const auto rows = inputs.at("E").size(0);
  const auto elastic = at::arange(rows, at::kLong).remainder(2) == 0;
  inputs["E"] = at::where(elastic.unsqueeze(1), inputs["E"] * 1e-3, inputs["E"]);
  return elastic;
}

/// The ConvergenceError `f` throws (a test failure when it throws none).
inline neml2::ConvergenceError convergence_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const neml2::ConvergenceError& e) {
    return e;
  }
  FAIL("expected a ConvergenceError");
  throw std::logic_error("unreachable");
}

} // namespace test

// Which Newton a segment runs (newton_plan.hpp): every rule that picks a strategy.

#include "implicit/newton_plan.hpp"

#include <fmt/format.h>

#include <neml2/errors.hpp>

#include "implicit/lapack_rows.hpp"

namespace neml2::detail {

NewtonShape newton_shape(const ImplicitSegment& segment) {
  NewtonShape shape;
  for (const auto& u : segment.unknowns)
    shape.unknowns += u.var_size;
  shape.krylov = !segment.matvec_package.empty();
  for (const auto* groups :
       {&segment.unknown_groups, &segment.given_groups, &segment.residual_groups})
    for (const auto& g : *groups)
      shape.block_groups = shape.block_groups || g.block;
  return shape;
}

bool has_factor_slot(const NewtonShape& shape) {
  return !shape.krylov;
}

NewtonPlan plan_newton(const NewtonShape& shape, c10::Device device, c10::ScalarType dtype,
                       const SolverConfig& config) {
  NewtonPlan plan;
  plan.unknowns = shape.unknowns;
  plan.device = device;
  plan.dtype = dtype;
  // The row pass and LAPACK's rows compute in double on the CPU (NEML2 compiles implicit
  // models in double); anything else is the graphs'.
  const bool cpu_double = device.is_cpu() && dtype == c10::kDouble;
  const bool row_sized = shape.unknowns <= row_pass_max_unknowns;
  const bool by_lapack = cpu_double && !row_sized && lapack_rows_available();
  if (shape.krylov)
    plan.strategy = NewtonStrategy::krylov;
  else if (shape.block_groups)
    plan.strategy = NewtonStrategy::solve_graph;
  else if (cpu_double && row_sized && config.row_pass)
    plan.strategy = NewtonStrategy::rows;
  else
    plan.strategy = by_lapack ? NewtonStrategy::lapack_rows : NewtonStrategy::solve_graph;
  // The derivatives' solves take A from the jacobian graph (a Krylov segment's too); block
  // groups have no derivative graphs (segment_chain_load.cpp refuses them).
  if (cpu_double && row_sized && config.row_pass)
    plan.derivatives = DerivativeSolve::rows;
  else if (by_lapack)
    plan.derivatives = DerivativeSolve::lapack_rows;
  return plan;
}

NewtonPlan plan_newton(const NewtonGraphs& graphs, std::span<const at::Tensor> u,
                       const SolverConfig& config) {
  const NewtonShape shape{.unknowns = unknowns_per_row(u),
                          .krylov = static_cast<bool>(graphs.matvec),
                          .block_groups = !graphs.dense_blocks};
  return plan_newton(shape, u.front().device(), u.front().scalar_type(), config);
}

std::int64_t unknowns_per_row(std::span<const at::Tensor> u) {
  std::int64_t unknowns = 0;
  for (const auto& t : u)
    unknowns += c10::multiply_integers(t.sizes().slice(std::min<std::int64_t>(t.dim(), 1)));
  return unknowns;
}

void check_plan(const NewtonPlan& plan, std::span<const at::Tensor> u) {
  const auto& like = u.front();
  const auto n = unknowns_per_row(u);
  if (n != plan.unknowns || like.device().type() != plan.device.type() ||
      like.scalar_type() != plan.dtype)
    throw FatalError(fmt::format(
        "a Newton solve of {} unknowns a row in {} on {} runs under a plan made for {} in {} "
        "on {}: a bug in neml2-dispatch, please report it",
        n, c10::toString(like.scalar_type()), like.device().str(), plan.unknowns,
        c10::toString(plan.dtype), plan.device.str()));
}

std::string to_string(NewtonStrategy strategy) {
  switch (strategy) {
  case NewtonStrategy::rows:
    return "rows";
  case NewtonStrategy::lapack_rows:
    return "lapack_rows";
  case NewtonStrategy::solve_graph:
    return "solve_graph";
  case NewtonStrategy::krylov:
    return "krylov";
  }
  return "unknown";
}

} // namespace neml2::detail

// A segment's Newton by its plan's strategy (newton.hpp).

#include "implicit/newton.hpp"

#include "implicit/host_reads.hpp"
#include "implicit/newton_rows.hpp"
#include "implicit/tensor_newton.hpp"

namespace neml2::detail {

std::vector<at::Tensor> graph_args(const std::vector<at::Tensor>& u,
                                   const std::vector<at::Tensor>& givens,
                                   const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> args;
  args.reserve(u.size() + givens.size() + params.size());
  args.insert(args.end(), u.begin(), u.end());
  args.insert(args.end(), givens.begin(), givens.end());
  args.insert(args.end(), params.begin(), params.end());
  return args;
}

NewtonResult newton_solve(const NewtonGraphs& graphs, const NewtonPlan& plan,
                          std::vector<at::Tensor> u0, const std::vector<at::Tensor>& givens,
                          const std::vector<at::Tensor>& params, const SolverConfig& config,
                          bool gate_relative, const at::Tensor& factors) {
  check_plan(plan, u0);
  const bool chord = plan.keeps_factors() && (config.chord || factors.defined());
  // The row pass's chord takes no line search; the tensor path's does.
  if (plan.strategy == NewtonStrategy::rows && !(chord && config.ls_max_iters > 2))
    return newton_solve_rows(graphs, std::move(u0), givens, params, config, gate_relative, factors);
  if (chord)
    return newton_solve_tensor_chord(graphs, plan, u0, givens, params, config, gate_relative,
                                     factors);
  return newton_solve_tensors(graphs, plan, std::move(u0), givens, params, config, gate_relative);
}

std::uint64_t newton_host_reads() noexcept {
  return host_reads;
}

} // namespace neml2::detail

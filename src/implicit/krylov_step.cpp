// A Krylov Newton step (tensor_newton.hpp): GMRES on the matvec graph, preconditioned as
// the segment's cache strategy says.

#include <ATen/ATen.h>

#include "implicit/gmres.hpp"
#include "implicit/host_reads.hpp"
#include "implicit/tensor_newton.hpp"

namespace neml2::detail {

// A Krylov Newton step du per unknown group: GMRES on the matvec graph at the working
// set's iterate, for its active rows, with the preconditioner kept as the cache strategy
// says (none: rebuilt every step; chord: built at the first step of the solve; max_its:
// rebuilt for the rows whose last linear solve took more than cache_max_its iterations).
std::vector<at::Tensor> krylov_step(const NewtonGraphs& graphs, WorkingSet& w,
                                    const std::vector<at::Tensor>& params,
                                    const SolverConfig::Krylov& config) {
  const auto args = graph_args(w.u, w.givens, params);
  KrylovOperators ops;
  ops.apply = [&](const at::Tensor& v) {
    auto with_v = args;
    for (auto& part : split_groups(v, w.u))
      with_v.push_back(std::move(part));
    return flatten_groups(graphs.matvec(with_v));
  };
  if (graphs.precond_setup) {
    const bool first = w.precond.empty();
    if (first || config.cache_strategy == "none")
      w.precond = graphs.precond_setup(args);
    else if (config.cache_strategy == "max_its") {
      const auto stale = w.krylov_iterations > config.cache_max_its;
      if (to_host<bool>(stale.any())) {
        auto fresh = graphs.precond_setup(args);
        for (std::size_t k = 0; k < fresh.size(); ++k) {
          auto shape = std::vector<std::int64_t>(static_cast<std::size_t>(fresh[k].dim()), 1);
          shape[0] = stale.size(0);
          w.precond[k] = at::where(stale.reshape(shape), fresh[k], w.precond[k]);
        }
      }
    }
    ops.precondition = [&](const at::Tensor& r) {
      auto state = w.precond;
      state.push_back(r.contiguous());
      return graphs.precond_apply(state).front();
    };
  }
  auto solved = gmres(ops, flatten_groups(w.jacobian), config, w.active);
  w.krylov_iterations = solved.iterations;
  return split_groups(solved.x, w.u);
}

} // namespace neml2::detail

// GMRES settings checked, for the metadata reader and for set_solver_config alike.

#include <fmt/format.h>

#include <neml2/artifact.hpp>

namespace neml2::detail {

std::optional<std::string> check_krylov(const SolverConfig::Krylov& k) {
  if (k.method != "gmres")
    return fmt::format("method is '{}'; the Krylov methods run here: gmres", k.method);
  if (k.cache_strategy != "none" && k.cache_strategy != "chord" && k.cache_strategy != "max_its")
    return fmt::format("cache_strategy is '{}'; the cache strategies run here: none, chord, "
                       "max_its",
                       k.cache_strategy);
  if (k.restart < 1)
    return fmt::format("restart is {}; it must be >= 1", k.restart);
  if (k.max_its < 1)
    return fmt::format("max_its is {}; it must be >= 1", k.max_its);
  if (!(k.abs_tol >= 0) || !(k.rel_tol >= 0))
    return fmt::format("abs_tol is {} and rel_tol {}; both must be >= 0", k.abs_tol, k.rel_tol);
  if (k.cache_max_its < 0)
    return fmt::format("cache_max_its is {}; it must be >= 0", k.cache_max_its);
  return std::nullopt;
}

} // namespace neml2::detail

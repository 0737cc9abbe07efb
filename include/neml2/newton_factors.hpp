#pragma once

/// @file newton_factors.hpp
/// @brief NewtonFactors: each point's factored Newton matrix, kept from one call to the
/// next, so that Newton on a history pays for A only where it changed (the chord).

#include <cstdint>
#include <memory>

namespace at {
class Tensor; // declared only: the slots are the engine's
} // namespace at

namespace neml2 {
namespace detail {
struct NewtonFactorsAccess; // the engine's way in (src/implicit/newton_factors.cpp)
} // namespace detail

/// @brief The chord (SolverConfig::chord) across calls: pass the same object to the
/// forward() or jacobian() calls of a history, over the same points in the same order.
/// Each point then steps from the LU of the last Newton matrix it took, in an earlier step
/// too, and takes A again only where its residual stops falling by `chord_rate` a step.
/// Results meet Newton's convergence test, so they agree with the default's within its
/// tolerance, whatever the factors hold: a batch of another size starts it afresh.
/// @code
/// neml2::NewtonFactors factors;
/// for (int step = 0; step < steps; ++step)
///   state = model.forward(inputs_of(step, state), factors);
/// @endcode
/// Memory: 8 (1 + n + n^2) bytes a point for n unknowns (Chaboche's 19: 3 KB; NEML2's
/// multi-grain model, 92: 68 KB). Applies wherever Newton's steps are direct on the CPU in
/// double (SolverConfig::chord): block groups, large systems and line searches included.
/// Thread safety: one call at a time. A copy shares the slots held when it was made.
class NewtonFactors {
public:
  /// Forgets every point's factor: the next call takes A at every point that iterates.
  void clear() noexcept { _slots.reset(); }
  /// The points it holds slots for (0 before the first call).
  [[nodiscard]] std::int64_t points() const noexcept;
  /// The bytes it holds.
  [[nodiscard]] std::int64_t bytes() const noexcept;

private:
  friend struct detail::NewtonFactorsAccess;
  // (points, width) double on the CPU, each segment's slots side by side; none before the
  // first call
  std::shared_ptr<at::Tensor> _slots;
};

} // namespace neml2

#pragma once

// Newton on the CPU as one pass over the rows between two graph calls (the row pass,
// NewtonStrategy::rows): each row's norm, convergence and failure flags, its LU solve (in
// place of the solve graph), its update and its place in the compacted working set, in
// plain C++ over the graphs' results, with no tensor operation per iteration (the row
// systems: row_system.hpp). RowNewton holds the working set the strategies share; each
// strategy is a file of its own: NEML2's Newton (newton_rows_dense.cpp), its line search
// (newton_rows_line_search.cpp) and the chord (newton_rows_chord.cpp); the working set's
// own steps are in newton_rows.cpp. Private to src/implicit/.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/Tensor.h>

#include <neml2/artifact.hpp>

#include "implicit/newton_graphs.hpp"
#include "implicit/row_system.hpp"

namespace neml2::detail {

/// newton_solve's contract (newton.hpp), on rows. Every row that iterates is in the
/// working set of each graph call, and no other: rows leave it as soon as they converge or
/// fail. A row whose A has a zero or non-finite pivot fails, with its last residual norm.
///
/// The chord (SolverConfig::chord, or `factors` given; not with a line search): a row
/// steps from the LU of the last A it took, and only the residual graph is called, until
/// chord_refactors says so (its ||r|| falls by less than `chord_rate` a step, or would not
/// reach its tolerance within miters at that rate): then it takes A where it is (the
/// jacobian graph on the rows that do, alone). A step from an A taken at an earlier iterate (or
/// call) that does not lower ||r|| is taken back, and A taken where it started. Rows converge by
/// NEML2's test. `factors`: `(B, chord_slot_width(n))` double, contiguous rows, a row's slot kept
/// from call to call (its first value 1 where it holds a factor); none: slots for this solve.
[[nodiscard]] NewtonResult newton_solve_rows(const NewtonGraphs& graphs, std::vector<at::Tensor> u0,
                                             const std::vector<at::Tensor>& givens,
                                             const std::vector<at::Tensor>& params,
                                             const SolverConfig& config, bool gate_relative,
                                             const at::Tensor& factors);

/// One row-pass solve: the working set and the strategies over it.
class RowNewton {
public:
  RowNewton(const NewtonGraphs& graphs, const std::vector<at::Tensor>& params,
            const SolverConfig& config, bool gate_relative, const at::Tensor& factors);
  ~RowNewton();
  RowNewton(const RowNewton&) = delete;
  RowNewton& operator=(const RowNewton&) = delete;

  [[nodiscard]] NewtonResult solve(std::vector<at::Tensor> u0,
                                   const std::vector<at::Tensor>& givens);

private:
  // The strategies: NEML2's Newton (A at every iterate that steps; newton_rows_dense.cpp),
  // its line search, and the chord (newton_rows_chord.cpp). Each returns the iterations.
  std::int64_t newton_iterations();
  std::int64_t pass(const std::vector<at::Tensor>& results, bool has_a, std::int64_t it,
                    bool check);
  void line_search();
  std::int64_t chord_iterations();
  double* slot(std::int64_t batch_row);
  [[nodiscard]] bool too_slow(std::size_t row, double norm, std::int64_t it) const;
  std::int64_t chord_pass(const std::vector<at::Tensor>& results, std::int64_t it);
  std::int64_t refactor();

  // The working set's own steps (newton_rows.cpp).
  [[nodiscard]] std::int64_t size() const { return static_cast<std::int64_t>(_index.size()); }
  [[nodiscard]] std::vector<at::Tensor> call(const GraphFn& graph,
                                             const std::vector<at::Tensor>& u) const;
  [[nodiscard]] std::vector<at::Tensor> call(const GraphFn& graph, const std::vector<at::Tensor>& u,
                                             const std::vector<at::Tensor>& g) const;
  [[nodiscard]] bool converged_at(std::size_t row, double norm, std::int64_t it) const;
  void finish(const Groups& u, std::int64_t i, bool converged);
  void finish_singular(const Groups& u, std::int64_t i);
  void advance(bool move);
  void step_in_place();
  [[nodiscard]] std::uint8_t gate(const double* du, const double* u) const;

  const NewtonGraphs& _graphs;
  const std::vector<at::Tensor>& _params;
  const SolverConfig& _config;
  // The chord asked for (SolverConfig::chord, or factors given); run where it pays.
  const bool _gate, _search, _chord_asked, _chord;

  // The working set: unknowns (ours, updated in place) and givens per group, each row's
  // batch row, first and last ||r||, whether its last update passes the gate, whether it
  // stays, its step and <b, du>.
  std::vector<at::Tensor> _u, _g;
  std::int64_t _n = 0;
  std::vector<std::int64_t> _index;
  std::vector<double> _r0, _norm, _du, _slope;
  std::vector<std::uint8_t> _gate_ok, _keep, _undecided;
  std::vector<std::uint8_t> _singular; // per batch row: failed at a singular A

  // The chord: the caller's slots `(B, width)` (a row's at its batch row), or this solve's
  // own (`_pool`, a row's at `_slot_of`); per row of the working set, whether its last step
  // came from an older factor, ||r|| where that step started, whether it takes A.
  at::Tensor _store;
  std::int64_t _slot_width = 0;
  std::vector<double> _pool;
  std::vector<std::int64_t> _slot_of;
  std::vector<std::uint8_t> _chorded, _need_a;
  std::vector<double> _step_norm;

  std::unique_ptr<Groups> _out;
  double* _out_norm = nullptr;
  bool* _out_converged = nullptr;
};

// The per-row steps every strategy's pass takes, inline in each.

// NEML2's test: row `row` converged at ||r|| = `norm` at check `it`.
inline bool RowNewton::converged_at(std::size_t row, double norm, std::int64_t it) const {
  return norm < _config.atol ||
         (it > 0 && norm < _config.rtol * _r0[row] && (!_gate || _gate_ok[row] != 0));
}

// Row i leaves the working set: its unknowns, norm and flag into the batch's result.
inline void RowNewton::finish(const Groups& u, std::int64_t i, bool converged) {
  const auto row = _index[static_cast<std::size_t>(i)];
  _out->copy_row(row, u, i);
  _out_norm[row] = _norm[static_cast<std::size_t>(i)];
  _out_converged[row] = converged;
}

// Row i fails at a zero or non-finite pivot of its A: no step.
inline void RowNewton::finish_singular(const Groups& u, std::int64_t i) {
  _singular[static_cast<std::size_t>(_index[static_cast<std::size_t>(i)])] = 1;
  finish(u, i, false);
}

// NEML2's gate on the relative test while substepping: ||du|| < substep_del_tol
// (||u|| + atol) at the updated u (the step taken, alpha du with a line search).
inline std::uint8_t RowNewton::gate(const double* du, const double* u) const {
  return !_gate || norm(du, _n) < _config.substep_del_tol * (norm(u, _n) + _config.atol) ? 1 : 0;
}

} // namespace neml2::detail

// The row pass's working set (newton_rows.hpp): the graphs' results are read in place,
// each row's state lives in plain arrays, and the rows still iterating are copied into the
// next call's arguments as the pass goes.

#include "implicit/newton_rows.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include <ATen/ATen.h>

#include "core/stopwatch.hpp"
#include "implicit/row_failures.hpp"
#include "implicit/row_system.hpp"

namespace neml2::detail {

RowNewton::RowNewton(const NewtonGraphs& graphs, const std::vector<at::Tensor>& params,
                     const SolverConfig& config, bool gate_relative, const at::Tensor& factors)
    : _graphs(graphs)
    , _params(params)
    , _config(config)
    , _gate(gate_relative)
    , _search(config.ls_max_iters > 2)
    , _chord_asked((config.chord || factors.defined()) && !_search)
    , _chord(_chord_asked && (!graphs.schedule || graphs.schedule->chord_pays()))
    , _store(factors) {}

RowNewton::~RowNewton() = default;

NewtonResult RowNewton::solve(std::vector<at::Tensor> u0, const std::vector<at::Tensor>& givens) {
  const auto rows = u0.front().size(0);
  for (auto& t : u0) {
    // Ours to update: a guess may be a view of the caller's input.
    _u.push_back(typed(t).reshape({rows, -1}).clone(at::MemoryFormat::Contiguous));
    _n += _u.back().size(1);
  }
  for (const auto& g : givens)
    _g.push_back(typed(g).reshape({rows, -1}).contiguous());
  _index.resize(static_cast<std::size_t>(rows));
  std::iota(_index.begin(), _index.end(), 0);
  _r0.resize(_index.size());
  _norm.resize(_index.size());
  _gate_ok.assign(_index.size(), 0);
  _undecided.assign(_index.size(), 0);
  _singular.assign(_index.size(), 0);

  NewtonResult result;
  result.u = empty_like_rows(_u, rows);
  result.norm = at::empty({rows}, _u.front().options());
  result.converged = at::empty({rows}, _u.front().options().dtype(at::kBool));
  _out = std::make_unique<Groups>(result.u);
  _out_norm = result.norm.data_ptr<double>();
  _out_converged = result.converged.data_ptr<bool>();
  if (rows == 0)
    return result;

  if (_chord) {
    _slot_width = chord_slot_width(_n);
    if (!_store.defined())
      _slot_of.assign(static_cast<std::size_t>(rows), -1);
    result.iterations = chord_iterations();
  } else
    result.iterations = newton_iterations();

  double worst = 0;
  bool not_finite = false, any_failed = false;
  for (std::int64_t r = 0; r < rows; ++r)
    if (!_out_converged[r]) {
      any_failed = true;
      not_finite = not_finite || !std::isfinite(_out_norm[r]);
      worst = std::max(worst, _out_norm[r]);
    }
  result.worst_residual = not_finite ? std::numeric_limits<double>::quiet_NaN() : worst;
  if (any_failed)
    result.reasons = row_failures(result.converged, result.norm, result.u, u0, givens,
                                  at::from_blob(_singular.data(), {rows}, at::kByte).to(at::kBool));
  return result;
}

// A graph at unknowns `u` of the working set (or of rows of it, given `g`).
std::vector<at::Tensor> RowNewton::call(const GraphFn& graph,
                                        const std::vector<at::Tensor>& u) const {
  return call(graph, u, _g);
}

std::vector<at::Tensor> RowNewton::call(const GraphFn& graph, const std::vector<at::Tensor>& u,
                                        const std::vector<at::Tensor>& g) const {
  if (!_graphs.schedule || !_chord_asked) // the costs only decide whether the chord pays
    return call_for_rows(graph, graph_args(u, g, _params));
  const auto start = steady_clock::now();
  auto results = call_for_rows(graph, graph_args(u, g, _params));
  _graphs.schedule->record_cost(&graph == &_graphs.jacobian, u.front().size(0),
                                seconds_since(start));
  return results;
}

// The working set becomes its rows with `_keep` set, in order (gathered into new tensors
// when some left); with `move`, each takes its full step (u += du).
void RowNewton::advance(bool move) {
  const auto m = std::count(_keep.begin(), _keep.end(), 1);
  const auto n = _n;
  if (m == size()) { // every row stays: the step in place, nothing gathered
    if (move)
      step_in_place();
    return;
  }
  std::vector<std::int64_t> from;
  from.reserve(static_cast<std::size_t>(m));
  for (std::int64_t i = 0; i < size(); ++i)
    if (_keep[static_cast<std::size_t>(i)] != 0)
      from.push_back(i);
  auto u = empty_like_rows(_u, m);
  auto g = empty_like_rows(_g, m);
  const Groups old_u(_u), new_u(u), old_g(_g), new_g(g);
  std::vector<std::int64_t> index(from.size());
  // The line search takes du and <b, du> later; the chord may take a step back.
  const bool carry_step = _search || _chord;
  std::vector<double> r0(from.size()), norm(from.size()), slope(from.size()),
      du(carry_step ? from.size() * static_cast<std::size_t>(n) : 0);
  std::vector<std::uint8_t> gate_ok(from.size()), undecided(from.size()),
      chorded(_chord ? from.size() : 0);
  std::vector<double> step_norm(_chord ? from.size() : 0);
  for_rows(m, [&](std::int64_t begin, std::int64_t end) {
    std::vector<double> x(static_cast<std::size_t>(n));
    for (auto j = begin; j < end; ++j) {
      const auto i = from[static_cast<std::size_t>(j)];
      const auto to = static_cast<std::size_t>(j), at = static_cast<std::size_t>(i);
      if (move) {
        old_u.read(i, x.data());
        const double* step = _du.data() + i * n;
        for (std::int64_t k = 0; k < n; ++k)
          x[static_cast<std::size_t>(k)] += step[k];
        new_u.write(j, x.data());
        gate_ok[to] = gate(step, x.data());
      } else {
        new_u.copy_row(j, old_u, i);
        gate_ok[to] = _gate_ok[at];
      }
      new_g.copy_row(j, old_g, i);
      if (carry_step && !_du.empty())
        std::copy_n(_du.data() + i * n, n, du.data() + j * n);
      if (_search && !_slope.empty())
        slope[to] = _slope[at];
      index[to] = _index[at];
      r0[to] = _r0[at];
      norm[to] = _norm[at];
      undecided[to] = _undecided[at];
      if (_chord) {
        chorded[to] = _chorded[at];
        step_norm[to] = _step_norm[at];
      }
    }
  });
  _u = std::move(u);
  _g = std::move(g);
  _index = std::move(index);
  _r0 = std::move(r0);
  _norm = std::move(norm);
  _gate_ok = std::move(gate_ok);
  _undecided = std::move(undecided);
  if (carry_step) {
    _du = std::move(du);
    _slope = std::move(slope);
  }
  if (_chord) {
    _chorded = std::move(chorded);
    _step_norm = std::move(step_norm);
  }
}

// u += du for every row of the working set, group by group (the gate's norms only while
// substepping).
void RowNewton::step_in_place() {
  const auto n = _n;
  std::int64_t first = 0;
  for (const auto& group : _u) {
    auto* u = group.data_ptr<double>();
    const auto width = group.size(1);
    for_rows(size(), [&](std::int64_t begin, std::int64_t end) {
      for (auto i = begin; i < end; ++i)
        for (std::int64_t k = 0; k < width; ++k)
          u[i * width + k] += _du[static_cast<std::size_t>(i * n + first + k)];
    });
    first += width;
  }
  if (!_gate)
    return;
  const Groups u(_u);
  for_rows(size(), [&](std::int64_t begin, std::int64_t end) {
    std::vector<double> x(static_cast<std::size_t>(n));
    for (auto i = begin; i < end; ++i) {
      u.read(i, x.data());
      _gate_ok[static_cast<std::size_t>(i)] = gate(_du.data() + i * n, x.data());
    }
  });
}

NewtonResult newton_solve_rows(const NewtonGraphs& graphs, std::vector<at::Tensor> u0,
                               const std::vector<at::Tensor>& givens,
                               const std::vector<at::Tensor>& params, const SolverConfig& config,
                               bool gate_relative, const at::Tensor& factors) {
  return RowNewton(graphs, params, config, gate_relative, factors).solve(std::move(u0), givens);
}

} // namespace neml2::detail

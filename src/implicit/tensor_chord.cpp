// The chord off the row pass (tensor_newton.hpp): block-structured groups and systems
// beyond the row pass, on the CPU in double. The graphs run on the rows that need them, as
// tensors; each row's step, check and factor are plain C++ over its slot.

#include <cmath>
#include <numeric>

#include <ATen/ATen.h>

#include "implicit/block_groups.hpp"
#include "implicit/host_reads.hpp"
#include "implicit/lapack_rows.hpp"
#include "implicit/newton_plan.hpp"
#include "implicit/newton_schedule.hpp"
#include "implicit/row_failures.hpp"
#include "implicit/row_lu.hpp"
#include "implicit/tensor_newton.hpp"

namespace neml2::detail {
namespace {

double norm_of(const double* x, std::int64_t n) {
  double s = 0;
  for (std::int64_t k = 0; k < n; ++k)
    s += x[k] * x[k];
  return std::sqrt(s);
}

// The rows of a solve a call takes: `rows` of the batch, or all `count` in order (none).
struct RowsTaken {
  const std::vector<std::int64_t>* rows;
  std::int64_t count;

  [[nodiscard]] bool all() const { return rows == nullptr; }
  [[nodiscard]] std::int64_t size() const { return count; }
  [[nodiscard]] std::int64_t operator[](std::int64_t j) const {
    return rows ? (*rows)[static_cast<std::size_t>(j)] : j;
  }
};

// Each group of `flat` (`(B, n)`, contiguous double, the groups side by side) at `rows`,
// shaped like `like`'s (`(B, ...)` each) and contiguous: copied row by row, the one ATen
// call an allocation (narrow, contiguous and index_select were most of a chord call).
std::vector<at::Tensor> groups_at(const at::Tensor& flat, const RowsTaken& rows,
                                  const std::vector<at::Tensor>& like) {
  std::vector<at::Tensor> groups;
  const auto n = flat.size(1);
  const double* from = flat.const_data_ptr<double>();
  std::int64_t offset = 0;
  for (const auto& l : like) {
    auto shape = l.sizes().vec();
    shape[0] = rows.size();
    auto group = at::empty(shape, flat.options());
    const auto width = l.numel() / std::max<std::int64_t>(l.size(0), 1);
    double* to = group.data_ptr<double>();
    for (std::int64_t j = 0; j < rows.size(); ++j)
      std::copy_n(from + rows[j] * n + offset, width, to + j * width);
    groups.push_back(std::move(group));
    offset += width;
  }
  return groups;
}

// Rows `rows` of each of `tensors` (`(B, ...)`, contiguous double), copied row by row.
std::vector<at::Tensor> rows_of(const std::vector<at::Tensor>& tensors, const RowsTaken& rows) {
  if (rows.all())
    return tensors;
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) {
    auto shape = t.sizes().vec();
    shape[0] = rows.size();
    auto taken = at::empty(shape, t.options());
    const auto width = t.numel() / std::max<std::int64_t>(t.size(0), 1);
    const double* from = t.const_data_ptr<double>();
    double* to = taken.data_ptr<double>();
    for (std::int64_t j = 0; j < rows.size(); ++j)
      std::copy_n(from + rows[j] * width, width, to + j * width);
    out.push_back(std::move(taken));
  }
  return out;
}

// `(m, n)` contiguous double from groups `(m, ...)` each, side by side (a call's b).
at::Tensor flat_rows(const std::vector<at::Tensor>& groups, std::int64_t n) {
  const auto m = groups.front().size(0);
  auto flat = at::empty({m, n}, groups.front().options().dtype(at::kDouble));
  double* to = flat.data_ptr<double>();
  std::int64_t offset = 0;
  for (const auto& g : groups) {
    const auto dense = g.to(at::kDouble).contiguous();
    const auto width = dense.numel() / std::max<std::int64_t>(m, 1);
    const double* from = dense.const_data_ptr<double>();
    for (std::int64_t j = 0; j < m; ++j)
      std::copy_n(from + j * width, width, to + j * n + offset);
    offset += width;
  }
  return flat;
}

// A from the jacobian graph's results, `(rows, n, n)` in Newton's layout, contiguous.
at::Tensor dense_a(const NewtonGraphs& graphs, const std::vector<at::Tensor>& results,
                   std::int64_t rows) {
  const std::vector<at::Tensor> blocks(
      results.begin(), results.begin() + static_cast<std::ptrdiff_t>(graphs.a_blocks));
  if (graphs.dense_a)
    return graphs.dense_a(blocks).front().expand({rows, -1, -1}).contiguous();
  const auto residual_groups = results.size() - graphs.a_blocks;
  const auto unknown_groups = graphs.a_blocks / residual_groups;
  std::vector<at::Tensor> block_rows;
  for (std::size_t i = 0; i < residual_groups; ++i) {
    std::vector<at::Tensor> row;
    for (std::size_t j = 0; j < unknown_groups; ++j) {
      const auto& b = blocks[i * unknown_groups + j];
      row.push_back(b.reshape({b.size(0), b.size(1), -1}).expand({rows, -1, -1}));
    }
    block_rows.push_back(at::cat(row, 2));
  }
  return at::cat(block_rows, 1).contiguous();
}

// Where each value of one row of A's blocks goes in that row's n x n A, row-major
// (NewtonGraphs::block_positions): dense_a on blocks that number their values.
std::vector<std::vector<std::int64_t>> block_positions(const NewtonGraphs& graphs,
                                                       const std::vector<at::Tensor>& results,
                                                       std::int64_t n) {
  std::vector<std::vector<std::int64_t>> of_block;
  std::vector<at::Tensor> numbered(results.size());
  for (std::size_t b = 0; b < graphs.a_blocks; ++b) {
    for (std::size_t k = 0; k < results.size(); ++k) {
      auto sizes = results[k].sizes().vec();
      sizes[0] = 1;
      const auto values = c10::multiply_integers(sizes);
      numbered[k] = k == b ? at::arange(1, values + 1, at::kDouble).reshape(sizes)
                           : at::zeros(sizes, at::kDouble);
    }
    const auto a = dense_a(graphs, numbered, 1);
    const double* at = a.data_ptr<double>();
    std::vector<std::int64_t> positions(static_cast<std::size_t>(numbered[b].numel()), -1);
    for (std::int64_t p = 0; p < n * n; ++p)
      if (at[p] != 0)
        positions[static_cast<std::size_t>(at[p]) - 1] = p;
    of_block.push_back(std::move(positions));
  }
  return of_block;
}

// Row j's A into `a` (n x n) from the blocks (`(rows or 1, ...)`, contiguous).
void fill_a(const std::vector<std::vector<std::int64_t>>& of_block,
            const std::vector<at::Tensor>& blocks, std::int64_t j, double* a, std::int64_t n) {
  std::fill(a, a + n * n, 0.0);
  for (std::size_t b = 0; b < of_block.size(); ++b) {
    const auto& positions = of_block[b];
    const auto values = static_cast<std::int64_t>(positions.size());
    const double* from = blocks[b].data_ptr<double>() + (blocks[b].size(0) == 1 ? 0 : j * values);
    for (std::int64_t k = 0; k < values; ++k)
      if (const auto p = positions[static_cast<std::size_t>(k)]; p >= 0)
        a[p] = from[k];
  }
}

// One solve's rows: unknowns `(B, n)`, and per row its state between graph calls.
class TensorChord {
public:
  TensorChord(const NewtonGraphs& graphs, const std::vector<at::Tensor>& params,
              const SolverConfig& config, bool gate, std::int64_t n, const at::Tensor& factors,
              std::int64_t rows)
      : _graphs(graphs)
      , _params(params)
      , _config(config)
      , _gate(gate)
      , _search(config.ls_max_iters > 2)
      , _n(n)
      , _rows(rows)
      , _slots(factors.defined() ? factors : at::zeros({rows, chord_slot_width(n)}, at::kDouble))
      , _r0(static_cast<std::size_t>(rows))
      , _step_norm(static_cast<std::size_t>(rows))
      , _du(static_cast<std::size_t>(rows * n))
      , _chorded(static_cast<std::size_t>(rows))
      , _gate_ok(static_cast<std::size_t>(rows)) {}

  NewtonResult solve(const std::vector<at::Tensor>& u0, const std::vector<at::Tensor>& givens) {
    _u = flatten_groups(u0).to(at::kDouble).clone(at::MemoryFormat::Contiguous);
    _givens.clear();
    for (const auto& g : givens)
      _givens.push_back(g.to(at::kDouble).contiguous());
    _like = u0;
    NewtonResult result;
    result.norm = at::full({_rows}, std::nan(""), _u.options());
    result.converged = at::zeros({_rows}, _u.options().dtype(at::kBool));
    auto singular = at::zeros({_rows}, _u.options().dtype(at::kBool));
    _norm = result.norm.data_ptr<double>();
    _converged = result.converged.data_ptr<bool>();
    _singular = singular.data_ptr<bool>();
    std::vector<std::int64_t> active(static_cast<std::size_t>(_rows));
    std::iota(active.begin(), active.end(), 0);
    for (std::int64_t it = 0; !active.empty(); ++it) {
      active = check(active, it);
      if (!active.empty())
        result.iterations = it + 1;
    }
    result.u = groups_at(_u, {nullptr, _rows}, u0);
    const auto failed = failed_rows(result.converged, result.norm);
    result.worst_residual = failed.worst_residual;
    if (failed.any)
      result.reasons = row_failures(result.converged, result.norm, result.u, u0, givens, singular);
    return result;
  }

private:
  double* slot(std::int64_t row) const {
    return _slots.data_ptr<double>() + row * _slots.stride(0);
  }

  // The graph's results at rows `rows` of the batch (all, in order, when it is the batch).
  std::vector<at::Tensor> call(const GraphFn& graph, const std::vector<std::int64_t>& rows) const {
    const auto m = static_cast<std::int64_t>(rows.size());
    const RowsTaken taken{m == _rows ? nullptr : &rows, m};
    const c10::InferenceMode inference;
    return graph(graph_args(groups_at(_u, taken, _like), rows_of(_givens, taken), _params));
  }

  // Check `it` of the rows in `active`: each leaves, steps from its factor, or takes A
  // (then steps from the new factor); the rows that stepped are returned.
  std::vector<std::int64_t> check(const std::vector<std::int64_t>& active, std::int64_t it) {
    const auto b = flat_rows(call(_graphs.residual, active), _n);
    const double* bp = b.data_ptr<double>();
    const bool last = it + 1 >= _config.miters;
    const auto n = _n;
    std::vector<std::int64_t> stepped, need_a;
    std::vector<std::int64_t> pivot(static_cast<std::size_t>(n));
    for (std::size_t j = 0; j < active.size(); ++j) {
      const auto row = active[j];
      const auto r = static_cast<std::size_t>(row);
      double* u = _u.data_ptr<double>() + row * n;
      double* du = _du.data() + row * n;
      double norm = norm_of(bp + static_cast<std::int64_t>(j) * n, n);
      if (it > 0 && _chorded[r] != 0 && !accepted(norm, _step_norm[r])) {
        for (std::int64_t k = 0; k < n; ++k) // taken back: A where the step started
          u[k] -= du[k];
        _chorded[r] = 0;
        slot(row)[0] = 0;
        _norm[row] = _step_norm[r];
        if (!last)
          need_a.push_back(row);
        continue;
      }
      _norm[row] = norm;
      if (it == 0)
        _r0[r] = norm;
      const bool converged = norm < _config.atol || (it > 0 && norm < _config.rtol * _r0[r] &&
                                                     (!_gate || _gate_ok[r] != 0));
      if (converged || !std::isfinite(norm) || last) {
        _converged[row] = converged;
        continue;
      }
      const double* factor = slot(row);
      if (factor[0] != 1 || (it > 0 && too_slow(r, norm, it))) {
        need_a.push_back(row);
        continue;
      }
      std::copy(bp + static_cast<std::int64_t>(j) * n, bp + static_cast<std::int64_t>(j + 1) * n,
                du);
      for (std::int64_t k = 0; k < n; ++k)
        pivot[static_cast<std::size_t>(k)] = static_cast<std::int64_t>(factor[1 + n * n + k]);
      lu_solve_skipping_zeros(factor + 1, pivot.data(), n, du);
      _chorded[r] = 1;
      _step_norm[r] = norm;
      stepped.push_back(row);
    }
    const auto fresh = refactor(need_a);
    stepped.insert(stepped.end(), fresh.begin(), fresh.end());
    std::sort(stepped.begin(), stepped.end());
    for (auto row : stepped) {
      double* u = _u.data_ptr<double>() + row * n;
      const double* du = _du.data() + row * n;
      for (std::int64_t k = 0; k < n; ++k)
        u[k] += du[k];
      if (_gate)
        _gate_ok[static_cast<std::size_t>(row)] =
            norm_of(du, n) < _config.substep_del_tol * (norm_of(u, n) + _config.atol) ? 1 : 0;
    }
    return stepped;
  }

  // A step from an older factor went far enough: ||r|| fell (by the line search's
  // sufficient decrease at alpha = 1, when there is one).
  [[nodiscard]] bool accepted(double norm, double before) const {
    return _search ? norm * norm <= (1 - _config.ls_c) * before * before : norm < before;
  }

  [[nodiscard]] bool too_slow(std::size_t r, double norm, std::int64_t it) const {
    return chord_refactors(norm / _step_norm[r],
                           norm / std::max(_config.atol, _config.rtol * _r0[r]),
                           _config.miters - it - 1, _config.chord_rate);
  }

  // A at rows `rows` (the jacobian graph on them alone): each row's factor into its slot
  // and its Newton step (along the line search, when there is one); a singular A fails the
  // row. Returns the rows that step.
  std::vector<std::int64_t> refactor(const std::vector<std::int64_t>& rows) {
    if (rows.empty())
      return {};
    const auto results = call(_graphs.jacobian, rows);
    const auto m = static_cast<std::int64_t>(rows.size());
    auto& positions = *_graphs.block_positions;
    std::call_once(positions.found,
                   [&] { positions.of_block = block_positions(_graphs, results, _n); });
    std::vector<at::Tensor> blocks;
    for (std::size_t k = 0; k < _graphs.a_blocks; ++k)
      blocks.push_back(results[k].contiguous());
    const auto b = flat_rows(
        std::vector<at::Tensor>(results.begin() + static_cast<std::ptrdiff_t>(_graphs.a_blocks),
                                results.end()),
        _n);
    const auto n = _n;
    std::vector<std::int64_t> pivot(static_cast<std::size_t>(n)), stepping;
    std::vector<double> scratch;
    for (std::int64_t j = 0; j < m; ++j) {
      const auto row = rows[static_cast<std::size_t>(j)];
      double* factor = slot(row);
      fill_a(positions.of_block, blocks, j, factor + 1, n);
      const bool regular = n > row_pass_max_unknowns
                               ? lapack_lu_factor(factor + 1, n, pivot.data(), scratch)
                               : lu_factor(factor + 1, n, pivot.data());
      if (!regular) {
        factor[0] = 0;
        _singular[row] = true;
        continue;
      }
      for (std::int64_t k = 0; k < n; ++k)
        factor[1 + n * n + k] = static_cast<double>(pivot[static_cast<std::size_t>(k)]);
      factor[0] = 1;
      double* du = _du.data() + row * n;
      std::copy(b.data_ptr<double>() + j * n, b.data_ptr<double>() + (j + 1) * n, du);
      lu_solve_skipping_zeros(factor + 1, pivot.data(), n, du);
      _chorded[static_cast<std::size_t>(row)] = 0;
      _step_norm[static_cast<std::size_t>(row)] = _norm[row];
      stepping.push_back(j);
    }
    if (_search && !stepping.empty())
      search(rows, results, stepping);
    std::vector<std::int64_t> stepped;
    for (auto j : stepping)
      stepped.push_back(rows[static_cast<std::size_t>(j)]);
    return stepped;
  }

  // NEML2's line search along the new steps of rows[stepping] (tensor_newton.cpp's).
  void search(const std::vector<std::int64_t>& rows, const std::vector<at::Tensor>& results,
              const std::vector<std::int64_t>& stepping) {
    const auto n = _n;
    std::vector<std::int64_t> batch_rows;
    for (auto j : stepping)
      batch_rows.push_back(rows[static_cast<std::size_t>(j)]);
    const auto in_results = at::tensor(stepping, at::kLong);
    WorkingSet w;
    const RowsTaken taken{&batch_rows, static_cast<std::int64_t>(batch_rows.size())};
    w.u = groups_at(_u, taken, _like);
    w.givens = rows_of(_givens, taken);
    // A's blocks as they are (the search reads b alone: they may be shared, `(1, ...)`).
    w.jacobian.assign(results.begin(),
                      results.begin() + static_cast<std::ptrdiff_t>(_graphs.a_blocks));
    for (auto k = _graphs.a_blocks; k < results.size(); ++k)
      w.jacobian.push_back(results[k].index_select(0, in_results));
    w.norm = at::empty({static_cast<std::int64_t>(batch_rows.size())}, _u.options());
    auto du = at::empty({w.norm.size(0), n}, _u.options());
    for (std::size_t q = 0; q < batch_rows.size(); ++q) {
      w.norm.data_ptr<double>()[q] = _norm[batch_rows[q]];
      std::copy(_du.data() + batch_rows[q] * n, _du.data() + (batch_rows[q] + 1) * n,
                du.data_ptr<double>() + static_cast<std::int64_t>(q) * n);
    }
    w.r0 = w.norm;
    w.active = at::ones({w.norm.size(0)}, _u.options().dtype(at::kBool));
    const auto alpha =
        line_search(_graphs, w, split_groups(du, w.u), _params, _config).contiguous();
    for (std::size_t q = 0; q < batch_rows.size(); ++q) {
      const double a = alpha.data_ptr<double>()[q];
      double* step = _du.data() + batch_rows[q] * n;
      for (std::int64_t k = 0; k < n; ++k)
        step[k] *= a;
    }
  }

  const NewtonGraphs& _graphs;
  const std::vector<at::Tensor>& _params;
  const SolverConfig& _config;
  const bool _gate, _search;
  const std::int64_t _n, _rows;
  at::Tensor _slots, _u;
  std::vector<at::Tensor> _givens, _like;
  std::vector<double> _r0, _step_norm, _du;
  std::vector<std::uint8_t> _chorded, _gate_ok;
  double* _norm = nullptr;
  bool* _converged = nullptr;
  bool* _singular = nullptr;
};

} // namespace

NewtonResult newton_solve_tensor_chord(const NewtonGraphs& graphs, const NewtonPlan& plan,
                                       const std::vector<at::Tensor>& u0,
                                       const std::vector<at::Tensor>& givens,
                                       const std::vector<at::Tensor>& params,
                                       const SolverConfig& config, bool gate_relative,
                                       const at::Tensor& factors) {
  // Block groups: the graphs' layout throughout (the factors too), converted here alone.
  if (graphs.in_graph_layout)
    return solve_in_graph_layout(*graphs.in_graph_layout, u0, givens,
                                 [&](const NewtonGraphs& in_graph, const auto& u, const auto& g) {
                                   return newton_solve_tensor_chord(in_graph, plan, u, g, params,
                                                                    config, gate_relative, factors);
                                 });
  const auto rows = u0.front().size(0);
  TensorChord chord(graphs, params, config, gate_relative, plan.unknowns, factors, rows);
  return chord.solve(u0, givens);
}

} // namespace neml2::detail

// Newton on the CPU as one pass over the rows between graph calls (newton_rows.hpp): the
// graphs' results are read in place, each row's state lives in plain arrays, and the rows
// still iterating are copied into the next call's arguments as the pass goes.

#include "implicit/newton_rows.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>

#include <ATen/ATen.h>

#include "core/stopwatch.hpp"
#include "implicit/row_failures.hpp"
#include "implicit/row_system.hpp"

namespace neml2::detail {
namespace {

class RowNewton {
public:
  RowNewton(const NewtonGraphs& graphs, const std::vector<at::Tensor>& params,
            const SolverConfig& config, bool gate_relative, const at::Tensor& factors)
      : _graphs(graphs)
      , _params(params)
      , _config(config)
      , _gate(gate_relative)
      , _search(config.ls_max_iters > 2)
      , _chord_asked((config.chord || factors.defined()) && !_search)
      , _chord(_chord_asked && (!graphs.schedule || graphs.schedule->chord_pays()))
      , _store(factors) {}

  NewtonResult solve(std::vector<at::Tensor> u0, const std::vector<at::Tensor>& givens) {
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
      result.reasons =
          row_failures(result.converged, result.norm, result.u, u0, givens,
                       at::from_blob(_singular.data(), {rows}, at::kByte).to(at::kBool));
    return result;
  }

private:
  // NEML2's Newton: A at every iterate that steps.
  std::int64_t newton_iterations() {
    // Which graph checks the rows: A along for small sets (a second call costs more than A),
    // after a step of a line search (it reads A at the trial point), or where the schedule
    // expects most rows to stay; else the residual alone, and A for the rows that stay.
    const auto take_a = [&](std::int64_t check) {
      return size() <= first_from_jacobian || (check > 0 && _search) ||
             (_graphs.schedule ? _graphs.schedule->with_a(check) : check > 0);
    };
    std::int64_t iterations = 0;
    bool has_a = take_a(0);
    auto results = call(has_a ? _graphs.jacobian : _graphs.residual, _u);
    for (std::int64_t it = 0;; ++it) {
      const auto checked = size();
      auto staying = pass(results, has_a, it, true);
      if (_graphs.schedule)
        _graphs.schedule->record(it, checked, staying);
      if (staying == 0)
        break;
      if (!has_a) { // the first residual came without A: A for the rows that stay
        advance(false);
        results = call(_graphs.jacobian, _u);
        has_a = true;
        if (pass(results, true, it, false) == 0)
          break;
      }
      advance(!_search);
      if (_search)
        line_search();
      iterations = it + 1;
      has_a = take_a(it + 1);
      results = call(has_a ? _graphs.jacobian : _graphs.residual, _u);
    }
    return iterations;
  }

  // The chord (newton_rows.hpp): the residual graph at every iterate, a step from the row's
  // kept factor; A (the jacobian graph) only for the rows that have none or refactor.
  std::int64_t chord_iterations() {
    std::int64_t iterations = 0;
    auto results = call(_graphs.residual, _u);
    for (std::int64_t it = 0;; ++it) {
      if (chord_pass(results, it) == 0 || refactor() == 0)
        break;
      advance(true);
      iterations = it + 1;
      results = call(_graphs.residual, _u);
    }
    return iterations;
  }

  // Row `batch_row`'s slot: whether it holds a factor, its LU (n x n), its pivots; nullptr
  // while a solve without a store has not given the row one.
  double* slot(std::int64_t batch_row) {
    if (_store.defined())
      return _store.data_ptr<double>() + batch_row * _store.stride(0);
    const auto at = _slot_of[static_cast<std::size_t>(batch_row)];
    return at < 0 ? nullptr : _pool.data() + at * _slot_width;
  }

  // Whether row i, at ||r|| = `norm` after a step from ||r|| = _step_norm, should take A
  // (chord_refactors).
  bool too_slow(std::size_t row, double norm, std::int64_t it) const {
    return chord_refactors(norm / _step_norm[row],
                           norm / std::max(_config.atol, _config.rtol * _r0[row]),
                           _config.miters - it - 1, _config.chord_rate);
  }

  // The chord's check of every row of the working set at the residual graph's `results`:
  // leaves (as NEML2's Newton) or stays, stepping from its factor (`_du`) or marked to take
  // A (`_need_a`). A step from an older factor that did not lower ||r|| is taken back first.
  // Returns how many rows stay.
  std::int64_t chord_pass(const std::vector<at::Tensor>& results, std::int64_t it) {
    const Residual b(results, 0);
    const bool last = it + 1 >= _config.miters;
    const Groups u(_u);
    const auto n = _n;
    _keep.assign(_index.size(), 0);
    _need_a.assign(_index.size(), 0);
    _du.resize(static_cast<std::size_t>(size() * n));
    _step_norm.resize(_index.size());
    _chorded.resize(_index.size());
    for_rows(size(), [&](std::int64_t begin, std::int64_t end) {
      std::vector<double> x(static_cast<std::size_t>(n));
      std::vector<std::int64_t> pivot(static_cast<std::size_t>(n));
      for (auto i = begin; i < end; ++i) {
        const auto row = static_cast<std::size_t>(i);
        double* du = _du.data() + i * n;
        double norm = b.norm(i);
        if (it > 0 && _chorded[row] != 0 && !(norm < _step_norm[row])) {
          u.read(i, x.data());
          for (std::int64_t k = 0; k < n; ++k)
            x[static_cast<std::size_t>(k)] -= du[k];
          u.write(i, x.data());
          norm = _step_norm[row];
          _chorded[row] = 0;
          slot(_index[row])[0] = 0;
          _norm[row] = norm;
          if (last)
            finish(u, i, false);
          else
            _keep[row] = _need_a[row] = 1;
          continue;
        }
        _norm[row] = norm;
        if (it == 0)
          _r0[row] = norm;
        const bool converged = converged_at(row, norm, it);
        if (converged || !std::isfinite(norm) || last) {
          finish(u, i, converged);
          continue;
        }
        _keep[row] = 1;
        const double* factor = slot(_index[row]);
        if (factor == nullptr || factor[0] != 1 || (it > 0 && too_slow(row, norm, it))) {
          _need_a[row] = 1;
          continue;
        }
        b.copy(i, du);
        for (std::int64_t k = 0; k < n; ++k)
          pivot[static_cast<std::size_t>(k)] = static_cast<std::int64_t>(factor[1 + n * n + k]);
        lu_solve(factor + 1, pivot.data(), n, du, 1);
        _chorded[row] = 1;
        _step_norm[row] = norm;
      }
    });
    return std::count(_keep.begin(), _keep.end(), 1);
  }

  // A at the rows marked `_need_a` (the jacobian graph on them alone): each row's factor
  // into its slot and its Newton step; a singular A fails the row. Returns how many rows
  // stay.
  std::int64_t refactor() {
    std::vector<std::int64_t> rows;
    for (std::int64_t i = 0; i < size(); ++i)
      if (_need_a[static_cast<std::size_t>(i)] != 0)
        rows.push_back(i);
    if (!rows.empty()) {
      if (!_store.defined()) // slots for rows that have none
        for (auto i : rows)
          if (auto& at = _slot_of[static_cast<std::size_t>(_index[static_cast<std::size_t>(i)])];
              at < 0) {
            at = static_cast<std::int64_t>(_pool.size()) / _slot_width;
            _pool.resize(_pool.size() + static_cast<std::size_t>(_slot_width));
          }
      const auto m = static_cast<std::int64_t>(rows.size());
      std::vector<at::Tensor> results;
      if (m == size())
        results = call(_graphs.jacobian, _u);
      else {
        auto u = empty_like_rows(_u, m), g = empty_like_rows(_g, m);
        const Groups from_u(_u), to_u(u), from_g(_g), to_g(g);
        for (std::int64_t j = 0; j < m; ++j) {
          to_u.copy_row(j, from_u, rows[static_cast<std::size_t>(j)]);
          to_g.copy_row(j, from_g, rows[static_cast<std::size_t>(j)]);
        }
        results = call(_graphs.jacobian, u, g);
      }
      const auto a_blocks = _graphs.a_blocks;
      const Blocks blocks(results, 0, a_blocks, results.size() - a_blocks);
      const Residual b(results, a_blocks);
      const Groups u(_u);
      const auto n = _n;
      for_rows(m, [&](std::int64_t begin, std::int64_t end) {
        std::vector<std::int64_t> pivot(static_cast<std::size_t>(n));
        for (auto j = begin; j < end; ++j) {
          const auto i = rows[static_cast<std::size_t>(j)];
          const auto row = static_cast<std::size_t>(i);
          double* factor = slot(_index[row]);
          blocks.fill(j, factor + 1);
          if (!lu_factor(factor + 1, n, pivot.data())) {
            factor[0] = 0;
            _keep[row] = 0;
            finish_singular(u, i);
            continue;
          }
          for (std::int64_t k = 0; k < n; ++k)
            factor[1 + n * n + k] = static_cast<double>(pivot[static_cast<std::size_t>(k)]);
          factor[0] = 1;
          double* du = _du.data() + i * n;
          b.copy(j, du);
          lu_solve(factor + 1, pivot.data(), n, du, 1);
          _chorded[row] = 0;
          _step_norm[row] = _norm[row];
        }
      });
    }
    return std::count(_keep.begin(), _keep.end(), 1);
  }

  std::int64_t size() const { return static_cast<std::int64_t>(_index.size()); }

  // A graph at unknowns `u` of the working set (or of rows of it, given `g`).
  std::vector<at::Tensor> call(const GraphFn& graph, const std::vector<at::Tensor>& u) const {
    return call(graph, u, _g);
  }
  std::vector<at::Tensor> call(const GraphFn& graph, const std::vector<at::Tensor>& u,
                               const std::vector<at::Tensor>& g) const {
    if (!_graphs.schedule || !_chord_asked) // the costs only decide whether the chord pays
      return call_for_rows(graph, graph_args(u, g, _params));
    const auto start = steady_clock::now();
    auto results = call_for_rows(graph, graph_args(u, g, _params));
    _graphs.schedule->record_cost(&graph == &_graphs.jacobian, u.front().size(0),
                                  seconds_since(start));
    return results;
  }

  // NEML2's test: row `row` converged at ||r|| = `norm` at check `it`.
  bool converged_at(std::size_t row, double norm, std::int64_t it) const {
    return norm < _config.atol ||
           (it > 0 && norm < _config.rtol * _r0[row] && (!_gate || _gate_ok[row] != 0));
  }

  // Row i leaves the working set: its unknowns, norm and flag into the batch's result.
  void finish(const Groups& u, std::int64_t i, bool converged) {
    const auto row = _index[static_cast<std::size_t>(i)];
    _out->copy_row(row, u, i);
    _out_norm[row] = _norm[static_cast<std::size_t>(i)];
    _out_converged[row] = converged;
  }

  // Row i fails at a zero or non-finite pivot of its A: no step.
  void finish_singular(const Groups& u, std::int64_t i) {
    _singular[static_cast<std::size_t>(_index[static_cast<std::size_t>(i)])] = 1;
    finish(u, i, false);
  }

  // One pass over the working set at a graph's results. With `check`: each row's ||r||
  // and whether it leaves (converged, failed, or at the iteration cap). With A (`has_a`):
  // each staying row's step du = A^{-1} b and <b, du>; a singular A fails the row.
  // Returns how many rows stay (`_keep`).
  std::int64_t pass(const std::vector<at::Tensor>& results, bool has_a, std::int64_t it,
                    bool check) {
    const auto a_blocks = has_a ? _graphs.a_blocks : 0;
    const Residual b(results, a_blocks);
    const auto residual_groups = results.size() - a_blocks;
    const bool last = it + 1 >= _config.miters;
    const Groups u(_u);
    const auto n = _n;
    _keep.assign(_index.size(), 0);
    if (has_a) {
      _du.resize(static_cast<std::size_t>(size() * n));
      _slope.resize(_index.size());
    }
    // Whether row i leaves at ||r|| = `norm` (finished into the result if so). The residual
    // graph alone leaves a row within a factor 2 of its tolerance undecided: the jacobian
    // graph's residual, which may differ from it in the last bits, decides (so the schedule
    // does not change which iterate a row ends at).
    const auto leaves = [&](std::int64_t i, double norm) {
      const auto row = static_cast<std::size_t>(i);
      _norm[row] = norm;
      if (it == 0)
        _r0[row] = norm;
      const bool converged = converged_at(row, norm, it);
      _undecided[row] =
          !has_a && converged_at(row, norm / 2, it) != converged_at(row, norm * 2, it);
      if (_undecided[row] != 0)
        return false;
      if (converged || !std::isfinite(norm) || last) {
        finish(u, i, converged);
        return true;
      }
      return false;
    };
    std::optional<Blocks> blocks;
    if (has_a)
      blocks.emplace(results, 0, a_blocks, residual_groups);
    if (n == 1 && b.groups.size() == 1) { // one unknown (radial return): du = b / A
      const auto& r = b.groups.front();
      for_rows(size(), [&](std::int64_t begin, std::int64_t end) {
        for (auto i = begin; i < end; ++i) {
          const double bi = r(i, 0);
          if ((check || _undecided[static_cast<std::size_t>(i)] != 0) &&
              leaves(i, std::sqrt(bi * bi)))
            continue;
          if (has_a) {
            const double a = blocks->blocks.front()(i, 0, 0);
            if (!(std::abs(a) > 0) || !std::isfinite(a)) { // lu_factor's test
              finish_singular(u, i);
              continue;
            }
            _du[static_cast<std::size_t>(i)] = bi / a;
            _slope[static_cast<std::size_t>(i)] = bi * (bi / a);
          }
          _keep[static_cast<std::size_t>(i)] = 1;
        }
      });
      return std::count(_keep.begin(), _keep.end(), 1);
    }
    const auto lanes = lanes_for(size());
    // Row i's step du = A^{-1} b from its solve (and <b, du>), or its failure.
    const auto stepped = [&](std::int64_t i, const double* x, std::int64_t stride, bool solved) {
      if (!solved) {
        finish_singular(u, i);
        return;
      }
      double* du = _du.data() + i * n;
      for (std::int64_t k = 0; k < n; ++k)
        du[k] = x[k * stride];
      if (_search) {
        double dot = 0;
        std::int64_t k = 0;
        for (const auto& g : b.groups)
          for (std::int64_t r = 0; r < g.size1; ++r)
            dot += g(i, r) * du[k++];
        _slope[static_cast<std::size_t>(i)] = dot;
      }
      _keep[static_cast<std::size_t>(i)] = 1;
    };
    for_rows(size(), [&](std::int64_t begin, std::int64_t end) {
      std::optional<LaneBatch> batch;
      if (has_a)
        batch.emplace(n, 1, lanes);
      for (auto i = begin; i < end; ++i) {
        if ((check || _undecided[static_cast<std::size_t>(i)] != 0) && leaves(i, b.norm(i)))
          continue;
        if (!has_a) {
          _keep[static_cast<std::size_t>(i)] = 1;
          continue;
        }
        blocks->fill(i, batch->a(), lanes);
        b.copy(i, batch->x(), lanes);
        batch->add(i, stepped);
      }
      if (batch)
        batch->solve(stepped);
    });
    return std::count(_keep.begin(), _keep.end(), 1);
  }

  // The working set becomes its rows with `_keep` set, in order (gathered into new tensors
  // when some left); with `move`, each takes its full step (u += du).
  void advance(bool move) {
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
  void step_in_place() {
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

  // NEML2's gate on the relative test while substepping: ||du|| < substep_del_tol
  // (||u|| + atol) at the updated u (the step taken, alpha du with a line search).
  std::uint8_t gate(const double* du, const double* u) const {
    return !_gate || norm(du, _n) < _config.substep_del_tol * (norm(u, _n) + _config.atol) ? 1 : 0;
  }

  // The line search of NEML2's Newton (newton.cpp's line_search, per row): every row of
  // the working set searches along its du, then takes u += alpha du.
  void line_search() {
    const auto m = size();
    const auto n = _n;
    const bool strong_wolfe = _config.ls_type == "STRONG_WOLFE";
    std::vector<double> alpha(_index.size(), 1);
    std::vector<std::uint8_t> settled(_index.size(), 0);
    const Groups u(_u);
    for (std::int64_t trial = 1; trial < _config.ls_max_iters; ++trial) {
      auto moved = empty_like_rows(_u, m);
      const Groups to(moved);
      for_rows(m, [&](std::int64_t begin, std::int64_t end) {
        std::vector<double> x(static_cast<std::size_t>(n));
        for (auto j = begin; j < end; ++j) {
          u.read(j, x.data());
          for (std::int64_t k = 0; k < n; ++k)
            x[static_cast<std::size_t>(k)] += alpha[static_cast<std::size_t>(j)] * _du[j * n + k];
          to.write(j, x.data());
        }
      });
      const Residual b(call(_graphs.residual, moved), 0);
      for_rows(m, [&](std::int64_t begin, std::int64_t end) {
        for (auto j = begin; j < end; ++j) {
          const auto row = static_cast<std::size_t>(j);
          const double nb = std::pow(b.norm(j), 2), nb0 = _norm[row] * _norm[row];
          const double crit = strong_wolfe ? (1 - _config.ls_c * alpha[row]) * nb0
                                           : nb0 - 2 * _config.ls_c * alpha[row] * _slope[row];
          settled[row] =
              settled[row] != 0 || nb <= crit || nb <= _config.atol * _config.atol ? 1 : 0;
        }
      });
      if (trial + 1 == _config.ls_max_iters ||
          std::all_of(settled.begin(), settled.end(), [](auto s) { return s != 0; }))
        break;
      for (std::size_t j = 0; j < settled.size(); ++j)
        if (settled[j] == 0)
          alpha[j] /= _config.ls_cutback;
    }
    for_rows(m, [&](std::int64_t begin, std::int64_t end) {
      std::vector<double> x(static_cast<std::size_t>(n)), step(static_cast<std::size_t>(n));
      for (auto j = begin; j < end; ++j) {
        const auto row = static_cast<std::size_t>(j);
        u.read(j, x.data());
        for (std::int64_t k = 0; k < n; ++k) {
          step[static_cast<std::size_t>(k)] = alpha[row] * _du[j * n + k];
          x[static_cast<std::size_t>(k)] += step[static_cast<std::size_t>(k)];
        }
        u.write(j, x.data());
        _gate_ok[row] = gate(step.data(), x.data());
      }
    });
  }

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

} // namespace

std::int64_t unknowns_per_row(std::span<const at::Tensor> u) {
  std::int64_t unknowns = 0;
  for (const auto& t : u)
    unknowns += c10::multiply_integers(t.sizes().slice(std::min<std::int64_t>(t.dim(), 1)));
  return unknowns;
}

bool runs_on_rows(std::span<const at::Tensor> u, const SolverConfig& config) {
  const auto& like = u.front();
  return config.row_pass && like.device().is_cpu() && like.scalar_type() == at::kDouble &&
         unknowns_per_row(u) <= row_pass_max_unknowns;
}

bool runs_on_rows(const NewtonGraphs& graphs, std::span<const at::Tensor> u,
                  const SolverConfig& config) {
  return !graphs.matvec && graphs.dense_blocks && runs_on_rows(u, config);
}

NewtonResult newton_solve_rows(const NewtonGraphs& graphs, std::vector<at::Tensor> u0,
                               const std::vector<at::Tensor>& givens,
                               const std::vector<at::Tensor>& params, const SolverConfig& config,
                               bool gate_relative, const at::Tensor& factors) {
  return RowNewton(graphs, params, config, gate_relative, factors).solve(std::move(u0), givens);
}

} // namespace neml2::detail

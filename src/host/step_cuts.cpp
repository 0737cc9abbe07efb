// The points of a step that fail retry it alone in bisected spans (forces and time
// interpolated linearly over the step, the state carried from span to span), and the
// derivatives of the whole step are chained through their spans.

#include "host/step_cuts.hpp"

#include <algorithm>
#include <limits>
#include <variant>

#include <ATen/ATen.h>

#include <neml2/any_dispatched_model.hpp>
#include <neml2/detail/call_names.hpp>

#include "core/finite_values.hpp"

namespace neml2::detail {

PointsEvaluation evaluate_points(const AnyDispatchedModel& model, const TensorMap& inputs,
                                 bool derivatives, NewtonFactors* factors) {
  PointsEvaluation p;
  try {
    if (!derivatives)
      p.outputs = factors ? model.forward(inputs, *factors) : model.forward(inputs);
    else
      std::tie(p.outputs, p.derivatives) =
          factors ? model.jacobian(inputs, *factors) : model.jacobian(inputs);
    flag_failures(model, p, nullptr);
  } catch (const ConvergenceError& e) {
    if (!e.per_row())
      throw;
    if (!derivatives)
      p.outputs = e.outputs();
    else
      std::tie(p.outputs, p.derivatives) =
          CallNames(model.sessions().front()).jacobian(std::vector<at::Tensor>(e.results()));
    flag_failures(model, p, &e);
  }
  return p;
}

void flag_failures(const AnyDispatchedModel& model, PointsEvaluation& e,
                   const ConvergenceError* error) {
  const auto& some = e.outputs.begin()->second;
  const auto rows = some.size(0);
  const auto on = some.options();
  if (error) { // Newton's own verdict (its chain fails a row whose results are not finite)
    e.converged = error->converged_mask().to(on.device());
    e.reasons = error->reasons().to(on.device());
    e.residuals = error->residual_norms().to(on.device());
    return;
  }
  const auto& segments = model.artifact().segments;
  if (!std::all_of(segments.begin(), segments.end(),
                   [](const auto& s) { return std::holds_alternative<ForwardSegment>(s); }))
    return;
  // An explicit model: no Newton judged its points.
  if (std::all_of(e.outputs.begin(), e.outputs.end(),
                  [](const auto& output) { return all_finite(output.second); }))
    return;
  at::Tensor finite; // (N,): every output of the point finite
  for (const auto& [y, value] : e.outputs) {
    const auto f = at::isfinite(value).reshape({rows, -1}).all(1);
    finite = finite.defined() ? finite.logical_and_(f) : f;
  }
  e.non_finite = !finite.all().item<bool>();
  e.converged = finite;
  e.reasons = at::zeros({rows}, on.dtype(at::kChar))
                  .masked_fill_(~finite, static_cast<std::int8_t>(RowFailure::non_finite));
  e.residuals = at::zeros({rows}, on.dtype(at::kDouble))
                    .masked_fill_(~finite, std::numeric_limits<double>::quiet_NaN());
}

void add_older_inputs(TensorMap& in, const AnyDispatchedModel& model, const OlderValues& older,
                      const at::Tensor& rows) {
  const auto& names = model.input_names();
  for (const auto& [n, values] : older)
    for (std::size_t j = 0; j < values.size(); ++j)
      if (const auto name = n + "~" + std::to_string(j + 2);
          std::find(names.begin(), names.end(), name) != names.end())
        in.emplace(name, rows.defined() ? values[j].index_select(0, rows) : values[j]);
}

void fill_failed(StepResult& result, const at::Tensor& failed) {
  for (auto& [y, value] : result.outputs)
    value.index_fill_(0, failed, std::numeric_limits<double>::quiet_NaN());
  for (auto& [y, blocks] : result.derivatives)
    for (auto& [z, block] : blocks)
      block.index_fill_(0, failed, std::numeric_limits<double>::quiet_NaN());
}

namespace {

constexpr double nan = std::numeric_limits<double>::quiet_NaN();

// `block` of d(y)/d(z) over `rows` points as (rows, numel(y), numel(z)); a batch-independent
// block (one for every point, without the batch axis) is expanded.
at::Tensor flat(const at::Tensor& block, std::int64_t rows, std::int64_t y_size,
                std::int64_t point_dims) {
  if (block.dim() != point_dims)
    return block.reshape({rows, y_size, -1});
  auto sizes = block.sizes().vec();
  sizes.insert(sizes.begin(), rows);
  return block.unsqueeze(0).expand(sizes).reshape({rows, y_size, -1});
}

// A tensor of `like`'s shape with `rows` rows, filled with `value`.
at::Tensor filled_rows(const at::Tensor& like, std::int64_t rows, double value) {
  auto sizes = like.sizes().vec();
  sizes[0] = rows;
  return at::full(sizes, value, like.options());
}

// Per point, the number of values of a (points, ...) tensor.
std::int64_t per_point(const at::Tensor& t) {
  return t.dim() == 0 ? 1 : t.numel() / std::max<std::int64_t>(t.size(0), 1);
}

class Cutter {
public:
  Cutter(const StepEnds& step, const at::Tensor& points, const StepResult& result)
      : _step(step)
      , _points(points)
      , _m(points.size(0)) {
    const auto& r = step.roles;
    for (const auto& x : r.state)
      _x.emplace(x, step.start.at(x).index_select(0, points));
    for (const auto& f : r.forces) {
      _f0.emplace(f, step.start.at(f).index_select(0, points));
      _f1.emplace(f, step.forces.at(f).index_select(0, points));
    }
    for (const auto& g : r.given)
      if (step.given_start.count(g)) { // interpolated from its last accepted value
        const auto end = step.forces.at(g).index_select(0, points);
        const auto start = step.given_start.at(g).index_select(0, points);
        _g0.emplace(g, at::where(at::isnan(start), end, start)); // NaN: none accepted yet
        _f1.emplace(g, end);
      } else
        _held.emplace(g, step.forces.at(g).index_select(0, points));
    for (const auto& [n, values] : step.older)
      for (const auto& v : values)
        _older[n].push_back(v.index_select(0, points));
    for (const auto& h : r.fixed)
      _held.emplace(h, step.start.at(h).index_select(0, points));
    const auto& inputs = step.model.input_names();
    for (const auto& x : r.state)
      _guess[x] = std::find(inputs.begin(), inputs.end(), x) != inputs.end();
    for (const auto& [y, value] : result.outputs)
      _out.emplace(y, filled_rows(value, _m, nan));
    for (const auto& [y, blocks] : result.derivatives)
      for (const auto& [z, block] : blocks)
        _J[y].emplace(z, filled_rows(block, _m, nan));
    const auto on = result.converged.options();
    _substeps = at::zeros({_m}, on.dtype(at::kLong));
    _failed = at::zeros({_m}, on.dtype(at::kBool));
    _reasons = at::zeros({_m}, on.dtype(at::kChar));
    _residuals = at::zeros({_m}, on.dtype(at::kDouble));
  }

  // Every point failed the whole step (depth 0): its halves.
  void run() { bisect(at::arange(_m, _substeps.options()), 0.0, 1.0, 0); }

  void write(StepResult& result) const {
    for (const auto& [y, value] : _out)
      result.outputs.at(y).index_copy_(0, _points, value);
    for (const auto& [y, blocks] : _J)
      for (const auto& [z, block] : blocks)
        result.derivatives.at(y).at(z).index_copy_(0, _points, block);
    result.substeps.index_copy_(0, _points, _substeps.masked_fill(_failed, 0));
    result.converged.index_copy_(0, _points, ~_failed);
    result.reasons.index_copy_(0, _points, _reasons);
    result.residuals.index_copy_(0, _points, _residuals);
  }

private:
  // The inputs of the span [a, b] of the step for local `rows`.
  TensorMap inputs_for(const at::Tensor& rows, double a, double b) const {
    TensorMap in;
    for (const auto& [x, value] : _x) {
      const auto v = value.index_select(0, rows);
      in.emplace(x + "~1", v);
      if (_guess.at(x))
        in.emplace(x, v);
    }
    // A force (and an interpolated given input) at the fraction w of the step; the ends
    // exactly as given: a span that ends the step ends at the step's forces.
    const auto at_fraction = [&](const at::Tensor& from, const std::string& f, double w) {
      const auto start = from.index_select(0, rows), end = _f1.at(f).index_select(0, rows);
      return w == 1.0 ? end : w == 0.0 ? start : start + (end - start) * w;
    };
    for (const auto& [f, f0] : _f0) {
      in.emplace(f, at_fraction(f0, f, b));
      in.emplace(f + "~1", at_fraction(f0, f, a));
    }
    for (const auto& [g, g0] : _g0)
      in.emplace(g, at_fraction(g0, g, b));
    for (const auto& [g, value] : _held)
      in.emplace(g, value.index_select(0, rows));
    // x~k (k > 1): the starts of the spans before, the step's own before its first span.
    add_older_inputs(in, _step.model, _older, rows);
    return in;
  }

  // d(outputs)/d(the step's inputs) over `rows` at the end of the span [a, b] from the
  // span's blocks `J`: forces through their interpolation weights, the state through what
  // it was chained to at the span's start (the step's own inputs when a = 0).
  VariablePairJacobian chain(const at::Tensor& rows, double a, double b, const PointsEvaluation& e,
                             const TensorMap& inputs) const {
    const auto s = rows.size(0);
    VariablePairJacobian D;
    const auto add = [&](const std::string& y, const std::string& z, const at::Tensor& t) {
      auto& d = D[y][z];
      d = d.defined() ? d + t : t;
    };
    for (const auto& [y, blocks] : e.derivatives) {
      const auto y_value = e.outputs.at(y);
      const auto ny = per_point(y_value);
      for (const auto& [i, block] : blocks) {
        const auto point_dims = (y_value.dim() - 1) + (inputs.at(i).dim() - 1);
        const auto B = flat(block, s, ny, point_dims);
        const bool old = i.ends_with("~1");
        const auto base = old ? i.substr(0, i.size() - 2) : i;
        if (_g0.count(i)) // a given input, from the state's start value: b of it is the step's
          add(y, i, B * b);
        else if (_f0.count(
                     base)) { // a force: f = (1-b) f~1 + b f at the span's end, a at its start
          const double w = old ? a : b;
          add(y, base, B * w);
          add(y, base + "~1", B * (1 - w));
        } else if (_x.count(base) && a != 0.0) { // the state, carried from the last span
          for (const auto& [z, d] : _dx.at(base))
            add(y, z, at::bmm(B, d.index_select(0, rows)));
        } else // a given or fixed input, or the state at the step's start
          add(y, i, B);
      }
    }
    return D;
  }

  void advance(const at::Tensor& rows, double a, double b, int depth) {
    const bool derivatives = _step.options.derivatives;
    const auto inputs = inputs_for(rows, a, b);
    const auto e = evaluate_points(_step.model, inputs, derivatives);
    const auto ok = e.converged.defined() ? e.converged : at::ones({rows.size(0)}, at::kBool);
    const auto ok_rows = ok.nonzero().squeeze(1).to(rows.device());
    const auto done = rows.index_select(0, ok_rows);
    if (done.numel() > 0) {
      const auto D = derivatives ? chain(rows, a, b, e, inputs) : VariablePairJacobian{};
      shift_older(done, inputs, ok_rows);
      for (auto& [x, value] : _x)
        value.index_copy_(0, done, e.outputs.at(x).index_select(0, ok_rows));
      if (derivatives)
        for (const auto& [x, value] : _x)
          for (const auto& [z, d] : D.at(x)) {
            auto& dx = _dx[x][z];
            if (!dx.defined())
              dx = at::zeros({_m, d.size(1), d.size(2)}, d.options());
            dx.index_copy_(0, done, d.index_select(0, ok_rows));
          }
      _substeps.index_add_(0, done, at::ones_like(done));
      if (b == 1.0) {
        for (auto& [y, value] : _out)
          value.index_copy_(0, done, e.outputs.at(y).index_select(0, ok_rows));
        for (auto& [y, blocks] : _J)
          for (auto& [z, block] : blocks) {
            const auto d = D.count(y) && D.at(y).count(z) ? D.at(y).at(z) : at::Tensor();
            const auto value = filled_rows(block, done.size(0), 0.0);
            if (d.defined()) // else nothing flows from z to y
              value.copy_(d.index_select(0, ok_rows).reshape(value.sizes()));
            block.index_copy_(0, done, value);
          }
      }
    }
    const auto failed = rows.masked_select(~ok.to(rows.device()));
    if (failed.numel() == 0)
      return;
    if (depth == _step.options.max_cuts) {
      _failed.index_fill_(0, failed, true);
      const auto failed_rows = (~ok).nonzero().squeeze(1);
      _reasons.index_copy_(0, failed, e.reasons.index_select(0, failed_rows).to(_reasons.device()));
      _residuals.index_copy_(0, failed,
                             e.residuals.index_select(0, failed_rows).to(_residuals.device()));
      return;
    }
    bisect(failed, a, b, depth);
  }

  // The span's older values move one place back for the points `done` (local), x~2 taking
  // the state (or force) the span started from, `inputs` at their rows `ok_rows`.
  void shift_older(const at::Tensor& done, const TensorMap& inputs, const at::Tensor& ok_rows) {
    for (auto& [n, values] : _older)
      for (auto j = values.size(); j-- > 0;) {
        const auto newer = j == 0 ? inputs.at(n + "~1").index_select(0, ok_rows)
                                  : values[j - 1].index_select(0, done);
        values[j].index_copy_(0, done, newer);
      }
  }

  // `rows` failed the span [a, b] at `depth`: its first half, then, for the rows that did
  // not fail for good, the rest of it.
  void bisect(const at::Tensor& rows, double a, double b, int depth) {
    const double middle = 0.5 * (a + b);
    advance(rows, a, middle, depth + 1);
    const auto alive = rows.masked_select(~_failed.index_select(0, rows));
    if (alive.numel() > 0)
      advance(alive, middle, b, depth + 1);
  }

  const StepEnds& _step;
  at::Tensor _points;
  std::int64_t _m;
  TensorMap _x, _f0, _f1, _g0, _held; // per cut point: the state where it is, the forces' ends
  OlderValues _older;                 // x~2, ... where each point is
  std::map<std::string, bool> _guess;
  TensorMap _out;                       // at the step's end (NaN until reached)
  VariablePairJacobian _J;              // the same for the derivatives
  std::map<std::string, TensorMap> _dx; // d(state)/d(step's inputs), (m, nx, nz)
  at::Tensor _substeps, _failed, _reasons, _residuals;
};

} // namespace

void cut_points(const StepEnds& step, const at::Tensor& points, StepResult& result) {
  Cutter cutter(step, points, result);
  cutter.run();
  cutter.write(result);
}

} // namespace neml2::detail

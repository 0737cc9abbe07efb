// MaterialState: the start of a step and its trial end over any dispatched model; step,
// accept and reject. The retry of failing points is step_cuts.cpp.

#include <algorithm>
#include <chrono>
#include <limits>
#include <set>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <neml2/any_dispatched_model.hpp>
#include <neml2/material_state.hpp>

#include "core/row_shape.hpp"
#include "engine/placement.hpp"
#include "host/step_cuts.hpp"
#include "implicit/newton_factors.hpp"

namespace neml2 {
using detail::with_rows;
namespace {

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::string old_name(const std::string& name) {
  return name + "~1";
}

// `name` as `base~k` (k >= 1), or {name, 0} without a history suffix.
std::pair<std::string, int> history_of(const std::string& name) {
  const auto tilde = name.rfind('~');
  const auto digits = tilde == std::string::npos ? std::string() : name.substr(tilde + 1);
  if (digits.empty() || digits.size() > 3 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return {name, 0};
  const int k = std::stoi(digits);
  return k < 1 ? std::pair{name, 0} : std::pair{name.substr(0, tilde), k};
}

// The per-point shape of each input (sub-batch then base axes), by public name.
std::map<std::string, Shape> input_shapes(const Artifact& artifact) {
  std::map<std::string, Shape> shapes;
  for (const auto& v : artifact.inputs) {
    auto s = v.sub_batch_shape;
    s.insert(s.end(), v.base_shape.begin(), v.base_shape.end());
    shapes.emplace(v.public_name, std::move(s));
  }
  return shapes;
}

// `value` as (points, *shape) on `options`' device and dtype: itself when it already is,
// else broadcast (a view) or converted (a copy). An error names it as `who` 'name'.
at::Tensor as_points(const at::Tensor& value, std::int64_t points, const Shape& shape,
                     const at::TensorOptions& options, const char* who, const std::string& name) {
  const auto full = with_rows(points, {&shape});
  if (value.defined() && value.sizes() == at::IntArrayRef(full) &&
      value.scalar_type() == options.dtype() && value.device() == options.device())
    return value;
  const auto what = fmt::format("{} '{}'", who, name);
  if (!value.defined())
    throw FatalError(fmt::format("{} is an undefined tensor; pass one of shape {} (or {}, the "
                                 "same for every point)",
                                 what, full, shape));
  if (!at::isFloatingType(value.scalar_type()))
    throw FatalError(fmt::format("{} has dtype {}; pass a floating-point tensor", what,
                                 c10::toString(value.scalar_type())));
  const auto sizes = value.sizes();
  bool fits = static_cast<std::size_t>(value.dim()) <= full.size();
  for (std::size_t k = 0; fits && k < sizes.size(); ++k) {
    const auto target = full[full.size() - sizes.size() + k];
    fits = sizes[k] == target || sizes[k] == 1;
  }
  if (!fits)
    throw FatalError(fmt::format("{} has shape {}, which does not broadcast to {} ({} points, "
                                 "then the variable's shape): pass {} or {}",
                                 what, sizes, full, points, full, shape));
  return value.to(options).expand(full);
}

// Newton's guess for state `x`: its start, or extrapolated from the step before (`before`
// empty: not asked) by the ratio of this step's time increment to that one's (1 untimed).
at::Tensor guess(const std::string& x, const TensorMap& start, const TensorMap& before,
                 const TensorMap& forces) {
  const auto& s = start.at(x);
  if (before.empty())
    return s;
  auto ratio = at::ones({s.size(0)}, s.options());
  if (before.count("t")) { // time is a force
    const auto last = start.at("t") - before.at("t");
    ratio = at::where(last != 0, (forces.at("t") - start.at("t")) / last, 0.0);
  }
  auto shape = std::vector<std::int64_t>(static_cast<std::size_t>(s.dim()), 1);
  shape[0] = s.size(0);
  return s + ratio.reshape(shape) * (s - before.at(x));
}

// The step's inputs by name: the state and old forces from `start`, the rest from `forces`;
// Newton's guess the start, or extrapolated (guess()).
TensorMap step_inputs(const AnyDispatchedModel& model, const StateRoles& roles,
                      const TensorMap& start, const TensorMap& forces, const TensorMap& before,
                      const detail::OlderValues& older) {
  TensorMap in;
  const auto& inputs = model.input_names();
  detail::add_older_inputs(in, model, older); // x~2, x~3, ...: the starts before
  for (const auto& x : roles.state) {
    in.emplace(old_name(x), start.at(x));
    if (contains(inputs, x))
      in.emplace(x, guess(x, start, before, forces));
  }
  for (const auto& f : roles.forces) {
    in.emplace(f, forces.at(f));
    in.emplace(old_name(f), start.at(f));
  }
  for (const auto& g : roles.given)
    in.emplace(g, forces.at(g));
  for (const auto& h : roles.fixed)
    in.emplace(h, start.at(h));
  return in;
}

// Whether `t` shares memory with a tensor of the host's layout.
bool overlaps(const HostLayout& into, const at::Tensor& t) {
  for (const auto& [y, d] : into.outputs)
    if (detail::share_memory(d, t))
      return true;
  for (const auto& [y, blocks] : into.derivatives)
    for (const auto& [z, d] : blocks)
      if (detail::share_memory(d, t))
        return true;
  return false;
}

// `t` as (points, *shape) owning its memory (a batch-independent block is copied per point).
at::Tensor owned_rows(const at::Tensor& t, const Shape& full) {
  if (t.sizes() == at::IntArrayRef(full) && t.is_non_overlapping_and_dense())
    return t;
  return t.expand(full).clone();
}

} // namespace

StateRoles state_roles(const AnyDispatchedModel& model) {
  const auto& in = model.input_names();
  const auto& out = model.output_names();
  StateRoles roles;
  for (const auto& x : out)
    if (contains(in, old_name(x)))
      roles.state.push_back(x);
  for (const auto& n : in) {
    const auto [base, k] = history_of(n);
    const bool paired = contains(in, old_name(base)) && (contains(out, base) || contains(in, base));
    if (k == 0) {
      if (!contains(in, old_name(n)))
        roles.given.push_back(n);
      else if (!contains(out, n))
        roles.forces.push_back(n);
    } else if (!paired) // h~1 (or h~2, ...) with no current partner
      roles.fixed.push_back(n);
    else if (k > 1) { // x~k: the state keeps k - 1 starts before
      auto& depth = roles.depth.try_emplace(base, 1).first->second;
      depth = std::max(depth, k);
    }
  }
  return roles;
}

MaterialState::MaterialState(const AnyDispatchedModel& model, std::int64_t points,
                             const TensorMap& initial)
    : _model(&model)
    , _roles(state_roles(model))
    , _points(points)
    , _options(at::TensorOptions().dtype(model.dtype()).device(model.device().torch())) {
  if (points < 1)
    throw FatalError(fmt::format("MaterialState: {} points; a state holds at least 1", points));
  const auto inputs = input_shapes(model.artifact());
  _input_shapes = inputs;
  for (std::size_t o = 0; o < model.output_names().size(); ++o) {
    const auto& y = model.output_names()[o];
    _output_shapes[y] = model.output_shapes()[o];
  }
  for (const auto& x : _roles.state)
    _shapes.emplace(x, inputs.at(old_name(x)));
  for (const auto& names : {_roles.forces, _roles.given, _roles.fixed})
    for (const auto& n : names)
      _shapes.emplace(n, inputs.at(n));
  std::vector<std::string> older; // x~2, ... by name
  for (const auto& [n, depth] : _roles.depth)
    for (int k = 2; k <= depth; ++k)
      older.push_back(n + "~" + std::to_string(k));
  for (const auto& [name, value] : initial)
    if (!_shapes.count(name) && !contains(older, name))
      throw FatalError(fmt::format(
          "MaterialState: an initial value for '{}', which is not a state variable, force, "
          "given or fixed input or older value of this model; it has state {}, forces {}, "
          "given inputs {}, fixed inputs {} and older values {}",
          name, _roles.state, _roles.forces, _roles.given, _roles.fixed, older));
  TensorMap start;
  for (const auto& names : {_roles.state, _roles.forces, _roles.fixed})
    for (const auto& n : names) {
      auto value = at::zeros(with_rows(points, {&_shapes.at(n)}), _options);
      if (const auto it = initial.find(n); it != initial.end())
        value.copy_(as_points(it->second, points, _shapes.at(n), _options,
                              "MaterialState: the initial value of", n));
      start.emplace(n, std::move(value));
    }
  _start = std::move(start);
  for (const auto& g : _roles.given) // a cut interpolates it from here
    if (const auto it = initial.find(g); it != initial.end())
      _given_start.emplace(g, as_points(it->second, points, _shapes.at(g), _options,
                                        "MaterialState: the initial value of", g)
                                  .clone());
  for (const auto& [n, depth] : _roles.depth) // before the first step: as given, or the start
    for (int k = 2; k <= depth; ++k) {
      const auto it = initial.find(n + "~" + std::to_string(k));
      _older[n].push_back(it == initial.end()
                              ? _start.at(n)
                              : as_points(it->second, points, _shapes.at(n), _options,
                                          "MaterialState: the initial value of", it->first)
                                    .clone());
    }
  _all_converged = at::ones({points}, _options.dtype(at::kBool));
  _one_substep = at::ones({points}, _options.dtype(at::kLong));
  _no_failures = at::zeros({points}, _options.dtype(at::kChar));
  _no_residuals = at::zeros({points}, _options.dtype(at::kDouble));

  // A cut point's derivatives are chained through its spans: every output that has
  // derivatives needs them with respect to every input.
  _pairs = model.sessions().front().jacobian_pairs();
  const std::set<std::pair<std::string, std::string>> pairs(_pairs.begin(), _pairs.end());
  std::set<std::string> differentiated(_roles.state.begin(), _roles.state.end());
  for (const auto& [o, i] : pairs)
    differentiated.insert(o);
  for (const auto& o : differentiated)
    for (const auto& i : model.input_names())
      if (_missing_block.empty() && !pairs.count({o, i}))
        _missing_block = fmt::format("d({})/d({})", o, i);
  _has_jacobian = !pairs.empty();
}

TensorMap MaterialState::checked_forces(const TensorMap& forces, const StepOptions& options,
                                        bool copy_given) const {
  if (options.max_cuts < 0 || options.max_cuts > 30)
    throw FatalError(fmt::format("MaterialState::step(): max_cuts = {}; give 0 (no retry) to 30 "
                                 "(spans of 2^-30 of the step)",
                                 options.max_cuts));
  if (options.points.defined())
    check_step_points(options);
  TensorMap checked;
  for (const auto& [name, value] : forces)
    if (!contains(_roles.forces, name) && !contains(_roles.given, name))
      throw FatalError(fmt::format("MaterialState::step(): '{}' is not a force or given input of "
                                   "this model; it takes forces {} and given inputs {}",
                                   name, _roles.forces, _roles.given));
  for (const auto& names : {_roles.forces, _roles.given})
    for (const auto& n : names) {
      const auto it = forces.find(n);
      if (it == forces.end())
        throw FatalError(fmt::format("MaterialState::step(): no value for '{}'; give every force "
                                     "{} and given input {}",
                                     n, _roles.forces, _roles.given));
      checked.emplace(n, as_points(it->second, step_rows(options), _shapes.at(n), _options,
                                   "MaterialState::step():", n));
    }
  if (options.derivatives && !_has_jacobian)
    throw FatalError("MaterialState::step(): derivatives asked, but the artifact has no "
                     "Jacobian graphs; compile it with -d : (or step without derivatives)");
  if (options.derivatives && options.max_cuts > 0 && !_missing_block.empty())
    throw FatalError(fmt::format(
        "MaterialState::step(): the derivatives of a cut step are chained through its spans, "
        "which needs {}, a block the artifact lacks; compile it with -d : (every pair), or "
        "step with max_cuts = 0",
        _missing_block));
  if (options.extrapolate &&
      std::none_of(_roles.state.begin(), _roles.state.end(),
                   [&](const auto& x) { return contains(_model->input_names(), x); }))
    throw FatalError(fmt::format(
        "MaterialState::step(): extrapolate asked, but this model takes no input named after a "
        "state variable {} for Newton's guess (its guess is its own, from the old values): "
        "step without extrapolate",
        _roles.state));
  check_layout(options.into, options);
  // Copied before anything runs: accept() takes the forces (and a cut the given inputs),
  // and the host may change its memory meanwhile, or this very step write it (a layout).
  const bool direct = !options.into.points.defined() &&
                      (!options.into.outputs.empty() || !options.into.derivatives.empty());
  const bool keep_given = copy_given || _cutting || options.max_cuts > 0;
  for (auto& [n, value] : checked)
    if (keep_given || contains(_roles.forces, n) || (direct && overlaps(options.into, value)))
      value = at::empty_like(value, at::MemoryFormat::Contiguous).copy_(value);
  return checked;
}

TensorMap MaterialState::with_time(const TensorMap& forces, const at::Tensor& t) const {
  if (!contains(_roles.forces, "t") && !contains(_roles.given, "t"))
    throw FatalError("MaterialState::step(): a time was given, but this model has no input 't'; "
                     "call step(forces) without it");
  if (forces.count("t"))
    throw FatalError("MaterialState::step(): 't' is given twice, in the forces and apart; give "
                     "it once");
  auto with = forces;
  with.emplace("t", t);
  return with;
}

std::int64_t MaterialState::step_rows(const StepOptions& options) const {
  return options.points.defined() ? options.points.size(0) : _points;
}

void MaterialState::check_step_points(const StepOptions& options) const {
  const auto& p = options.points;
  if (p.scalar_type() != at::kLong || p.dim() != 1 || p.size(0) == 0)
    throw FatalError(fmt::format("MaterialState::step(): the step's points have dtype {} and "
                                 "shape {}; pass 1-d int64 indices, at least one",
                                 c10::toString(p.scalar_type()), p.sizes()));
  const auto low = p.min().item<std::int64_t>(), high = p.max().item<std::int64_t>();
  if (low < 0 || high >= _points)
    throw FatalError(fmt::format("MaterialState::step(): the step's points run from {} to {}; "
                                 "this state has points 0 to {}",
                                 low, high, _points - 1));
  const auto sorted = std::get<0>(p.sort());
  const auto twice =
      sorted.narrow(0, 1, p.size(0) - 1)
          .masked_select(sorted.narrow(0, 1, p.size(0) - 1) == sorted.narrow(0, 0, p.size(0) - 1));
  if (twice.numel() > 0)
    throw FatalError(fmt::format("MaterialState::step(): the step's points name point {} more "
                                 "than once; give each point once",
                                 twice[0].item<std::int64_t>()));
  if (options.into.points.defined())
    throw FatalError("MaterialState::step(): points given twice, as StepOptions::points and as "
                     "the host layout's; give StepOptions::points alone (the layout's rows are "
                     "then the step's points, in that order)");
}

MaterialState::~MaterialState() {
  if (_submitted.valid())
    _submitted.wait();
}

bool MaterialState::pending() const noexcept {
  return (_unwaited && _unwaited->load(std::memory_order_acquire)) || _pending;
}

void MaterialState::refuse_while_submitted(const char* what) const {
  if (_unwaited && _unwaited->load(std::memory_order_acquire))
    throw FatalError(fmt::format("MaterialState::{}(): a submitted step is running or has not been "
                                 "waited for; call wait() on its handle first (its result is its "
                                 "step's until then)",
                                 what));
}

const StepResult& MaterialState::step(const TensorMap& forces, const at::Tensor& t,
                                      const StepOptions& options) {
  return step(with_time(forces, t), options);
}

const StepResult& MaterialState::step(const TensorMap& forces, const StepOptions& options) {
  refuse_while_submitted("step");
  return run_step(checked_forces(forces, options, false), options);
}

void MaterialState::reject() {
  refuse_while_submitted("reject");
  if (!_pending)
    throw FatalError("MaterialState::reject(): no step is pending; call step() first (a step is "
                     "accepted or rejected once)");
  _pending = false;
}

const StepResult& MaterialState::run_step(TensorMap values, const StepOptions& options) {
  const auto& into = options.into;
  const bool direct =
      !into.points.defined() && (!into.outputs.empty() || !into.derivatives.empty());
  _extrapolating = _extrapolating || options.extrapolate;
  _cutting = _cutting || options.max_cuts > 0;
  // The rows the step runs: every point, or StepOptions::points with their start gathered.
  const auto rows = step_rows(options);
  // Copied: the host may reuse its index buffer before accept() (the state keeps them).
  const auto subset = options.points.defined()
                          ? options.points.to(_options.device(), options.points.scalar_type(),
                                              /*non_blocking=*/false, /*copy=*/true)
                          : at::Tensor();
  TensorMap start_rows, before_rows, given_rows;
  detail::OlderValues older_rows;
  if (subset.defined()) {
    const auto gather = [&](const TensorMap& all, TensorMap& some) {
      for (const auto& [n, value] : all)
        some.emplace(n, value.index_select(0, subset));
    };
    gather(_start, start_rows);
    gather(_before, before_rows);
    gather(_given_start, given_rows);
    for (const auto& [n, values] : _older)
      for (const auto& v : values)
        older_rows[n].push_back(v.index_select(0, subset));
  }
  const auto& start = subset.defined() ? start_rows : _start;
  const auto& before = subset.defined() ? before_rows : _before;
  const auto& given_start = subset.defined() ? given_rows : _given_start;
  const auto& older = subset.defined() ? older_rows : _older;
  const auto inputs = step_inputs(*_model, _roles, start, values,
                                  options.extrapolate ? before : TensorMap{}, older);
  // The checks passed: the trial before goes now, so that its results and this step's are
  // never held at once (a failure below leaves no trial).
  _pending = false;
  _result = {};
  // The chord's factors of the step's points: the state's, or a subset's, put back after.
  NewtonFactors some_factors;
  auto* factors = options.chord ? &_factors : nullptr;
  const auto subset_on_cpu = options.chord && subset.defined() ? subset.cpu() : at::Tensor();
  if (subset_on_cpu.defined())
    if (const auto all = detail::NewtonFactorsAccess::slots(_factors, _model->artifact(), _points);
        all.defined()) {
      detail::NewtonFactorsAccess::held(some_factors) = all.index_select(0, subset_on_cpu);
      factors = &some_factors;
    }
  auto e = direct ? evaluate_into(inputs, options, factors)
                  : detail::evaluate_points(*_model, inputs, options.derivatives, factors);
  if (factors == &some_factors)
    detail::NewtonFactorsAccess::held(_factors).index_copy_(
        0, subset_on_cpu, detail::NewtonFactorsAccess::held(some_factors));
  StepResult r;
  at::Tensor failed; // the points that failed, when some did
  if (e.converged.defined()) {
    r.converged = e.converged.to(_options.device());
    r.substeps = r.converged.to(at::kLong);
    r.reasons = e.reasons.to(_options.device());
    r.residuals = e.residuals.to(_options.device());
    failed = (~r.converged).nonzero().squeeze(1);
  } else if (!subset.defined()) { // shared, read-only
    r.converged = _all_converged;
    r.substeps = _one_substep;
    r.reasons = _no_failures;
    r.residuals = _no_residuals;
  } else {
    r.converged = _all_converged.narrow(0, 0, rows);
    r.substeps = _one_substep.narrow(0, 0, rows);
    r.reasons = _no_failures.narrow(0, 0, rows);
    r.residuals = _no_residuals.narrow(0, 0, rows);
  }
  const bool some_failed = failed.defined() && failed.numel() > 0;
  const bool cut = some_failed && options.max_cuts > 0;
  r.outputs = std::move(e.outputs);
  if (!direct) // the state's own: whole rows, writable
    for (auto& [y, value] : r.outputs)
      value = owned_rows(value, value.sizes().vec());
  r.derivatives = std::move(e.derivatives);
  for (auto& [y, blocks] : r.derivatives)
    for (auto& [z, block] : blocks)
      if (block.dim() == r.outputs.at(y).dim() + inputs.at(z).dim() - 2) {
        // batch-independent: one block for every point (its own rows when some failed)
        const auto base = block.sizes().vec();
        const auto full = with_rows(rows, {&base});
        block = some_failed ? block.expand(full).clone() : block.expand(full);
      }
  if (some_failed && e.non_finite) // an explicit model's point: NaN, as a failed Newton's
    detail::fill_failed(r, failed);
  if (cut)
    detail::cut_points({*_model, _roles, options, start, values, given_start, older}, failed, r);
  if (failed.defined()) {
    r.failed = (~r.converged).sum().item<std::int64_t>();
    r.cut = (r.substeps > 1).sum().item<std::int64_t>();
  }
  if (into.points.defined()) { // the host's rows, in its order: copied
    const auto rows = into.points.to(_options.device());
    for (const auto& [y, t] : into.outputs)
      t.copy_(r.outputs.at(y).index_select(0, rows));
    for (const auto& [y, blocks] : into.derivatives)
      for (const auto& [z, t] : blocks)
        t.copy_(r.derivatives.at(y).at(z).index_select(0, rows));
  }

  // Nothing above changed the state. Given inputs are kept only for a state that cuts (the
  // host's own tensors otherwise, whose memory it may want back).
  if (!_cutting)
    for (const auto& g : _roles.given)
      values.erase(g);
  _forces = std::move(values);
  _result = std::move(r);
  _subset = subset;
  _host_owned.clear();
  if (direct)
    for (const auto& [y, t] : into.outputs)
      _host_owned.insert(y);
  _pending = true;
  return _result;
}

at::Tensor MaterialState::selected_points(const at::Tensor& points) const {
  if (!points.defined())
    throw FatalError("MaterialState::accept(): the points are an undefined tensor; pass an (N,) "
                     "bool mask or int64 indices");
  if (points.scalar_type() == at::kBool) {
    if (points.dim() != 1 || points.size(0) != _points)
      throw FatalError(fmt::format("MaterialState::accept(): a mask of shape {}; pass one of "
                                   "shape [{}], a bool per point",
                                   points.sizes(), _points));
    return points.to(_options.device()).nonzero().squeeze(1);
  }
  if (!at::isIntegralType(points.scalar_type(), false) || points.dim() != 1)
    throw FatalError(fmt::format("MaterialState::accept(): points of dtype {} and shape {}; pass "
                                 "an (N,) bool mask or 1-d integer indices",
                                 c10::toString(points.scalar_type()), points.sizes()));
  const auto index = points.to(_options.device(), at::kLong);
  if (index.numel() > 0 &&
      (index.min().item<std::int64_t>() < 0 || index.max().item<std::int64_t>() >= _points))
    throw FatalError(fmt::format("MaterialState::accept(): indices from {} to {}; this state has "
                                 "points 0 to {}",
                                 index.min().item<std::int64_t>(), index.max().item<std::int64_t>(),
                                 _points - 1));
  return index;
}

void MaterialState::keep_before(const at::Tensor& points, const at::Tensor& rows) {
  // `kept` with the accepted points' rows replaced by `now`'s (rows `at` of it): a new
  // tensor; `now` itself when every point is accepted.
  const auto replaced = [&](const at::Tensor& kept, const at::Tensor& now, const at::Tensor& at) {
    return points.defined() ? kept.index_copy(0, points, now.index_select(0, at)) : now;
  };
  // x~k (k > 1) take the older starts one place back, x~2 the start as it is.
  for (auto& [n, values] : _older)
    for (auto j = values.size(); j-- > 0;)
      values[j] = replaced(values[j], j == 0 ? _start.at(n) : values[j - 1], points);
  // A cut interpolates given inputs from their last accepted value (NaN: none yet).
  if (_cutting)
    for (const auto& g : _roles.given) {
      const auto none = [&] {
        return at::full(with_rows(_points, {&_shapes.at(g)}),
                        std::numeric_limits<double>::quiet_NaN(), _options);
      };
      const auto kept = _given_start.count(g) ? _given_start.at(g) : none();
      _given_start.insert_or_assign(g, replaced(kept, _forces.at(g), rows));
    }
  if (!_extrapolating) // kept only for a host that extrapolates: it holds a state's worth
    return;
  auto names = _roles.state;
  if (_start.count("t"))
    names.push_back("t");
  for (const auto& n : names) {
    const auto& now = _start.at(n);
    _before.insert_or_assign(n, replaced(_before.count(n) ? _before.at(n) : now, now, points));
  }
}

void MaterialState::accept() {
  refuse_while_submitted("accept");
  if (!_pending)
    throw FatalError("MaterialState::accept(): no step is pending; call step() first (a step is "
                     "accepted or rejected once)");
  if (_result.failed > 0 || _subset.defined()) {
    const auto rows = _result.converged.nonzero().squeeze(1);
    return accept_rows(_subset.defined() ? _subset.index_select(0, rows) : rows, rows);
  }
  keep_before({}, {});
  // The trial becomes the start: no copy, unless it lives in the host's storage. Tensors
  // once handed out (start(), a result) are never written again.
  for (const auto& x : _roles.state)
    _start.at(x) = _host_owned.count(x) ? _result.outputs.at(x).clone() : _result.outputs.at(x);
  for (const auto& f : _roles.forces)
    _start.at(f) = _forces.at(f);
  _pending = false;
}

void MaterialState::accept(const at::Tensor& points) {
  refuse_while_submitted("accept");
  if (!_pending)
    throw FatalError("MaterialState::accept(): no step is pending; call step() first (a step is "
                     "accepted or rejected once)");
  const auto index = selected_points(points);
  auto rows = index; // the trial's rows of those points
  if (_subset.defined()) {
    auto row_of = at::full({_points}, -1, index.options());
    row_of.index_copy_(0, _subset, at::arange(_subset.size(0), index.options()));
    rows = row_of.index_select(0, index);
    if (const auto outside = (rows < 0).nonzero(); outside.numel() > 0)
      throw FatalError(
          fmt::format("MaterialState::accept(): point {} was not among this step's points "
                      "(StepOptions::points); accept only points the step evaluated",
                      index[outside[0][0].item<std::int64_t>()].item<std::int64_t>()));
  }
  const auto unconverged = (~_result.converged.index_select(0, rows)).nonzero();
  if (unconverged.numel() > 0)
    throw FatalError(fmt::format(
        "MaterialState::accept(): point {} did not converge in this step (its trial is NaN); "
        "accept only points whose StepResult::converged is true",
        index[unconverged[0][0].item<std::int64_t>()].item<std::int64_t>()));
  accept_rows(index, rows);
}

void MaterialState::accept_rows(const at::Tensor& points, const at::Tensor& rows) {
  keep_before(points, rows);
  // New tensors, not writes into ones a host may hold (start() or an earlier result).
  for (const auto& x : _roles.state)
    _start.at(x) = _start.at(x).index_copy(0, points, _result.outputs.at(x).index_select(0, rows));
  for (const auto& f : _roles.forces)
    _start.at(f) = _start.at(f).index_copy(0, points, _forces.at(f).index_select(0, rows));
  _pending = false;
}

} // namespace neml2

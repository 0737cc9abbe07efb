// Composed models: segments in order over one state of named tensors; Newton for the
// implicit ones; Jacobians chained through every segment (implicit ones by the implicit
// function theorem, du/dg = -A^{-1} B, from their compiled graphs).

#include "implicit/segment_chain.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <neml2/errors.hpp>

#include "graph/graph.hpp"
#include "implicit/newton_rows.hpp"
#include "implicit/row_ranges.hpp"

namespace neml2::detail {
namespace {

Shape with_rows(std::int64_t rows, std::initializer_list<const Shape*> parts) {
  Shape s{rows};
  for (const auto* p : parts)
    s.insert(s.end(), p->begin(), p->end());
  return s;
}

// addend + a . b per row, `a` `(rows or 1, n, k)`, `b` `(rows or 1, k, m)`, `addend`
// undefined or `(rows, n, m)`. On the CPU in double one pass over the rows on the host:
// ATen's bmm runs many small products as a slow loop (most of jacobian()'s time on J2).
at::Tensor rows_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& addend = {}) {
  const auto host = [](const at::Tensor& t) {
    return !t.defined() || (t.is_cpu() && t.scalar_type() == at::kDouble && t.dim() == 3);
  };
  const auto rows = std::max(a.size(0), b.size(0));
  if (!host(a) || !host(b) || !host(addend) || a.size(2) != b.size(1) ||
      (addend.defined() && addend.sizes() != c10::IntArrayRef{rows, a.size(1), b.size(2)})) {
    auto product = at::matmul(a, b);
    return addend.defined() ? addend + product : product;
  }
  const auto n = a.size(1), k = a.size(2), m = b.size(2);
  auto out = addend.defined() ? addend.clone(at::MemoryFormat::Contiguous)
                              : at::zeros({rows, n, m}, a.options());
  const auto* pa = a.data_ptr<double>();
  const auto* pb = b.data_ptr<double>();
  auto* po = out.data_ptr<double>();
  const auto as0 = a.size(0) == 1 ? 0 : a.stride(0), as1 = a.stride(1), as2 = a.stride(2);
  const auto bs0 = b.size(0) == 1 ? 0 : b.stride(0), bs1 = b.stride(1), bs2 = b.stride(2);
  for_row_ranges(rows, 256, [&](std::int64_t begin, std::int64_t end) {
    for (auto i = begin; i < end; ++i)
      for (std::int64_t r = 0; r < n; ++r) {
        double* o = po + (i * n + r) * m;
        for (std::int64_t x = 0; x < k; ++x) {
          const double air = pa[i * as0 + r * as1 + x * as2];
          for (std::int64_t c = 0; c < m; ++c)
            o[c] += air * pb[i * bs0 + x * bs1 + c * bs2];
        }
      }
  });
  return out;
}

// d(target)/d(inputs) += block . d(source)/d(inputs); `block` is `(rows or 1, n_t, n_s)`.
void accumulate(std::vector<at::Tensor>& target, const at::Tensor& block,
                const std::vector<at::Tensor>& source) {
  for (std::size_t x = 0; x < source.size(); ++x)
    if (source[x].defined())
      target[x] = rows_matmul(block, source[x], target[x]);
}

// Where each variable sits in its packed group.
std::map<std::string, GroupSlice> slices(const std::vector<VariableGroup>& groups,
                                         const std::vector<ImplicitVariable>& variables) {
  std::map<std::string, std::int64_t> sizes;
  for (const auto& v : variables)
    sizes[v.name] = v.var_size;
  std::map<std::string, GroupSlice> found;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    std::int64_t offset = 0;
    for (const auto& n : groups[g].names) {
      const auto size = sizes.count(n) ? sizes.at(n) : 1;
      found[n] = {g, offset, size};
      offset += size;
    }
  }
  return found;
}

// The givens' substepping roles (metadata.json `role` and `pair`) as slices of the packed
// groups. Roles are the compiler's: a force listed in incremental_variables already has
// its `~1` partner and the cur_force / old_force roles.
SubstepPlan substep_plan(const ImplicitSegment& seg, const std::filesystem::path& root) {
  SubstepPlan plan;
  plan.max_level = seg.max_substepping_level;
  if (plan.max_level <= 0)
    return plan;
  if (plan.max_level > 30)
    throw FatalError(fmt::format("{}/metadata.json: max_substepping_level = {} asks for 2^{} "
                                 "substeps; at most 30 levels are supported: lower it on the "
                                 "ImplicitUpdate and recompile",
                                 root.string(), plan.max_level, plan.max_level));
  const auto given = slices(seg.given_groups, seg.givens);
  const auto unknown = slices(seg.unknown_groups, seg.unknowns);
  const auto inconsistent = [&](const ImplicitVariable& v, const std::string& why) {
    return FatalError(fmt::format("{}/metadata.json: given '{}' has substepping role '{}' with "
                                  "pair '{}', but {}; the artifact is inconsistent: recompile it "
                                  "with neml2-compile",
                                  root.string(), v.name, v.role, v.pair, why));
  };
  for (const auto& v : seg.givens) {
    if (v.role == "cur_force") {
      const auto old = given.find(v.pair);
      if (old == given.end() || old->second.size != given.at(v.name).size)
        throw inconsistent(v, "the pair is not a given of the same size");
      plan.ramps.push_back({given.at(v.name), old->second});
    } else if (v.role == "old_state") {
      const auto u = unknown.find(v.pair);
      if (u == unknown.end() || u->second.size != given.at(v.name).size)
        throw inconsistent(v, "the pair is not an unknown of the same size");
      plan.chains.push_back({given.at(v.name), u->second});
    } else if (v.role != "static" && v.role != "old_force" && v.role != "unknown")
      throw FatalError(fmt::format("{}/metadata.json: given '{}' has substepping role '{}'; "
                                   "known roles are static, old_state, cur_force and old_force "
                                   "(recompile with neml2-compile 3.1)",
                                   root.string(), v.name, v.role));
  }
  return plan;
}

// What a solve_ift graph returns from the dense du/dg = -A^{-1} B `(rows, n_u, n_g)`: its
// blocks at each pair's offsets.
std::vector<at::Tensor> ift_pairs(const ImplicitSegment& seg, const at::Tensor& du_dg) {
  const auto rows = du_dg.size(0);
  std::vector<at::Tensor> pairs;
  for (const auto& pair : seg.jacobian_pairs) {
    const auto nu = numel(pair.unknown_base_shape), ng = numel(pair.given_base_shape);
    pairs.push_back(
        du_dg.narrow(1, pair.row_offset, nu)
            .narrow(2, pair.col_offset, ng)
            .reshape(with_rows(rows, {&pair.unknown_base_shape, &pair.given_base_shape})));
  }
  return pairs;
}

// What a solve_ift graph returns, for an iterative input sensitivity (no such graph), off
// the CPU's row pass: A and B assembled and solved. NEML2 runs GMRES to its rel_tol on
// them; A is assembled anyway, so we solve it exactly (on purpose).
GraphFn dense_ift(const ImplicitSegment& seg, std::size_t a_blocks) {
  const auto units = seg.unknown_groups.size();
  return [&seg, a_blocks, units](const std::vector<at::Tensor>& operators) {
    const auto rows = operators.front().size(0);
    const auto assemble = [&](std::size_t first, std::size_t count, std::size_t columns) {
      std::vector<at::Tensor> block_rows;
      for (std::size_t i = first; i < first + count; i += columns) {
        std::vector<at::Tensor> row;
        for (std::size_t j = i; j < i + columns; ++j)
          row.push_back(operators[j].expand({rows, -1, -1}));
        block_rows.push_back(at::cat(row, 2));
      }
      return at::cat(block_rows, 1);
    };
    const auto givens = (operators.size() - a_blocks) / (a_blocks / units);
    const auto a = assemble(0, a_blocks, units);
    const auto b = assemble(a_blocks, operators.size() - a_blocks, givens);
    return ift_pairs(seg, -at::linalg_solve(a, b));
  };
}

// Whether every value of the CPU double tensor `t` is finite, read in place when it is
// dense (in any order of its axes): the exponent bits of each value (vectorized).
bool all_finite(const at::Tensor& t) {
  if (!t.is_non_overlapping_and_dense())
    return at::isfinite(t).all().item<bool>();
  const auto* bits = static_cast<const std::uint64_t*>(t.data_ptr());
  const auto count = t.numel();
  // The exponent field plus one carries into the sign bit only when it is all ones.
  constexpr std::uint64_t exponent = 0x7ffULL << 52, one = 1ULL << 52;
  std::uint64_t carries = 0;
  for (std::int64_t k = 0; k < count; ++k)
    carries |= (bits[k] & exponent) + one;
  return (carries >> 63) == 0;
}

// Clears `finite[r]` where row r of the `(rows, n)` `t` has a value that is not finite: on
// the host instead of five tensor operations, and rows only when some value is not.
void host_finite_rows(const at::Tensor& t, bool* finite) {
  if (all_finite(t))
    return;
  const auto dense = t.contiguous();
  const auto* data = dense.data_ptr<double>();
  const auto width = dense.size(1);
  for_row_ranges(dense.size(0), 2048, [&](std::int64_t begin, std::int64_t end) {
    for (auto r = begin; r < end; ++r) {
      bool all = true;
      for (std::int64_t k = 0; k < width; ++k) // x - x is 0 unless x is inf or NaN
        all &= data[r * width + k] - data[r * width + k] == 0;
      finite[r] = finite[r] && all;
    }
  });
}

} // namespace

struct SegmentChain::State {
  std::int64_t rows = 0;
  bool track = false;  // chain the derivatives with respect to the model's inputs
  bool params = false; // ... and its parameters (columns after the inputs')
  std::size_t columns = 0;
  std::map<std::string, at::Tensor> values;
  std::map<std::string, std::vector<at::Tensor>> derivatives; // (rows, n_var, n_input)
  at::Tensor converged;                                       // (rows,) once a solve ran
  double worst_residual = 0;

  const at::Tensor& value(const std::string& name, const std::string& needed_by) const {
    const auto it = values.find(name);
    if (it == values.end())
      throw FatalError(fmt::format("{} needs '{}', which no model input or earlier segment "
                                   "provides; the artifact is inconsistent: recompile it with "
                                   "neml2-compile",
                                   needed_by, name));
    return it->second;
  }

  // (rows, n) view of a variable, for packing and contracting.
  at::Tensor flat(const std::string& name, const std::string& needed_by) const {
    return value(name, needed_by).reshape({rows, -1});
  }

  std::vector<at::Tensor>& derivative(const std::string& name, std::size_t n_inputs) {
    auto& d = derivatives[name];
    d.resize(n_inputs);
    return d;
  }
};

SegmentChain::SegmentChain(const Artifact& artifact, const GraphLoader& load)
    : _artifact(artifact)
    , _config(artifact.solver_config.value_or(SolverConfig{})) {
  auto& param_index = _param_index;
  std::map<std::string, std::size_t> input_index, output_index;
  for (std::size_t p = 0; p < artifact.parameters.size(); ++p)
    param_index[artifact.parameters[p].name] = p;
  for (std::size_t i = 0; i < artifact.inputs.size(); ++i) {
    input_index[artifact.inputs[i].name] = i;
    _input_sizes.push_back(numel(artifact.inputs[i].sub_batch_shape) *
                           numel(artifact.inputs[i].base_shape));
  }
  for (std::size_t o = 0; o < artifact.outputs.size(); ++o)
    output_index[artifact.outputs[o].name] = o;

  const auto params_of = [&](const std::vector<std::string>& names) {
    std::vector<std::size_t> positions;
    for (const auto& n : names) {
      const auto it = param_index.find(n);
      if (it == param_index.end())
        throw FatalError(fmt::format("{}/metadata.json: a segment takes parameter '{}', which "
                                     "is not declared under 'parameters'; recompile with "
                                     "neml2-compile",
                                     artifact.root.string(), n));
      positions.push_back(it->second);
    }
    return positions;
  };

  for (const auto& segment : artifact.segments) {
    if (const auto* f = std::get_if<ForwardSegment>(&segment)) {
      // Intermediate variables' shapes are not in metadata.json: counts only, shapes at
      // the first call.
      const std::vector<std::optional<Shape>> takes(f->inputs.size() + f->param_inputs.size());
      _steps.emplace_back(ForwardStep{
          f, load(f->package, "package", takes, f->outputs.size()),
          load(f->jvp_package, "jvp_package", takes, f->outputs.size() + f->jacobian_pairs.size()),
          load(f->param_jacobian_package, "param_jacobian_package", takes,
               f->param_jacobian_pairs.size()),
          params_of(f->param_inputs)});
      _has_input_derivatives = _has_input_derivatives && !f->jvp_package.empty();
      _has_param_derivatives = _has_param_derivatives && !f->jvp_package.empty() &&
                               (f->param_inputs.empty() || !f->param_jacobian_package.empty());
      continue;
    }
    const auto& s = std::get<ImplicitSegment>(segment);
    ImplicitStep step;
    step.segment = &s;
    step.params = params_of(s.param_inputs);
    // What each Newton graph takes: the groups packed (B, width), A's blocks (B, r, u)
    // residual by unknown, B's (B, r, g), the parameters as stored (per row for dr_dparam).
    const auto widths = [](const std::vector<VariableGroup>& groups,
                           const std::vector<ImplicitVariable>& vars) {
      std::vector<std::int64_t> w;
      for (const auto& g : groups) {
        std::int64_t width = 0;
        for (const auto& n : g.names) {
          const auto v = std::find_if(vars.begin(), vars.end(),
                                      [&](const ImplicitVariable& x) { return x.name == n; });
          width += v == vars.end() ? 1 : v->var_size;
        }
        w.push_back(width);
      }
      return w;
    };
    const auto u = widths(s.unknown_groups, s.unknowns), g = widths(s.given_groups, s.givens),
               r = widths(s.residual_groups, s.residuals);
    using Arguments = std::vector<std::optional<Shape>>;
    const auto packed = [](Arguments& args, const std::vector<std::int64_t>& w) {
      for (auto x : w)
        args.emplace_back(Shape{-1, x});
    };
    const auto blocks = [&](Arguments& args, const std::vector<std::int64_t>& columns) {
      for (auto rows : r)
        for (auto x : columns)
          args.emplace_back(Shape{-1, rows, x});
    };
    Arguments state, per_row_state, a_and_b, a_and_given, a_and_dparam;
    packed(state, u);
    packed(state, g);
    per_row_state = state;
    std::int64_t param_width = 0;
    for (auto p : step.params) {
      const auto& param = artifact.parameters[p];
      state.emplace_back(param.shape);
      auto per_row = param.base_shape;
      per_row.insert(per_row.begin(), -1);
      per_row_state.emplace_back(per_row);
      param_width += numel(param.base_shape);
    }
    blocks(a_and_b, u);
    a_and_given = a_and_dparam = a_and_b;
    packed(a_and_b, r);
    blocks(a_and_given, g);
    for (auto rows : r)
      a_and_dparam.emplace_back(Shape{-1, rows, param_width});
    const auto a_blocks = r.size() * u.size();
    step.newton.residual = load(s.residual_package, "residual_package", state, r.size());
    step.newton.jacobian = load(s.jacobian_package, "jacobian_package", state, a_blocks + r.size());
    step.newton.solve = load(s.solve_package, "solve_package", a_and_b, u.size());
    step.newton.a_blocks = step.a_blocks = a_blocks;
    if (!s.matvec_package.empty()) { // a Krylov step: A only through A v
      auto with_v = state;
      packed(with_v, u);
      step.newton.matvec = load(s.matvec_package, "matvec_package", with_v, r.size());
      step.newton.precond_setup =
          load(s.precond_setup_package, "precond_setup_package", state, unchecked_results);
      step.newton.precond_apply =
          load(s.precond_apply_package, "precond_apply_package", Arguments{},
               unchecked_results); // (state, r): its own checks
      step.newton.a_blocks = 0;
    }
    step.given_blocks = r.size() * g.size();
    step.substeps = substep_plan(s, artifact.root);
    step.predictor = load(s.predictor_package, "predictor_package",
                          Arguments(s.predictor_inputs.size()), s.predictor_outputs.size());
    step.jacobian_given =
        load(s.jacobian_given_package, "jacobian_given_package", state, step.given_blocks);
    step.solve_ift = s.iterative_input_sensitivity ? dense_ift(s, a_blocks)
                                                   : load(s.solve_ift_package, "solve_ift_package",
                                                          a_and_given, s.jacobian_pairs.size());
    step.dr_dparam =
        load(s.dr_dparam_package, "dr_dparam_package", per_row_state, a_blocks + r.size());
    step.solve_param = load(s.solve_param_package, "solve_param_package", a_and_dparam,
                            s.param_jacobian_pairs.size());
    _has_input_derivatives = _has_input_derivatives && step.jacobian_given && step.solve_ift;
    _has_param_derivatives = _has_param_derivatives && step.jacobian_given && step.solve_ift &&
                             (s.param_inputs.empty() || step.solve_param);
    _steps.emplace_back(std::move(step));
  }

  // metadata.json's pairs of names -> (output, input or parameter) positions.
  const auto positions = [&](const std::vector<std::pair<std::string, std::string>>& pairs,
                             const std::map<std::string, std::size_t>& second, const char* key) {
    std::vector<std::pair<std::size_t, std::size_t>> found;
    for (const auto& [a, b] : pairs) {
      const auto o = output_index.find(a);
      const auto x = second.find(b);
      if (o == output_index.end() || x == second.end())
        throw FatalError(fmt::format("{}/metadata.json: {} pair [{}, {}] names something the "
                                     "model does not declare; recompile with neml2-compile",
                                     artifact.root.string(), key, a, b));
      found.emplace_back(o->second, x->second);
    }
    return found;
  };
  _jacobian_blocks = positions(artifact.derivatives, input_index, "derivatives");
  _param_jacobian_blocks =
      positions(artifact.parameter_derivatives, param_index, "parameter_derivatives");
  _has_param_derivatives = _has_param_derivatives && !_param_jacobian_blocks.empty();
  for (const auto& [o, p] : _param_jacobian_blocks)
    if (std::find(_param_vjp_params.begin(), _param_vjp_params.end(), p) == _param_vjp_params.end())
      _param_vjp_params.push_back(p);
  std::sort(_param_vjp_params.begin(), _param_vjp_params.end());
}

bool SegmentChain::solves_with_parameter(std::size_t p) const {
  for (const auto& step : _steps)
    if (const auto* s = std::get_if<ImplicitStep>(&step))
      if (std::find(s->params.begin(), s->params.end(), p) != s->params.end())
        return true;
  return false;
}

void SegmentChain::set_solver_config(const SolverConfig& config) {
  const auto fail = [](const std::string& field, const std::string& what) {
    throw FatalError(fmt::format("set_solver_config: {} {}", field, what));
  };
  if (!(config.atol >= 0))
    fail("atol", fmt::format("is {}; it must be >= 0", config.atol));
  if (!(config.rtol >= 0))
    fail("rtol", fmt::format("is {}; it must be >= 0", config.rtol));
  if (config.miters < 1)
    fail("miters", fmt::format("is {}; it must be >= 1 (miters = N allows N - 1 Newton updates)",
                               config.miters));
  if (config.ls_max_iters < 1)
    fail("ls_max_iters",
         fmt::format("is {}; it must be >= 1 (1 = no line search)", config.ls_max_iters));
  if (config.ls_type != "BACKTRACKING" && config.ls_type != "STRONG_WOLFE")
    fail("ls_type", fmt::format("is '{}'; it must be BACKTRACKING or STRONG_WOLFE (NEML2's "
                                "linesearch_type)",
                                config.ls_type));
  if (!(config.substep_del_tol >= 0))
    fail("substep_del_tol", fmt::format("is {}; it must be >= 0", config.substep_del_tol));
  if (config.ls_max_iters > 1 && !(config.ls_cutback > 1))
    fail("ls_cutback", fmt::format("is {}; it must be > 1", config.ls_cutback));
  if (config.solver_kind != _config.solver_kind)
    fail("solver_kind", fmt::format("is '{}'; this artifact's solve is '{}' (its graphs decide it)",
                                    config.solver_kind, _config.solver_kind));
  if (const auto why = check_krylov(config.krylov))
    fail("krylov." + why->substr(0, why->find(' ')), why->substr(why->find(' ') + 1));
  if (!(config.compact_below >= 0 && config.compact_below <= 1))
    fail("compact_below", fmt::format("is {}; it must be within [0, 1]", config.compact_below));
  _config = config;
}

void SegmentChain::run_forward(const ForwardStep& step, const ChunkArgs& chunk,
                               State& state) const {
  const auto& seg = *step.segment;
  std::vector<at::Tensor> args;
  args.reserve(seg.inputs.size() + step.params.size());
  for (const auto& n : seg.inputs)
    args.push_back(state.value(n, "graph '" + seg.package + "'"));
  for (auto p : step.params)
    args.push_back(chunk.params[p]);
  auto results = state.track ? step.jvp(args) : step.value(args);

  std::vector<std::vector<at::Tensor>> derivatives(seg.outputs.size());
  const auto column = [&](const std::string& param) {
    return _input_sizes.size() + _param_index.at(param);
  };
  if (state.params && step.param_jacobian) {
    const auto blocks = step.param_jacobian(args);
    for (std::size_t k = 0; k < seg.param_jacobian_pairs.size(); ++k) {
      const auto& pair = seg.param_jacobian_pairs[k];
      const auto o = static_cast<std::size_t>(
          std::find(seg.outputs.begin(), seg.outputs.end(), pair.out) - seg.outputs.begin());
      derivatives[o].resize(state.columns);
      derivatives[o][column(pair.param)] =
          blocks[k].reshape({state.rows, numel(pair.out_base_shape), numel(pair.param_base_shape)});
    }
  }
  if (state.track) {
    const auto n_inputs = state.columns;
    for (std::size_t k = 0; k < seg.jacobian_pairs.size(); ++k) {
      const auto& pair = seg.jacobian_pairs[k];
      const auto o = static_cast<std::size_t>(
          std::find(seg.outputs.begin(), seg.outputs.end(), pair.out) - seg.outputs.begin());
      const auto source = state.derivatives.find(pair.in);
      if (source == state.derivatives.end())
        continue;
      const auto& block = results[seg.outputs.size() + k];
      derivatives[o].resize(n_inputs);
      accumulate(
          derivatives[o],
          block.reshape({block.size(0), numel(pair.out_base_shape), numel(pair.in_base_shape)}),
          source->second);
    }
  }
  for (std::size_t o = 0; o < seg.outputs.size(); ++o) {
    state.values[seg.outputs[o]] = std::move(results[o]);
    if (state.track)
      state.derivatives[seg.outputs[o]] = std::move(derivatives[o]);
  }
}

void SegmentChain::run_implicit(const ImplicitStep& step, const ChunkArgs& chunk,
                                State& state) const {
  const auto& seg = *step.segment;
  const auto where = fmt::format("graph '{}'", seg.residual_package);
  const auto pack = [&](const std::vector<VariableGroup>& groups,
                        const std::map<std::string, at::Tensor>& overrides) {
    std::vector<at::Tensor> packed;
    for (const auto& group : groups) {
      std::vector<at::Tensor> parts;
      for (const auto& n : group.names) {
        const auto it = overrides.find(n);
        parts.push_back(it != overrides.end() ? it->second.reshape({state.rows, -1})
                                              : state.flat(n, where));
      }
      packed.push_back(parts.size() == 1 ? parts.front().contiguous() : at::cat(parts, 1));
    }
    return packed;
  };

  // The initial guess: the predictor's outputs, else the unknown's incoming value, else 0.
  std::map<std::string, at::Tensor> guess;
  if (step.predictor) {
    std::vector<at::Tensor> args;
    for (const auto& n : seg.predictor_inputs)
      args.push_back(state.value(n, "graph '" + seg.predictor_package + "'"));
    auto predicted = step.predictor(args);
    for (std::size_t k = 0; k < seg.predictor_outputs.size(); ++k)
      guess[seg.predictor_outputs[k]] = std::move(predicted[k]);
  }
  const auto options =
      chunk.inputs.empty() ? at::TensorOptions(at::kDouble) : chunk.inputs.front().options();
  for (const auto& u : seg.unknowns)
    if (!guess.count(u.name) && !state.values.count(u.name))
      guess[u.name] = at::zeros({state.rows, u.var_size}, options);

  // Parameters enter the solve graphs as stored (one value for every row).
  std::vector<at::Tensor> params;
  for (auto p : step.params)
    params.push_back(chunk.params[p].select(0, 0));

  const auto givens = pack(seg.given_groups, {});
  // Substepped rows chain their derivatives through their spans (dense_derivative).
  const auto layout = dense_layout(step, state.params && step.solve_param);
  DerivativeFn du_dg;
  if (state.track && step.substeps.max_level > 0)
    du_dg = [&](const std::vector<at::Tensor>& u, const std::vector<at::Tensor>& g) {
      return dense_derivative(step, chunk, params, layout, u, g);
    };
  auto solved = solve_with_substeps(step.newton, pack(seg.unknown_groups, guess), givens, params,
                                    _config, step.substeps, du_dg, layout.n_params);

  // Unpack the unknowns into the state.
  std::map<std::string, const ImplicitVariable*> unknown_spec;
  for (const auto& u : seg.unknowns)
    unknown_spec[u.name] = &u;
  for (std::size_t g = 0; g < seg.unknown_groups.size(); ++g) {
    std::int64_t offset = 0;
    for (const auto& n : seg.unknown_groups[g].names) {
      const auto& spec = *unknown_spec.at(n);
      state.values[n] = solved.u[g]
                            .narrow(1, offset, spec.var_size)
                            .reshape(with_rows(state.rows, {&spec.base_shape}));
      offset += spec.var_size;
    }
  }
  state.converged =
      state.converged.defined() ? state.converged & solved.converged : solved.converged;
  if (std::isnan(solved.worst_residual) || solved.worst_residual > state.worst_residual)
    state.worst_residual = solved.worst_residual;

  if (!state.track)
    return;
  // du/dg = -A^{-1} B at the solution, then chained to the model's inputs.
  auto pairs = input_sensitivity(step, solved.u, givens, params);
  if (solved.substepped.defined()) {
    // Rows solved in substeps: their derivatives chained through the substeps.
    for (std::size_t k = 0; k < seg.jacobian_pairs.size(); ++k) {
      const auto& pair = seg.jacobian_pairs[k];
      const auto nu = numel(pair.unknown_base_shape), ng = numel(pair.given_base_shape);
      pairs[k] = pairs[k]
                     .reshape({state.rows, nu, ng})
                     .index_copy(0, solved.substepped,
                                 solved.substepped_du_dg.narrow(1, pair.row_offset, nu)
                                     .narrow(2, pair.col_offset, ng));
    }
  }
  const auto n_columns = state.columns;
  std::map<std::string, std::vector<at::Tensor>> derivatives;
  if (state.params && step.solve_param) {
    // du/dparam = -A^{-1} dr/dparam, the parameters given per row.
    std::vector<at::Tensor> per_row = solved.u;
    per_row.insert(per_row.end(), givens.begin(), givens.end());
    for (auto p : step.params)
      per_row.push_back(chunk.params[p]);
    const auto blocks = param_sensitivity(step, per_row, layout);
    for (std::size_t k = 0; k < seg.param_jacobian_pairs.size(); ++k) {
      const auto& pair = seg.param_jacobian_pairs[k];
      auto& target = derivatives[pair.out];
      target.resize(n_columns);
      const auto nu = numel(pair.out_base_shape), np = numel(pair.param_base_shape);
      auto block = blocks[k].reshape({state.rows, nu, np});
      if (solved.substepped.defined()) // chained through the substeps
        block =
            block.index_copy(0, solved.substepped,
                             solved.substepped_du_dg.narrow(1, layout.unknown_row.at(pair.out), nu)
                                 .narrow(2,
                                         solved.substepped_du_dg.size(2) - layout.n_params +
                                             layout.param_column.at(pair.param),
                                         np));
      target[_input_sizes.size() + _param_index.at(pair.param)] = block;
    }
  }
  for (std::size_t k = 0; k < seg.jacobian_pairs.size(); ++k) {
    const auto& pair = seg.jacobian_pairs[k];
    const auto source = state.derivatives.find(pair.given);
    auto& target = derivatives[pair.unknown];
    target.resize(n_columns);
    if (source != state.derivatives.end())
      accumulate(target,
                 pairs[k].reshape(
                     {state.rows, numel(pair.unknown_base_shape), numel(pair.given_base_shape)}),
                 source->second);
  }
  for (const auto& u : seg.unknowns) {
    auto& d = derivatives[u.name];
    d.resize(n_columns);
    state.derivatives[u.name] = std::move(d);
  }
}

std::vector<at::Tensor>
SegmentChain::input_sensitivity(const ImplicitStep& step, const std::vector<at::Tensor>& u,
                                const std::vector<at::Tensor>& g,
                                const std::vector<at::Tensor>& params) const {
  const auto args = graph_args(u, g, params);
  if (runs_on_rows(u.front(), _config)) {
    auto a_blocks = call_for_rows(step.newton.jacobian, args);
    a_blocks.resize(step.a_blocks);
    return ift_pairs(*step.segment,
                     minus_solve_rows(a_blocks, call_for_rows(step.jacobian_given, args),
                                      step.segment->residual_groups.size()));
  }
  auto operators = step.newton.jacobian(args);
  operators.resize(step.a_blocks);
  const auto b_blocks = step.jacobian_given(args);
  operators.insert(operators.end(), b_blocks.begin(), b_blocks.end());
  return step.solve_ift(operators);
}

std::vector<at::Tensor> SegmentChain::param_sensitivity(const ImplicitStep& step,
                                                        const std::vector<at::Tensor>& per_row,
                                                        const DenseLayout& layout) const {
  if (!runs_on_rows(per_row.front(), _config))
    return step.solve_param(step.dr_dparam(per_row));
  const auto operators = call_for_rows(step.dr_dparam, per_row);
  const auto split = operators.begin() + static_cast<std::ptrdiff_t>(step.a_blocks);
  const auto du = minus_solve_rows({operators.begin(), split}, {split, operators.end()},
                                   step.segment->residual_groups.size());
  std::vector<at::Tensor> pairs;
  for (const auto& pair : step.segment->param_jacobian_pairs)
    pairs.push_back(
        du.narrow(1, layout.unknown_row.at(pair.out), numel(pair.out_base_shape))
            .narrow(2, layout.param_column.at(pair.param), numel(pair.param_base_shape)));
  return pairs;
}

SegmentChain::DenseLayout SegmentChain::dense_layout(const ImplicitStep& step,
                                                     bool with_params) const {
  DenseLayout layout;
  if (!with_params)
    return layout;
  const auto& seg = *step.segment;
  std::vector<std::int64_t> group_start{0};
  for (const auto& g : seg.unknown_groups) {
    std::int64_t width = 0;
    for (const auto& n : g.names)
      for (const auto& u : seg.unknowns)
        width += u.name == n ? u.var_size : 0;
    group_start.push_back(group_start.back() + width);
  }
  for (const auto& [name, at] : slices(seg.unknown_groups, seg.unknowns))
    layout.unknown_row[name] = group_start[at.group] + at.offset;
  for (auto p : step.params) {
    layout.param_column[_artifact.parameters[p].name] = layout.n_params;
    layout.n_params += numel(_artifact.parameters[p].base_shape);
  }
  return layout;
}

at::Tensor SegmentChain::dense_derivative(const ImplicitStep& step, const ChunkArgs& chunk,
                                          const std::vector<at::Tensor>& params,
                                          const DenseLayout& layout,
                                          const std::vector<at::Tensor>& u,
                                          const std::vector<at::Tensor>& g) const {
  const auto& seg = *step.segment;
  // du/dg = -A^{-1} B, from the graphs, at the blocks' flat offsets.
  const auto blocks = input_sensitivity(step, u, g, params);
  std::int64_t n_u = 0, n_g = 0;
  for (const auto& t : u)
    n_u += t.size(1);
  for (const auto& t : g)
    n_g += t.size(1);
  const auto rows = u.front().size(0);
  auto dense = at::zeros({rows, n_u, n_g + layout.n_params}, u.front().options());
  for (std::size_t k = 0; k < seg.jacobian_pairs.size(); ++k) {
    const auto& pair = seg.jacobian_pairs[k];
    const auto nu = numel(pair.unknown_base_shape), ng = numel(pair.given_base_shape);
    dense.narrow(1, pair.row_offset, nu)
        .narrow(2, pair.col_offset, ng)
        .copy_(blocks[k].reshape({rows, nu, ng}));
  }
  if (layout.n_params == 0)
    return dense;
  // du/dparam = -A^{-1} dr/dparam, the parameters (one value for every row) per row.
  std::vector<at::Tensor> per_row = u;
  per_row.insert(per_row.end(), g.begin(), g.end());
  for (auto p : step.params) {
    auto shape = chunk.params[p].sizes().vec();
    shape[0] = rows;
    per_row.push_back(chunk.params[p].narrow(0, 0, 1).expand(shape).contiguous());
  }
  const auto by_param = param_sensitivity(step, per_row, layout);
  for (std::size_t k = 0; k < seg.param_jacobian_pairs.size(); ++k) {
    const auto& pair = seg.param_jacobian_pairs[k];
    const auto nu = numel(pair.out_base_shape), np = numel(pair.param_base_shape);
    dense.narrow(1, layout.unknown_row.at(pair.out), nu)
        .narrow(2, n_g + layout.param_column.at(pair.param), np)
        .copy_(by_param[k].reshape({rows, nu, np}));
  }
  return dense;
}

std::vector<at::Tensor> SegmentChain::run(Operation op, ChunkArgs& chunk) const {
  auto state = start(op, chunk);
  run_steps(chunk, state);
  auto results = results_of(op, chunk, state);
  const auto n_not_finite = fail_rows_not_finite(chunk, results, state);
  if (state.converged.defined() && !state.converged.all().item<bool>())
    throw_unconverged(op, state, n_not_finite, std::move(results));
  return results;
}

SegmentChain::State SegmentChain::start(Operation op, const ChunkArgs& chunk) const {
  const auto n_inputs = _input_sizes.size();
  State state;
  state.rows = chunk.rows;
  state.track = op != Operation::forward;
  // param_vjp: the parameter Jacobian, contracted with the cotangents at the end.
  state.params = op == Operation::param_jacobian || op == Operation::param_vjp;
  state.columns = n_inputs + (state.params ? _artifact.parameters.size() : 0);
  for (std::size_t i = 0; i < n_inputs; ++i) {
    const auto& name = _artifact.inputs[i].name;
    state.values[name] = chunk.inputs[i];
    if (state.track) {
      auto& d = state.derivative(name, state.columns);
      const auto n = _input_sizes[i];
      d[i] = at::eye(n, chunk.inputs[i].options()).expand({chunk.rows, n, n});
    }
  }
  return state;
}

void SegmentChain::run_steps(const ChunkArgs& chunk, State& state) const {
  for (const auto& step : _steps)
    std::visit(
        [&](const auto& s) {
          if constexpr (std::is_same_v<std::decay_t<decltype(s)>, ForwardStep>)
            run_forward(s, chunk, state);
          else
            run_implicit(s, chunk, state);
        },
        step);
}

std::vector<at::Tensor> SegmentChain::results_of(Operation op, const ChunkArgs& chunk,
                                                 const State& state) const {
  std::vector<at::Tensor> results;
  for (const auto& out : _artifact.outputs)
    results.push_back(state.value(out.name, "the model's outputs"));
  if (op == Operation::param_vjp)
    return param_vjp_gradients(chunk, state, results);
  if (op == Operation::param_jacobian || op == Operation::jacobian)
    append_blocks(op, state, results);
  else if (op == Operation::jvp)
    append_tangents(chunk, state, results);
  return results;
}

std::vector<at::Tensor>
SegmentChain::param_vjp_gradients(const ChunkArgs& chunk, const State& state,
                                  const std::vector<at::Tensor>& outputs) const {
  const auto n_inputs = _input_sizes.size();
  std::vector<at::Tensor> grads;
  for (auto p : _param_vjp_params) {
    const auto& param = _artifact.parameters[p];
    at::Tensor grad = at::zeros({state.rows, numel(param.base_shape)}, outputs.front().options());
    for (std::size_t o = 0; o < _artifact.outputs.size(); ++o) {
      const auto it = state.derivatives.find(_artifact.outputs[o].name);
      const auto column = n_inputs + p;
      if (it == state.derivatives.end() || it->second.size() <= column ||
          !it->second[column].defined() || !chunk.extras[o].defined())
        continue;
      // (rows, 1, n_out) x (rows, n_out, n_param)
      grad =
          grad +
          rows_matmul(chunk.extras[o].reshape({state.rows, 1, -1}), it->second[column]).squeeze(1);
    }
    grads.push_back(grad.reshape(with_rows(state.rows, {&param.base_shape})));
  }
  return grads;
}

void SegmentChain::append_blocks(Operation op, const State& state,
                                 std::vector<at::Tensor>& results) const {
  const auto n_inputs = _input_sizes.size();
  // d(out)/d(column) as (rows, *out_base, *in_base); zero where nothing depends on it.
  const auto block = [&](const VariableSpec& out, std::size_t column, const Shape& in_base) {
    const auto shape = with_rows(state.rows, {&out.base_shape, &in_base});
    const auto it = state.derivatives.find(out.name);
    const bool known =
        it != state.derivatives.end() && column < it->second.size() && it->second[column].defined();
    return known ? it->second[column].reshape(shape) : at::zeros(shape, results.front().options());
  };
  if (op == Operation::param_jacobian)
    for (const auto& [o, p] : _param_jacobian_blocks)
      results.push_back(
          block(_artifact.outputs[o], n_inputs + p, _artifact.parameters[p].base_shape));
  else
    for (const auto& [o, i] : _jacobian_blocks)
      results.push_back(block(_artifact.outputs[o], i, _artifact.inputs[i].base_shape));
}

void SegmentChain::append_tangents(const ChunkArgs& chunk, const State& state,
                                   std::vector<at::Tensor>& results) const {
  const auto n_inputs = _input_sizes.size();
  for (std::size_t o = 0; o < _artifact.outputs.size(); ++o) {
    const auto& out = _artifact.outputs[o];
    at::Tensor sum;
    const auto it = state.derivatives.find(out.name);
    if (it != state.derivatives.end())
      for (std::size_t i = 0; i < n_inputs; ++i)
        if (it->second[i].defined() && chunk.extras[i].defined()) {
          sum = rows_matmul(it->second[i], chunk.extras[i].reshape({state.rows, -1, 1}), sum);
        }
    results.push_back(sum.defined() ? sum.reshape(results[o].sizes()) : at::zeros_like(results[o]));
  }
}

// A row whose inputs are finite but whose results are not (a derivative through a dR/du
// that is singular at its converged point) failed too: reported, never returned.
std::int64_t SegmentChain::fail_rows_not_finite(const ChunkArgs& chunk,
                                                const std::vector<at::Tensor>& results,
                                                State& state) const {
  const auto finite_rows = [&](const std::vector<at::Tensor>& tensors) {
    auto finite = at::ones({state.rows},
                           at::TensorOptions().dtype(at::kBool).device(results.front().device()));
    for (const auto& t : tensors)
      if (t.defined() && t.dim() > 0 && t.size(0) == state.rows && t.is_floating_point()) {
        if (t.is_cpu() && t.scalar_type() == at::kDouble && finite.is_cpu())
          host_finite_rows(t.reshape({state.rows, -1}), finite.data_ptr<bool>());
        else
          finite = finite & at::isfinite(t.reshape({state.rows, -1})).all(1);
      }
    return finite;
  };
  const auto not_finite =
      results.empty() ? at::Tensor() : finite_rows(chunk.inputs) & ~finite_rows(results);
  const auto n_not_finite = not_finite.defined() ? not_finite.sum().item<std::int64_t>() : 0;
  if (n_not_finite > 0)
    state.converged = (state.converged.defined() ? state.converged : ~not_finite) & ~not_finite;
  return n_not_finite;
}

void SegmentChain::throw_unconverged(Operation op, const State& state, std::int64_t n_not_finite,
                                     std::vector<at::Tensor> results) const {
  const auto failed = ~state.converged;
  if (op == Operation::param_vjp) // a sum over rows: one that failed spoils it
    throw ConvergenceError(fmt::format(
        "{}: param_vjp(): Newton did not converge for {} of {} rows (iteration cap miters = "
        "{}, or a residual that stopped being finite); worst residual norm {}. The gradient "
        "sums over rows, so it is not returned: forward() tells which rows fail",
        _artifact.root.string(), failed.sum().item<std::int64_t>(), state.rows, _config.miters,
        state.worst_residual));
  for (auto& r : results) {
    auto mask_shape = Shape(static_cast<std::size_t>(r.dim()), 1);
    mask_shape[0] = state.rows;
    r = r.masked_fill(failed.reshape(mask_shape), std::numeric_limits<double>::quiet_NaN());
  }
  const auto n_failed = failed.sum().item<std::int64_t>();
  const auto singular =
      n_not_finite == 0
          ? std::string()
          : fmt::format(" ({} of them converged to a point where the results are not finite: "
                        "dR/du singular there)",
                        n_not_finite);
  throw ConvergenceError(
      fmt::format("{}: Newton did not converge for {} of {} rows{} (iteration cap miters = {}, "
                  "or a residual that stopped being finite); worst residual norm {}. "
                  "converged_mask() says which rows converged (their results are kept, the "
                  "others are NaN): cut the step of the failed rows and retry",
                  _artifact.root.string(), n_failed, state.rows, singular, _config.miters,
                  state.worst_residual),
      state.converged, state.worst_residual, std::move(results));
}

} // namespace neml2::detail

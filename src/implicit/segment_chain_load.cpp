// A SegmentChain made from metadata.json: each segment's graphs loaded and checked, the
// substepping plan, the derivative blocks' positions; the solver settings' checks.

#include <algorithm>
#include <functional>
#include <map>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <neml2/errors.hpp>

#include "core/shape_text.hpp"
#include "graph/graph.hpp"
#include "implicit/block_groups.hpp"
#include "implicit/chain_state.hpp"
#include "implicit/newton_factors.hpp"
#include "implicit/segment_chain.hpp"

namespace neml2::detail {
namespace {

Shape per_row_shape(const Shape& sub_batch, const Shape& base) {
  auto shape = sub_batch;
  shape.insert(shape.end(), base.begin(), base.end());
  return shape;
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

bool blocks_in(const std::vector<GroupLayout>& layouts) {
  return std::any_of(layouts.begin(), layouts.end(),
                     [](const GroupLayout& l) { return l.block(); });
}

// What a block-structured segment cannot take: neml2-compile 3.1 writes no derivative graph
// for a sub-batched unknown, and NEML2 runs no Krylov solve over block groups.
void refuse_with_blocks(const ImplicitSegment& s, const std::string& where) {
  const auto refuse = [&](const std::string& package, const char* what) {
    if (!package.empty())
      throw FatalError(fmt::format("{} has block-structured variable groups and a {} ({}); "
                                   "neml2-dispatch runs block groups with the direct Newton "
                                   "step and no derivatives, as neml2-compile 3.1 writes them: "
                                   "recompile without it",
                                   where, what, package));
  };
  refuse(s.matvec_package, "Krylov matvec graph");
  refuse(s.jacobian_given_package, "derivative graph");
  refuse(s.dr_dparam_package, "parameter-derivative graph");
}

using Arguments = std::vector<std::optional<Shape>>;

// Groups of widths `w` laid out as `layouts` say, appended to a graph's `args`.
void pack_groups(Arguments& args, const std::vector<std::int64_t>& w,
                 const std::vector<GroupLayout>& layouts) {
  for (std::size_t k = 0; k < w.size(); ++k)
    args.emplace_back(layouts[k].graph_shape(w[k]));
}

// Each group's width: its variables' sizes (1 for a name that is not one of `vars`).
std::vector<std::int64_t> group_widths(const std::vector<VariableGroup>& groups,
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
}

} // namespace

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

// What loading the chain keeps until its constructor ends.
struct SegmentChain::Loading {
  explicit Loading(const GraphLoader& load)
      : load_graph(load) {}

  const GraphLoader& load_graph;
  std::map<std::string, Shape> per_row; // each variable's shape per row, for output_shapes()
  std::map<std::string, std::size_t> input_index, output_index;
  FactorColumns chord;
  std::size_t implicit_steps = 0;

  [[nodiscard]] GraphFn load(const std::string& package, const char* listed_as,
                             const std::vector<std::optional<Shape>>& arguments,
                             std::size_t results) const {
    return load_graph(package, listed_as, arguments, results, nullptr);
  }
};

// What each Newton graph takes: the groups packed (B, width), A's blocks (B, r, u)
// residual by unknown, B's (B, r, g), the parameters as stored (per row for dr_dparam).
struct SegmentChain::ImplicitArguments {
  std::vector<std::int64_t> u, g, r; // each unknown, given and residual group's width
  std::vector<GroupLayout> lu, lg, lr, lug;
  bool block = false; // a block-structured group
  Arguments state, per_row_state, a_and_b, a_and_given, a_and_dparam;
  std::size_t a_blocks = 0;
};

SegmentChain::SegmentChain(const Artifact& artifact, c10::Device device, c10::ScalarType dtype,
                           const GraphLoader& load_graph)
    : _artifact(artifact)
    , _device(device)
    , _dtype(dtype)
    , _config(artifact.solver_config.value_or(SolverConfig{})) {
  Loading loading(load_graph);
  for (std::size_t p = 0; p < artifact.parameters.size(); ++p)
    _param_index[artifact.parameters[p].name] = p;
  for (std::size_t i = 0; i < artifact.inputs.size(); ++i) {
    loading.input_index[artifact.inputs[i].name] = i;
    _input_sizes.push_back(numel(artifact.inputs[i].sub_batch_shape) *
                           numel(artifact.inputs[i].base_shape));
    loading.per_row[artifact.inputs[i].name] =
        per_row_shape(artifact.inputs[i].sub_batch_shape, artifact.inputs[i].base_shape);
  }
  for (std::size_t o = 0; o < artifact.outputs.size(); ++o)
    loading.output_index[artifact.outputs[o].name] = o;
  loading.chord = factor_columns(artifact);
  for (const auto& segment : artifact.segments) {
    if (const auto* f = std::get_if<ForwardSegment>(&segment))
      load_forward(*f, loading);
    else
      load_implicit(std::get<ImplicitSegment>(segment),
                    static_cast<std::size_t>(&segment - artifact.segments.data()), loading);
  }
  check_outputs(loading);
  index_derivatives(loading);
}

std::vector<std::size_t> SegmentChain::params_of(const std::vector<std::string>& names) const {
  std::vector<std::size_t> positions;
  for (const auto& n : names) {
    const auto it = _param_index.find(n);
    if (it == _param_index.end())
      throw FatalError(fmt::format("{}/metadata.json: a segment takes parameter '{}', which "
                                   "is not declared under 'parameters'; recompile with "
                                   "neml2-compile",
                                   _artifact.root.string(), n));
    positions.push_back(it->second);
  }
  return positions;
}

void SegmentChain::load_forward(const ForwardSegment& f, Loading& loading) {
  // Intermediate variables' shapes are not in metadata.json: counts only, shapes at
  // the first call.
  const std::vector<std::optional<Shape>> takes(f.inputs.size() + f.param_inputs.size());
  std::vector<Shape> made;
  auto value = loading.load_graph(f.package, "package", takes, f.outputs.size(), &made);
  for (std::size_t o = 0; o < made.size() && o < f.outputs.size(); ++o)
    loading.per_row[f.outputs[o]] = std::move(made[o]);
  _steps.emplace_back(ForwardStep{
      &f, std::move(value),
      loading.load(f.jvp_package, "jvp_package", takes, f.outputs.size() + f.jacobian_pairs.size()),
      loading.load(f.param_jacobian_package, "param_jacobian_package", takes,
                   f.param_jacobian_pairs.size()),
      params_of(f.param_inputs)});
  _has_input_derivatives = _has_input_derivatives && !f.jvp_package.empty();
  _has_param_derivatives = _has_param_derivatives && !f.jvp_package.empty() &&
                           (f.param_inputs.empty() || !f.param_jacobian_package.empty());
}

void SegmentChain::load_implicit(const ImplicitSegment& s, std::size_t position, Loading& loading) {
  for (const auto& u : s.unknowns)
    loading.per_row[u.name] = per_row_shape(u.sub_batch_shape, u.base_shape);
  ImplicitStep step;
  step.segment = &s;
  step.shape = newton_shape(s);
  step.plan = plan_newton(step.shape, _device, _dtype, _config);
  step.plan.factor_column = loading.chord.first[loading.implicit_steps++];
  step.params = params_of(s.param_inputs);
  const auto a = implicit_arguments(s, step.params, position);
  load_implicit_graphs(s, a, step, loading);
  _steps.emplace_back(std::move(step));
}

SegmentChain::ImplicitArguments
SegmentChain::implicit_arguments(const ImplicitSegment& s, const std::vector<std::size_t>& params,
                                 std::size_t position) const {
  ImplicitArguments a;
  auto& u = a.u;
  auto& g = a.g;
  auto& r = a.r;
  auto& lu = a.lu;
  auto& lg = a.lg;
  auto& lr = a.lr;
  auto& lug = a.lug;
  auto& block = a.block;
  auto& state = a.state;
  auto& per_row_state = a.per_row_state;
  auto& a_and_b = a.a_and_b;
  auto& a_and_given = a.a_and_given;
  auto& a_and_dparam = a.a_and_dparam;
  auto& a_blocks = a.a_blocks;
  u = group_widths(s.unknown_groups, s.unknowns);
  g = group_widths(s.given_groups, s.givens);
  r = group_widths(s.residual_groups, s.residuals);
  const auto where =
      fmt::format("{}/metadata.json: segments[{}]", _artifact.root.string(), position);
  lu = group_layouts(s.unknown_groups, s.unknowns, where + ".unknown_group_infos");
  lg = group_layouts(s.given_groups, s.givens, where + ".given_group_infos");
  lr = group_layouts(s.residual_groups, s.residuals, where + ".residual_group_infos");
  block = blocks_in(lu) || blocks_in(lg) || blocks_in(lr);
  if (block)
    refuse_with_blocks(s, where);
  const auto blocks = [&](Arguments& args, const std::vector<std::int64_t>& columns,
                          const std::vector<GroupLayout>& layouts) {
    for (std::size_t i = 0; i < r.size(); ++i)
      for (std::size_t j = 0; j < columns.size(); ++j)
        args.emplace_back(jacobian_block_shape(lr[i], r[i], layouts[j], columns[j]));
  };
  pack_groups(state, u, lu);
  pack_groups(state, g, lg);
  per_row_state = state;
  std::int64_t param_width = 0;
  for (auto p : params) {
    const auto& param = _artifact.parameters[p];
    state.emplace_back(param.shape);
    auto per_row = param.base_shape;
    per_row.insert(per_row.begin(), -1);
    per_row_state.emplace_back(per_row);
    param_width += numel(param.base_shape);
  }
  blocks(a_and_b, u, lu);
  a_and_given = a_and_dparam = a_and_b;
  pack_groups(a_and_b, r, lr);
  blocks(a_and_given, g, lg);
  for (auto rows : r)
    a_and_dparam.emplace_back(Shape{-1, rows, param_width});
  a_blocks = r.size() * u.size();
  lug = lu;
  lug.insert(lug.end(), lg.begin(), lg.end());
  return a;
}

void SegmentChain::load_implicit_graphs(const ImplicitSegment& s, const ImplicitArguments& a,
                                        ImplicitStep& step, const Loading& loading) {
  const auto residual = loading.load(s.residual_package, "residual_package", a.state, a.r.size());
  const auto jacobian =
      loading.load(s.jacobian_package, "jacobian_package", a.state, a.a_blocks + a.r.size());
  const auto solve = loading.load(s.solve_package, "solve_package", a.a_and_b, a.u.size());
  step.newton.residual = in_newton_layout(residual, 0, a.lug, 0, a.lr);
  step.newton.jacobian = in_newton_layout(jacobian, 0, a.lug, a.a_blocks, a.lr);
  step.newton.solve = in_newton_layout(solve, a.a_blocks, a.lr, 0, a.lu);
  step.newton.a_blocks = step.a_blocks = a.a_blocks;
  const auto dense_a = [&a](GroupOrder order) -> GraphFn {
    return [lr = a.lr, r = a.r, lu = a.lu, u = a.u, order](const std::vector<at::Tensor>& blocks) {
      return std::vector<at::Tensor>{dense_jacobian(blocks, lr, r, lu, u, order)};
    };
  };
  if (a.block && solve && a.lr == a.lu && a.r == a.u) {
    auto in_graph = std::make_shared<InGraphLayout>();
    in_graph->graphs.residual = residual;
    in_graph->graphs.jacobian = jacobian;
    in_graph->graphs.solve = solve;
    in_graph->graphs.a_blocks = a.a_blocks;
    in_graph->graphs.dense_blocks = false;
    in_graph->graphs.dense_a = dense_a(GroupOrder::graph);
    in_graph->unknowns = a.lu;
    in_graph->givens = a.lg;
    step.newton.in_graph_layout = std::move(in_graph);
  }
  step.newton.dense_blocks = !a.block;
  if (a.block) // the chord factors A itself (tensor_chord.cpp)
    step.newton.dense_a = dense_a(GroupOrder::newton);
  step.newton.schedule = std::make_shared<NewtonSchedule>();
  if (!s.matvec_package.empty()) { // a Krylov step: A only through A v
    auto with_v = a.state;
    pack_groups(with_v, a.u, a.lu);
    step.newton.matvec = loading.load(s.matvec_package, "matvec_package", with_v, a.r.size());
    step.newton.precond_setup =
        loading.load(s.precond_setup_package, "precond_setup_package", a.state, unchecked_results);
    step.newton.precond_apply =
        loading.load(s.precond_apply_package, "precond_apply_package", Arguments{},
                     unchecked_results); // (state, r): its own checks
    step.newton.a_blocks = 0;
  }
  step.given_blocks = a.r.size() * a.g.size();
  step.substeps = substep_plan(s, _artifact.root);
  step.predictor = loading.load(s.predictor_package, "predictor_package",
                                Arguments(s.predictor_inputs.size()), s.predictor_outputs.size());
  step.jacobian_given =
      loading.load(s.jacobian_given_package, "jacobian_given_package", a.state, step.given_blocks);
  step.solve_ift = s.iterative_input_sensitivity
                       ? dense_ift(s, a.a_blocks)
                       : loading.load(s.solve_ift_package, "solve_ift_package", a.a_and_given,
                                      s.jacobian_pairs.size());
  step.dr_dparam = loading.load(s.dr_dparam_package, "dr_dparam_package", a.per_row_state,
                                a.a_blocks + a.r.size());
  step.solve_param = loading.load(s.solve_param_package, "solve_param_package", a.a_and_dparam,
                                  s.param_jacobian_pairs.size());
  _has_input_derivatives = _has_input_derivatives && step.jacobian_given && step.solve_ift;
  _has_param_derivatives = _has_param_derivatives && step.jacobian_given && step.solve_ift &&
                           (s.param_inputs.empty() || step.solve_param);
}

void SegmentChain::check_outputs(const Loading& loading) {
  const auto& per_row = loading.per_row;
  const auto& artifact = _artifact;
  for (const auto& out : artifact.outputs) {
    const auto it = per_row.find(out.name);
    if (it == per_row.end())
      throw FatalError(fmt::format("{}/metadata.json: output '{}' is neither an input nor made by "
                                   "a segment; the artifact is inconsistent: recompile it with "
                                   "neml2-compile",
                                   artifact.root.string(), out.name));
    const auto& shape = it->second;
    if (shape.size() < out.base_shape.size() ||
        !std::equal(out.base_shape.rbegin(), out.base_shape.rend(), shape.rbegin()))
      throw FatalError(fmt::format("{}/metadata.json: output '{}' has base shape {}, but its "
                                   "graph makes {} per row; the graph belongs to another model: "
                                   "recompile the artifact with neml2-compile",
                                   artifact.root.string(), out.name, shape_text(out.base_shape),
                                   shape_text(shape)));
    _output_shapes.push_back(shape);
  }
}

void SegmentChain::index_derivatives(const Loading& loading) {
  const auto& artifact = _artifact;
  const auto& output_index = loading.output_index;
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
  _jacobian_blocks = positions(artifact.derivatives, loading.input_index, "derivatives");
  _param_jacobian_blocks =
      positions(artifact.parameter_derivatives, _param_index, "parameter_derivatives");
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
  if (!(config.chord_rate > 0 && config.chord_rate < 1))
    fail("chord_rate", fmt::format("is {}; it must be within (0, 1): the least fall of ||r|| a "
                                   "chord step must bring",
                                   config.chord_rate));
  _config = config;
  for (auto& step : _steps)
    if (auto* implicit = std::get_if<ImplicitStep>(&step)) {
      const auto factor_column = implicit->plan.factor_column;
      implicit->plan = plan_newton(implicit->shape, _device, _dtype, _config);
      implicit->plan.factor_column = factor_column;
    }
}

std::vector<NewtonPlan> SegmentChain::newton_plans() const {
  std::vector<NewtonPlan> plans;
  for (const auto& step : _steps)
    if (const auto* implicit = std::get_if<ImplicitStep>(&step))
      plans.push_back(implicit->plan);
  return plans;
}

} // namespace neml2::detail

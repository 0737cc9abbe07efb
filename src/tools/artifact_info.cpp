// What an artifact offers, from its metadata and its folders.

#include <algorithm>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <neml2/artifact_info.hpp>

namespace neml2 {

namespace fs = std::filesystem;

bool ArtifactInfo::can(const std::string& operation) const {
  for (const auto& [name, available] : operations)
    if (name == operation)
      return available;
  return false;
}

namespace {

// Which operations the graphs allow: the rules the session applies when it loads them
// (a single forward segment calls its graphs directly; a chain needs every segment's
// derivative graphs to chain the derivatives through).
std::vector<std::pair<std::string, bool>> operations_of(const Artifact& a) {
  bool input = true, param = true;
  bool jvp = false, param_jacobian = false, param_vjp = false;
  for (const auto& segment : a.segments) {
    if (const auto* f = std::get_if<ForwardSegment>(&segment)) {
      jvp = !f->jvp_package.empty();
      param_jacobian = !f->param_jacobian_package.empty();
      param_vjp = !f->param_vjp_package.empty();
      input = input && jvp;
      param = param && jvp && (f->param_inputs.empty() || param_jacobian);
    } else {
      const auto& s = std::get<ImplicitSegment>(segment);
      const bool derivatives = !s.jacobian_given_package.empty() && !s.solve_ift_package.empty();
      input = input && derivatives;
      param = param && derivatives && (s.param_inputs.empty() || !s.solve_param_package.empty());
    }
  }
  if (a.single_forward()) {
    input = jvp;
    return {{"forward", true},
            {"jvp", input},
            {"jacobian", input},
            {"param_jacobian", param_jacobian},
            {"param_vjp", param_vjp}};
  }
  param = param && !a.parameter_derivatives.empty(); // the pairs the chain contracts
  return {{"forward", true},
          {"jvp", input},
          {"jacobian", input},
          {"param_jacobian", param},
          {"param_vjp", param}};
}

SegmentInfo segment_of(const Segment& segment) {
  SegmentInfo info;
  const auto graph = [&](const std::string& package) {
    if (!package.empty())
      info.graphs.push_back(package);
  };
  if (const auto* f = std::get_if<ForwardSegment>(&segment)) {
    info.kind = "forward";
    info.inputs = f->inputs;
    info.outputs = f->outputs;
    for (const auto* p :
         {&f->package, &f->jvp_package, &f->param_jacobian_package, &f->param_vjp_package})
      graph(*p);
    return info;
  }
  const auto& s = std::get<ImplicitSegment>(segment);
  info.kind = "implicit";
  for (const auto& v : s.givens)
    info.inputs.push_back(v.name);
  for (const auto& v : s.unknowns)
    info.outputs.push_back(v.name);
  for (const auto& v : s.residuals)
    info.residuals.push_back(v.name);
  info.max_substepping_level = s.max_substepping_level;
  info.predictor = !s.predictor_package.empty();
  for (const auto* p : {&s.residual_package, &s.jacobian_package, &s.solve_package,
                        &s.predictor_package, &s.jacobian_given_package, &s.solve_ift_package,
                        &s.dr_dparam_package, &s.solve_param_package, &s.matvec_package,
                        &s.precond_setup_package, &s.precond_apply_package})
    graph(*p);
  return info;
}

std::vector<LeafInfo> leaves_of(const fs::path& root) {
  std::vector<LeafInfo> leaves;
  std::error_code ec;
  for (const auto family : known_device_families) {
    const auto dir = root / std::string(name(family));
    if (!fs::is_directory(dir, ec))
      continue;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      if (!entry.is_directory())
        continue;
      const auto dtype = entry.path().filename().string();
      try {
        (void)dtype_from_name(dtype);
      } catch (const FatalError&) {
        continue; // not a dtype folder
      }
      LeafInfo leaf{std::string(name(family)), dtype};
      for (const auto& file : fs::directory_iterator(entry.path(), ec))
        leaf.graphs += file.path().extension() == ".pt2" ? 1 : 0;
      leaves.push_back(leaf);
    }
  }
  std::sort(leaves.begin(), leaves.end(), [](const LeafInfo& a, const LeafInfo& b) {
    return std::tie(a.device, a.dtype) < std::tie(b.device, b.dtype);
  });
  return leaves;
}

std::string shape_text(const Shape& shape) {
  return fmt::format("({})", fmt::join(shape, ", "));
}

std::string variable_text(const VariableSpec& v) {
  auto text =
      fmt::format("{:<28} {:<8} base {}", v.public_name, v.var_type, shape_text(v.base_shape));
  if (!v.sub_batch_shape.empty())
    text += " sub-batch " + shape_text(v.sub_batch_shape);
  if (v.public_name != v.name)
    text += " (model's name: " + v.name + ")";
  return text;
}

} // namespace

ArtifactInfo artifact_info(const Artifact& artifact) {
  ArtifactInfo info{.root = artifact.root,
                    .schema_version = artifact.schema_version,
                    .inputs = artifact.inputs,
                    .outputs = artifact.outputs,
                    .parameters = artifact.parameters,
                    .operations = operations_of(artifact),
                    .derivatives = artifact.derivatives,
                    .parameter_derivatives = artifact.parameter_derivatives,
                    .solver_config = artifact.solver_config,
                    .leaves = leaves_of(artifact.root)};
  for (const auto& s : artifact.segments)
    info.segments.push_back(segment_of(s));
  return info;
}

std::string format_artifact_info(const ArtifactInfo& info) {
  std::string text =
      fmt::format("artifact {} (metadata schema {})\n", info.root.string(), info.schema_version);
  text += fmt::format("inputs ({}):\n", info.inputs.size());
  for (const auto& v : info.inputs)
    text += "  " + variable_text(v) + "\n";
  text += fmt::format("outputs ({}):\n", info.outputs.size());
  for (const auto& v : info.outputs)
    text += "  " + variable_text(v) + "\n";
  text += fmt::format("parameters ({}):\n", info.parameters.size());
  for (const auto& p : info.parameters)
    text += fmt::format("  {:<28} shape {} base {}\n", p.public_name, shape_text(p.shape),
                        shape_text(p.base_shape));
  text += "operations:\n";
  for (const auto& [name, available] : info.operations)
    text += fmt::format("  {:<16} {}\n", name, available ? "yes" : "no (graphs not compiled)");
  std::vector<std::string> pairs;
  for (const auto& [o, i] : info.derivatives)
    pairs.push_back(o + "/" + i);
  text += fmt::format("derivatives ({}): {}\n", pairs.size(), fmt::join(pairs, ", "));
  pairs.clear();
  for (const auto& [o, p] : info.parameter_derivatives)
    pairs.push_back(o + "/" + p);
  text += fmt::format("parameter derivatives ({}): {}\n", pairs.size(), fmt::join(pairs, ", "));
  text += fmt::format("segments ({}):\n", info.segments.size());
  for (std::size_t k = 0; k < info.segments.size(); ++k) {
    const auto& s = info.segments[k];
    if (s.kind == "forward")
      text += fmt::format("  {}. forward: {} -> {} [{} graphs]\n", k, fmt::join(s.inputs, ", "),
                          fmt::join(s.outputs, ", "), s.graphs.size());
    else
      text += fmt::format("  {}. implicit: solves {} from residuals {} given {}; predictor {}, "
                          "max_substepping_level {} [{} graphs]\n",
                          k, fmt::join(s.outputs, ", "), fmt::join(s.residuals, ", "),
                          fmt::join(s.inputs, ", "), s.predictor ? "yes" : "no",
                          s.max_substepping_level, s.graphs.size());
  }
  if (const auto& c = info.solver_config)
    text += fmt::format("solver: atol {:g}, rtol {:g}, miters {}, line search {} (max {} "
                        "iterations, cutback {:g}, c {:g}), {} linear solve\n",
                        c->atol, c->rtol, c->miters, c->ls_type, c->ls_max_iters, c->ls_cutback,
                        c->ls_c, c->solver_kind);
  if (const auto& c = info.solver_config; c && c->solver_kind == "krylov")
    text += fmt::format("krylov: {}, restart {}, max_its {}, abs_tol {:g}, rel_tol {:g}, "
                        "cache_strategy {} (cache_max_its {})\n",
                        c->krylov.method, c->krylov.restart, c->krylov.max_its, c->krylov.abs_tol,
                        c->krylov.rel_tol, c->krylov.cache_strategy, c->krylov.cache_max_its);
  text += "devices and dtypes:";
  for (const auto& l : info.leaves)
    text += fmt::format(" {}/{} ({} graphs)", l.device, l.dtype, l.graphs);
  return text + (info.leaves.empty() ? " none\n" : "\n");
}

std::string artifact_info_json(const ArtifactInfo& info) {
  using json = nlohmann::json;
  const auto variables = [](const std::vector<VariableSpec>& list) {
    json out = json::array();
    for (const auto& v : list)
      out.push_back({{"name", v.public_name},
                     {"model_name", v.name},
                     {"type", v.var_type},
                     {"base_shape", v.base_shape},
                     {"sub_batch_shape", v.sub_batch_shape}});
    return out;
  };
  json parameters = json::array(), operations = json::object(), segments = json::array(),
       leaves = json::array();
  for (const auto& p : info.parameters)
    parameters.push_back(
        {{"name", p.public_name}, {"shape", p.shape}, {"base_shape", p.base_shape}});
  for (const auto& [name, available] : info.operations)
    operations[name] = available;
  for (const auto& s : info.segments)
    segments.push_back({{"kind", s.kind},
                        {"inputs", s.inputs},
                        {"outputs", s.outputs},
                        {"residuals", s.residuals},
                        {"graphs", s.graphs},
                        {"predictor", s.predictor},
                        {"max_substepping_level", s.max_substepping_level}});
  for (const auto& l : info.leaves)
    leaves.push_back({{"device", l.device}, {"dtype", l.dtype}, {"graphs", l.graphs}});
  json out = {{"root", info.root.string()},
              {"schema_version", info.schema_version},
              {"inputs", variables(info.inputs)},
              {"outputs", variables(info.outputs)},
              {"parameters", parameters},
              {"operations", operations},
              {"derivatives", info.derivatives},
              {"parameter_derivatives", info.parameter_derivatives},
              {"segments", segments},
              {"leaves", leaves}};
  if (const auto& c = info.solver_config)
    out["solver_config"] = {{"atol", c->atol},
                            {"rtol", c->rtol},
                            {"miters", c->miters},
                            {"ls_type", c->ls_type},
                            {"ls_max_iters", c->ls_max_iters},
                            {"solver_kind", c->solver_kind}};
  if (const auto& c = info.solver_config; c && c->solver_kind == "krylov")
    out["solver_config"]["krylov"] = {{"method", c->krylov.method},
                                      {"restart", c->krylov.restart},
                                      {"max_its", c->krylov.max_its},
                                      {"abs_tol", c->krylov.abs_tol},
                                      {"rel_tol", c->krylov.rel_tol},
                                      {"cache_strategy", c->krylov.cache_strategy},
                                      {"cache_max_its", c->krylov.cache_max_its}};
  return out.dump(2) + "\n";
}

} // namespace neml2

// metadata.json read into an Artifact; anything malformed is a FatalError naming the field.

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <neml2/artifact.hpp>

#include "core/bounded_files.hpp"
#include "core/json_fields.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace neml2 {
namespace {

constexpr std::string_view regenerate = "regenerate the artifact with neml2-compile";

// metadata.json's fields, with errors that name the file and the field:
// "<file>: field 'inputs[0].base_shape': missing; the file is not what ...".
struct MetadataFields final : detail::JsonFields {
  explicit MetadataFields(std::string file)
      : file(std::move(file)) {}

  std::string file;

  // A shape field, checked by check_shape.
  Shape shape(const json& j, const std::string& key, const std::string& field) const {
    auto value = get<Shape>(j, key, field);
    check_shape(value, detail::field_path(field, key));
    return value;
  }
  Shape shape_or(const json& j, const std::string& key, const std::string& field,
                 Shape fallback) const {
    return j.contains(key) ? shape(j, key, field) : fallback;
  }

  // A variable's shape per row: small non-negative sizes (an SR2 is [6], an R4 [3, 3, 3, 3]).
  void check_shape(const Shape& shape, const std::string& field) const {
    constexpr std::int64_t most = std::int64_t(1) << 24;
    std::int64_t numel = 1;
    for (auto d : shape) {
      if (d < 0 || d > most)
        fail(field, fmt::format("size {} in [{}] is not a size between 0 and {}", d,
                                fmt::join(shape, ", "), most));
      numel = std::min(numel * std::max<std::int64_t>(d, 1), most + 1);
    }
    if (numel > most)
      fail(field, fmt::format("[{}] has more than {} values", fmt::join(shape, ", "), most));
  }

  // A graph file name inside the <device>/<dtype>/ folder (empty when optional and absent).
  std::string package(const json& j, const std::string& key, const std::string& field,
                      bool required) const {
    auto name = required ? get<std::string>(j, key, field) : get_or<std::string>(j, key, field, "");
    if ((required && name.empty()) || (!name.empty() && (name.find('/') != std::string::npos ||
                                                         name == ".." || !name.ends_with(".pt2"))))
      fail(detail::field_path(field, key), fmt::format("'{}' is not the file name of a .pt2 "
                                                       "graph in the <device>/<dtype>/ folder",
                                                       name));
    return name;
  }

private:
  std::string message(const std::string& field, const std::string& problem) const override {
    return fmt::format("{}: field '{}': {}; the file is not what neml2-compile 3.x writes: "
                       "regenerate the artifact with neml2-compile",
                       file, field, problem);
  }
  std::string words(const detail::FieldProblem& problem) const override {
    using Kind = detail::FieldProblem::Kind;
    switch (problem.kind) {
    case Kind::missing:
      return "missing";
    case Kind::wrong_type:
      return problem.converter_message.empty() ? "expected " + problem.expected
                                               : problem.converter_message;
    case Kind::not_integer:
      return fmt::format("{} is not an integer", problem.value->dump());
    case Kind::out_of_range:
      return fmt::format("{} is out of range", problem.value->dump());
    }
    return "malformed";
  }
};

std::map<std::string, std::string> aliases(const json& meta, const char* kind,
                                           const MetadataFields& r) {
  if (!meta.contains("boundary_aliases"))
    return {};
  return r.get_or<std::map<std::string, std::string>>(r.object(meta, "boundary_aliases", ""), kind,
                                                      "boundary_aliases", {});
}

std::string aliased(const std::map<std::string, std::string>& alias, const std::string& name) {
  const auto it = alias.find(name);
  return it == alias.end() ? name : it->second;
}

std::vector<VariableSpec> read_variables(const json& meta, const char* kind,
                                         const MetadataFields& r) {
  const auto alias = aliases(meta, kind, r);
  std::vector<VariableSpec> vars;
  const auto& list = r.array(meta, kind, "");
  for (std::size_t i = 0; i < list.size(); ++i) {
    const auto field = fmt::format("{}[{}]", kind, i);
    VariableSpec v;
    v.name = r.get<std::string>(list[i], "name", field);
    v.public_name = aliased(alias, v.name);
    v.var_type = r.get_or<std::string>(list[i], "var_type", field, "");
    v.base_shape = r.shape(list[i], "base_shape", field);
    v.sub_batch_shape = r.shape_or(list[i], "sub_batch_shape", field, {});
    vars.push_back(std::move(v));
  }
  return vars;
}

std::vector<std::string> names_of(const json& list, const std::string& field,
                                  const MetadataFields& r) {
  std::vector<std::string> names;
  for (std::size_t i = 0; i < list.size(); ++i)
    names.push_back(r.get<std::string>(list[i], "name", fmt::format("{}[{}]", field, i)));
  return names;
}

// Calls f(entry, "<field>.<key>[i]") for each entry of the array s[key].
template <class F>
void each_entry(const json& s, const char* key, const std::string& field, const MetadataFields& r,
                F&& f) {
  const auto& list = r.array(s, key, field);
  for (std::size_t i = 0; i < list.size(); ++i)
    f(list[i], fmt::format("{}.{}[{}]", field, key, i));
}

ForwardSegment read_segment(const json& s, const std::string& field, const MetadataFields& r) {
  ForwardSegment seg;
  seg.package = r.package(s, "package", field, true);
  seg.inputs = names_of(r.array(s, "inputs", field), field + ".inputs", r);
  seg.outputs = names_of(r.array(s, "outputs", field), field + ".outputs", r);
  seg.param_inputs = r.get_or<std::vector<std::string>>(s, "param_inputs", field, {});
  seg.jvp_package = r.package(s, "jvp_package", field, false);
  if (!seg.jvp_package.empty())
    each_entry(s, "jacobian_pairs", field, r, [&](const json& p, const std::string& f) {
      seg.jacobian_pairs.push_back({r.get<std::string>(p, "out_var", f),
                                    r.get<std::string>(p, "in_var", f),
                                    r.shape(p, "out_base_shape", f), r.shape(p, "in_base_shape", f),
                                    r.shape_or(p, "in_sub_batch_shape", f, {}),
                                    r.get_or<bool>(p, "batch_independent", f, false)});
    });
  seg.param_jacobian_package = r.package(s, "param_jacobian_package", field, false);
  if (!seg.param_jacobian_package.empty()) {
    const auto& pairs = r.array(s, "param_jacobian_pairs", field);
    for (std::size_t i = 0; i < pairs.size(); ++i) {
      const auto f = fmt::format("{}.param_jacobian_pairs[{}]", field, i);
      seg.param_jacobian_pairs.push_back(
          {r.get<std::string>(pairs[i], "out_var", f), r.get<std::string>(pairs[i], "param", f),
           r.shape(pairs[i], "out_base_shape", f), r.shape(pairs[i], "param_base_shape", f)});
    }
  }
  seg.param_vjp_package = r.package(s, "param_vjp_package", field, false);
  if (!seg.param_vjp_package.empty()) {
    seg.param_vjp_params = r.get<std::vector<std::string>>(s, "param_vjp_params", field);
    seg.param_vjp_outputs = r.get<std::vector<std::string>>(s, "param_vjp_outputs", field);
  }
  return seg;
}

// A feature of an implicit segment this runtime does not run: refused at load, never a
// wrong answer at run time.
[[noreturn]] void unsupported(const MetadataFields& r, const std::string& field,
                              const std::string& feature, const std::string& fix) {
  throw FatalError(fmt::format("{}: {} uses {}, which neml2-dispatch does not support yet; {}",
                               r.file, field, feature, fix));
}

std::vector<ImplicitVariable> read_implicit_variables(const json& s, const char* key,
                                                      const std::string& field,
                                                      const MetadataFields& r) {
  std::vector<ImplicitVariable> vars;
  each_entry(s, key, field, r, [&](const json& entry, const std::string& f) {
    ImplicitVariable v;
    v.name = r.get<std::string>(entry, "name", f);
    v.var_size = r.get<std::int64_t>(entry, "var_size", f);
    v.base_shape = r.shape(entry, "base_shape", f);
    // neml2-compile writes var_size over the sub-batch axes too (300 bins of a scalar: 300).
    v.sub_batch_shape = r.shape_or(entry, "sub_batch_shape", f, {});
    const auto values = detail::numel(v.sub_batch_shape) * detail::numel(v.base_shape);
    if (v.var_size != values)
      r.fail(f + ".var_size",
             fmt::format("{} for sub_batch_shape [{}] and base_shape [{}] of {} values", v.var_size,
                         fmt::join(v.sub_batch_shape, ", "), fmt::join(v.base_shape, ", "),
                         values));
    v.role = r.get_or<std::string>(entry, "role", f, "static");
    v.pair = r.get_nullable<std::string>(entry, "pair", f, ""); // null for a static given
    vars.push_back(std::move(v));
  });
  return vars;
}

std::vector<VariableGroup> read_groups(const json& s, const char* key, const std::string& field,
                                       const MetadataFields& r) {
  std::vector<VariableGroup> groups;
  each_entry(s, key, field, r, [&](const json& entry, const std::string& f) {
    const auto structure = r.get<std::string>(entry, "structure", f);
    if (structure != "dense" && structure != "block")
      unsupported(r, f, fmt::format("a '{}' variable group", structure),
                  "dense and block groups run here");
    groups.push_back({r.get<std::vector<std::string>>(entry, "var_names", f),
                      r.shape_or(entry, "sub_batch_shape", f, {}), structure == "block"});
  });
  return groups;
}

std::vector<std::string> optional_names(const json& s, const char* key, const std::string& field,
                                        const MetadataFields& r) {
  return s.contains(key) ? names_of(r.array(s, key, field), detail::field_path(field, key), r)
                         : std::vector<std::string>{};
}

// A derivative solve's descriptor ({kind: direct | krylov, krylov?}): whether it is
// iterative. Iterative ones have no baked solve graph; we solve the assembled A instead.
bool sensitivity_is_iterative(const json& s, const char* key, const std::string& field,
                              const MetadataFields& r) {
  if (!s.contains(key))
    return false;
  const auto where = detail::field_path(field, key);
  const auto kind = r.get<std::string>(r.object(s, key, field), "kind", where);
  if (kind != "direct" && kind != "krylov")
    r.fail(where + ".kind", fmt::format("'{}' is not a sensitivity solve neml2-dispatch knows "
                                        "(supported: direct, krylov)",
                                        kind));
  return kind == "krylov";
}

ImplicitSegment read_implicit_segment(const json& s, const std::string& field,
                                      const MetadataFields& r) {
  if (s.contains("predictor_feedback"))
    unsupported(r, field, "an iterated predictor (predictor_feedback)",
                "use a predictor without feedback iterations");
  ImplicitSegment seg;
  seg.residual_package = r.package(s, "residual_package", field, true);
  seg.jacobian_package = r.package(s, "jacobian_package", field, false);
  seg.solve_package = r.package(s, "solve_package", field, false);
  seg.matvec_package = r.package(s, "matvec_package", field, false);
  seg.precond_setup_package = r.package(s, "precond_setup_package", field, false);
  seg.precond_apply_package = r.package(s, "precond_apply_package", field, false);
  if (seg.matvec_package.empty() && (seg.jacobian_package.empty() || seg.solve_package.empty()))
    r.fail(field + ".solve_package", "a segment needs jacobian_package and solve_package (a "
                                     "direct solve) or matvec_package (a Krylov solve)");
  if (seg.precond_setup_package.empty() != seg.precond_apply_package.empty())
    r.fail(field + (seg.precond_setup_package.empty() ? ".precond_setup_package"
                                                      : ".precond_apply_package"),
           "a preconditioner needs both precond_setup_package and precond_apply_package");
  if (!seg.precond_setup_package.empty() && seg.matvec_package.empty())
    r.fail(field + ".matvec_package", "a preconditioner without a Krylov solve (matvec_package)");
  seg.jacobian_given_package = r.package(s, "jacobian_given_package", field, false);
  seg.solve_ift_package = r.package(s, "solve_ift_package", field, false);
  seg.predictor_package = r.package(s, "predictor_package", field, false);
  seg.predictor_inputs = optional_names(s, "predictor_inputs", field, r);
  seg.predictor_outputs = optional_names(s, "predictor_outputs", field, r);
  seg.unknowns = read_implicit_variables(s, "unknowns", field, r);
  seg.residuals = read_implicit_variables(s, "residuals", field, r);
  seg.givens = read_implicit_variables(s, "givens", field, r);
  seg.unknown_groups = read_groups(s, "unknown_group_infos", field, r);
  seg.given_groups = read_groups(s, "given_group_infos", field, r);
  seg.residual_groups = read_groups(s, "residual_group_infos", field, r);
  seg.param_inputs = r.get_or<std::vector<std::string>>(s, "param_inputs", field, {});
  seg.max_substepping_level = r.get_or<std::int64_t>(s, "max_substepping_level", field, 0);
  seg.incremental_variables =
      r.get_or<std::vector<std::string>>(s, "incremental_variables", field, {});
  seg.iterative_input_sensitivity = sensitivity_is_iterative(s, "input_sensitivity", field, r);
  if (!seg.jacobian_given_package.empty() && seg.solve_ift_package.empty() &&
      !seg.iterative_input_sensitivity)
    r.fail(field + ".solve_ift_package", "missing for a direct input sensitivity");
  if (seg.iterative_input_sensitivity && seg.jacobian_package.empty())
    r.fail(field + ".jacobian_package", "an iterative input sensitivity solves the assembled A "
                                        "of the jacobian graph");
  if (s.contains("jacobian_pairs"))
    each_entry(s, "jacobian_pairs", field, r, [&](const json& p, const std::string& f) {
      seg.jacobian_pairs.push_back({r.get<std::string>(p, "out_var", f),
                                    r.get<std::string>(p, "in_var", f),
                                    r.shape(p, "out_base_shape", f), r.shape(p, "in_base_shape", f),
                                    r.get_or<std::int64_t>(p, "row_offset", f, 0),
                                    r.get_or<std::int64_t>(p, "col_offset", f, 0)});
    });
  seg.dr_dparam_package = r.package(s, "dr_dparam_package", field, false);
  seg.solve_param_package = r.package(s, "solve_param_package", field, false);
  seg.iterative_param_sensitivity = sensitivity_is_iterative(s, "param_sensitivity", field, r);
  if (!seg.dr_dparam_package.empty() && seg.solve_param_package.empty())
    unsupported(r, field, "an iterative parameter sensitivity solve (no solve_param_package)",
                "give the ImplicitUpdate a direct param_sensitivity_solver (DenseLU) and "
                "recompile");
  if (!seg.dr_dparam_package.empty())
    each_entry(s, "param_jacobian_pairs", field, r, [&](const json& p, const std::string& f) {
      seg.param_jacobian_pairs.push_back(
          {r.get<std::string>(p, "out_var", f), r.get<std::string>(p, "param", f),
           r.shape(p, "out_base_shape", f), r.shape(p, "param_base_shape", f)});
    });
  return seg;
}

SolverConfig read_solver_config(const json& c, const MetadataFields& r) {
  SolverConfig config;
  const std::string f = "solver_config";
  config.atol = r.get_or<double>(c, "atol", f, config.atol);
  config.rtol = r.get_or<double>(c, "rtol", f, config.rtol);
  config.miters = r.get_or<std::int64_t>(c, "miters", f, config.miters);
  config.substep_del_tol = r.get_or<double>(c, "substep_del_tol", f, config.substep_del_tol);
  config.ls_type = r.get_or<std::string>(c, "ls_type", f, config.ls_type);
  config.ls_max_iters = r.get_or<std::int64_t>(c, "ls_max_iters", f, config.ls_max_iters);
  config.ls_cutback = r.get_or<double>(c, "ls_cutback", f, config.ls_cutback);
  config.ls_c = r.get_or<double>(c, "ls_c", f, config.ls_c);
  config.solver_kind = r.get_or<std::string>(c, "solver_kind", f, config.solver_kind);
  if (config.solver_kind != "direct" && config.solver_kind != "krylov")
    unsupported(r, f, fmt::format("solver_kind '{}'", config.solver_kind),
                "the solver kinds run here are direct and krylov (GMRES)");
  if (config.solver_kind == "krylov") {
    const auto kf = f + ".krylov";
    const auto& k = r.object(c, "krylov", f);
    auto& g = config.krylov;
    g.method = r.get_or<std::string>(k, "method", kf, g.method);
    g.restart = r.get_or<std::int64_t>(k, "restart", kf, g.restart);
    g.max_its = r.get_or<std::int64_t>(k, "max_its", kf, g.max_its);
    g.abs_tol = r.get_or<double>(k, "abs_tol", kf, g.abs_tol);
    g.rel_tol = r.get_or<double>(k, "rel_tol", kf, g.rel_tol);
    g.cache_strategy = r.get_or<std::string>(k, "cache_strategy", kf, g.cache_strategy);
    g.cache_max_its = r.get_or<std::int64_t>(k, "cache_max_its", kf, g.cache_max_its);
    if (const auto why = detail::check_krylov(g))
      throw FatalError(fmt::format("{}: {}.{}; regenerate the artifact with neml2-compile (a "
                                   "GMRES linear_solver with these settings)",
                                   r.file, kf, *why));
  }
  if (config.ls_type != "BACKTRACKING" && config.ls_type != "STRONG_WOLFE")
    unsupported(r, f, fmt::format("a '{}' line search", config.ls_type),
                "use linesearch_type = BACKTRACKING or STRONG_WOLFE");
  return config;
}

} // namespace

Artifact read_artifact(const fs::path& root) {
  const auto file = root / "metadata.json";
  // A FIFO or a device in its place is read_text's error: it exists, but is no file.
  if (const auto status = detail::status_of(file, "the metadata file");
      !fs::exists(status) || fs::is_directory(status))
    throw FatalError(
        fmt::format("'{}' is not an artifact root: it has no metadata.json. Pass the folder "
                    "<output-dir>/<name>/ that neml2-compile writes (holding metadata.json and "
                    "<device>/<dtype>/), or the <name>_aoti.i stub beside it",
                    root.string()));
  return detail::parse_metadata(
      detail::read_text(file, "the metadata file", detail::max_metadata_bytes, regenerate), root);
}

namespace detail {

Artifact parse_metadata(std::string_view text, const fs::path& root) {
  const auto file = root / "metadata.json";
  // Bounded before nlohmann sees it: its parser and the copies of its values would take
  // whatever memory and stack such a file asks for.
  check_size(text.size(), max_metadata_bytes, "the metadata file", file.string(), regenerate);
  check_json_bounds(text, file.string(), regenerate);
  json meta;
  try {
    meta = json::parse(text);
  } catch (const json::exception& e) {
    throw FatalError(fmt::format("{}: malformed JSON ({}); regenerate the artifact with "
                                 "neml2-compile",
                                 file.string(), e.what()));
  }
  const MetadataFields r{file.string()};

  Artifact a;
  a.root = root;
  a.schema_version = r.get<int>(meta, "schema_version", "");
  if (std::find(std::begin(supported_schema_versions), std::end(supported_schema_versions),
                a.schema_version) == std::end(supported_schema_versions))
    throw FatalError(fmt::format("{}: schema_version {} is not supported (supported: {}); "
                                 "regenerate the artifact with neml2-compile from neml2 3.1",
                                 file.string(), a.schema_version,
                                 fmt::join(supported_schema_versions, ", ")));
  a.inputs = read_variables(meta, "inputs", r);
  a.outputs = read_variables(meta, "outputs", r);

  const auto param_alias = aliases(meta, "parameters", r);
  const auto& params = r.array(meta, "parameters", "");
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto field = fmt::format("parameters[{}]", i);
    ParameterSpec p;
    p.name = r.get<std::string>(params[i], "name", field);
    p.public_name = aliased(param_alias, p.name);
    p.shape = r.shape(params[i], "shape", field);
    p.base_shape = r.shape_or(params[i], "param_base_shape", field, p.shape);
    p.values = r.get<std::vector<double>>(params[i], "values", field);
    if (params[i].contains("dtype")) {
      const auto name = r.get<std::string>(params[i], "dtype", field);
      try {
        p.dtype = dtype_from_name(name);
      } catch (const FatalError&) {
        r.fail(field + ".dtype", fmt::format("unknown dtype '{}' (known: float64, float32, "
                                             "float16, bfloat16, int64, int32, bool)",
                                             name));
      }
    }
    if (detail::numel(p.shape) != static_cast<std::int64_t>(p.values.size()))
      r.fail(field + ".values",
             fmt::format("{} values for shape [{}]", p.values.size(), fmt::join(p.shape, ", ")));
    a.parameters.push_back(std::move(p));
  }

  const auto& segments = r.array(meta, "segments", "");
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const auto field = fmt::format("segments[{}]", i);
    const auto kind = r.get<std::string>(segments[i], "kind", field);
    if (kind == "forward")
      a.segments.emplace_back(read_segment(segments[i], field, r));
    else if (kind == "implicit")
      a.segments.emplace_back(read_implicit_segment(segments[i], field, r));
    else
      throw FatalError(fmt::format("{}: {} is a '{}' segment; neml2-dispatch runs 'forward' and "
                                   "'implicit' segments: regenerate the artifact with "
                                   "neml2-compile 3.1",
                                   file.string(), field, kind));
  }
  if (a.segments.empty())
    r.fail("segments", "empty");
  for (const auto* key : {"derivatives", "parameter_derivatives"}) {
    if (!meta.contains(key))
      continue;
    const bool inputs = std::string(key) == "derivatives";
    auto& pairs = inputs ? a.derivatives : a.parameter_derivatives;
    const auto names = r.get<std::vector<std::vector<std::string>>>(meta, key, "");
    for (std::size_t i = 0; i < names.size(); ++i) {
      // Refused, not skipped: a skipped entry is a derivative asked for and silently absent.
      if (names[i].size() != 2)
        r.fail(fmt::format("{}[{}]", key, i),
               fmt::format("expected an [output, {}] pair of names, got {} name{}",
                           inputs ? "input" : "parameter", names[i].size(),
                           names[i].size() == 1 ? "" : "s"));
      pairs.emplace_back(names[i][0], names[i][1]);
    }
  }
  if (meta.contains("solver_config"))
    a.solver_config = read_solver_config(r.object(meta, "solver_config", ""), r);
  // The solver kind and the segments' graphs must agree: a Krylov step needs its matvec.
  const bool krylov = a.solver_config && a.solver_config->solver_kind == "krylov";
  for (std::size_t i = 0; i < a.segments.size(); ++i)
    if (const auto* s = std::get_if<ImplicitSegment>(&a.segments[i]);
        s && s->matvec_package.empty() == krylov)
      r.fail(fmt::format("segments[{}].{}", i, krylov ? "matvec_package" : "solve_package"),
             krylov ? "missing for solver_kind 'krylov'"
                    : "a matvec_package (a Krylov solve) under a direct solver_kind");
  return a;
}

} // namespace detail

} // namespace neml2

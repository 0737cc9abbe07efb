// What an artifact offers: checked against what a session can actually run, on every
// artifact the build compiled.

#include <nlohmann/json.hpp>

#include <neml2/artifact_info.hpp>
#include <neml2/detail/tune_measure.hpp>
#include <neml2/tune.hpp>

#include "reference.hpp"

using namespace neml2;
using test::contains;
namespace fs = std::filesystem;

namespace {
// Every artifact root the build compiled: artifacts/<name>/<model>/metadata.json.
std::vector<fs::path> every_root() {
  std::vector<fs::path> roots;
  for (const auto& dir : fs::directory_iterator(test::artifacts()))
    if (dir.is_directory())
      for (const auto& sub : fs::directory_iterator(dir.path()))
        if (fs::is_regular_file(sub.path() / "metadata.json"))
          roots.push_back(sub.path());
  std::sort(roots.begin(), roots.end());
  return roots;
}

// Runs `op` on two generated rows (a batch every graph takes, the fixed-batch artifacts'
// too): false when the session says the graphs are missing.
bool runs(const Session& s, const Artifact& a, const std::string& op) {
  const auto inputs = neml2::detail::tune_inputs(a, {}, 2, "cpu", s.dtype());
  try {
    if (op == "forward")
      (void)s.forward(inputs);
    else if (op == "jvp")
      (void)s.jvp(inputs, {});
    else if (op == "jacobian")
      (void)s.jacobian(inputs);
    else if (op == "param_jacobian")
      (void)s.param_jacobian(inputs);
    else
      (void)s.param_vjp(inputs, {});
  } catch (const FatalError& e) {
    if (contains(e.what(), "was compiled without the graphs"))
      return false;
    throw;
  }
  return true;
}
} // namespace

TEST_CASE("the operations info lists are exactly those a session runs, on every artifact") {
  const auto roots = every_root();
  REQUIRE(roots.size() >= 10);
  std::size_t with_jacobian = 0, with_param = 0, without_jacobian = 0;
  for (const auto& root : roots) {
    CAPTURE(root);
    const auto artifact = std::make_shared<const Artifact>(read_artifact(root));
    const auto info = artifact_info(*artifact);
    REQUIRE(!info.leaves.empty());
    const auto dtype = dtype_from_name(info.leaves.front().dtype);
    std::optional<Session> loaded;
    try {
      loaded.emplace(artifact, "cpu", dtype);
    } catch (const FatalError& e) {
      // neml2-compile 3.1 writes float64 graphs into a float32 folder: the session refuses
      // them (docs/artifact-contract.md); info still describes the artifact.
      CHECK(contains(e.what(), "sits in a float32 folder"));
      CHECK(!format_artifact_info(info).empty());
      continue;
    }
    const auto& session = *loaded;
    for (const auto& [op, available] : info.operations) {
      CAPTURE(op);
      CHECK(available == runs(session, *artifact, op));
    }
    with_jacobian += info.can("jacobian");
    without_jacobian += !info.can("jacobian");
    with_param += info.can("param_jacobian") && !info.parameters.empty();
    // Inputs, outputs and parameters are the session's, by public name.
    REQUIRE(info.inputs.size() == session.input_names().size());
    for (std::size_t i = 0; i < info.inputs.size(); ++i) {
      CHECK(info.inputs[i].public_name == session.input_names()[i]);
      CHECK(info.inputs[i].base_shape == session.input_base_shapes()[i]);
    }
    REQUIRE(info.outputs.size() == session.output_names().size());
    CHECK(info.parameters.size() == session.named_parameters().size());
    CHECK(info.segments.size() == artifact->segments.size());
    CHECK(info.solver_config.has_value() ==
          std::any_of(info.segments.begin(), info.segments.end(),
                      [](const SegmentInfo& s) { return s.kind == "implicit"; }));
    const auto text = format_artifact_info(info);
    for (const auto& v : info.inputs)
      CHECK(contains(text, v.public_name));
    CHECK(nlohmann::json::parse(artifact_info_json(info))["inputs"].size() == info.inputs.size());
  }
  CHECK(with_jacobian > 0); // the loop saw both kinds
  CHECK(without_jacobian > 0);
  CHECK(with_param > 0);
}

TEST_CASE("info on known artifacts: names, shapes, segments, solver, leaves") {
  const auto renamed =
      artifact_info(read_artifact(test::artifacts() / "elasticity_renamed" / "elasticity"));
  REQUIRE(renamed.inputs.size() == 1);
  CHECK(renamed.inputs[0].public_name == "eps");
  CHECK(renamed.inputs[0].base_shape == Shape{6});
  CHECK(renamed.parameters.at(0).public_name == "youngs_modulus");
  CHECK(contains(format_artifact_info(renamed), "(model's name: strain)"));

  const auto f32 =
      artifact_info(read_artifact(test::artifacts() / "elasticity_float32" / "elasticity"));
  REQUIRE(f32.leaves.size() == 1);
  CHECK(f32.leaves[0].device == "cpu");
  CHECK(f32.leaves[0].dtype == "float32");
  CHECK(f32.leaves[0].graphs >= 1);
  CHECK(!f32.can("jacobian"));

  const auto j2 = artifact_info(
      read_artifact(resolve_artifact_root(test::stub("j2_radial_return", "model"), "model")));
  CHECK(j2.can("jacobian"));
  REQUIRE(j2.solver_config.has_value());
  const auto implicit = std::find_if(j2.segments.begin(), j2.segments.end(),
                                     [](const SegmentInfo& s) { return s.kind == "implicit"; });
  REQUIRE(implicit != j2.segments.end());
  CHECK(implicit->predictor);
  CHECK(!implicit->outputs.empty());
  const auto text = format_artifact_info(j2);
  CHECK(contains(text, "implicit: solves"));
  CHECK(contains(text, "solver: atol"));
  CHECK(contains(text, "cpu/float64"));

  // A GMRES model: its matvec and preconditioner graphs and its Krylov settings, as read.
  const auto gmres_artifact =
      read_artifact(resolve_artifact_root(test::stub("perzyna_gmres_bjac", "model")));
  const auto gmres = artifact_info(gmres_artifact);
  const auto& solve = std::get<ImplicitSegment>(gmres_artifact.segments.front());
  const auto& graphs = gmres.segments.front().graphs;
  for (const auto* package :
       {&solve.matvec_package, &solve.precond_setup_package, &solve.precond_apply_package}) {
    REQUIRE(!package->empty());
    CHECK(std::find(graphs.begin(), graphs.end(), *package) != graphs.end());
  }
  const auto& krylov = gmres_artifact.solver_config->krylov;
  CHECK(contains(format_artifact_info(gmres),
                 "krylov: " + krylov.method + ", restart " + std::to_string(krylov.restart)));
  CHECK(nlohmann::json::parse(artifact_info_json(gmres))["solver_config"]["krylov"]["max_its"] ==
        krylov.max_its);

  const auto sub = artifact_info(read_artifact(
      resolve_artifact_root(test::stub("elasticity_subbatch", "elasticity"), "elasticity")));
  CHECK(sub.inputs[0].sub_batch_shape == Shape{3});
  CHECK(contains(format_artifact_info(sub), "sub-batch (3)"));
}

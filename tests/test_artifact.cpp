// Reading what neml2-compile writes, and an error naming the file and the fix for each
// malformed case.

#include <array>
#include <atomic>
#include <fstream>

#include "scratch.hpp"

using namespace neml2;
using test::contains;
using test::metadata_rewriter;
using test::Scratch;
namespace fs = std::filesystem;

// How every field error of metadata.json ends.
const std::string unlike_neml2_compile =
    "; the file is not what neml2-compile 3.x writes: regenerate the artifact with neml2-compile";

TEST_CASE("a real artifact: variables, segment and graphs") {
  const auto root = resolve_artifact_root(test::stub("elasticity", "elasticity"), "elasticity");
  CHECK(root.filename() == "elasticity");
  const auto a = read_artifact(root);
  CHECK(a.schema_version == 14);
  REQUIRE(a.inputs.size() == 1);
  CHECK(a.inputs[0].name == "strain");
  CHECK(a.inputs[0].public_name == "strain");
  CHECK(a.inputs[0].var_type == "SR2");
  CHECK(a.inputs[0].base_shape == Shape{6});
  REQUIRE(a.outputs.size() == 1);
  CHECK(a.outputs[0].name == "stress");
  CHECK(a.parameters.empty());
  REQUIRE(a.segments.size() == 1);
  const auto& seg = std::get<ForwardSegment>(a.segments[0]);
  CHECK(seg.package == "elasticity.pt2");
  CHECK(seg.jvp_package == "elasticity_jvp.pt2");
  REQUIRE(seg.jacobian_pairs.size() == 1);
  CHECK(seg.jacobian_pairs[0].batch_independent); // baked E and nu: a constant stiffness
  CHECK(fs::is_regular_file(a.leaf("cpu", at::kDouble) / seg.package));
}

TEST_CASE("promoted parameters with their stored values") {
  const auto a = read_artifact(test::artifacts() / "elasticity_params" / "elasticity");
  REQUIRE(a.parameters.size() == 2);
  CHECK(a.parameters[0].name == "elasticity.E");
  CHECK(a.parameters[0].values == std::vector<double>{100.0});
  CHECK(a.parameters[0].base_shape.empty());
  CHECK(a.parameters[1].name == "elasticity.nu");
  CHECK(a.parameters[1].values == std::vector<double>{0.3});
  const auto& seg = std::get<ForwardSegment>(a.segments[0]);
  CHECK(seg.param_inputs == std::vector<std::string>{"elasticity.E", "elasticity.nu"});
  CHECK(seg.param_jacobian_pairs.size() == 2);
  CHECK(seg.param_vjp_params == std::vector<std::string>{"elasticity.E", "elasticity.nu"});
  CHECK(seg.param_vjp_outputs == std::vector<std::string>{"stress"});
  CHECK_FALSE(seg.jacobian_pairs[0].batch_independent);
}

TEST_CASE("renamed boundaries, no stub: public names follow the aliases") {
  const auto root = test::artifacts() / "elasticity_renamed" / "elasticity";
  CHECK_FALSE(fs::exists(test::stub("elasticity_renamed", "elasticity")));
  const auto a = read_artifact(resolve_artifact_root(root, "ignored for a folder"));
  CHECK(a.inputs[0].name == "strain");
  CHECK(a.inputs[0].public_name == "eps");
  CHECK(a.outputs[0].public_name == "sig");
  CHECK(a.parameters[0].name == "elasticity.E");
  CHECK(a.parameters[0].public_name == "youngs_modulus");
  CHECK(std::get<ForwardSegment>(a.segments[0]).inputs ==
        std::vector<std::string>{"strain"}); // internal names

  const auto message = test::fatal_message([&] { return a.leaf("cpu", at::kFloat); });
  CHECK(contains(message, "no graphs for device cpu and dtype float32"));
  CHECK(contains(message, "it has: cpu/float64"));
  CHECK(
      contains(message, "neml2-compile <input.i> --model elasticity --device cpu --dtype float32"));
}

TEST_CASE("--dtype float32: the leaf is cpu/float32") {
  const auto a = read_artifact(test::artifacts() / "elasticity_float32" / "elasticity");
  CHECK(fs::is_regular_file(a.leaf("cpu", at::kFloat) / "elasticity.pt2"));
  CHECK(contains(test::fatal_message([&] { return a.leaf("cpu", at::kDouble); }),
                 "it has: cpu/float32"));
}

TEST_CASE("no folder for the device: the folders that exist and the command that makes it") {
  const auto a = read_artifact(test::artifacts() / "elasticity" / "elasticity");
  const auto message = test::fatal_message([&] { return a.leaf("cuda:1", at::kDouble); });
  CHECK(contains(message, "no graphs for device cuda:1 and dtype float64"));
  CHECK(contains(message, "it has: cpu/float64"));
  CHECK(contains(message, "--device cuda --dtype float64"));
}

TEST_CASE("stubs: relative and absolute artifact_path, and every malformed case") {
  Scratch s;
  const auto root = s.copy_root("elasticity", "elasticity");
  const auto stub_for = [&](const std::string& body) { return s.write("stub.i", body); };

  SUBCASE("relative to the stub's folder, with comments and other sections") {
    const auto stub = stub_for("# comment\n[Models]\n  [elasticity] # the model\n"
                               "    type = AOTIModel\n    artifact_path = 'elasticity'\n  []\n"
                               "[]\n[Drivers]\n  [d]\n    type = X\n  []\n[]\n");
    CHECK(artifact_root_from_stub(stub, "elasticity") == s.dir / "elasticity");
  }
  SUBCASE("absolute") {
    const auto stub = stub_for("[Models]\n[elasticity]\ntype = AOTIModel\nartifact_path = \"" +
                               root.string() + "\"\n[]\n[]\n");
    CHECK(artifact_root_from_stub(stub, "elasticity") == root);
  }
  SUBCASE("no such model: the models that are there") {
    const auto message = test::fatal_message(
        [&] { return resolve_artifact_root(test::stub("elasticity", "elasticity"), "elastic"); });
    CHECK(contains(message, "elasticity_aoti.i"));
    CHECK(contains(message, "no model 'elastic' under [Models] (models there: elasticity)"));
  }
  SUBCASE("not a compiled-model block") {
    const auto input = fs::path(NEML2_DISPATCH_TEST_SOURCES) / ".." / "models" / "elasticity.i";
    const auto message =
        test::fatal_message([&] { return artifact_root_from_stub(input, "elasticity"); });
    CHECK(contains(message, "elasticity.i:"));
    CHECK(contains(message, "type = LinearIsotropicElasticity, expected AOTIModel"));
    CHECK(contains(message, "neml2-compile"));
  }
  SUBCASE("no [Models]") {
    const auto message =
        test::fatal_message([&] { return artifact_root_from_stub(stub_for("[A]\n[]\n"), "m"); });
    CHECK(contains(message, "stub.i: no model under [Models]"));
  }
  SUBCASE("no artifact_path") {
    const auto message = test::fatal_message([&] {
      return artifact_root_from_stub(stub_for("[Models]\n[m]\ntype = AOTIModel\n[]\n[]\n"), "m");
    });
    CHECK(contains(message, "stub.i:2: [Models]/[m] has no artifact_path"));
  }
  SUBCASE("malformed HIT: nmhit's messages, with the line and column") {
    CHECK(contains(test::fatal_message([&] {
                     return artifact_root_from_stub(
                         stub_for("[Models]\n  [m]\n    type = AOTIModel\n[]\n"), "m");
                   }),
                   "stub.i:4:3: syntax error, unexpected end of file"));
    CHECK(contains(test::fatal_message([&] {
                     return artifact_root_from_stub(stub_for("[Models]\n  just words\n[]\n"), "m");
                   }),
                   "stub.i:2:8: unexpected character 'w'"));
    CHECK(contains(test::fatal_message([&] {
                     return artifact_root_from_stub(stub_for("[Models]\n[]\n[]\n"), "m");
                   }),
                   "stub.i:3:1: syntax error, unexpected [], expecting end of file"));
    CHECK(contains(test::fatal_message([&] {
                     return artifact_root_from_stub(
                         stub_for("[Models]\n[m]\nartifact_path = 'x\n[]\n[]\n"), "m");
                   }),
                   "stub.i:5:3: syntax error, unexpected end of file, expecting \"'\""));
  }
  SUBCASE("a path that does not exist") {
    CHECK(
        contains(test::fatal_message([&] { return resolve_artifact_root(s.dir / "nope.i", "m"); }),
                 "nope.i' does not exist"));
  }
}

TEST_CASE("metadata.json: every malformed case names the file and the fix") {
  Scratch s;
  const auto root = s.copy_root("elasticity", "elasticity");
  const auto rewrite = metadata_rewriter(root);

  SUBCASE("no metadata.json") {
    const auto message = test::fatal_message([&] { return read_artifact(s.dir); });
    CHECK(contains(message, "is not an artifact root: it has no metadata.json"));
    CHECK(contains(message, "<output-dir>/<name>/"));
  }
  SUBCASE("unsupported schema version") {
    rewrite("\"schema_version\": 14", "\"schema_version\": 13");
    const auto message = test::fatal_message([&] { return read_artifact(root); });
    CHECK(contains(message, "metadata.json: schema_version 13 is not supported (supported: 14)"));
    CHECK(contains(message, "regenerate the artifact with neml2-compile"));
  }
  SUBCASE("malformed JSON") {
    rewrite("\"schema_version\": 14", "\"schema_version\": 14,,");
    CHECK(contains(test::fatal_message([&] { return read_artifact(root); }),
                   "metadata.json: malformed JSON"));
  }
  SUBCASE("a missing field") {
    rewrite("\"base_shape\"", "\"shape_of_base\"");
    CHECK(contains(test::fatal_message([&] { return read_artifact(root); }),
                   "field 'inputs[0].base_shape': missing"));
  }
  SUBCASE("a field of the wrong type") {
    rewrite("\"package\": \"elasticity.pt2\"", "\"package\": 3");
    CHECK(contains(test::fatal_message([&] { return read_artifact(root); }),
                   "field 'segments[0].package'"));
  }
  SUBCASE("a forward segment marked implicit") {
    rewrite("\"kind\": \"forward\"", "\"kind\": \"implicit\"");
    CHECK(contains(test::fatal_message([&] { return read_artifact(root); }),
                   "field 'segments[0].residual_package': missing"));
  }
  SUBCASE("a graph file listed but missing") {
    fs::remove(root / "cpu" / "float64" / "elasticity_jvp.pt2");
    const auto artifact = std::make_shared<const Artifact>(read_artifact(root));
    const auto message = test::fatal_message([&] { return Session(artifact, "cpu"); });
    CHECK(contains(message, "elasticity_jvp.pt2' (metadata.json jvp_package) is missing"));
  }
}

TEST_CASE("dtype folder names") {
  CHECK(dtype_folder(at::kDouble) == "float64");
  CHECK(dtype_folder(at::kFloat) == "float32");
  CHECK(
      contains(test::fatal_message([] { return dtype_folder(at::kHalf); }), "float64 or float32"));
  CHECK((dtype_from_name("torch.int64") == at::kLong));
}

TEST_CASE("implicit features not run here are refused at load, naming the feature") {
  const Scratch s;
  const auto root = s.copy_root("scalar_backward_euler", "model");
  CHECK_NOTHROW(static_cast<void>(read_artifact(root)));
  const auto rewrite = metadata_rewriter(root);
  const std::array<std::array<std::string, 3>, 3> refused = {{
      {"\"ls_type\": \"BACKTRACKING\",\n    \"ls_max_iters\": 1",
       "\"ls_type\": \"MORE_THUENTE\", \"ls_max_iters\": 5",
       "a 'MORE_THUENTE' line search, which neml2-dispatch does not support yet; use "
       "linesearch_type = BACKTRACKING or STRONG_WOLFE"},
      {"\"solver_kind\": \"direct\"", "\"solver_kind\": \"multigrid\"",
       "solver_kind 'multigrid', which neml2-dispatch does not support yet; the solver kinds "
       "run here are direct and krylov"},
      {"\"kind\": \"implicit\"", "\"kind\": \"iterative\"", "segments[0] is a 'iterative' segment"},
  }};
  for (const auto& [from, to, message] : refused) {
    CAPTURE(to);
    rewrite(from, to);
    CHECK(contains(test::fatal_message([&] { return read_artifact(root); }), message));
  }
}

TEST_CASE("substepping and a strong-Wolfe line search load; substepping roles that do not fit "
          "are refused") {
  const Scratch s;
  const auto root = s.copy_root("scalar_substepping", "model");
  const auto rewrite = metadata_rewriter(root);
  rewrite("\"ls_type\": \"BACKTRACKING\",\n    \"ls_max_iters\": 1",
          "\"ls_type\": \"STRONG_WOLFE\",\n    \"ls_max_iters\": 5");
  const auto artifact = std::make_shared<const Artifact>(read_artifact(root));
  CHECK(artifact->solver_config->ls_type == "STRONG_WOLFE");
  CHECK(artifact->solver_config->ls_max_iters == 5);
  CHECK(std::get<ImplicitSegment>(artifact->segments[0]).max_substepping_level == 3);
  const Session session(artifact, "cpu");
  CHECK(session.solver_config().ls_type == "STRONG_WOLFE");

  const auto refused = [&] {
    return test::fatal_message(
        [&] { return Session(std::make_shared<const Artifact>(read_artifact(root)), "cpu"); });
  };
  rewrite("\"pair\": \"x\"", "\"pair\": \"y\"");
  CHECK(contains(refused(), "given 'x~1' has substepping role 'old_state' with pair 'y', but "
                            "the pair is not an unknown of the same size"));
  rewrite("\"role\": \"static\"", "\"role\": \"ramp\"");
  CHECK(contains(refused(), "given 'a' has substepping role 'ramp'; known roles are static, "
                            "old_state, cur_force and old_force"));
}

TEST_CASE("metadata.json: a substepping pair, a section or the aliases of the wrong type are "
          "refused by name") {
  const Scratch s;
  const auto root = s.copy_root("scalar_substepping", "model");
  const auto rewrite = metadata_rewriter(root);
  // neml2-compile writes null for a static given's pair: no pair.
  const auto artifact = read_artifact(root);
  for (const auto& given : std::get<ImplicitSegment>(artifact.segments[0]).givens)
    CHECK((given.role == "static") == given.pair.empty());
  const auto refused = [&] { return test::fatal_message([&] { return read_artifact(root); }); };
  rewrite("\"pair\": \"x\"", "\"pair\": 7");
  CHECK(contains(refused(), "metadata.json: field 'segments[0].givens[1].pair': "
                            "[json.exception.type_error.302] type must be string, but is number" +
                                unlike_neml2_compile));
  rewrite("\"solver_config\": {", "\"solver_config\": [], \"solver_config_before\": {");
  CHECK(contains(refused(), "metadata.json: field 'solver_config': expected an object" +
                                unlike_neml2_compile));
  rewrite("\"solver_kind\": \"direct\"", "\"solver_kind\": \"krylov\", \"krylov\": 7");
  CHECK(contains(refused(), "metadata.json: field 'solver_config.krylov': expected an object" +
                                unlike_neml2_compile));
  rewrite("\"schema_version\": 14", "\"schema_version\": 14, \"boundary_aliases\": [\"x\"]");
  CHECK(contains(refused(), "metadata.json: field 'boundary_aliases': expected an object" +
                                unlike_neml2_compile));
}

TEST_CASE("metadata.json: a derivatives or parameter_derivatives entry that is not an [output, "
          "input] pair is refused by name") {
  const Scratch s;
  const auto root = s.copy_root("scalar_substepping", "model");
  const auto rewrite = metadata_rewriter(root);
  CHECK(read_artifact(root).derivatives.size() == 5);
  const auto refused = [&] { return test::fatal_message([&] { return read_artifact(root); }); };
  // Each was skipped before: the artifact loaded without the derivative it was asked for.
  rewrite("\"x\",\n      \"a\"\n", "\"x\",\n      \"a\",\n      \"t\"\n");
  CHECK(contains(refused(), "metadata.json: field 'derivatives[1]': expected an [output, input] "
                            "pair of names, got 3 names" +
                                unlike_neml2_compile));
  rewrite("\"derivatives\": [\n    [\n      \"x\",\n      \"x\"\n",
          "\"derivatives\": [\n    [\n      \"x\"\n");
  CHECK(contains(refused(), "metadata.json: field 'derivatives[0]': expected an [output, input] "
                            "pair of names, got 1 name" +
                                unlike_neml2_compile));
  rewrite("\"parameter_derivatives\": []", "\"parameter_derivatives\": [[]]");
  CHECK(contains(refused(), "metadata.json: field 'parameter_derivatives[0]': expected an "
                            "[output, parameter] pair of names, got 0 names" +
                                unlike_neml2_compile));
}

// Damaged artifacts, as a user could end up with them: every fault is a FatalError that
// names the file at load, never a crash and never a wrong number.

#include <functional>
#include <map>

#include <sys/stat.h>

#include "model_checks.hpp"
#include "scratch.hpp"

using namespace neml2;
using test::contains;
using test::load_artifact;
using test::Scratch;
using test::write_bytes;
namespace fs = std::filesystem;

namespace {

// Every operation the model offers, on a few rows of zeros (the results are only compared).
std::vector<at::Tensor> run_everything(const Session& s) {
  const auto inputs = test::zeros_inputs(s, 3);
  std::vector<at::Tensor> results;
  const auto keep = [&](const TensorMap& m) {
    for (const auto& [name, t] : m)
      results.push_back(t);
  };
  const auto keep_blocks = [&](const VariablePairJacobian& J) {
    for (const auto& [o, row] : J)
      keep(row);
  };
  keep(s.forward(inputs));
  const auto& a = s.artifact();
  if (!a.derivatives.empty()) {
    keep_blocks(s.jacobian(inputs).second);
    keep(s.jvp(inputs, {}).second);
  }
  if (!a.parameter_derivatives.empty())
    keep_blocks(s.param_jacobian(inputs).second);
  if (a.single_forward() && !std::get<ForwardSegment>(a.segments.front()).param_vjp_package.empty())
    keep(s.param_vjp(inputs, {}));
  return results;
}

bool same_results(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size())
    return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!test::identical(a[i], b[i]))
      return false;
  return true;
}

// The faults applied to one graph file: each with what the file then holds.
std::map<std::string, std::function<void(const fs::path&, const fs::path& other)>> graph_faults() {
  return {
      {"empty", [](const fs::path& f, const fs::path&) { write_bytes(f, ""); }},
      {"truncated to 100 bytes",
       [](const fs::path& f, const fs::path&) { write_bytes(f, test::read(f).substr(0, 100)); }},
      {"truncated to half",
       [](const fs::path& f, const fs::path&) {
         const auto bytes = test::read(f);
         write_bytes(f, bytes.substr(0, bytes.size() / 2));
       }},
      {"one byte changed in the middle",
       [](const fs::path& f, const fs::path&) {
         auto bytes = test::read(f);
         bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x5a);
         write_bytes(f, bytes);
       }},
      {"another graph of the model copied over it",
       [](const fs::path& f, const fs::path& other) {
         fs::copy_file(other, f, fs::copy_options::overwrite_existing);
       }},
      {"a folder in its place",
       [](const fs::path& f, const fs::path&) {
         fs::remove(f);
         fs::create_directory(f);
       }},
      {"text, not a zip", [](const fs::path& f, const fs::path&) { write_bytes(f, "hello\n"); }},
  };
}

// Damages each graph of an artifact in turn, every way: loading must fail naming the
// file, or (a byte the graph never reads) the results must be exactly the undamaged ones.
void check_graph_faults(const std::string& artifact, const std::string& model) {
  const Scratch s;
  const auto root = s.copy_root(artifact, model);
  const auto leaf = root / "cpu" / "float64";
  const auto expected = run_everything(Session(load_artifact(root), "cpu"));
  std::vector<fs::path> graphs;
  for (const auto& e : fs::directory_iterator(leaf))
    graphs.push_back(e.path());
  std::sort(graphs.begin(), graphs.end());
  REQUIRE(graphs.size() >= 2);
  int refused = 0, harmless = 0;
  for (std::size_t g = 0; g < graphs.size(); ++g) {
    const auto& file = graphs[g];
    const auto original = s.dir / "original.pt2";
    fs::copy_file(file, original, fs::copy_options::overwrite_existing);
    for (const auto& [fault, apply] : graph_faults()) {
      CAPTURE(file.filename().string());
      CAPTURE(fault);
      apply(file, graphs[(g + 1) % graphs.size()]);
      std::vector<at::Tensor> results;
      std::string message;
      try {
        results = run_everything(Session(load_artifact(root), "cpu"));
      } catch (const FatalError& e) {
        message = e.what();
      }
      if (message.empty()) {
        // Loading can only pass when nothing the graph runs was touched.
        CHECK(fault == "one byte changed in the middle");
        CHECK(same_results(results, expected));
        ++harmless;
      } else {
        CHECK_MESSAGE(contains(message, file.filename().string()), message);
        CHECK_MESSAGE(message.size() < 1200, message); // no backtrace
        ++refused;
      }
      fs::remove_all(file);
      fs::copy_file(original, file);
    }
  }
  CHECK(refused >= static_cast<int>(graphs.size()) * 6);
  MESSAGE(artifact << ": " << refused << " faults refused at load, " << harmless
                   << " harmless single-byte changes with identical results");
  // Restored, the artifact works again.
  CHECK(same_results(run_everything(Session(load_artifact(root), "cpu")), expected));
}

// Loading `root` fails with a FatalError naming the root and saying `part`.
void check_load_fails(const fs::path& root, const std::string& part) {
  const auto message = test::fatal_message([&] { return Session(load_artifact(root), "cpu"); });
  CHECK_MESSAGE(contains(message, part), message);
  CHECK_MESSAGE(contains(message, root.string()), message);
}

} // namespace

TEST_CASE("damaged graphs of a forward model with parameter derivatives (4 graph kinds)") {
  check_graph_faults("elasticity_params", "elasticity");
}

TEST_CASE("damaged graphs of an implicit model with a predictor (every Newton graph kind)") {
  check_graph_faults("j2_radial_return", "model");
}

TEST_CASE("damaged graphs of an implicit model with parameter derivatives") {
  check_graph_faults("scalar_backward_euler_params", "model");
}

TEST_CASE("a graph of another model with the same file name") {
  const Scratch s;
  const auto root = s.copy_root("elasticity", "elasticity");
  fs::copy_file(test::artifacts() / "elasticity_params" / "elasticity" / "cpu" / "float64" /
                    "elasticity.pt2",
                root / "cpu" / "float64" / "elasticity.pt2", fs::copy_options::overwrite_existing);
  const auto message = test::fatal_message([&] { return Session(load_artifact(root), "cpu"); });
  CHECK(contains(message, "elasticity.pt2' (metadata.json package) does not match metadata.json: "
                          "it takes 3 arguments, metadata.json implies 1"));
}

TEST_CASE("metadata.json that disagrees with the graphs or with itself") {
  const Scratch s;
  const auto root = s.copy_root("elasticity_params", "elasticity");
  const auto rewrite = test::metadata_rewriter(root);
  const auto load_fails = [&](const std::string& part) { check_load_fails(root, part); };
  // What issue 8 found: an SR2 declared [3] was accepted and read past.
  rewrite("\"base_shape\": [\n        6\n      ]", "\"base_shape\": [3]");
  load_fails("argument 0 is (B, 6) in the graph but (B, 3) in metadata.json");
  rewrite("\"base_shape\": [\n        6\n      ]", "\"base_shape\": [-6]");
  load_fails("field 'inputs[0].base_shape': size -6 in [-6] is not a size between 0 and");
  rewrite("\"base_shape\": [\n        6\n      ]", "\"base_shape\": [100000, 100000]");
  load_fails("has more than 16777216 values");
  rewrite("\"base_shape\": [\n        6\n      ]", "\"base_shape\": [1e300]");
  load_fails("field 'inputs[0].base_shape'");
  // Results are checked too: on a probe call at load, and after every call.
  rewrite("\"name\": \"stress\",\n      \"var_size\": 6,\n      \"var_type\": \"SR2\",\n      "
          "\"base_shape\": [\n        6\n      ]",
          "\"name\": \"stress\", \"var_size\": 9, \"var_type\": \"R2\", \"base_shape\": [3, 3]");
  load_fails("result 0 is Double [2, 6], metadata.json implies Double (B, 3, 3)");
  rewrite("\"out_var\": \"stress\"", "\"out_var\": \"strain\"");
  load_fails("the segment names output 'strain', which is not declared at the top level");
  rewrite("\"name\": \"strain\"", "\"name\": \"strainn\"");
  load_fails("strain");
  rewrite("\"package\": \"elasticity.pt2\"", "\"package\": \"elasticity_jvp.pt2\"");
  load_fails("it returns 2 results, metadata.json implies 1");
  rewrite("\"jvp_package\": \"elasticity_jvp.pt2\"", "\"jvp_package\": \"elasticity.pt2\"");
  load_fails("it returns 1 results, metadata.json implies 2");
  rewrite("\"package\": \"elasticity.pt2\"", "\"package\": \"../../metadata.json\"");
  load_fails("'../../metadata.json' is not the file name of a .pt2 graph");
  rewrite("\"package\": \"elasticity.pt2\"", "\"package\": \"\"");
  load_fails("field 'segments[0].package': '' is not the file name of a .pt2 graph");
  rewrite("\"package\": \"elasticity.pt2\"", "\"package\": \"elasticity.i.pt2\"");
  load_fails("elasticity.i.pt2' (metadata.json package) is missing");
}

TEST_CASE("implicit metadata that disagrees with its graphs") {
  const Scratch s;
  const auto root = s.copy_root("scalar_backward_euler", "model");
  const auto rewrite = test::metadata_rewriter(root);
  const auto load_fails = [&](const std::string& part) { check_load_fails(root, part); };
  rewrite("\"unknowns\": [\n        {\n          \"name\": \"x\",\n          \"var_size\": 1",
          "\"unknowns\": [{\"name\": \"x\", \"var_size\": 2");
  load_fails("var_size': 2 for sub_batch_shape [] and base_shape [] of 1 values");
  // Consistent in itself (2 bins of a scalar), but not what the graphs take.
  rewrite("\"name\": \"x\",\n          \"var_size\": 1,\n          \"sub_batch_shape\": []",
          "\"name\": \"x\", \"var_size\": 2, \"sub_batch_shape\": [2]");
  load_fails("does not match metadata.json: argument 0 is (B, 1) in the graph but (B, 2) in "
             "metadata.json");
  rewrite("\"residual_package\": \"model_residual.pt2\"",
          "\"residual_package\": \"model_jacobian.pt2\"");
  load_fails("model_jacobian.pt2' (metadata.json residual_package) does not match metadata.json: "
             "it returns 2 results, metadata.json implies 1");
  // The same counts as the solve graph: refused by its argument shapes.
  rewrite("\"solve_package\": \"model_solve.pt2\"", "\"solve_package\": \"model_residual.pt2\"");
  load_fails("model_residual.pt2' (metadata.json solve_package) does not match metadata.json: "
             "argument 0 is (B, 1) in the graph but (B, 1, 1) in metadata.json");
}

TEST_CASE("unreadable files and folders") {
  const Scratch s;
  const auto root = s.copy_root("elasticity", "elasticity");
  SUBCASE("metadata.json is a folder") {
    fs::remove(root / "metadata.json");
    fs::create_directory(root / "metadata.json");
    CHECK(contains(test::fatal_message([&] { return read_artifact(root); }),
                   "it has no metadata.json"));
  }
  SUBCASE("metadata.json is empty") {
    write_bytes(root / "metadata.json", "");
    CHECK(contains(test::fatal_message([&] { return read_artifact(root); }), "malformed JSON"));
  }
  SUBCASE("metadata.json is binary") {
    write_bytes(root / "metadata.json", test::read(root / "cpu" / "float64" / "elasticity.pt2"));
    CHECK(contains(test::fatal_message([&] { return read_artifact(root); }), "malformed JSON"));
  }
  SUBCASE("metadata.json or a graph that is a FIFO") {
    // Opening either to read would wait for a writer; a FIFO is no artifact root's file.
    fs::remove(root / "metadata.json");
    REQUIRE(::mkfifo((root / "metadata.json").c_str(), 0600) == 0);
    CHECK(contains(test::fatal_message([&] { return read_artifact(root); }),
                   "the metadata file '" + (root / "metadata.json").string() +
                       "' is not a regular file but a FIFO; regenerate the artifact"));
    fs::remove(root / "metadata.json");
    fs::copy_file(test::artifacts() / "elasticity" / "elasticity" / "metadata.json",
                  root / "metadata.json");
    const auto graph = root / "cpu" / "float64" / "elasticity.pt2";
    fs::remove(graph);
    REQUIRE(::mkfifo(graph.c_str(), 0600) == 0);
    CHECK(contains(test::fatal_message([&] { return Session(load_artifact(root), "cpu"); }),
                   "graph file '" + graph.string() + "' is not a regular file but a FIFO"));
  }
  SUBCASE("metadata.json far larger than any real one") {
    fs::resize_file(root / "metadata.json", std::uintmax_t(1) << 30); // sparse: no disk used
    CHECK(contains(test::fatal_message([&] { return read_artifact(root); }),
                   "the metadata file '" + (root / "metadata.json").string() +
                       "' is 1073741824 bytes, more than the 67108864 bytes read at most"));
  }
  SUBCASE("a graph far larger than any real one") {
    const auto graph = root / "cpu" / "float64" / "elasticity.pt2";
    fs::resize_file(graph, std::uintmax_t(1) << 30);
    CHECK(contains(test::fatal_message([&] { return Session(load_artifact(root), "cpu"); }),
                   "graph file '" + graph.string() +
                       "' is 1073741824 bytes, more than the 536870912 bytes read at most"));
  }
  SUBCASE("the leaf folder is a file") {
    fs::remove_all(root / "cpu" / "float64");
    write_bytes(root / "cpu" / "float64", "");
    CHECK(contains(test::fatal_message([&] { return Session(load_artifact(root), "cpu"); }),
                   "has no graphs for device cpu and dtype float64"));
  }
  SUBCASE("a stub that is a folder") {
    fs::create_directory(s.dir / "model_aoti.i");
    // A folder is taken as an artifact root; this one is not.
    CHECK(contains(test::fatal_message([&] {
                     return read_artifact(
                         resolve_artifact_root(s.dir / "model_aoti.i", "elasticity"));
                   }),
                   "is not an artifact root"));
  }
  SUBCASE("a stub that is a dangling link") {
    fs::create_symlink(s.dir / "nowhere.i", s.dir / "model_aoti.i");
    CHECK(contains(test::fatal_message(
                       [&] { return resolve_artifact_root(s.dir / "model_aoti.i", "elasticity"); }),
                   "does not exist"));
  }
}

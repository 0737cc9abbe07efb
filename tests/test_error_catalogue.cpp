// The entries of docs/errors.md that no topic's own test checks: each error triggered as a
// user would meet it, checked for its type, recoverable() and the distinctive part of its
// message. With NEML2_DISPATCH_PRINT_MESSAGES set, each message is printed (to refresh the
// examples in docs/errors.md).

#include <cstdlib>
#include <functional>
#include <iostream>
#include <optional>
#include <regex>

#include <caffe2/serialize/inline_container.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "internals.hpp" // the library's private parts
#include "model_checks.hpp"
#include "scratch.hpp"

using namespace neml2;
using test::contains;
using test::load_artifact;
using test::Scratch;
using test::write_bytes;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

void print(const std::string& message) {
  if (std::getenv("NEML2_DISPATCH_PRINT_MESSAGES"))
    std::cerr << "[error] " << message << "\n";
}

// The message of the FatalError that f throws, checked to say a retry cannot help.
template <class F>
std::string fatal(F&& f) {
  try {
    f();
  } catch (const FatalError& e) {
    CHECK_FALSE(e.recoverable());
    print(e.what());
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected neml2::FatalError, got another exception: " << std::string(e.what()));
  }
  FAIL("expected neml2::FatalError, nothing was thrown");
  return {};
}

// Checks that f throws a FatalError whose message holds `part`.
template <class F>
void fails_with(F&& f, const std::string& part) {
  const auto message = fatal(std::forward<F>(f));
  CHECK_MESSAGE(contains(message, part), message);
}

// Loading root's graphs for the CPU (metadata.json first) fails with `part`.
void loading_fails_with(const fs::path& root, const std::string& part) {
  fails_with([&] { return Session(load_artifact(root), "cpu"); }, part);
}

// Edits a copied root's metadata.json as JSON.
void edit_metadata(const fs::path& root, const std::function<void(json&)>& edit) {
  const auto file = root / "metadata.json";
  auto meta = json::parse(test::read(file));
  edit(meta);
  std::ofstream(file) << meta.dump(2);
}

// Loading a copy of `artifact` (root folder `model`) with its metadata.json edited fails
// with `part`.
void edited_loading_fails_with(const std::string& artifact, const std::string& model,
                               const std::function<void(json&)>& edit, const std::string& part) {
  const Scratch s;
  const auto root = s.copy_root(artifact, model);
  edit_metadata(root, edit);
  loading_fails_with(root, part);
}

// A copy of graph package `file`, rewritten record by record through PyTorch's own archive
// writer (valid zip, valid CRC-32s): `edit` may change a record's bytes, or return false
// to leave the record out.
void forge_package(const fs::path& file,
                   const std::function<bool(const std::string&, std::string&)>& edit) {
  std::vector<std::pair<std::string, std::string>> records;
  {
    caffe2::serialize::PyTorchStreamReader reader(file.string());
    for (const auto& name : reader.getAllRecords()) {
      if (name == ".data/version" || name == ".data/serialization_id" || name == "version")
        continue; // the writer writes its own
      const auto [data, size] = reader.getRecord(name);
      std::string bytes(static_cast<const char*>(data.get()), size);
      if (edit(name, bytes))
        records.emplace_back(name, std::move(bytes));
    }
  }
  fs::remove(file);
  caffe2::serialize::PyTorchStreamWriter writer(file.string());
  for (const auto& [name, bytes] : records)
    writer.writeRecord(name, bytes.data(), bytes.size());
  writer.writeEndOfFile();
}

// Replaces `from` by `to` in the generated wrapper source (which must hold it).
std::function<bool(const std::string&, std::string&)> in_wrapper(const std::string& from,
                                                                 const std::string& to) {
  return [from, to](const std::string& name, std::string& bytes) {
    if (name.ends_with("wrapper.cpp")) {
      const auto at = bytes.find(from);
      REQUIRE(at != std::string::npos);
      bytes.replace(at, from.size(), to);
    }
    return true;
  };
}

// Runs `f` as a user who may not read files with no permissions: this process itself,
// or, where it runs as root (which reads anything), with its effective user id set to
// nobody's for the call. False when neither is possible (no test then).
template <class F>
bool unprivileged(F&& f) {
  if (::geteuid() != 0) {
    f();
    return true;
  }
  if (::seteuid(65534) != 0)
    return false;
  try {
    f();
  } catch (...) {
    REQUIRE(::seteuid(0) == 0);
    throw;
  }
  REQUIRE(::seteuid(0) == 0);
  return true;
}

// A scratch copy of the elasticity artifact, and the file of its value graph.
struct ElasticityCopy {
  Scratch scratch;
  fs::path root = scratch.copy_root("elasticity", "elasticity");
  fs::path graph = root / "cpu" / "float64" / "elasticity.pt2";
};

// A synchronous policy whose device list is empty.
struct ListsNothing {
  using dispatch_mode = synchronous;
  std::vector<Device> devices() const { return {}; }
  Device compute_device() const { return "cpu"; }
  std::int64_t chunk_rows(std::int64_t) const { return 0; }
};

} // namespace

static_assert(DispatchPolicy<ListsNothing>);

// ------------------------------------------------------------------ loading: stub and files

TEST_CASE("a stub or a metadata.json that cannot be read names the file") {
  const Scratch s;
  const auto root = s.copy_root("elasticity", "elasticity");
  const auto stub = s.write("model_aoti.i", "[Models]\n[m]\ntype = AOTIModel\n"
                                            "artifact_path = 'elasticity'\n[]\n[]\n");
  fs::permissions(stub, fs::perms::none);
  fs::permissions(root / "metadata.json", fs::perms::none);
  std::string stub_message, metadata_message;
  const bool tried = unprivileged([&] {
    stub_message = fatal([&] { return resolve_artifact_root(stub, "m"); });
    metadata_message = fatal([&] { return read_artifact(root); });
  });
  if (!tried) {
    MESSAGE("skipped: running as root and cannot change the effective user id");
    return;
  }
  CHECK_MESSAGE(contains(stub_message, "cannot read the stub (the <name>_aoti.i file that "
                                       "neml2-compile writes) '" +
                                           stub.string() +
                                           "' (the read failed): check that it exists"),
                stub_message);
  CHECK_MESSAGE(contains(metadata_message, "cannot read the metadata file '" +
                                               (root / "metadata.json").string() +
                                               "' (the read failed): check that it exists"),
                metadata_message);
}

TEST_CASE("a stub line that opens a section header and does not close it") {
  const Scratch s;
  const auto stub = s.write("stub.i", "[Models\n[m]\n[]\n[]\n");
  fails_with([&] { return artifact_root_from_stub(stub, "m"); },
             "stub.i:1:8: unexpected character 'newline in section header'; " + stub.string() +
                 ":2:1: syntax error, unexpected [, expecting ']'");
}

// ------------------------------------------------------------------ loading: metadata.json

TEST_CASE("metadata.json with an object or a list where the other belongs") {
  edited_loading_fails_with(
      "elasticity", "elasticity", [](json& m) { m["inputs"] = json::object(); },
      "inputs': expected an array; the file is not what neml2-compile 3.x writes");
  edited_loading_fails_with(
      "elasticity", "elasticity", [](json& m) { m["outputs"][0] = 3; },
      "metadata.json: field 'outputs[0]': expected an object");
}

TEST_CASE("a parameter whose values do not fill its shape, or of an unknown dtype") {
  edited_loading_fails_with(
      "elasticity_params", "elasticity",
      [](json& m) {
        m["parameters"][0]["values"] = {1.0, 2.0};
      },
      "field 'parameters[0].values': 2 values for shape []");
  edited_loading_fails_with(
      "elasticity_params", "elasticity",
      [](json& m) { m["parameters"][0]["dtype"] = "complex128"; }, "unknown dtype 'complex128'");
}

TEST_CASE("inputs whose sub-batch shapes do not broadcast together") {
  // Torch's own broadcasting error (with its backtrace) left the constructor before.
  edited_loading_fails_with(
      "rates", "eq",
      [](json& m) {
        m["inputs"][0]["sub_batch_shape"] = {2};
        m["inputs"][2]["sub_batch_shape"] = {3};
      },
      "inputs 'a' (sub-batch shape [2]) and 't' (sub-batch shape [3]) do not broadcast "
      "together; the file is not what neml2-compile writes");
}

TEST_CASE("an output whose base shape is not what its forward graph makes") {
  // slip_systems' mean_hardening is an SR2 the forward segment after the solve averages
  // over the 12 systems: (B, 6), found at load by a call on zeros.
  edited_loading_fails_with(
      "slip_systems", "model",
      [](json& m) {
        for (auto& out : m["outputs"])
          if (out["name"] == "mean_hardening") {
            out["base_shape"] = {3};
            out["var_size"] = 3;
          }
      },
      "output 'mean_hardening' has base shape [3], but its graph makes [6] per row");
}

TEST_CASE("metadata.json with no segments") {
  edited_loading_fails_with(
      "elasticity", "elasticity", [](json& m) { m["segments"] = json::array(); },
      "field 'segments': empty; the file is not what neml2-compile 3.x "
      "writes: regenerate the artifact with neml2-compile");
}

TEST_CASE("an implicit segment without its Jacobian or solve graph") {
  edited_loading_fails_with(
      "scalar_backward_euler", "model", [](json& m) { m["segments"][0].erase("jacobian_package"); },
      "field 'segments[0].solve_package': a segment needs jacobian_package and solve_package "
      "(a direct solve) or matvec_package (a Krylov solve)");
}

TEST_CASE("every other implicit feature not run here is refused at load, by name") {
  // test_artifact.cpp checks the line search, the solver kind and substepping's bad roles.
  const std::vector<std::pair<std::function<void(json&)>, std::string>> refused = {
      {[](json& s) { s["matvec_package"] = "model_matvec.pt2"; },
       "field 'segments[0].solve_package': a matvec_package (a Krylov solve) under a direct "
       "solver_kind"},
      {[](json& s) { s["predictor_feedback"] = json::object(); },
       "uses an iterated predictor (predictor_feedback)"},
      {[](json& s) { s["unknown_group_infos"][0]["structure"] = "block_diagonal"; },
       "segments[0].unknown_group_infos[0] uses a 'block_diagonal' variable group"},
      {[](json& s) { s["input_sensitivity"]["kind"] = "iterative"; },
       "'iterative' is not a sensitivity solve neml2-dispatch knows (supported: direct, krylov)"},
      {[](json& s) { s.erase("solve_ift_package"); },
       "field 'segments[0].solve_ift_package': missing for a direct input sensitivity"},
  };
  for (const auto& [edit, part] : refused) {
    CAPTURE(part);
    edited_loading_fails_with(
        "scalar_backward_euler", "model", [&](json& m) { edit(m["segments"][0]); }, part);
  }
  edited_loading_fails_with(
      "scalar_backward_euler_params", "model",
      [](json& m) { m["segments"][0].erase("solve_param_package"); },
      "uses an iterative parameter sensitivity solve (no "
      "solve_param_package)");
}

TEST_CASE("block-structured groups that neml2-compile 3.1 does not write are refused at load") {
  edited_loading_fails_with(
      "grains", "model",
      [](json& m) { m["segments"][0]["unknown_group_infos"][0]["sub_batch_shape"] = {2}; },
      "segments[0].unknown_group_infos[0]: block group of sub-batch axes [2] holds 'hardening' "
      "with sub-batch axes [4]");
  edited_loading_fails_with(
      "grains", "model",
      [](json& m) {
        auto& s = m["segments"][0];
        s["jacobian_given_package"] = "model_seg0_jacobian.pt2";
        s["solve_ift_package"] = "model_seg0_solve.pt2";
        s["input_sensitivity"] = {{"kind", "direct"}};
      },
      "segments[0] has block-structured variable groups and a derivative graph "
      "(model_seg0_jacobian.pt2)");
}

TEST_CASE("a composed model whose names do not hold together") {
  edited_loading_fails_with(
      "scalar_backward_euler_params", "model",
      [](json& m) { m["segments"][0]["param_inputs"][0] = "scaling"; },
      "metadata.json: a segment takes parameter 'scaling', which is not declared under "
      "'parameters'");
  edited_loading_fails_with(
      "scalar_backward_euler", "model", [](json& m) { m["derivatives"][0][1] = "y"; },
      "metadata.json: derivatives pair [x, y] names something the model does not declare");
  // Found at the first call, not at load.
  const Scratch s;
  const auto root = s.copy_root("j2_radial_return", "model");
  edit_metadata(root, [](json& m) { m["segments"][2]["inputs"][0]["name"] = "flow_rat"; });
  const Session session(load_artifact(root), "cpu");
  fails_with([&] { return session.forward(test::zeros_inputs(session, 2)); },
             "graph 'model_seg2.pt2' needs 'flow_rat', which no model input or earlier segment "
             "provides");
}

// ------------------------------------------------------------------ loading: graph files

TEST_CASE("a graph file that is not a zip archive, or is cut short") {
  const ElasticityCopy copy;
  const auto original = test::read(copy.graph);
  std::string header(30, '\0'); // a zip local file header naming a 100-byte record
  header.replace(0, 4, "PK\x03\x04");
  header[26] = 100;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "(shorter than a zip header)"},
      {"hello, world: not an archive, but longer than a zip header\n", "(not a zip archive)"},
      {header, "(truncated zip header)"},
      {header.substr(0, 26) + std::string("\x01\x00\x00\x00x", 5),
       "(its records are not in one folder)"},
      {original.substr(0, original.size() / 2), "(no zip directory at its end: truncated)"},
  };
  for (const auto& [bytes, reason] : cases) {
    CAPTURE(reason);
    write_bytes(copy.graph, bytes);
    loading_fails_with(copy.root, "graph file '" + copy.graph.string() +
                                      "' is not a compiled graph neml2-dispatch can use " + reason);
  }
}

TEST_CASE("a graph file with a damaged record fails its CRC-32 check") {
  const ElasticityCopy copy;
  auto bytes = test::read(copy.graph);
  const auto at = bytes.find("check_input_0"); // in the stored wrapper source
  REQUIRE(at != std::string::npos);
  bytes[at] = 'C';
  write_bytes(copy.graph, bytes);
  loading_fails_with(copy.root, "elasticity.pt2' is not a compiled graph neml2-dispatch can use "
                                "(record 'elasticity/data/aotinductor/model/");
  loading_fails_with(copy.root, "wrapper.cpp' fails its CRC-32 check)");
}

TEST_CASE("a graph file that holds another graph") {
  const ElasticityCopy copy;
  fs::copy_file(copy.graph.parent_path() / "elasticity_jvp.pt2", copy.graph,
                fs::copy_options::overwrite_existing);
  loading_fails_with(copy.root, "elasticity.pt2' (metadata.json package) holds the graph "
                                "'elasticity_jvp', not 'elasticity': a file was copied or renamed "
                                "over another");
}

TEST_CASE("a graph package without a wrapper, or whose wrapper does not add up") {
  const ElasticityCopy copy;
  const auto original = copy.scratch.dir / "original.pt2";
  fs::copy_file(copy.graph, original);
  const auto forged = [&](const std::function<bool(const std::string&, std::string&)>& edit) {
    fs::copy_file(original, copy.graph, fs::copy_options::overwrite_existing);
    forge_package(copy.graph, edit);
  };
  SUBCASE("the forgery itself loads") {
    fs::copy_file(original, copy.graph, fs::copy_options::overwrite_existing);
    forge_package(copy.graph, [](const std::string&, std::string&) { return true; });
    CHECK_NOTHROW(Session(load_artifact(copy.root), "cpu"));
  }
  SUBCASE("no wrapper source") {
    forged([](const std::string& name, std::string&) { return !name.ends_with("wrapper.cpp"); });
    loading_fails_with(copy.root, "(it holds no generated wrapper source to check its signature "
                                  "against)");
  }
  SUBCASE("input counts that disagree") {
    forged(in_wrapper("AOTInductorModelBase(1,", "AOTInductorModelBase(2,"));
    loading_fails_with(copy.root, "(its wrapper declares 2 inputs but checks 1)");
  }
  SUBCASE("an empty batch range") {
    forged(in_wrapper("_size[0] > 1048576)", "_size[0] > 1)"));
    loading_fails_with(copy.root, "elasticity.pt2' (metadata.json package) does not match "
                                  "metadata.json: its batch range [2, 1] is empty");
  }
  SUBCASE("no compiled library: the loader's own error, its first lines") {
    forged([](const std::string& name, std::string&) { return !name.ends_with(".so"); });
    loading_fails_with(copy.root,
                       "loading '" + copy.graph.string() + "' for cpu: File not found: ");
  }
}

TEST_CASE("a graph that fails while it runs: its file, its device, the runtime's words") {
  // A wrapper source that claims one row is in range, while the compiled library (with the
  // runtime's input checks on) refuses fewer than two: the call reaches the graph unpadded.
  const ElasticityCopy copy;
  forge_package(copy.graph, in_wrapper("_size[0] < 2)", "_size[0] < 1)"));
  const char* before = std::getenv("AOTI_RUNTIME_CHECK_INPUTS");
  const std::optional<std::string> kept =
      before ? std::optional<std::string>(before) : std::nullopt;
  ::setenv("AOTI_RUNTIME_CHECK_INPUTS", "1", 1); // read once, at this graph's first call
  std::string message, details;
  try { // the load's probe call, of one row, already reaches the graph
    const Session session(load_artifact(copy.root), "cpu");
    static_cast<void>(session.forward({{"strain", at::zeros({1, 6}, at::kDouble)}}));
  } catch (const FatalError& e) {
    message = e.what();
    details = e.details();
    CHECK_FALSE(e.recoverable());
    print(message);
  }
  if (kept)
    ::setenv("AOTI_RUNTIME_CHECK_INPUTS", kept->c_str(), 1);
  else
    ::unsetenv("AOTI_RUNTIME_CHECK_INPUTS");
  // AOTI prints the reason ("input_handles[0]: dim value is too small at 0, expected it to
  // be >= 2") on stderr; its C entry point returns only that the call failed.
  CHECK_MESSAGE(contains(message, "running '" + copy.graph.string() + "' on cpu: "), message);
  CHECK_MESSAGE(contains(message, "the AOTI runtime's call failed"), message);
  CHECK_MESSAGE(!contains(message, "frame #"), message);
}

TEST_CASE("a graph that returns fewer results than its signature declares") {
  // Metadata and wrapper source both say two outputs; the compiled library returns one.
  const Scratch s;
  const auto root = s.copy_root("elasticity_forward", "elasticity");
  edit_metadata(root, [](json& m) {
    m["outputs"].push_back(m["outputs"][0]);
    m["outputs"][1]["name"] = "stress2";
    m["segments"][0]["outputs"].push_back({{"name", "stress2"}});
  });
  const auto file = root / "cpu" / "float64" / "elasticity.pt2";
  forge_package(file, [](const std::string& name, std::string& bytes) {
    if (name.ends_with("wrapper.cpp")) {
      static const std::regex counts(R"(AOTInductorModelBase\((\s*\d+,\s*)1,)");
      const auto edited = std::regex_replace(bytes, counts, "AOTInductorModelBase($012,",
                                             std::regex_constants::format_first_only);
      REQUIRE(edited != bytes);
      bytes = edited;
    }
    return true;
  });
  fails_with( // on the load's probe call
      [&] {
        const Session session(load_artifact(root), "cpu");
        return session.forward({{"strain", at::zeros({3, 6}, at::kDouble)}});
      },
      "elasticity.pt2' (metadata.json package) does not match metadata.json: it returned "
      "1 results, its signature says 2");
}

// ------------------------------------------------------------------ loading: devices

TEST_CASE("a bare accelerator family where torch has no such device") {
  if (device_count(DeviceFamily::xpu) > 0) {
    MESSAGE("skipped: this machine has an XPU device");
    return;
  }
  const Scratch s;
  const auto root = s.copy_root("elasticity", "elasticity");
  fs::copy(root / "cpu", root / "xpu", fs::copy_options::recursive);
  fails_with([&] { return Session(load_artifact(root), "xpu"); },
             "selecting the device: PyTorch is not linked with support for xpu devices");
}

// ------------------------------------------------------------------ policies

TEST_CASE("a policy that lists no devices") {
  fails_with(
      [] {
        return load_model(test::stub("elasticity", "elasticity"), "elasticity", ListsNothing{});
      },
      "the dispatch policy lists no devices; list at least one");
}

// ------------------------------------------------------------------ calls

TEST_CASE("a dispatcher binds the wrong number of positional inputs, or extras to forward") {
  const Session s(load_artifact(test::artifacts() / "elasticity" / "elasticity"), "cpu");
  const auto strain = at::zeros({2, 6}, at::kDouble);
  fails_with(
      [&] {
        return neml2::detail::CallProtocol::bind(s, Operation::forward,
                                                 std::vector<at::Tensor>{strain, strain}, {},
                                                 s.named_parameters(), {});
      },
      "2 input tensors given, but this model takes 1, in this order: strain");
  fails_with(
      [&] {
        return neml2::detail::CallProtocol::bind(s, Operation::forward,
                                                 TensorMap{{"strain", strain}},
                                                 {{"strain", strain}}, s.named_parameters(), {});
      },
      "extra tensors given to an operation that takes none");
}

TEST_CASE("a promoted parameter taken out of named_parameters()") {
  auto m = load_model(test::stub("elasticity_params", "elasticity"), "elasticity");
  const TensorMap in = {{"strain", at::zeros({3, 6}, at::kDouble)}};
  const auto kept = m.named_parameters().at("elasticity.E");
  m.named_parameters().erase("elasticity.E");
  fails_with([&] { return m.forward(in); },
             "promoted parameter 'elasticity.E' was removed from named_parameters(); put it back "
             "or use set_parameter()");
  m.named_parameters()["elasticity.E"] = kept;
  CHECK(m.forward(in).at("stress").sizes() == c10::IntArrayRef{3, 6});
}

TEST_CASE("results into the caller's tensors: an undefined tensor, a block too many") {
  const auto m = load_model(test::stub("elasticity", "elasticity"), "elasticity");
  const TensorMap in = {{"strain", at::zeros({7, 6}, at::kDouble)}};
  fails_with(
      [&] {
        m.forward_into(in, {{"stress", at::Tensor()}});
      },
      "output 'stress' is an undefined tensor; pass one of shape [7, 6]");
  const auto stress = at::empty({7, 6}, at::kDouble);
  const auto block = at::empty({7, 6, 6}, at::kDouble);
  fails_with(
      [&] {
        m.jacobian_into(in, {{"stress", stress}},
                        {{"stress", {{"strain", block}, {"strainn", block}}}});
      },
      "2 blocks given, but this call has 1: pass exactly the blocks the artifact has");
}

// ------------------------------------------------------------------ running

TEST_CASE("rows of an implicit model that do not converge, through a DispatchedModel") {
  const auto m = load_model(test::artifacts() / "scalar_backward_euler" / "model", "model",
                            SyncChunking{.batch_size = 2});
  auto in = test::zeros_inputs(m, 5); // x' = a - x^2 from x = 0.5, one step of 0.1
  in["x"].fill_(0.5);
  in["x~1"].fill_(0.5);
  in["t"].fill_(0.1);
  in["a"] = at::tensor({1.0, -50.0, 2.0, 0.5, 0.3}, at::kDouble);
  try {
    static_cast<void>(m.forward(in));
    FAIL("expected a ConvergenceError");
  } catch (const ConvergenceError& e) {
    print(e.what());
    CHECK(e.recoverable());
    CHECK(e.per_row());
    CHECK(e.failed_rows() == 1);
    CHECK_MESSAGE(contains(e.what(), "1 of 5 rows did not converge (worst residual norm "),
                  e.what());
    CHECK_MESSAGE(contains(e.what(), "cut the step where converged_mask() is false"), e.what());
    CHECK(e.outputs().at("x").sizes() == c10::IntArrayRef{5});
  }
}

// Library bugs found while writing docs/errors.md, fixed since: these left as
// std::filesystem_error and std::ios_base::failure, not as neml2::FatalError (files are read
// by src/core/bounded_files.cpp).
TEST_CASE("paths the file system cannot resolve or read are FatalErrors") {
  const Scratch s;
  const auto root = s.copy_root("elasticity", "elasticity");
  SUBCASE("a stub that is a symbolic link to itself") {
    fs::create_symlink(s.dir / "loop_aoti.i", s.dir / "loop_aoti.i");
    fails_with([&] { return load_model(s.dir / "loop_aoti.i", "elasticity"); }, "loop_aoti.i");
  }
  SUBCASE("a path with a name too long for the file system") {
    fails_with([&] { return load_model(s.dir / std::string(300, 'a'), "elasticity"); }, "aaaa");
  }
  SUBCASE("metadata.json that is a symbolic link to itself") {
    fs::remove(root / "metadata.json");
    fs::create_symlink(root / "metadata.json", root / "metadata.json");
    fails_with([&] { return load_model(root, "elasticity"); }, "metadata.json");
  }
  SUBCASE("metadata.json that opens but cannot be read") {
    fs::remove(root / "metadata.json");
    fs::create_symlink("/proc/self/mem", root / "metadata.json");
    fails_with([&] { return load_model(root, "elasticity"); }, "cannot read the metadata file");
  }
  SUBCASE("a device folder that is a symbolic link to itself") {
    fs::remove_all(root / "cpu");
    fs::create_symlink(root / "cpu", root / "cpu");
    fails_with([&] { return load_model(root, "elasticity"); }, "cpu");
  }
}

// The session: every operation against eager NEML2, parameters, and input validation.

#include <cstdlib>
#include <optional>
#include <thread>

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include "graph/graph.hpp" // the library's private parts
#include "model_checks.hpp"

using namespace neml2;
using test::contains;

namespace {

Session open(const std::string& artifact, const std::string& model,
             at::ScalarType dtype = at::kDouble) {
  const auto root = test::artifacts() / artifact / model;
  return Session(std::make_shared<const Artifact>(read_artifact(root)), "cpu", dtype);
}

} // namespace

TEST_CASE("elasticity: forward, jacobian and jvp match eager NEML2") {
  const auto s = open("elasticity", "elasticity");
  const test::Reference ref("elasticity");
  test::check_all_batches(s, ref, /*derivatives=*/true, /*parameters=*/false);
  // The stiffness does not depend on the batch: one unbatched block.
  const auto [out, J] = s.jacobian(ref.group("b7/in"));
  CHECK(J.at("stress").at("strain").sizes() == c10::IntArrayRef{6, 6});
}

TEST_CASE("three rates: eight inputs, unbatched ones broadcast") {
  const auto s = open("rates", "eq");
  const test::Reference ref("rates");
  CHECK(s.input_names() ==
        std::vector<std::string>{"a", "a~1", "t", "t~1", "b", "b~1", "c", "c~1"});
  test::check_all_batches(s, ref, true, false);
  test::check_forward(s, ref, "bcast");
  test::check_jacobian(s, ref, "bcast");
  test::check_jvp(s, ref, "bcast");
}

TEST_CASE("promoted parameters: values, derivatives, set_parameter, batched values") {
  auto s = open("elasticity_params", "elasticity");
  const test::Reference ref("elasticity_params");
  REQUIRE(s.named_parameters().size() == 2);
  CHECK(s.named_parameters().at("elasticity.E").item<double>() == 100.0);
  CHECK(s.parameter_base_shapes().at("elasticity.nu").empty());
  test::check_all_batches(s, ref, true, true);

  SUBCASE("set_parameter") {
    for (const auto& p : {"elasticity.E", "elasticity.nu"})
      s.set_parameter(p, ref[std::string("set/param/") + p]);
    test::check_forward(s, ref, "set");
  }
  SUBCASE("in-place changes through named_parameters() are seen by the next call") {
    for (const auto& p : {"elasticity.E", "elasticity.nu"})
      s.named_parameters().at(p).copy_(ref[std::string("set/param/") + p]);
    test::check_forward(s, ref, "set");
  }
  SUBCASE("a batched parameter: one value per row") {
    test::check_batched_parameter(s, ref);
    const auto message = test::fatal_message([&] { return s.forward(ref.group("b2/in")); });
    CHECK(contains(message, "batch sizes do not agree ('strain' has 2, 'elasticity.E' has 7)"));
  }
  SUBCASE("a name that is not a promoted parameter, added to named_parameters()") {
    s.named_parameters()["elasticity.G"] = at::ones({}, at::kDouble);
    CHECK(contains(test::fatal_message([&] { return s.forward(ref.group("b2/in")); }),
                   "named_parameters() has 'elasticity.G', which is not a promoted parameter"));
    s.named_parameters().erase("elasticity.G");
    test::check_forward(s, ref, "b2");
  }
  SUBCASE("bad set_parameter calls") {
    CHECK(contains(test::fatal_message([&] { s.set_parameter("E", at::ones({})); }),
                   "'E' is not a promoted parameter (promoted: elasticity.E, elasticity.nu)"));
    CHECK(contains(test::fatal_message([&] {
                     s.set_parameter("elasticity.E", at::ones({2, 3}));
                   }),
                   "'elasticity.E' takes shape () or batched (B, ); got [2, 3]"));
    test::check_forward(s, ref, "b7"); // still usable
  }
}

TEST_CASE("renamed boundaries: inputs, outputs and parameters by their public names") {
  auto s = open("elasticity_renamed", "elasticity");
  const test::Reference ref("elasticity");
  CHECK(s.input_names() == std::vector<std::string>{"eps"});
  CHECK(s.output_names() == std::vector<std::string>{"sig"});
  CHECK(s.named_parameters().count("youngs_modulus") == 1);
  const auto out = s.forward({{"eps", ref["b33/in/strain"]}});
  test::check_close(out.at("sig"), ref["b33/out/stress"], "stress as sig");
  const auto [values, J] = s.jacobian({{"eps", ref["b7/in/strain"]}});
  test::check_close(J.at("sig").at("eps"), ref["b7/jac/stress/strain"], "dsig/deps", 1e-10);
  // Doubling E doubles the stress of a linear elastic material.
  s.set_parameter("youngs_modulus", 2 * s.named_parameters().at("youngs_modulus"));
  test::check_close(s.forward({{"eps", ref["b7/in/strain"]}}).at("sig"), 2 * ref["b7/out/stress"],
                    "stress with 2E");
}

TEST_CASE("a float32 artifact runs in float32, or is refused if its graphs are not") {
  const auto root = test::artifacts() / "elasticity_float32" / "elasticity";
  const auto artifact = std::make_shared<const Artifact>(read_artifact(root));
  const test::Reference ref("elasticity");
  try {
    const Session s(artifact, "cpu", at::kFloat);
    const auto out = s.forward({{"strain", ref["b33/in/strain"].to(at::kFloat)}});
    CHECK((out.at("stress").scalar_type() == at::kFloat));
    test::check_close(out.at("stress"), ref["b33/out/stress"], "float32 stress", 1e-5);
  } catch (const FatalError& e) {
    // neml2-compile 3.1 writes float64 graphs into cpu/float32/: never run them on
    // float32 data.
    const std::string message = e.what();
    CHECK_MESSAGE(contains(message, "takes float64 inputs, but it sits in a float32 folder"),
                  message);
  }
}

TEST_CASE("batch 0 gives empty results of the right shapes; no batch axis gives none") {
  test::check_empty_batch(open("elasticity", "elasticity"), true);
  test::check_empty_batch(open("rates", "eq"), true);

  const auto s = open("elasticity", "elasticity");
  const test::Reference ref("elasticity");
  const auto out = s.forward({{"strain", ref["b1/in/strain"][0]}});
  CHECK(out.at("stress").sizes() == c10::IntArrayRef{6});
  test::check_close(out.at("stress"), ref["b1/out/stress"][0], "unbatched stress");

  const auto p = open("elasticity_params", "elasticity");
  const auto grads = p.param_vjp(test::zeros_inputs(p, 0), {});
  CHECK(grads.at("elasticity.E").sizes() == c10::IntArrayRef{});
  CHECK(grads.at("elasticity.E").item<double>() == 0.0);
}

TEST_CASE("inputs are checked before any graph runs, and the session stays usable") {
  const auto s = open("rates", "eq");
  const test::Reference ref("rates");
  auto good = ref.group("b7/in");
  const auto fails_with = [&](TensorMap inputs, const std::string& part) {
    const auto message = test::fatal_message([&] { return s.forward(inputs); });
    CHECK_MESSAGE(contains(message, part), message);
  };

  auto missing = good;
  missing.erase("t~1");
  fails_with(missing, "missing input 't~1'");
  fails_with(missing, "this model takes: a, a~1, t, t~1, b, b~1, c, c~1");

  auto unknown = good;
  unknown["d"] = good["a"];
  fails_with(unknown, "unknown input 'd'");

  auto wrong_dtype = good;
  wrong_dtype["b"] = good["b"].to(at::kFloat);
  fails_with(wrong_dtype, "input 'b' has dtype Float, but the artifact");
  fails_with(wrong_dtype, "runs Double");

  auto wrong_shape = good;
  wrong_shape["c"] = at::zeros({7, 2}, at::kDouble);
  fails_with(wrong_shape, "input 'c' has shape [7, 2]; expected (B, ) or ()");

  auto two_batch_axes = good;
  two_batch_axes["c"] = at::zeros({7, 2, 3}, at::kDouble);
  fails_with(two_batch_axes, "one leading batch axis");

  auto disagreeing = good;
  disagreeing["a"] = at::ones({5}, at::kDouble);
  fails_with(disagreeing, "batch sizes do not agree");
  fails_with(disagreeing, "'a' has 5");

  auto elsewhere = good;
  elsewhere["a"] = at::ones({7}, at::TensorOptions().dtype(at::kDouble).device(at::kMeta));
  fails_with(elsewhere, "input 'a' is on meta, a device that holds no data");

  auto undefined = good;
  undefined["a"] = at::Tensor();
  fails_with(undefined, "input 'a' is an undefined tensor");

  // Leading size 1 broadcasts like no batch axis.
  auto unit = good;
  unit["t"] = good["t"].narrow(0, 0, 1);
  const auto out = s.forward(unit);
  CHECK(out.at("a_rate").sizes() == c10::IntArrayRef{7});

  test::check_forward(s, ref, "b7");
}

TEST_CASE("tangents and cotangents are checked too") {
  const auto s = open("elasticity_params", "elasticity");
  const test::Reference ref("elasticity_params");
  const auto inputs = ref.group("b7/in");
  CHECK(contains(test::fatal_message([&] {
                   return s.jvp(inputs, {{"stress", inputs.at("strain")}});
                 }),
                 "unknown tangent (tangents are keyed by input) 'stress'"));
  CHECK(contains(test::fatal_message([&] {
                   return s.jvp(inputs, {{"strain", at::ones({3, 6}, at::kDouble)}});
                 }),
                 "batch sizes do not agree"));
  CHECK(contains(
      test::fatal_message([&] {
        return s.param_vjp(inputs, {{"strain", inputs.at("strain")}});
      }),
      "cotangent 'strain' is not an output the param_vjp graph was compiled for (stress)"));
  // A missing tangent or cotangent counts as zero.
  const auto [out, tangent_out] = s.jvp(inputs, {});
  CHECK(tangent_out.at("stress").abs().max().item<double>() == 0.0);
  for (const auto& [name, grad] : s.param_vjp(inputs, {}))
    CHECK_MESSAGE(grad.abs().max().item<double>() == 0.0, name);
}

TEST_CASE("operations without their graphs say how to compile them") {
  const auto s = open("elasticity_forward", "elasticity");
  const test::Reference ref("elasticity");
  const auto inputs = ref.group("b2/in");
  const auto jac = test::fatal_message([&] { return s.jacobian(inputs); });
  CHECK(contains(jac, "jacobian(): artifact"));
  CHECK(contains(jac, "-d OUT:IN"));
  CHECK(contains(test::fatal_message([&] { return s.jvp(inputs, {}); }), "jvp(): artifact"));
  CHECK(contains(test::fatal_message([&] { return s.param_jacobian(inputs); }),
                 "-p PARAM -d OUT:PARAM"));
  CHECK(contains(test::fatal_message([&] { return s.param_vjp(inputs, {}); }),
                 "param_vjp(): artifact"));
  test::check_forward(s, ref, "b2");
}

TEST_CASE("a model that calls the custom operator neml2::opaque_pow") {
  // Without the operator registered, such a graph fails with "Could not find schema for
  // neml2::opaque_pow".
  const auto s = open("perzyna", "perzyna");
  test::check_all_batches(s, test::Reference("perzyna"), true, false);
}

TEST_CASE("sessions constructed from several threads at once all work") {
  const auto artifact = std::make_shared<const Artifact>(
      read_artifact(test::artifacts() / "elasticity_params" / "elasticity"));
  std::vector<std::optional<Session>> sessions(4);
  std::vector<std::thread> threads;
  for (auto& s : sessions)
    threads.emplace_back([&] { s.emplace(artifact, "cpu"); });
  for (auto& t : threads)
    t.join();
  const test::Reference ref("elasticity_params");
  for (const auto& s : sessions)
    test::check_all_batches(*s, ref, true, true);
}

TEST_CASE("an error torch raises mid-call is a FatalError that keeps torch's message") {
  auto s = open("elasticity_params", "elasticity");
  const test::Reference ref("elasticity_params");
  // A sparse parameter passes every check of its shape, dtype and device; torch refuses
  // to lay it out for the graph.
  s.named_parameters().at("elasticity.E") = at::full({1}, 100.0, at::kDouble).to_sparse();
  const auto message = test::fatal_message([&] { return s.forward(ref.group("b7/in")); });
  CHECK(contains(message, "neml2::Session: "));
  CHECK_MESSAGE(contains(message, "parse"), message);
  // torch's C++ backtrace is not in the message, but kept on the exception.
  try {
    static_cast<void>(s.forward(ref.group("b7/in")));
  } catch (const FatalError& e) {
    const std::string what = e.what();
    CHECK_MESSAGE(!contains(what, "frame #"), what);
    CHECK_MESSAGE(!contains(what, "Exception raised from"), what);
    CHECK(what.size() < 1000);
    CHECK(contains(e.details(), "parse"));
    CHECK(e.details().size() >= what.size() - std::string("neml2::Session: ").size());
  }
  s.set_parameter("elasticity.E", at::full({}, 100.0, at::kDouble));
  test::check_forward(s, ref, "b7"); // usable again
}

TEST_CASE("calls outside the graphs' exported batch range: padded below, split above") {
  // neml2-compile exports graphs for 2 to 2^20 rows. Under AOTI_RUNTIME_CHECK_INPUTS=1
  // (the ctest variants *_checked_inputs) the runtime refuses any other count.
  const auto s = open("elasticity", "elasticity");
  const test::Reference ref("elasticity");
  test::check_forward(s, ref, "b1");
  const auto [out, J] = s.jacobian(ref.group("b1/in"));
  const auto stiffness = J.at("stress").at("strain"); // (6, 6), batch-independent
  const auto rows = (std::int64_t(1) << 20) + 3;
  const auto strain = at::rand({rows, 6}, at::kDouble);
  const auto stress = s.forward({{"strain", strain}}).at("stress");
  CHECK(stress.sizes() == c10::IntArrayRef{rows, 6});
  test::check_close(stress, at::matmul(strain, stiffness.t()), "2^20 + 3 rows", 1e-12);
  // The rows of the last piece (3, padded to 2^20's minimum) are the right ones.
  test::check_close(stress.narrow(0, rows - 3, 3),
                    at::matmul(strain.narrow(0, rows - 3, 3), stiffness.t()), "last rows", 1e-12);
}

TEST_CASE("the AOTI runtime's input checks refuse one row; the session pads it") {
  if (!std::getenv("AOTI_RUNTIME_CHECK_INPUTS"))
    return; // meaningful only in the *_checked_inputs variants
  const auto file =
      test::artifacts() / "elasticity" / "elasticity" / "cpu" / "float64" / "elasticity.pt2";
  torch::inductor::AOTIModelPackageLoader raw(file.string());
  CHECK_THROWS(static_cast<void>(raw.run({at::zeros({1, 6}, at::kDouble)})));
  CHECK_NOTHROW(static_cast<void>(raw.run({at::zeros({2, 6}, at::kDouble)})));
  const auto s = open("elasticity", "elasticity");
  CHECK(s.forward({{"strain", at::zeros({1, 6}, at::kDouble)}}).at("stress").size(0) == 1);
}

TEST_CASE("a graph exported for two rows or more runs one unpadded where it gives that row the "
          "same bits; under the runtime's input checks it stays padded") {
  const auto root = resolve_artifact_root(test::stub("perzyna", "perzyna"), "perzyna");
  const auto artifact = read_artifact(root);
  const auto& segment = std::get<ForwardSegment>(artifact.segments.front());
  neml2::detail::Graph graph(artifact.leaf(Device("cpu"), at::kDouble), segment.package, c10::kCPU,
                             at::kDouble, 1, "package");
  graph.expect({}, neml2::detail::unchecked_results);
  graph.probe_one_row(at::kDouble);
  CHECK(graph.runs_one_row() == (std::getenv("AOTI_RUNTIME_CHECK_INPUTS") == nullptr));
  // Either way, one row's results are those it has among two (the padding's or its own).
  const auto& inputs = graph.signature().inputs;
  std::vector<at::Tensor> two, one;
  for (const auto& in : inputs) {
    auto sizes = in.sizes;
    for (auto& d : sizes)
      d = d < 0 ? 2 : d;
    two.push_back(at::rand(sizes, at::kDouble));
    one.push_back(in.batched() ? two.back().narrow(0, 1, 1).contiguous() : two.back());
  }
  const auto from_two = graph.run(two), from_one = graph.run(one);
  REQUIRE(from_two.size() == from_one.size());
  for (std::size_t r = 0; r < from_two.size(); ++r)
    if (from_two[r].dim() > 0 && from_two[r].size(0) == 2)
      CHECK(at::equal(from_one[r], from_two[r].narrow(0, 1, 1)));
}

// Artifacts compiled for a fixed batch ([Settings] dynamic_batch = false, example batch 2):
// any batch in chunks of 2 when rows are interchangeable; only batches of 2 when a per-row
// tensor is baked into the graphs.
// The per-row model also loads through its stub, which repeats its [Tensors] section (a
// triple-quoted multi-line expr) and its [Settings].

#include "internals.hpp" // the library's private parts
#include "model_checks.hpp"
#include "scratch.hpp"

using namespace neml2;
using test::contains;

namespace {

std::filesystem::path root(const std::string& artifact) {
  return test::artifacts() / artifact / "elasticity";
}

Session session(const std::string& artifact) {
  return {std::make_shared<const Artifact>(read_artifact(root(artifact))), "cpu"};
}

neml2::detail::Graph value_graph(const std::string& artifact) {
  neml2::detail::Graph g(root(artifact) / "cpu" / "float64", "elasticity.pt2", c10::kCPU,
                         at::kDouble, 1, "package");
  g.expect({Shape{-1, 6}}, 1);
  return g;
}

} // namespace

TEST_CASE("what a fixed-batch artifact says: a leading size of 2, not a range") {
  for (const auto* name : {"elasticity_fixed_batch", "elasticity_static_batch"}) {
    CAPTURE(name);
    const auto signature =
        neml2::detail::read_graph_signature(root(name) / "cpu" / "float64" / "elasticity.pt2");
    REQUIRE(signature.inputs.size() == 1);
    CHECK(signature.inputs[0].sizes == std::vector<std::int64_t>{2, 6});
    CHECK_FALSE(signature.inputs[0].batched());
    // metadata.json says nothing of it (nor of the baked tensor).
    CHECK(test::read(root(name) / "metadata.json").find("dynamic") == std::string::npos);
    const auto g = value_graph(name);
    CHECK(g.fixed_rows() == 2);
  }
  // The probe of one row repeated: the per-row modulus makes the two rows differ.
  CHECK(value_graph("elasticity_fixed_batch").rows_differ());
  CHECK_FALSE(value_graph("elasticity_static_batch").rows_differ());
}

TEST_CASE("nothing per row: batches 1, 2, 3 and 1000 in chunks of 2, against eager NEML2") {
  const auto s = session("elasticity_static_batch");
  const test::Reference ref("elasticity_static_batch");
  for (const auto* c : {"b1", "b2", "b3", "b1000"})
    test::check_forward(s, ref, c);
  // Jacobians too, against the same model compiled with a dynamic batch.
  const auto dynamic = Session(std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(
                                   test::stub("elasticity", "elasticity"), "elasticity"))),
                               "cpu");
  const auto inputs = ref.group("b3/in");
  const auto [out, J] = s.jacobian(inputs);
  const auto [expected_out, expected_J] = dynamic.jacobian(inputs);
  test::check_close(J.at("stress").at("strain"),
                    expected_J.at("stress").at("strain").expand({3, 6, 6}), "dstress/dstrain");
  // Through a dispatcher whose chunks are not multiples of 2.
  const auto m = load_model(root("elasticity_static_batch"), "elasticity",
                            SyncChunking{.device = "cpu", .batch_size = 7});
  test::check_forward(m, ref, "b1000");
}

TEST_CASE("a per-row tensor baked in: batches of 2 match eager NEML2, others are refused") {
  const auto s = session("elasticity_fixed_batch");
  const test::Reference ref("elasticity_fixed_batch");
  test::check_forward(s, ref, "b2");
  const auto strain = ref["b2/in/strain"];
  for (std::int64_t rows : {1, 3, 1000}) {
    CAPTURE(rows);
    const auto message = test::fatal_message([&] {
      static_cast<void>(s.forward({{"strain", strain.narrow(0, 0, 1).expand({rows, 6})}}));
    });
    CHECK(contains(message, "was compiled for exactly 2 rows"));
    CHECK(contains(message, "a call of " + std::to_string(rows) + " rows has no meaning"));
    CHECK(contains(message, "[Tensors]"));
  }
  // Batch 0 never reaches a graph.
  CHECK(s.forward({{"strain", at::zeros({0, 6}, at::kDouble)}}).at("stress").size(0) == 0);
  // The stub neml2-compile wrote ([Tensors] with a triple-quoted expr, [Settings]) loads,
  // its one model found without a name, to the same results.
  const auto from_stub = load_model(test::stub("elasticity_fixed_batch", "elasticity"));
  test::check_close(from_stub.forward({{"strain", strain}}).at("stress"), ref["b2/out/stress"],
                    "stress through the stub");
}

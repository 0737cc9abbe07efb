// DispatchedModel<SyncChunking>: every operation, chunked every way, against eager NEML2.

#include <limits>
#include <thread>

#include "graph/graph_calls.hpp" // the library's private parts
#include "model_checks.hpp"

using namespace neml2;
using test::contains;
using test::load;

TEST_CASE("every chunk size gives the eager numbers: 1, 3, the batch and 0") {
  for (std::int64_t rows : {1, 3, 7, 33, 0}) {
    CAPTURE(rows);
    const SyncChunking policy{.device = "cpu", .batch_size = rows};
    test::check_all_batches(load("elasticity", "elasticity", policy), test::Reference("elasticity"),
                            true, false);
    const auto rates = load("rates", "eq", policy);
    const test::Reference rates_ref("rates");
    test::check_all_batches(rates, rates_ref, true, false);
    test::check_forward(rates, rates_ref, "bcast");
    test::check_jvp(rates, rates_ref, "bcast");
    test::check_jacobian(rates, rates_ref, "bcast");
    test::check_all_batches(load("elasticity_params", "elasticity", policy),
                            test::Reference("elasticity_params"), true, true);
    test::check_empty_batch(rates, true);
  }
}

TEST_CASE("sub-batch axes ride along with each row") {
  const test::Reference ref("elasticity_subbatch");
  for (std::int64_t rows : {1, 3, 0}) {
    CAPTURE(rows);
    const auto m = load("elasticity_subbatch", "elasticity", SyncChunking{.batch_size = rows});
    test::check_all_batches(m, ref, true, false);
    CHECK(m.forward(ref.group("b7/in")).at("stress").sizes() == c10::IntArrayRef{7, 3, 6});
  }
}

TEST_CASE("batched parameters are cut with the batch; param_vjp sums or keeps rows") {
  const test::Reference ref("elasticity_params");
  auto m = load("elasticity_params", "elasticity", SyncChunking{.batch_size = 3});
  test::check_batched_parameter(m, ref);
}

TEST_CASE("load_model: stub or artifact root, default whole batch on cpu") {
  const test::Reference ref("elasticity");
  const auto by_stub = load_model(test::stub("elasticity", "elasticity"), "elasticity");
  CHECK(by_stub.policy().batch_size == 0);
  CHECK(by_stub.device() == Device("cpu"));
  test::check_forward(by_stub, ref, "b33");
  const auto by_root = load_model(test::artifacts() / "elasticity" / "elasticity", "elasticity",
                                  SyncChunking{.batch_size = 4});
  test::check_forward(by_root, ref, "b33");
  CHECK(by_root.input_names() == std::vector<std::string>{"strain"});
  CHECK(by_root.output_base_shapes() == std::vector<Shape>{{6}});
  CHECK((by_root.dtype() == at::kDouble));
}

TEST_CASE("results come back on the input device, shaped like the inputs") {
  const auto m = load("elasticity", "elasticity", SyncChunking{.batch_size = 2});
  const test::Reference ref("elasticity");
  // Non-contiguous batched input: a transposed view.
  const auto strain = ref["b7/in/strain"].t().contiguous().t();
  REQUIRE_FALSE(strain.is_contiguous());
  test::check_close(m.forward({{"strain", strain}}).at("stress"), ref["b7/out/stress"],
                    "non-contiguous input");
  // No batch axis in, none out.
  const auto out = m.forward({{"strain", ref["b1/in/strain"][0]}});
  CHECK(out.at("stress").sizes() == c10::IntArrayRef{6});
}

TEST_CASE("a policy's bad fields are errors that name the field") {
  CHECK(contains(test::fatal_message([] {
                   return load("elasticity", "elasticity", SyncChunking{.batch_size = -2});
                 }),
                 "SyncChunking.batch_size is -2; it must be >= 0"));
  CHECK(contains(test::fatal_message([] { return SyncChunking{.device = "gpu"}; }),
                 "unknown device family 'gpu'"));
  // No CUDA graphs in a cpu-only artifact: say how to make them.
  CHECK(contains(test::fatal_message([] {
                   return load("elasticity", "elasticity", SyncChunking{.device = "cuda:0"});
                 }),
                 "--device cuda"));
}

namespace {
// A user-written policy: halves of the batch, wherever the batch is.
struct Halves {
  using dispatch_mode = synchronous;
  std::array<Device, 1> devices() const { return {"cpu"}; }
  Device compute_device() const { return "cpu"; }
  std::int64_t chunk_rows(std::int64_t batch) const { return (batch + 1) / 2; }
};

struct NegativeRows : Halves {
  std::int64_t chunk_rows(std::int64_t) const { return -1; }
};
} // namespace

TEST_CASE("a user-written policy is honoured") {
  const test::Reference ref("rates");
  test::check_all_batches(load("rates", "eq", Halves{}), ref, true, false);
  const auto bad = load("rates", "eq", NegativeRows{});
  CHECK(contains(test::fatal_message([&] { return bad.forward(ref.group("b2/in")); }),
                 "chunk_rows() must return >= 0"));
}

TEST_CASE("an error mid-call leaves the model usable") {
  const test::Reference ref("elasticity");
  const auto m = load("elasticity", "elasticity", SyncChunking{.batch_size = 3});
  CHECK_THROWS_AS((void)m.forward({{"strain", at::ones({4, 5}, at::kDouble)}}), FatalError);
  test::check_forward(m, ref, "b7");
}

TEST_CASE("one model called from several threads at once") {
  const test::Reference ref("rates");
  const auto m = load("rates", "eq", SyncChunking{.batch_size = 3});
  std::vector<TensorMap> results(4);
  std::vector<std::thread> threads;
  for (auto& r : results)
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i)
        r = m.forward(ref.group("b33/in"));
    });
  for (auto& t : threads)
    t.join();
  for (const auto& r : results)
    test::check_close(r, ref.group("b33/out"), "concurrent forward");
}

TEST_CASE("a whole batch on the CPU runs in pieces of an eighth of it, at most cache-sized, "
          "with the same numbers") {
  const auto whole = load("elasticity", "elasticity", SyncChunking{.cpu_lanes = 1});
  // An eighth is 25000 rows; at most 16384 (96 bytes a row, 2 MiB a piece).
  const std::int64_t batch = 200000;
  const TensorMap in = {{"strain", 1e-3 * at::rand({batch, 6}, at::kDouble)}};
  std::vector<std::int64_t> rows;
  neml2::detail::observe_graph_calls(
      [&](const std::string&, std::int64_t n) { rows.push_back(n); });
  const auto out = whole.forward(in).at("stress");
  auto into = at::full({batch, 6}, std::numeric_limits<double>::quiet_NaN(), at::kDouble);
  whole.forward_into(in, {{"stress", into}});
  neml2::detail::observe_graph_calls({});
  auto pieces = std::vector<std::int64_t>(12, 16384);
  pieces.push_back(3392);
  const auto once = pieces;
  pieces.insert(pieces.end(), once.begin(), once.end()); // forward, then forward_into
  CHECK(rows == pieces);
  const Session session(std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(
                            test::stub("elasticity", "elasticity"), "elasticity"))),
                        "cpu");
  const auto expected = session.forward(in).at("stress"); // one graph call on every row
  CHECK(at::equal(out, expected));
  CHECK(at::equal(into, expected));
  // 40000 rows: an eighth, 5000, down to a power of two, is below the least piece, 8192.
  rows.clear();
  neml2::detail::observe_graph_calls(
      [&](const std::string&, std::int64_t n) { rows.push_back(n); });
  const auto part = TensorMap{{"strain", in.at("strain").narrow(0, 0, 40000)}};
  CHECK(at::equal(whole.forward(part).at("stress"), expected.narrow(0, 0, 40000)));
  pieces.assign(4, 8192);
  pieces.push_back(7232);
  CHECK(rows == pieces);
  // One piece (8192 rows at least): the graph's own result, handed over.
  rows.clear();
  (void)whole.forward({{"strain", in.at("strain").narrow(0, 0, 8192)}});
  neml2::detail::observe_graph_calls({});
  CHECK(rows == std::vector<std::int64_t>{8192});
}

TEST_CASE("forward() straight through the graph only when the call needs nothing more") {
  // A whole small batch of dense inputs goes to the value graph as given; everything else
  // takes the bound path. Each case below fails if the direct path took it.
  std::vector<std::int64_t> rows;
  const auto graph_calls = [&](auto&& call) {
    rows.clear();
    neml2::detail::observe_graph_calls(
        [&](const std::string&, std::int64_t n) { rows.push_back(n); });
    call();
    neml2::detail::observe_graph_calls({});
    return rows;
  };
  const auto strain = 1e-3 * at::rand({10, 6}, at::kDouble);
  const Session session(std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(
                            test::stub("elasticity", "elasticity"), "elasticity"))),
                        "cpu");
  const auto expected = session.forward({{"strain", strain}}).at("stress");

  SUBCASE("the policy's chunks are kept") {
    const auto chunked =
        load("elasticity", "elasticity", SyncChunking{.batch_size = 4, .cpu_lanes = 1});
    TensorMap out;
    CHECK(graph_calls([&] {
            out = chunked.forward({{"strain", strain}});
          }) == std::vector<std::int64_t>{4, 4, 2});
    CHECK(at::equal(out.at("stress"), expected));
    std::vector<at::Tensor> prepared;
    CHECK(graph_calls([&] { prepared = chunked.prepare().forward({{strain}}); }) ==
          std::vector<std::int64_t>{4, 4, 2});
    CHECK(at::equal(prepared.at(0), expected));
  }
  SUBCASE("a whole batch: one call, the same numbers") {
    const auto whole = load("elasticity", "elasticity");
    TensorMap out;
    CHECK(graph_calls([&] {
            out = whole.forward({{"strain", strain}});
          }) == std::vector<std::int64_t>{10});
    CHECK(at::equal(out.at("stress"), expected));
    CHECK(at::equal(whole.prepare().forward({{strain}}).at(0), expected));
    CHECK(at::equal(whole.forward({{"strain", strain.narrow(0, 0, 1)}}).at("stress"),
                    expected.narrow(0, 0, 1)));
  }
  SUBCASE("no batch axis: none in the result") {
    const auto whole = load("elasticity", "elasticity");
    const auto out = whole.forward({{"strain", strain[3]}}).at("stress");
    CHECK(out.sizes() == c10::IntArrayRef{6});
    CHECK(at::equal(out, expected[3]));
  }
  SUBCASE("a strided input, and one of another dtype") {
    const auto whole = load("elasticity", "elasticity");
    const auto strided = strain.t().contiguous().t();
    CHECK(at::equal(whole.forward({{"strain", strided}}).at("stress"), expected));
    CHECK(contains(test::fatal_message([&] {
                     return whole.forward({{"strain", strain.to(at::kFloat)}});
                   }),
                   "'strain' has dtype Float"));
  }
  SUBCASE("named_parameters() is still checked") {
    auto whole = load("elasticity", "elasticity");
    whole.named_parameters()["elasticity.G"] = at::ones({}, at::kDouble);
    CHECK(contains(test::fatal_message([&] {
                     return whole.forward({{"strain", strain}});
                   }),
                   "named_parameters() has 'elasticity.G', which is not a promoted parameter"));
    CHECK(contains(test::fatal_message([&] { return whole.prepare().forward({{strain}}); }),
                   "named_parameters() has 'elasticity.G'"));
  }
  SUBCASE("names are still checked") {
    const auto whole = load("elasticity", "elasticity");
    CHECK(contains(test::fatal_message([&] {
                     return whole.forward({{"strian", strain}});
                   }),
                   "unknown input 'strian'"));
    CHECK(contains(test::fatal_message([&] {
                     return whole.forward({{"strain", strain}, {"extra", strain}});
                   }),
                   "unknown input 'extra'"));
    CHECK(
        contains(test::fatal_message([&] { return whole.forward({}); }), "missing input 'strain'"));
  }
}

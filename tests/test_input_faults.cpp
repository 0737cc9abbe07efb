// Inputs as a host may pass them: each one correct or a clear FatalError, and the model
// usable afterwards. One body, run on the session, on SyncChunking and on the pool.

#include <cmath>
#include <cstring>
#include <limits>

#include "model_checks.hpp"

using namespace neml2;
using test::contains;
namespace fs = std::filesystem;

namespace {

const fs::path elasticity_stub = test::stub("elasticity", "elasticity");

// Elasticity is linear: stress = strain . C^T, with C the model's (batch-independent)
// stiffness, the reference every row is checked against.
at::Tensor stiffness() {
  static const auto C = [] {
    const Session s(std::make_shared<const Artifact>(
                        read_artifact(test::artifacts() / "elasticity" / "elasticity")),
                    "cpu");
    return s.jacobian({{"strain", at::zeros({2, 6}, at::kDouble)}})
        .second.at("stress")
        .at("strain");
  }();
  return C;
}

at::Tensor expected_stress(const at::Tensor& strain) {
  return at::matmul(strain.to(at::kDouble).contiguous(), stiffness().t());
}

// Rows 0..n-1 of a strain history with distinct values in every entry.
at::Tensor strains(std::int64_t rows) {
  return at::arange(rows * 6, at::kDouble).reshape({rows, 6}).mul(1e-4).sin();
}

template <class Model>
void check_input_faults(const Model& m) {
  const auto forward = [&](const at::Tensor& strain) {
    return m.forward({{"strain", strain}}).at("stress");
  };
  const auto fails_with = [&](const TensorMap& inputs, const std::string& part) {
    const auto message = test::fatal_message([&] { return m.forward(inputs); });
    CHECK_MESSAGE(contains(message, part), message);
  };

  SUBCASE("lazy views are read as their values: negated, the imaginary part of a conjugate, "
          "a zero tensor without memory") {
    const auto strain = strains(7);
    const auto negated = at::_neg_view(strain);
    REQUIRE(negated.is_neg());
    test::check_close(forward(negated), expected_stress(-strain), "negated view");
    const auto imag_of_conj = at::imag(at::conj(at::complex(strain.flip(0), strain)));
    REQUIRE(imag_of_conj.is_neg());
    test::check_close(forward(imag_of_conj), expected_stress(-strain), "imag of a conjugate");
    const auto zero = at::_efficientzerotensor({7, 6}, at::kDouble);
    REQUIRE(zero._is_zerotensor());
    CHECK(at::equal(forward(zero), at::zeros({7, 6}, at::kDouble)));
  }

  SUBCASE("NaN and Inf pass through row by row") {
    auto strain = strains(9);
    strain[2][1] = std::numeric_limits<double>::quiet_NaN();
    strain[5][0] = std::numeric_limits<double>::infinity();
    strain[6][3] = -std::numeric_limits<double>::infinity();
    const auto stress = forward(strain);
    const auto bad = at::tensor({2, 5, 6}, at::kLong);
    // Every damaged row carries its NaN or Inf on; the others are exact.
    const bool damaged_rows_finite =
        at::isfinite(stress.index_select(0, bad)).all(1).any().template item<bool>();
    CHECK_FALSE(damaged_rows_finite);
    for (std::int64_t r : {0, 1, 3, 4, 7, 8})
      test::check_close(stress[r], expected_stress(strain[r].unsqueeze(0))[0],
                        "row " + std::to_string(r), 1e-13);
  }
  SUBCASE("batch 0 and batch 1") {
    CHECK(forward(at::zeros({0, 6}, at::kDouble)).sizes() == c10::IntArrayRef{0, 6});
    const auto one = strains(1);
    test::check_close(forward(one), expected_stress(one), "batch 1", 1e-13);
    test::check_close(forward(one[0]), expected_stress(one)[0], "no batch axis", 1e-13);
  }
  SUBCASE("non-contiguous, strided, offset, broadcast-expanded and misaligned inputs") {
    const auto base = strains(40);
    const auto transposed = base.t().contiguous().t(); // column-major (40, 6)
    test::check_close(forward(transposed), expected_stress(base), "column-major", 1e-13);
    const auto every_third = base.slice(0, 1, 40, 3);
    test::check_close(forward(every_third), expected_stress(every_third), "stride 3", 1e-13);
    const auto offset = base.narrow(0, 7, 11);
    test::check_close(forward(offset), expected_stress(offset), "storage offset", 1e-13);
    const auto expanded = base[3].unsqueeze(0).expand({17, 6}); // stride 0
    test::check_close(forward(expanded), expected_stress(expanded), "expanded", 1e-13);
    const auto columns =
        at::arange(12 * 40, at::kDouble).reshape({40, 12}).mul(1e-3).slice(1, 0, 12, 2);
    test::check_close(forward(columns), expected_stress(columns), "every other column", 1e-13);
    // Doubles 4 bytes off their alignment.
    std::vector<char> bytes(40 * 6 * sizeof(double) + 4);
    std::memcpy(bytes.data() + 4, base.data_ptr<double>(), 40 * 6 * sizeof(double));
    const auto misaligned = at::from_blob(bytes.data() + 4, {40, 6}, at::kDouble);
    REQUIRE(reinterpret_cast<std::uintptr_t>(misaligned.data_ptr()) % alignof(double) != 0);
    test::check_close(forward(misaligned), expected_stress(base), "misaligned", 1e-13);
    const auto tracked = base.clone().requires_grad_(true);
    test::check_close(forward(tracked).detach(), expected_stress(base), "requires_grad", 1e-13);
  }
  SUBCASE("refused before any graph runs") {
    const auto good = strains(8);
    fails_with({{"strain", good.to(at::kFloat)}}, "input 'strain' has dtype Float");
    fails_with({{"strain", good.to(at::kLong)}}, "input 'strain' has dtype Long");
    fails_with({{"strain", good.to(at::kBool)}}, "input 'strain' has dtype Bool");
    fails_with(
        {{"strain", at::zeros({8, 6}, at::TensorOptions().dtype(at::kDouble).device(at::kMeta))}},
        "input 'strain' is on meta");
    fails_with({{"strain", good.reshape({2, 4, 6})}}, "one leading batch axis");
    fails_with({{"strain", good.narrow(1, 0, 3)}}, "has shape [8, 3]");
    fails_with({{"strain", good}, {"stress", good}}, "unknown input 'stress'");
    fails_with({}, "missing input 'strain'");
    fails_with({{"strain", at::Tensor()}}, "undefined tensor");
  }
  // After every refusal or odd input above, the model still gives exact results.
  const auto after = strains(33);
  test::check_close(forward(after), expected_stress(after), "after", 1e-13);
}

} // namespace

TEST_CASE("input faults: the session") {
  check_input_faults(Session(std::make_shared<const Artifact>(read_artifact(
                                 resolve_artifact_root(elasticity_stub, "elasticity"))),
                             "cpu"));
}

TEST_CASE("input faults: SyncChunking in chunks of 5") {
  check_input_faults(load_model(elasticity_stub, "elasticity", SyncChunking{.batch_size = 5}));
}

TEST_CASE("input faults: SyncChunking in one chunk (a small batch straight to the graph)") {
  check_input_faults(load_model(elasticity_stub, "elasticity", SyncChunking{}));
}

TEST_CASE("input faults: the asynchronous pool in chunks of 4") {
  check_input_faults(load_model(elasticity_stub, "elasticity",
                                GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {4}}));
}

TEST_CASE("input faults: unbatched inputs broadcast, batch sizes must agree") {
  const auto m = load_model(test::stub("rates", "eq"), "eq", SyncChunking{.batch_size = 3});
  const test::Reference ref("rates");
  test::check_forward(m, ref, "bcast");
  auto disagreeing = ref.group("b7/in");
  disagreeing["a"] = at::ones({5}, at::kDouble);
  const auto message = test::fatal_message([&] { return m.forward(disagreeing); });
  CHECK(contains(message, "batch sizes do not agree"));
  test::check_forward(m, ref, "b7");
}

TEST_CASE("input faults: NaN and Inf in an implicit model fail only their rows") {
  const auto m = load_model(test::artifacts() / "scalar_backward_euler" / "model", "model",
                            GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {3}});
  const auto rows = 8;
  TensorMap in;
  for (const auto& name : m.input_names())
    in[name] = at::zeros({rows}, at::kDouble);
  in["t"].fill_(0.1);
  in["a"] = at::linspace(0.5, 2.0, rows, at::kDouble);
  const auto clean = m.forward(in).at("x");
  // A negated view of the same values (the row pass reads raw memory): the same bits.
  auto negated = in;
  negated["a"] = at::_neg_view(-in["a"]);
  CHECK(test::identical(m.forward(negated).at("x"), clean));
  in["a"][2] = std::numeric_limits<double>::quiet_NaN();
  in["x~1"][6] = std::numeric_limits<double>::infinity();
  try {
    static_cast<void>(m.forward(in));
    FAIL("expected a ConvergenceError");
  } catch (const ConvergenceError& e) {
    CHECK(e.recoverable());
    CHECK(e.failed_rows() == 2);
    const auto mask = e.converged_mask();
    CHECK_FALSE(mask[2].item<bool>());
    CHECK_FALSE(mask[6].item<bool>());
    const auto x = e.outputs().at("x");
    for (std::int64_t r : {0, 1, 3, 4, 5, 7}) {
      CHECK(mask[r].item<bool>());
      CHECK(x[r].item<double>() == clean[r].item<double>()); // row independence: bitwise
    }
  }
}

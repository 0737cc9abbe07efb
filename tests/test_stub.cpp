// Stubs as neml2-compile writes them, read with nmhit (NEML2's HIT parser): every section
// it writes loads, the model name may be left out when the stub holds one model, and the
// guards in front of nmhit turn what would hang or crash it into FatalErrors.

#include "model_checks.hpp"
#include "scratch.hpp"

using namespace neml2;
using test::contains;
using test::Scratch;
namespace fs = std::filesystem;

namespace {

const fs::path corpus = fs::path(NEML2_DISPATCH_TEST_SOURCES) / ".." / "fuzz" / "corpus" / "stub";

// The stress of uniaxial strain 1e-3 through linear isotropic elasticity (E = 100, nu =
// 0.3), the elasticity artifact's baked coefficients: analytic, not from the artifact.
void check_elasticity(const DispatchedModel<SyncChunking>& model) {
  auto strain = at::zeros({4, 6}, at::kDouble);
  strain.select(1, 0).fill_(1e-3);
  const auto stress = model.forward({{"strain", strain}}).at("stress");
  const double E = 100, nu = 0.3;
  const double lambda = E * nu / ((1 + nu) * (1 - 2 * nu)), mu = E / (2 * (1 + nu));
  CHECK(stress[3][0].item<double>() == doctest::Approx((lambda + 2 * mu) * 1e-3).epsilon(1e-12));
  CHECK(stress[3][1].item<double>() == doctest::Approx(lambda * 1e-3).epsilon(1e-12));
}

std::string with_model(const std::string& before, const std::string& model = "elasticity") {
  return before + "[Models]\n  [" + model +
         "]\n    type = AOTIModel\n    artifact_path = 'elasticity'\n  []\n[]\n";
}

} // namespace

TEST_CASE("a stub with [Settings] and [Tensors] (a triple-quoted multi-line expr) loads") {
  // What neml2-compile 3.1 writes for an input with [Settings] and a `type = Python`
  // tensor (neml2.cli.aoti_compile.emit_aoti_stub), beside a real artifact root.
  Scratch s;
  s.copy_root("elasticity", "elasticity");
  const auto stub = s.write("elasticity_aoti.i", test::read(corpus / "tensors_settings_aoti.i"));
  REQUIRE(contains(test::read(stub), "expr = '''\n"));
  CHECK(artifact_root_from_stub(stub, "elasticity") == s.dir / "elasticity");
  CHECK(artifact_root_from_stub(stub) == s.dir / "elasticity");
  check_elasticity(load_model(stub));
}

TEST_CASE("text that looks like HIT inside triple quotes is the expression's, not the stub's") {
  // A line-by-line reader would close [Tensors] at the '[]' inside the expression and take
  // its artifact_path; nmhit reads the whole string as one value.
  Scratch s;
  s.copy_root("elasticity", "elasticity");
  for (const std::string quote : {"'''", "\"\"\""}) {
    CAPTURE(quote);
    const auto stub =
        s.write("model_aoti.i",
                with_model("[Tensors]\n  [E]\n    type = Python\n    expr = " + quote +
                           "\n[]\n[Models]\n  [elasticity]\n    artifact_path = 'elsewhere'\n"
                           "result = Scalar(torch.tensor(100.0))  # it's [fine]\n" +
                           quote + "\n  []\n[]\n"));
    CHECK(resolve_artifact_root(stub) == s.dir / "elasticity");
    CHECK(stub_models(stub) == std::vector<std::string>{"elasticity"});
  }
}

TEST_CASE("the model name: optional for one model, and several are listed when left out") {
  Scratch s;
  s.copy_root("elasticity", "elasticity");
  const auto one = s.write("one_aoti.i", with_model(""));
  check_elasticity(load_model(one));
  check_elasticity(load_model(one, SyncChunking{.batch_size = 3}));
  check_elasticity(load_model(s.dir / "elasticity", SyncChunking{.batch_size = 3}));
  CHECK(load_model(one, SyncChunking{.batch_size = 3}).policy().batch_size == 3);

  const auto two = s.write(
      "two_aoti.i", "[Models]\n  [first]\n    type = AOTIModel\n    artifact_path = 'elasticity'\n"
                    "  []\n  [second]\n    type = AOTIModel\n    artifact_path = 'other'\n"
                    "  []\n[]\n");
  CHECK(stub_models(two) == std::vector<std::string>{"first", "second"});
  CHECK(artifact_root_from_stub(two, "second") == s.dir / "other");
  const auto message = test::fatal_message([&] { return load_model(two); });
  CHECK(contains(message, "two_aoti.i: the stub holds 2 models (first, second); name the one"));
  CHECK(contains(test::fatal_message([&] { return resolve_artifact_root(two); }),
                 "holds 2 models (first, second)"));
  CHECK(contains(test::fatal_message([&] { return artifact_root_from_stub(two, "third"); }),
                 "no model 'third' under [Models] (models there: first, second)"));
}

TEST_CASE("the guards before nmhit: deep nesting, !include and ${...} are FatalErrors") {
  const auto fails_with = [](const std::string& text, const std::string& part) {
    CHECK_THROWS_WITH_AS((void)neml2::detail::artifact_root_from_stub(text, "g_aoti.i"),
                         doctest::Contains(part.c_str()), FatalError);
  };
  // nmhit takes minutes over 20,000 nested sections and overflows the stack at 10,000; a
  // quote inside a word (which nmhit skips, reading on) must not hide them from the guard.
  std::string nested = "x = don't\n";
  for (int i = 0; i < 10000; ++i)
    nested += "[a]\n";
  fails_with(nested, "g_aoti.i:66: section [a] is nested more than 64 deep");
  // nmhit would open the path itself, relative to the working directory.
  fails_with("!include /dev/stdin\n" + with_model(""), "g_aoti.i:1: !include is not read");
  // A field that refers to itself recurses in nmhit until the stack overflows.
  fails_with("[Models]\n  [m]\n    type = AOTIModel\n    artifact_path = ${Models/m/artifact_path}"
             "\n  []\n[]\n",
             "artifact_path = ${Models/m/artifact_path} holds a ${...} expression");
  // Elsewhere (a [Tensors] entry) nothing is evaluated.
  CHECK(neml2::detail::artifact_root_from_stub(
            with_model("[Tensors]\n  [E]\n    expr = ${E}\n  []\n[]\n"), "dir/g_aoti.i") ==
        fs::path("dir/elasticity"));
}

TEST_CASE("nmhit's own errors name the stub, the line and the column") {
  const auto message = test::fatal_message([] {
    return neml2::detail::artifact_root_from_stub("[Models]\n  just words\n[]\n", "bad_aoti.i",
                                                  "m");
  });
  CHECK(contains(message, "bad_aoti.i:2:8: unexpected character 'w'; bad_aoti.i:2:9: syntax"));
  CHECK(contains(message, "regenerate it with neml2-compile"));
}

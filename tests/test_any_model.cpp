// AnyDispatchedModel: the calls of every DispatchedModel<Policy> behind one type, compiled
// once. A host file compiled without ATen (header_light.cpp, <neml2/dispatch_fwd.hpp> and
// <neml2/any_dispatched_model.hpp>) holds and calls a model; models of two policies held as
// AnyDispatchedModel give the eager results; a prepared call survives a move of its model; policy()
// is the model's copy; the README's first snippet, compiled with nothing but <neml2/dispatch.hpp>,
// gives the eager results.

#include <unistd.h>

#include "header_light.hpp"
#include "model_checks.hpp"
#include "scratch.hpp"

namespace readme {
neml2::TensorMap first_snippet(); // readme_first_snippet.cpp, generated from README.md
}

using namespace neml2;
namespace fs = std::filesystem;

TEST_CASE("a file without ATen holds and calls a model: the eager results") {
  const test::Reference ref("elasticity");
  const AnyDispatchedModel model =
      load_model(test::stub("elasticity", "elasticity"),
                 GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {4}});
  for (const std::string c : {"b1", "b7", "b33"}) {
    CAPTURE(c);
    const auto expected = ref.group(c + "/out");
    TensorMap out;
    for (const auto& [name, value] : expected)
      out[name] = at::full_like(value, std::numeric_limits<double>::quiet_NaN());
    light::step(model, ref.group(c + "/in"), out);
    test::check_close(out, expected, c + " forward_into");
  }
}

TEST_CASE("models of two policies as AnyDispatchedModel: the same surface, the eager results") {
  const test::Reference ref("elasticity");
  const auto stub = test::stub("elasticity", "elasticity");
  std::vector<AnyDispatchedModel> models;
  models.push_back(load_model(stub, SyncChunking{.batch_size = 3}));
  models.push_back(
      load_model(stub, GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {5}}));
  for (const auto& m : models)
    for (const std::string c : {"b1", "b33"}) {
      CAPTURE(c);
      test::check_forward(m, ref, c);
      test::check_jacobian(m, ref, c);
    }
}

TEST_CASE("a prepared call outlives a move of its model, and policy() is the model's copy") {
  const test::Reference ref("elasticity");
  auto chunked = load_model(test::stub("elasticity", "elasticity"), SyncChunking{.batch_size = 7});
  CHECK(chunked.policy().batch_size == 7);
  const auto step = chunked.prepare();
  AnyDispatchedModel held = std::move(chunked);
  const auto in = ref.group("b33/in");
  const auto out = step.forward(std::vector<at::Tensor>{in.at("strain")});
  REQUIRE(out.size() == 1);
  test::check_close(TensorMap{{"stress", out[0]}}, ref.group("b33/out"), "prepared after the move");
  CHECK(held.output_names() == std::vector<std::string>{"stress"});
}

TEST_CASE("the README's first snippet, with nothing but <neml2/dispatch.hpp>: the eager results") {
  // Its path, aoti/elasticity_aoti.i, from a scratch working folder.
  const test::Scratch scratch;
  fs::create_directory_symlink(test::artifacts() / "elasticity", scratch.dir / "aoti");
  const auto before = fs::current_path();
  fs::current_path(scratch.dir);
  TensorMap made;
  try {
    made = readme::first_snippet();
  } catch (...) {
    fs::current_path(before);
    throw;
  }
  fs::current_path(before);
  // Linear elasticity: stress = C strain, with C eager NEML2's Jacobian.
  const auto C = test::Reference("elasticity")["b1/jac/stress/strain"].reshape({6, 6});
  const auto& strain = made.at("strain");
  REQUIRE(strain.size(0) > 1000);
  const auto expected = at::matmul(strain, C.transpose(0, 1));
  test::check_close(made.at("stress"), expected, "README stress");
  test::check_close(made.at("outputs.stress"), expected, "README jacobian outputs");
  const auto& J = made.at("J.stress.strain");
  test::check_close(J, C.expand_as(J), "README J");
}

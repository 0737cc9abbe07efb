// AnyDispatchedModel: the calls of every DispatchedModel<Policy> behind one type, compiled
// once. A host file compiled without ATen (header_light.cpp) loads, holds and calls a
// model; models of two policies held as AnyDispatchedModel give the eager results; a
// prepared call survives a move of its model; policy() is the model's copy.

#include "header_light.hpp"
#include "model_checks.hpp"

using namespace neml2;

TEST_CASE("a file without ATen loads, holds and calls a model: the eager results") {
  const test::Reference ref("elasticity");
  const auto model = light::load_pooled(test::stub("elasticity", "elasticity"), 4);
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

// Compiled without ATen (no precompiled header): what a host's file that only loads, holds
// and calls a model sees of <neml2/dispatch.hpp>. It fails to compile if a public header
// brings in ATen's Tensor class again.

#include <neml2/dispatch.hpp>

#include "header_light.hpp"

namespace {
template <class T, class = decltype(sizeof(T))>
constexpr bool complete(int) {
  return true;
}
template <class T>
constexpr bool complete(...) {
  return false;
}
} // namespace

static_assert(!complete<at::Tensor>(0),
              "<neml2/dispatch.hpp> defines at::Tensor: a public header includes ATen again; "
              "declare the type instead (see errors.hpp)");

namespace light {

neml2::AnyDispatchedModel load_pooled(const std::filesystem::path& stub, std::int64_t chunk) {
  return neml2::load_model(stub, neml2::GreedyPriorityCapacity{.devices = {"cpu"},
                                                               .batch_sizes = {chunk}});
}

void step(const neml2::AnyDispatchedModel& model, const neml2::TensorMap& inputs,
          const neml2::TensorMap& outputs) {
  model.forward_into(inputs, outputs);
}

} // namespace light

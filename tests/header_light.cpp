// Compiled without ATen (no precompiled header): what a host's file that only holds and
// calls a model sees of <neml2/dispatch_fwd.hpp> (holds: header_light.hpp) and
// <neml2/any_dispatched_model.hpp> (calls). It fails to compile if either header brings in
// ATen's Tensor class.

#include "header_light.hpp"

#include <neml2/any_dispatched_model.hpp>

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
              "<neml2/dispatch_fwd.hpp> or <neml2/any_dispatched_model.hpp> defines "
              "at::Tensor: it includes ATen; declare the type instead (see errors.hpp)");

namespace light {

void step(const neml2::AnyDispatchedModel& model, const neml2::TensorMap& inputs,
          const neml2::TensorMap& outputs) {
  model.forward_into(inputs, outputs);
}

} // namespace light

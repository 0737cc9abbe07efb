#pragma once

// What tests/header_light.cpp, compiled without ATen, offers the test that checks it.

#include <neml2/dispatch_fwd.hpp>

namespace light {
/// model.forward_into(inputs, outputs), from a file that never saw ATen.
void step(const neml2::AnyDispatchedModel& model, const neml2::TensorMap& inputs,
          const neml2::TensorMap& outputs);
} // namespace light

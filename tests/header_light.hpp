#pragma once

// What tests/header_light.cpp, compiled without ATen, offers the test that checks it.

#include <cstdint>
#include <filesystem>

#include <neml2/dispatched_model.hpp>

namespace light {
/// The model of `stub`, pooled on the CPU in chunks of `chunk` rows, policy type erased.
neml2::AnyDispatchedModel load_pooled(const std::filesystem::path& stub, std::int64_t chunk);
/// model.forward_into(inputs, outputs), from a file that never saw ATen.
void step(const neml2::AnyDispatchedModel& model, const neml2::TensorMap& inputs,
          const neml2::TensorMap& outputs);
} // namespace light

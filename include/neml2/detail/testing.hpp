#pragma once

/// @file detail/testing.hpp
/// @brief Hooks for the library's tests, included by tests only: what a test needs to see
/// or disturb inside a model (fault injection).

#include <functional>

#include <neml2/any_dispatched_model.hpp>
#include <neml2/observer.hpp>

namespace neml2::detail {

/// A model's insides, for tests.
struct ModelAccess {
  /// Runs `hook` as each chunk starts (it may throw to fail that chunk); an empty one
  /// turns it off.
  static void before_chunk(AnyDispatchedModel& model, std::function<void(const ChunkEvent&)> hook);
};

} // namespace neml2::detail

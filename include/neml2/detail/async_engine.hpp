#pragma once

/// @file detail/async_engine.hpp
/// @brief What runs the calls of an asynchronous policy: chunks on a worker per
/// accelerator and the CPU's on the calling thread, the policy asked under one lock
/// (src/engine/async/). Only models of asynchronous policies make one, so a program that
/// uses synchronous policies alone links none of it.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <neml2/detail/model_core.hpp>
#include <neml2/detail/policy_protocol.hpp>
#include <neml2/detail/request.hpp>

namespace neml2::detail {

/// @brief The calls of one model of an asynchronous policy: a worker pool (a lane per
/// device, as many workers as the policy's chunks in flight on an accelerator, none on the
/// CPU, whose chunks run on the calling threads) and the loads every call shares.
class AsyncEngine {
public:
  AsyncEngine(const ModelCore& core, AsyncPolicyCalls& policy);
  ~AsyncEngine();
  AsyncEngine(const AsyncEngine&) = delete;
  AsyncEngine& operator=(const AsyncEngine&) = delete;

  /// Runs `request` to its results, in slot order.
  [[nodiscard]] std::vector<at::Tensor> run(Request& request) const;

private:
  struct Impl;
  std::unique_ptr<Impl> _impl;
};

} // namespace neml2::detail

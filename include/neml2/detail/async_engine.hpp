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
#include <neml2/policy.hpp>

namespace neml2::detail {

/// What the engine asks of an asynchronous policy and its state, always under its lock.
class AsyncPolicyCalls {
public:
  [[nodiscard]] virtual std::optional<ChunkChoice>
  next_chunk(std::span<const std::int64_t> rows_in_flight, std::int64_t remaining) = 0;
  virtual void on_dispatched(std::size_t device, std::int64_t rows) = 0;
  virtual void on_completed(std::size_t device, std::int64_t rows, double seconds) = 0;

protected:
  ~AsyncPolicyCalls() = default;
};

/// @brief The calls of one model of an asynchronous policy: a worker pool (a lane per
/// device, as many workers as `chunks_in_flight[d]` on an accelerator, none on the CPU,
/// whose chunks run on the calling threads) and the loads every call shares.
class AsyncEngine {
public:
  AsyncEngine(const ModelCore& core, AsyncPolicyCalls& policy,
              const std::vector<std::size_t>& chunks_in_flight);
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

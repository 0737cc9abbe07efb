#pragma once

/// @file detail/sync_call.hpp
/// @brief One call of a synchronous policy on the calling thread, compiled
/// (src/engine/sync_call.cpp); the loop that drives it is run_synchronous
/// (detail/dispatcher.hpp), a template over the policy.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include <neml2/detail/model_core.hpp>
#include <neml2/detail/request.hpp>

namespace neml2::detail {

/// @brief One call of a synchronous policy on the calling thread: bound at construction,
/// then run whole or chunk by chunk as the policy's template loop says.
class SyncCall {
public:
  SyncCall(const ModelCore& core, Request& request);
  ~SyncCall();
  SyncCall(const SyncCall&) = delete;
  SyncCall& operator=(const SyncCall&) = delete;

  /// The call's batch (1 when nothing carries a batch axis).
  [[nodiscard]] std::int64_t batch() const noexcept { return _batch; }
  /// Whether the call runs as one chunk on device `d` in place: no slicing, no copy.
  [[nodiscard]] bool runs_whole(std::size_t d, std::int64_t rows) const noexcept;
  /// The whole call on device `d` (in cache-sized pieces on the CPU when large).
  [[nodiscard]] std::vector<at::Tensor> run_whole(std::size_t d);
  /// The call in chunks of `rows` rows on device `d`, put in place (on the CPU's lanes).
  void run_chunks(std::size_t d, std::int64_t rows);
  /// The gathered results (a ConvergenceError over the batch when rows failed).
  [[nodiscard]] std::vector<at::Tensor> finish();

private:
  struct State;
  std::unique_ptr<State> _state;
  std::int64_t _batch = 0;
};

} // namespace neml2::detail

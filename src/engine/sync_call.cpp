// One call of a synchronous policy, on the calling thread (see
// include/neml2/detail/sync_call.hpp; the loop itself is run_synchronous, a template).

#include <optional>

#include <ATen/ATen.h>

#include <neml2/detail/sync_call.hpp>

#include "core/stopwatch.hpp"
#include "engine/chunk_runner.hpp"

namespace neml2::detail {
struct SyncCall::State {
  const ModelCore::State& core;
  Operation op;
  BoundCall call;
  std::vector<at::Tensor> targets; // the caller's tensors, until `results` takes them
  std::optional<Gatherer> results; // made at the first chunk
  ChunkArgs chunk;                 // reused by every chunk

  Gatherer& gatherer() {
    if (!results)
      results.emplace(call, core.sessions.front().dtype(), /*concurrent=*/false,
                      std::move(targets));
    return *results;
  }
};

SyncCall::SyncCall(const ModelCore& core, Request& request) {
  auto [call, targets] = bind(core.state(), request);
  _batch = call.batch;
  _state.reset(new State{core.state(), request.op, std::move(call), std::move(targets), {}, {}});
}

SyncCall::~SyncCall() = default;

bool SyncCall::runs_whole(std::size_t d, std::int64_t rows) const noexcept {
  const auto& s = *_state;
  return _batch > 0 && rows == _batch && s.call.device == s.core.compute[d];
}

std::vector<at::Tensor> SyncCall::run_whole(std::size_t d) {
  auto& s = *_state;
  if (!s.core.observer)
    return detail::run_whole(s.core, s.op, s.call, d, s.targets);
  const auto start = steady_clock::now();
  auto results = detail::run_whole(s.core, s.op, s.call, d, s.targets);
  finished_on(s.core, d); // the observer's seconds end when the results are ready
  s.core.observer(s.core.event(0, d, 0, _batch, seconds_since(start)));
  return results;
}

void SyncCall::run_chunk(std::size_t d, std::int64_t first, std::int64_t rows, std::size_t index) {
  auto& s = *_state;
  if (index > 0)
    ask_interrupt_check(s.core);
  auto& results = s.gatherer();
  const auto start = s.core.observer ? steady_clock::now() : steady_clock::time_point{};
  take_rows(s.call, first, rows, s.core.compute[d], s.chunk);
  detail::run_chunk(s.core, s.op, s.chunk, results, d, first, index);
  // Only the observer waits for an accelerator: without one, the next chunk is queued
  // while this one runs (results gathered on the CPU wait in their copy anyway).
  if (s.core.observer) {
    finished_on(s.core, d);
    s.core.observer(s.core.event(index, d, first, rows, seconds_since(start)));
  }
}

std::vector<at::Tensor> SyncCall::finish() {
  return std::move(_state->gatherer()).finish(); // made here when no chunk ran (no rows)
}

} // namespace neml2::detail

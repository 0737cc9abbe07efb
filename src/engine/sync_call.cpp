// One call of a synchronous policy, on the calling thread (see
// include/neml2/detail/sync_call.hpp; the loop itself is run_synchronous, a template).

#include <optional>

#include <ATen/ATen.h>

#include <neml2/detail/sync_call.hpp>

#include "core/cpu_lanes.hpp"
#include "core/stopwatch.hpp"
#include "engine/chunk_runner.hpp"

namespace neml2::detail {
struct SyncCall::State {
  State(const ModelCore::State& core, Request& request)
      : core(core) {
    auto bound = bind(core, request);
    call = std::move(bound.call);
    targets = std::move(bound.targets);
    context = std::move(bound.context);
  }

  CallOnItsLanes on_its_lanes; // first: the binding too
  const ModelCore::State& core;
  CallContext context;
  BoundCall call;
  std::vector<at::Tensor> targets; // the caller's tensors, until `results` takes them
  std::optional<Gatherer> results; // made when the chunks run

  Gatherer& gatherer(bool concurrent = false) {
    if (!results)
      results.emplace(call, core.sessions.front().dtype(), concurrent, std::move(targets));
    return *results;
  }
};

SyncCall::SyncCall(const ModelCore& core, Request& request)
    : _state(std::make_unique<State>(core.state(), request))
    , _batch(_state->call.batch) {}

SyncCall::~SyncCall() = default;

bool SyncCall::runs_whole(std::size_t d, std::int64_t rows) const noexcept {
  const auto& s = *_state;
  return _batch > 0 && rows == _batch && s.call.device == s.core.compute[d];
}

std::vector<at::Tensor> SyncCall::run_whole(std::size_t d) {
  auto& s = *_state;
  if (!s.context.observed())
    return detail::run_whole(s.core, s.context, s.call, d, s.targets);
  const auto start = steady_clock::now();
  auto results = detail::run_whole(s.core, s.context, s.call, d, s.targets);
  finished_on(s.core, d); // the observer's seconds end when the results are ready
  (*s.context.observer)(s.core.event(0, d, 0, _batch, seconds_since(start)));
  return results;
}

void SyncCall::run_chunks(std::size_t d, std::int64_t rows) {
  auto& s = *_state;
  detail::run_chunks(s.core, s.context, s.call, s.gatherer(s.context.lanes_for(d) > 1), d, rows);
}

std::vector<at::Tensor> SyncCall::finish() {
  return std::move(_state->gatherer()).finish(); // made here when no chunk ran (no rows)
}

} // namespace neml2::detail

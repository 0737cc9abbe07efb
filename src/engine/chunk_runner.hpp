#pragma once

// Running a bound call's rows on one device, for both runners (synchronous and
// asynchronous): the whole call in place, or one chunk into a Gatherer. A chunk whose solve
// failed in some rows is handled here, and only here.

#include <cstddef>
#include <cstdint>
#include <vector>

#include <neml2/detail/request.hpp>

#include "engine/gatherer.hpp"
#include "engine/model_core.hpp"
#include "graph/call.hpp"

namespace neml2::detail {

/// A request bound (checked, in positional order, no copy) against the model's master
/// parameters, and the caller's tensors for its results checked as targets (none: empty).
struct BoundRequest {
  BoundCall call;
  std::vector<at::Tensor> targets;
};
[[nodiscard]] BoundRequest bind(const ModelCore::State& core, Request& request);

/// The whole call as one chunk on device `d` (the inputs' device): no slicing, no copy
/// (into `targets` when given); on the CPU a large batch runs in cache-sized pieces into
/// kept memory or `targets`. Runs the before-chunk hook once.
[[nodiscard]] std::vector<at::Tensor> run_whole(const ModelCore::State& core, Operation op,
                                                BoundCall& call, std::size_t d,
                                                const std::vector<at::Tensor>& targets);

/// One chunk taken onto device `d` (rows [first, first + rows) of the call), run and put
/// in place in `results`, failed rows included. Runs the before-chunk hook first.
void run_chunk(const ModelCore::State& core, Operation op, ChunkArgs& chunk, Gatherer& results,
               std::size_t d, std::int64_t first, std::size_t index);

/// Asks the call's interrupt check, if any (InterruptCheck); what it throws leaves as one
/// of the library's errors.
void ask_interrupt_check(const ModelCore::State& core);

/// Waits until this thread's work on accelerator `d` is done (nothing on the CPU): a
/// chunk's seconds end when its results are ready.
void finished_on(const ModelCore::State& core, std::size_t d);

} // namespace neml2::detail

#pragma once

// Running a bound call's rows on one device, for both runners (synchronous and
// asynchronous): the whole call in place, or one chunk into a Gatherer. A chunk whose solve
// failed in some rows is handled here, and only here.

#include <cstddef>
#include <cstdint>
#include <vector>

#include <neml2/detail/request.hpp>

#include "core/cpu_lanes.hpp"
#include "engine/gatherer.hpp"
#include "engine/model_core.hpp"
#include "graph/call.hpp"

namespace neml2::detail {

/// What a call carries beside its tensors, for every chunk of it: its operation, the
/// chord's factors, its lanes, and the model's observer and interrupt check. Made once when
/// the call is bound, on the calling thread, and owned by its runner (SyncCall, the
/// asynchronous engine's call); the session and graph layers below see only a chunk's rows
/// of the factors.
struct CallContext {
  Operation op = Operation::forward;
  /// The chord's slots, `(batch, width)` on the CPU (NewtonFactors'), or undefined.
  at::Tensor newton_factors;
  /// Per device, the lanes the call's work there may run on: on the CPU the policy's
  /// cpu_lanes resolved against the session's runners on the calling thread
  /// (resolve_cpu_lanes), 1 elsewhere.
  std::vector<std::size_t> lanes;
  /// The model's (ModelCore::State): not called when empty.
  const ChunkObserver* observer = nullptr;
  const InterruptCheck* interrupt_check = nullptr;

  /// The factors of rows [first, first + rows) on device `device` (none off the CPU).
  [[nodiscard]] at::Tensor factors_of(std::int64_t first, std::int64_t rows,
                                      c10::Device device) const;
  /// The lanes on device `d` for `work` pieces (or chunks): lanes[d], at most `work`, at
  /// least 1.
  [[nodiscard]] std::size_t lanes_for(std::size_t d,
                                      std::size_t work = LaneLimits::none) const noexcept;
  [[nodiscard]] bool observed() const noexcept { return observer && *observer; }
  [[nodiscard]] bool interruptible() const noexcept { return interrupt_check && *interrupt_check; }
  /// Asks the interrupt check, if any (InterruptCheck); what it throws leaves as one of
  /// the library's errors.
  void ask_interrupt_check() const;
};

/// A request bound (checked, in positional order, no copy) against the model's master
/// parameters, the caller's tensors for its results checked as targets (none: empty), and
/// its context.
struct BoundRequest {
  BoundCall call;
  std::vector<at::Tensor> targets;
  CallContext context;
};
[[nodiscard]] BoundRequest bind(const ModelCore::State& core, Request& request);

/// The whole call as one chunk on device `d` (the inputs' device): no slicing, no copy
/// (into `targets` when given); on the CPU a large batch runs in pieces (see piece_rows())
/// over the CPU's lanes, into kept memory or `targets`. Runs the before-chunk hook once.
[[nodiscard]] std::vector<at::Tensor> run_whole(const ModelCore::State& core,
                                                const CallContext& context, BoundCall& call,
                                                std::size_t d,
                                                const std::vector<at::Tensor>& targets);

/// The call's chunks of `rows` rows on device `d`, put in place in `results` (failed rows
/// included), each on one of the CPU's lanes (one after another elsewhere). Each chunk runs
/// the before-chunk hook, then is reported to the observer with its lane (one at a time);
/// the calling thread asks the interrupt check before each chunk it takes after the first.
/// After a chunk throws no chunk starts; what the first of them threw is rethrown.
void run_chunks(const ModelCore::State& core, const CallContext& context, const BoundCall& call,
                Gatherer& results, std::size_t d, std::int64_t rows);

/// One chunk taken onto device `d` (rows [first, first + rows) of the call), run and put
/// in place in `results`, failed rows included. Runs the before-chunk hook first.
void run_chunk(const ModelCore::State& core, const CallContext& context, ChunkArgs& chunk,
               Gatherer& results, std::size_t d, std::int64_t first, std::size_t index);

/// Chunk `index` (rows [first, first + rows) of the call) on the CPU device `d`, in pieces
/// over its lanes (see piece_rows()), put in place in `results`. Runs the before-chunk hook
/// once, for the whole chunk.
void run_chunk_on_lanes(const ModelCore::State& core, const CallContext& context,
                        const BoundCall& call, Gatherer& results, std::size_t d, std::int64_t first,
                        std::int64_t rows, std::size_t index);

/// Waits until this thread's work on accelerator `d` is done (nothing on the CPU): a
/// chunk's seconds end when its results are ready.
void finished_on(const ModelCore::State& core, std::size_t d);

} // namespace neml2::detail

// Running a bound call's rows on one device (see chunk_runner.hpp).

#include "engine/chunk_runner.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <optional>

#include <ATen/ATen.h>

#include <neml2/detail/policy_protocol.hpp>

#include "core/cpu_lanes.hpp"
#include "core/device_sync.hpp"
#include "core/stopwatch.hpp"
#include "implicit/newton_factors.hpp"
#include "session/call_protocol.hpp"

namespace neml2::detail {
namespace {
// One chunk's results, or, when its solve failed in some rows, those results with the
// rows that converged: the one place a per-row failure is caught.
struct Outcome {
  std::vector<at::Tensor> results;
  std::optional<ConvergenceError> failed;
};

// Rows [first, first + chunk.rows) of the call. `event`: the chunk as the before-chunk hook
// sees it (a test's fault may be a per-row one).
Outcome run_rows(const ModelCore::State& core, const ChunkEvent* event, const CallContext& context,
                 std::size_t d, ChunkArgs& chunk, std::int64_t first,
                 std::span<const Place> places) {
  try {
    if (event && core.before_chunk)
      core.before_chunk(*event);
    return {CallProtocol::run(core.sessions[d], context.op, chunk, places,
                              context.factors_of(first, chunk.rows, core.compute[d])),
            std::nullopt};
  } catch (const ConvergenceError& e) {
    if (!e.per_row())
      throw;
    return {{}, e};
  }
}

void add(Gatherer& results, std::size_t index, std::int64_t first, std::int64_t rows,
         Outcome&& outcome, std::size_t piece = 0) {
  if (outcome.failed)
    results.add_failed_rows(index, first, rows, *outcome.failed, piece);
  else
    results.add(index, first, rows, outcome.results, piece);
}

// Runs run(lane, i, first, n, chunk) for the pieces of `piece` rows covering rows
// [first, first + rows), each on one of device `d`'s lanes (the call's: no more than the
// pieces), taken in order; `chunk` is the lane's own. The calling thread (lane 0) asks the
// interrupt check before it takes a piece, unless no lane has taken one yet and
// `asks_first` is false: a stop leaves the pieces taken before it, [0, k), and nothing
// after. After a piece throws none starts, and what the lowest of those that threw threw
// is rethrown: what one lane taking them in order would have thrown.
template <class Run>
void on_lanes(const CallContext& context, std::size_t d, std::int64_t first, std::int64_t rows,
              std::int64_t piece, bool asks_first, const Run& run) {
  if (rows <= 0 || piece <= 0)
    return;
  const auto pieces = (rows + piece - 1) / piece;
  std::atomic<std::int64_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex failed_mutex;
  std::int64_t failed_index = pieces;
  std::exception_ptr failed;
  const auto fail = [&](std::int64_t i) {
    stop = true; // the other lanes take no chunk from now on
    const std::lock_guard lock(failed_mutex);
    if (i < failed_index) {
      failed_index = i;
      failed = std::current_exception();
    }
  };
  run_on_lanes(context.lanes_for(d, static_cast<std::size_t>(pieces)), [&](std::size_t lane) {
    ChunkArgs chunk;
    while (!stop.load(std::memory_order_relaxed)) {
      // Asked before a chunk is taken, so that one it stops leaves no hole behind.
      if (const auto taken = next.load();
          lane == 0 && taken < pieces && (asks_first || taken > 0)) {
        try {
          context.ask_interrupt_check();
        } catch (...) {
          fail(next.load());
          return;
        }
      }
      const auto i = next.fetch_add(1);
      if (i >= pieces)
        return;
      try {
        const auto at = first + i * piece;
        run(lane, static_cast<std::size_t>(i), at, std::min(piece, first + rows - at), chunk);
      } catch (...) {
        fail(i);
      }
    }
  });
  if (failed)
    std::rethrow_exception(failed);
}

// Rows [first, first + rows) of the call on the CPU in pieces of `piece` rows over the
// lanes, into `results` as chunk `index` (the policy sees one chunk: no hook per piece).
void run_pieces(const ModelCore::State& core, const CallContext& context, const BoundCall& call,
                Gatherer& results, std::size_t d, std::int64_t first, std::int64_t rows,
                std::int64_t piece, std::size_t index) {
  on_lanes(context, d, first, rows, piece, /*asks_first=*/false,
           [&](std::size_t, std::size_t i, std::int64_t at, std::int64_t n, ChunkArgs& chunk) {
             take_rows(call, at, n, core.compute[d], chunk);
             add(results, index, at, n,
                 run_rows(core, nullptr, context, d, chunk, at, results.places(at, n)), i);
           });
}

// The rows of the pieces a CPU call's rows run in (0: one piece).
std::int64_t pieces_of(const ModelCore::State& core, const BoundCall& call, std::size_t d,
                       std::int64_t rows) {
  return piece_rows(call, core.sessions[d].dtype(), rows,
                    CallProtocol::runs_chain(core.sessions[d]));
}
} // namespace

std::size_t CallContext::lanes_for(std::size_t d, std::size_t work) const noexcept {
  return std::max<std::size_t>(std::min(lanes[d], work), 1);
}

void CallContext::ask_interrupt_check() const {
  if (!interruptible())
    return;
  try {
    (*interrupt_check)();
  } catch (...) {
    std::rethrow_exception(as_library_error(std::current_exception(), "the interrupt check"));
  }
}

at::Tensor CallContext::factors_of(std::int64_t first, std::int64_t rows,
                                   c10::Device device) const {
  if (!newton_factors.defined() || !device.is_cpu())
    return {};
  return first == 0 && rows == newton_factors.size(0) ? newton_factors
                                                      : newton_factors.narrow(0, first, rows);
}

BoundRequest bind(const ModelCore::State& core, Request& request) {
  const auto& session = core.sessions.front();
  const TensorMap none;
  auto call =
      CallProtocol::bind(session, request.op, std::move(request.inputs),
                         request.extras ? *request.extras : none, session.named_parameters(), {});
  auto targets =
      request.into ? writable(call, session.dtype(), *request.into) : std::vector<at::Tensor>{};
  CallContext context;
  context.op = request.op;
  if (request.factors)
    context.newton_factors =
        NewtonFactorsAccess::slots(*request.factors, session.artifact(), call.batch);
  context.lanes.reserve(core.compute.size());
  for (std::size_t d = 0; d < core.compute.size(); ++d)
    context.lanes.push_back(
        core.compute[d].is_cpu()
            ? resolve_cpu_lanes(static_cast<std::int64_t>(core.cpu_lanes),
                                lane_limits_here(CallProtocol::runners(core.sessions[d])))
            : 1);
  context.observer = &core.observer;
  context.interrupt_check = &core.interrupt_check;
  return {std::move(call), std::move(targets), std::move(context)};
}

std::vector<at::Tensor> run_whole(const ModelCore::State& core, const CallContext& context,
                                  BoundCall& call, std::size_t d,
                                  const std::vector<at::Tensor>& targets) {
  if (const auto piece = pieces_of(core, call, d, call.batch); piece > 0) {
    Gatherer results(call, core.sessions[d].dtype(), /*concurrent=*/context.lanes_for(d) > 1,
                     targets);
    if (core.before_chunk) // the policy sees one chunk
      core.before_chunk(core.event(0, d, 0, call.batch, 0));
    run_pieces(core, context, call, results, d, 0, call.batch, piece, 0);
    return std::move(results).finish();
  }
  ChunkArgs chunk;
  take_all(call, core.compute[d], chunk);
  const auto event = core.event(0, d, 0, call.batch, 0);
  auto outcome = run_rows(core, &event, context, d, chunk, 0,
                          targets.empty() ? Places{} : places(call, targets, 0, call.batch));
  auto results =
      finish_whole(call, outcome.failed ? outcome.failed->results() : std::move(outcome.results));
  if (!targets.empty() && results.size() == targets.size()) {
    copy_into(targets, call, results);
    results = targets;
  }
  if (const auto& failed = outcome.failed)
    throw_failed_rows(failed->converged_mask(), failed->worst_residual(), std::move(results),
                      failed->reasons(), failed->residual_norms());
  return results;
}

void run_chunks(const ModelCore::State& core, const CallContext& context, const BoundCall& call,
                Gatherer& results, std::size_t d, std::int64_t rows) {
  std::recursive_mutex observing; // the observer sees one chunk at a time (and may call back)
  on_lanes(context, d, 0, call.batch, rows, /*asks_first=*/false,
           [&](std::size_t lane, std::size_t index, std::int64_t first, std::int64_t n,
               ChunkArgs& chunk) {
             const auto observed = context.observed();
             const auto start = observed ? steady_clock::now() : steady_clock::time_point{};
             take_rows(call, first, n, core.compute[d], chunk);
             const auto event = core.event(index, d, first, n, 0, lane);
             const auto on_cpu = core.compute[d].is_cpu();
             add(results, index, first, n,
                 run_rows(core, &event, context, d, chunk, first,
                          on_cpu ? results.places(first, n) : Places{}));
             // Only the observer waits for an accelerator: without one, the next chunk is
             // queued while this one runs (results gathered on the CPU wait in their copy).
             if (observed) {
               finished_on(core, d);
               const auto seconds = seconds_since(start);
               const std::lock_guard lock(observing);
               (*context.observer)(core.event(index, d, first, n, seconds, lane));
             }
           });
}

void run_chunk_on_lanes(const ModelCore::State& core, const CallContext& context,
                        const BoundCall& call, Gatherer& results, std::size_t d, std::int64_t first,
                        std::int64_t rows, std::size_t index) {
  const auto piece = pieces_of(core, call, d, rows);
  if (piece == 0) {
    ChunkArgs chunk;
    take_rows(call, first, rows, core.compute[d], chunk);
    run_chunk(core, context, chunk, results, d, first, index);
    return;
  }
  if (core.before_chunk)
    core.before_chunk(core.event(index, d, first, rows, 0));
  run_pieces(core, context, call, results, d, first, rows, piece, index);
}

void run_chunk(const ModelCore::State& core, const CallContext& context, ChunkArgs& chunk,
               Gatherer& results, std::size_t d, std::int64_t first, std::size_t index) {
  const auto event = core.event(index, d, first, chunk.rows, 0);
  const auto on_cpu = core.compute[d].is_cpu();
  add(results, index, first, chunk.rows,
      run_rows(core, &event, context, d, chunk, first,
               on_cpu ? results.places(first, chunk.rows) : Places{}));
}

void finished_on(const ModelCore::State& core, std::size_t d) {
  if (!core.compute[d].is_cpu())
    synchronize_current_stream(core.compute[d]);
}

} // namespace neml2::detail

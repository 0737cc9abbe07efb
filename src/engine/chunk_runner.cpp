// Running a bound call's rows on one device (see chunk_runner.hpp).

#include "engine/chunk_runner.hpp"

#include <optional>

#include <ATen/ATen.h>

#include <neml2/detail/policy_protocol.hpp>

#include "core/device_sync.hpp"
#include "session/call_protocol.hpp"

namespace neml2::detail {
namespace {
// One chunk's results, or, when its solve failed in some rows, those results with the
// rows that converged: the one place a per-row failure is caught.
struct Outcome {
  std::vector<at::Tensor> results;
  std::optional<ConvergenceError> failed;
};

// `event`: the chunk as the before-chunk hook sees it (a test's fault may be a per-row one).
Outcome run_rows(const ModelCore::State& core, const ChunkEvent* event, Operation op, std::size_t d,
                 ChunkArgs& chunk, std::span<const Place> places) {
  try {
    if (event && core.before_chunk)
      core.before_chunk(*event);
    return {CallProtocol::run(core.sessions[d], op, chunk, places), std::nullopt};
  } catch (const ConvergenceError& e) {
    if (!e.per_row())
      throw;
    return {{}, e};
  }
}

void add(Gatherer& results, std::size_t index, std::int64_t first, std::int64_t rows,
         Outcome&& outcome) {
  if (outcome.failed)
    results.add_failed_rows(index, first, rows, *outcome.failed);
  else
    results.add(index, first, rows, outcome.results);
}

// The whole call on the CPU in pieces of `piece` rows, one after the other: each piece's
// results are copied into place while still in cache.
std::vector<at::Tensor> run_pieces(const ModelCore::State& core, Operation op,
                                   const BoundCall& call, std::size_t d, std::int64_t piece,
                                   const std::vector<at::Tensor>& targets) {
  Gatherer results(call, core.sessions[d].dtype(), /*concurrent=*/false, targets);
  if (core.before_chunk) // the policy sees one chunk
    core.before_chunk(core.event(0, d, 0, call.batch, 0));
  ChunkArgs chunk;
  for_each_chunk(call.batch, piece, [&](std::int64_t first, std::int64_t rows, std::size_t index) {
    if (index > 0)
      ask_interrupt_check(core);
    take_rows(call, first, rows, core.compute[d], chunk);
    add(results, index, first, rows,
        run_rows(core, nullptr, op, d, chunk, results.places(first, rows)));
  });
  return std::move(results).finish();
}
} // namespace

BoundRequest bind(const ModelCore::State& core, Request& request) {
  const auto& session = core.sessions.front();
  const TensorMap none;
  auto call =
      CallProtocol::bind(session, request.op, std::move(request.inputs),
                         request.extras ? *request.extras : none, session.named_parameters(), {});
  auto targets =
      request.into ? writable(call, session.dtype(), *request.into) : std::vector<at::Tensor>{};
  return {std::move(call), std::move(targets)};
}

std::vector<at::Tensor> run_whole(const ModelCore::State& core, Operation op, BoundCall& call,
                                  std::size_t d, const std::vector<at::Tensor>& targets) {
  if (call.batch > min_piece_rows)
    if (const auto piece = piece_rows(call, core.sessions[d].dtype()); piece > 0)
      return run_pieces(core, op, call, d, piece, targets);
  ChunkArgs chunk;
  take_all(call, core.compute[d], chunk);
  const auto event = core.event(0, d, 0, call.batch, 0);
  auto outcome = run_rows(core, &event, op, d, chunk,
                          targets.empty() ? Places{} : places(call, targets, 0, call.batch));
  auto results =
      finish_whole(call, outcome.failed ? outcome.failed->results() : std::move(outcome.results));
  if (!targets.empty() && results.size() == targets.size()) {
    copy_into(targets, call, results);
    results = targets;
  }
  if (outcome.failed)
    throw_failed_rows(outcome.failed->converged_mask(), outcome.failed->worst_residual(),
                      std::move(results));
  return results;
}

void run_chunk(const ModelCore::State& core, Operation op, ChunkArgs& chunk, Gatherer& results,
               std::size_t d, std::int64_t first, std::size_t index) {
  const auto event = core.event(index, d, first, chunk.rows, 0);
  const auto on_cpu = core.compute[d].is_cpu();
  add(results, index, first, chunk.rows,
      run_rows(core, &event, op, d, chunk, on_cpu ? results.places(first, chunk.rows) : Places{}));
}

void ask_interrupt_check(const ModelCore::State& core) {
  if (!core.interrupt_check)
    return;
  try {
    core.interrupt_check();
  } catch (...) {
    std::rethrow_exception(as_library_error(std::current_exception(), "the interrupt check"));
  }
}

void finished_on(const ModelCore::State& core, std::size_t d) {
  if (!core.compute[d].is_cpu())
    synchronize_current_stream(core.compute[d]);
}

} // namespace neml2::detail

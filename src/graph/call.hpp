#pragma once

// A call in positional form, how each result gathers across chunks, and a chunk's
// arguments taken from it (src/graph/call.cpp). Shared by the session (which binds and
// runs them) and the engine (which chunks them).

#include <cstdint>
#include <vector>

#include <ATen/Tensor.h>

#include <neml2/artifact.hpp>
#include <neml2/detail/destinations.hpp>

namespace neml2::detail {

/// One chunk's arguments: every tensor `(rows, *trailing)`, contiguous, on the compute
/// device (undefined extras stay undefined).
struct ChunkArgs {
  std::int64_t rows = 0;
  std::vector<at::Tensor> inputs, params, extras;
};

/// How a result gathers across chunks.
enum class Gather : std::uint8_t {
  rows,   ///< one row per batch row: chunks fill their rows of `(batch, *shape)`
  shared, ///< batch-independent: the same in every chunk, `(*shape)`; taken once
  sum,    ///< per-row contributions summed over the batch to `(*shape)`
};

struct ResultSlot {
  Gather gather = Gather::rows;
  Shape shape; ///< without the batch axis
};

/// A validated call: tensors in graph-independent positional order (inputs in master
/// order, parameters in Artifact::parameters order, extras = tangents in master input
/// order or cotangents in param_vjp_outputs order). Every tensor has a leading axis: the
/// batch, or 1 to broadcast to every row. An undefined extra stands for zero. No data has
/// been copied or moved.
struct BoundCall {
  std::int64_t batch = 1;
  bool batched = false;           ///< false when nothing carried a batch axis: results drop it
  c10::Device device = c10::kCPU; ///< where the inputs live, and the results go
  std::vector<at::Tensor> inputs, params, extras;

  /// How each result of the operation gathers (shared by all calls, or this call's own).
  [[nodiscard]] const std::vector<ResultSlot>& slots() const {
    return shared_slots ? *shared_slots : own_slots;
  }
  const std::vector<ResultSlot>* shared_slots = nullptr;
  std::vector<ResultSlot> own_slots;
};

/// One tensor's rows [first, first + rows) on `device`, `(rows, *trailing)`, contiguous:
/// a leading size of 1 is broadcast, anything else narrowed (a view) then moved.
[[nodiscard]] at::Tensor take_rows(const at::Tensor& t, std::int64_t first, std::int64_t rows,
                                   c10::Device device);

/// Rows [first, first + rows) of a call as one chunk's arguments on `device`.
void take_rows(const BoundCall& call, std::int64_t first, std::int64_t rows, c10::Device device,
               ChunkArgs& chunk);

/// The whole call as one chunk, reusing its tensor lists: nothing is copied for batched
/// tensors already on `device` (the call's tensors are moved out).
void take_all(BoundCall& call, c10::Device device, ChunkArgs& chunk);

/// Result `i` with its batch axis as called (dropped when nothing had one).
[[nodiscard]] at::Tensor as_called(const BoundCall& call, std::size_t i, const at::Tensor& result);

/// The results of a call run as one chunk: sums taken, batch axis as called.
[[nodiscard]] std::vector<at::Tensor> finish_whole(const BoundCall& call,
                                                   std::vector<at::Tensor> results);

/// The results of a call of no rows, on its device.
[[nodiscard]] std::vector<at::Tensor> empty_results(const BoundCall& call, c10::ScalarType dtype);

/// Throws the ConvergenceError of a call whose rows did not all converge: `converged`,
/// `reasons` and `residual_norms` over its rows (see ConvergenceError).
[[noreturn]] void throw_failed_rows(const at::Tensor& converged, double worst_residual,
                                    std::vector<at::Tensor> results, const at::Tensor& reasons,
                                    const at::Tensor& residual_norms);

} // namespace neml2::detail

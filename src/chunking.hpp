#pragma once

// Cutting a bound call into row chunks on a compute device, and gathering the chunk
// results into preallocated outputs on the input device (src/chunking.cpp).

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "call.hpp"
#include "result_memory.hpp"
#include <neml2/errors.hpp>

namespace neml2::detail {

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

/// Throws the ConvergenceError of a call whose rows did not all converge.
[[noreturn]] void throw_failed_rows(const at::Tensor& converged, double worst_residual,
                                    std::vector<at::Tensor> results);

/// The results of a call run as one chunk: sums taken, batch axis as called.
[[nodiscard]] std::vector<at::Tensor> finish_whole(const BoundCall& call,
                                                   std::vector<at::Tensor> results);

/// What a call's chunk on the CPU should hold at most: its inputs and results in about
/// this many bytes, so that a chunk's results are still in cache when they are copied.
inline constexpr std::int64_t piece_bytes = std::int64_t(2) << 20;
/// The fewest and most rows of a piece.
inline constexpr std::int64_t min_piece_rows = 1024, max_piece_rows = 65536;

/// The rows of the pieces a whole-batch call on the CPU runs in (a power of two, about
/// piece_bytes of inputs and results), or 0 when it should run as one piece: on another
/// device, or when the batch is no larger than one piece.
[[nodiscard]] std::int64_t piece_rows(const BoundCall& call, c10::ScalarType dtype);

/// Where a chunk's results will be written: rows [first, first + rows) of each of
/// `results` (a call's outputs, slot order) gathered by rows; nowhere for the other
/// slots, and for all of them off the CPU. A chunk run on the CPU may compute them in
/// place (see SessionAccess::run).
[[nodiscard]] Places places(const BoundCall& call, const std::vector<at::Tensor>& results,
                            std::int64_t first, std::int64_t rows);

/// "[2, 6]": a shape for error messages.
[[nodiscard]] std::string shape_text(c10::IntArrayRef shape);

/// The caller's tensors as a Gatherer writes them: each checked against its result's
/// shape (batch axis as called), the dtype and its layout, before anything runs.
[[nodiscard]] std::vector<at::Tensor> writable(const BoundCall& call, c10::ScalarType dtype,
                                               const Destinations& into);

/// Writes results (as a whole-batch call returns them) into the caller's tensors.
void copy_into(const std::vector<at::Tensor>& into, const BoundCall& call,
               const std::vector<at::Tensor>& results);

/// @brief Collects chunk results into outputs allocated once on the input device, or
/// into the caller's tensors (see writable()).
/// Chunks may arrive in any order and, when `concurrent`, from several threads at once:
/// rows go straight into their place, sums are added in chunk order at the end (the same
/// whatever order chunks complete in), and chunks whose solve failed in some rows are
/// merged into one ConvergenceError over the whole batch.
class Gatherer {
public:
  Gatherer(const BoundCall& call, c10::ScalarType dtype, bool concurrent = false,
           std::vector<at::Tensor> into = {});

  /// The results of chunk `index`, rows [first, first + rows), in slot order.
  void add(std::size_t index, std::int64_t first, std::int64_t rows,
           const std::vector<at::Tensor>& chunk);

  /// Where chunk rows [first, first + rows) will be written (see places()).
  [[nodiscard]] Places places(std::int64_t first, std::int64_t rows) const {
    return detail::places(_call, _results, first, rows);
  }

  /// A chunk whose solve failed in some rows: its results (converged rows filled) and
  /// which rows converged.
  void add_failed_rows(std::size_t index, std::int64_t first, std::int64_t rows,
                       const ConvergenceError& error);

  /// The gathered results, batch axis as called (the caller's own tensors when it gave
  /// them); a ConvergenceError over the whole batch if any chunk failed in some rows.
  [[nodiscard]] std::vector<at::Tensor> finish() &&;

private:
  [[nodiscard]] std::unique_lock<std::mutex> _lock();

  const BoundCall& _call;
  std::vector<at::Tensor> _results;
  bool _into;                   // _results are the caller's tensors
  bool _concurrent;             // chunks arrive from several threads
  bool _sums_or_shared = false; // a slot not gathered by rows: add() takes the lock
  std::mutex _mutex;            // shared and summed slots and the failed rows, when concurrent
  std::vector<bool> _shared_taken;
  std::map<std::size_t, std::vector<at::Tensor>> _sums; // per chunk, in chunk order
  at::Tensor _converged;                                // (batch,) once a chunk failed
  double _worst_residual = 0;
};

} // namespace neml2::detail

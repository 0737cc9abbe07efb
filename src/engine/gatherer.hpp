#pragma once

// Gathering a call's chunk results into outputs allocated once on the input device, or
// into the caller's tensors (src/engine/gatherer.cpp).

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include <neml2/errors.hpp>

#include "engine/placement.hpp"

namespace neml2::detail {

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

  /// The results of chunk `index` (its piece `piece`, when the chunk ran in pieces), rows
  /// [first, first + rows), in slot order.
  void add(std::size_t index, std::int64_t first, std::int64_t rows,
           const std::vector<at::Tensor>& chunk, std::size_t piece = 0);

  /// Where chunk rows [first, first + rows) will be written (see places()).
  [[nodiscard]] Places places(std::int64_t first, std::int64_t rows) const {
    return detail::places(_call, _results, first, rows);
  }

  /// A chunk whose solve failed in some rows: its results (converged rows filled), which
  /// rows converged, why the others failed and their residual norms.
  void add_failed_rows(std::size_t index, std::int64_t first, std::int64_t rows,
                       const ConvergenceError& error, std::size_t piece = 0);

  /// Calls f(tensor) for each tensor chunks made (results, sums, the converged mask): the
  /// asynchronous engine hands them to the calling thread's streams before finish().
  template <class F>
  void for_each_made(F&& f) const {
    if (!_into)
      for (const auto& t : _results)
        f(t);
    for (const auto& [index, sums] : _sums)
      for (const auto& t : sums)
        f(t);
    f(_converged);
    f(_reasons);
    f(_residual_norms);
  }

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
  // per chunk and piece, in that order
  std::map<std::pair<std::size_t, std::size_t>, std::vector<at::Tensor>> _sums;
  at::Tensor _converged; // (batch,) once a chunk failed, with why and each row's ||r||
  at::Tensor _reasons, _residual_norms;
  double _worst_residual = 0;
};

} // namespace neml2::detail

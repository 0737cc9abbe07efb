#pragma once

/// @file detail/chunking.hpp
/// @brief Cutting a bound call into row chunks on a compute device, and gathering the
/// chunk results into preallocated outputs on the input device.

#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <neml2/detail/call.hpp>
#include <neml2/errors.hpp>

namespace neml2::detail {

/// One tensor's rows [first, first + rows) on `device`, `(rows, *trailing)`, contiguous:
/// a leading size of 1 is broadcast, anything else narrowed (a view) then moved.
inline at::Tensor take_rows(const at::Tensor& t, std::int64_t first, std::int64_t rows,
                            c10::Device device) {
  if (!t.defined())
    return t;
  const auto on_device = [&](const at::Tensor& x) {
    return x.device() == device ? x : x.to(device); // to() costs a dispatch even when a no-op
  };
  if (t.size(0) == rows)
    return on_device(t).contiguous();
  if (t.size(0) == 1) {
    auto sizes = t.sizes().vec();
    sizes[0] = rows;
    return on_device(t).expand(sizes).contiguous();
  }
  return on_device(t.narrow(0, first, rows)).contiguous();
}

inline void take_rows(const std::vector<at::Tensor>& from, std::int64_t first, std::int64_t rows,
                      c10::Device device, std::vector<at::Tensor>& to) {
  to.clear();
  to.reserve(from.size());
  for (const auto& t : from)
    to.push_back(take_rows(t, first, rows, device));
}

/// Rows [first, first + rows) of a call as one chunk's arguments on `device`.
inline void take_rows(const BoundCall& call, std::int64_t first, std::int64_t rows,
                      c10::Device device, ChunkArgs& chunk) {
  chunk.rows = rows;
  take_rows(call.inputs, first, rows, device, chunk.inputs);
  take_rows(call.params, first, rows, device, chunk.params);
  take_rows(call.extras, first, rows, device, chunk.extras);
}

/// The whole call as one chunk, reusing its tensor lists: nothing is copied for batched
/// tensors already on `device` (the call's tensors are moved out).
inline void take_all(BoundCall& call, c10::Device device, ChunkArgs& chunk) {
  const auto whole = [&](std::vector<at::Tensor>& tensors) {
    for (auto& t : tensors)
      t = take_rows(t, 0, call.batch, device);
    return std::move(tensors);
  };
  chunk.rows = call.batch;
  chunk.inputs = whole(call.inputs);
  chunk.params = whole(call.params);
  chunk.extras = whole(call.extras);
}

/// Throws the ConvergenceError of a call whose rows did not all converge.
[[noreturn]] inline void throw_failed_rows(const at::Tensor& converged, double worst_residual,
                                           std::vector<at::Tensor> results) {
  const auto failed = converged.numel() - converged.sum().item<std::int64_t>();
  throw ConvergenceError(std::to_string(failed) + " of " + std::to_string(converged.numel()) +
                             " rows did not converge (worst residual norm " +
                             std::to_string(worst_residual) +
                             "); the converged rows' results are in outputs(): cut the "
                             "step where converged_mask() is false and retry those rows",
                         converged, worst_residual, std::move(results));
}

/// Result `i` without its batch axis when nothing in the call had one.
inline at::Tensor as_called(const BoundCall& call, std::size_t i, const at::Tensor& result) {
  return call.slots()[i].gather == Gather::rows && !call.batched ? result.squeeze(0) : result;
}

/// The results of a call run as one chunk: sums taken, batch axis as called.
inline std::vector<at::Tensor> finish_whole(const BoundCall& call,
                                            std::vector<at::Tensor> results) {
  for (std::size_t i = 0; i < results.size(); ++i)
    results[i] =
        call.slots()[i].gather == Gather::sum ? results[i].sum(0) : as_called(call, i, results[i]);
  return results;
}

inline std::string shape_text(c10::IntArrayRef shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i)
    text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

/// The caller's tensors as a Gatherer writes them: each checked against its result's
/// shape (batch axis as called), the dtype and its layout, before anything runs.
inline std::vector<at::Tensor> writable(const BoundCall& call, c10::ScalarType dtype,
                                        const Destinations& into) {
  std::vector<at::Tensor> targets;
  for (std::size_t i = 0; i < call.slots().size(); ++i) {
    const auto& slot = call.slots()[i];
    const auto& t = into.tensors[i];
    const auto& label = into.labels[i];
    const bool rows = slot.gather == Gather::rows;
    auto expected = slot.shape;
    if (rows && call.batched)
      expected.insert(expected.begin(), call.batch);
    if (!t.defined())
      throw FatalError(label + " is an undefined tensor; pass one of shape " +
                       shape_text(expected));
    if (t.sizes() != c10::IntArrayRef(expected))
      throw FatalError(label + " has shape " + shape_text(t.sizes()) + ", but this call's " +
                       "result has shape " + shape_text(expected) +
                       ": pass a tensor of that shape (any strides, on any device)");
    if (t.scalar_type() != dtype)
      throw FatalError(label + " has dtype " + c10::toString(t.scalar_type()) +
                       ", but the model "
                       "computes " +
                       c10::toString(dtype) + ": pass a " + c10::toString(dtype) + " tensor");
    if (at::has_internal_overlap(t) == at::MemOverlap::Yes)
      throw FatalError(label +
                       " has elements that share memory (an expanded or broadcast "
                       "view): pass a tensor whose elements are distinct, e.g. a slice of a "
                       "contiguous one");
    targets.push_back(rows && !call.batched ? t.unsqueeze(0) : t);
  }
  return targets;
}

/// @brief Collects chunk results into outputs allocated once on the input device, or
/// into the caller's tensors (see writable()).
/// Chunks may arrive in any order and, when `concurrent`, from several threads at once:
/// rows go straight into their place, sums are added in chunk order at the end (the same
/// whatever order chunks complete in), and chunks whose solve failed in some rows are
/// merged into one ConvergenceError over the whole batch.
class Gatherer {
public:
  Gatherer(const BoundCall& call, c10::ScalarType dtype, bool concurrent = false,
           std::vector<at::Tensor> into = {})
      : _call(call)
      , _results(std::move(into))
      , _into(!_results.empty())
      , _concurrent(concurrent)
      , _shared_taken(call.slots().size(), false) {
    for (const auto& slot : call.slots())
      _sums_or_shared = _sums_or_shared || slot.gather != Gather::rows;
    if (_into) {
      for (std::size_t i = 0; i < _results.size(); ++i)
        if (call.slots()[i].gather == Gather::sum && call.batch == 0)
          _results[i].zero_();
      return;
    }
    _results.resize(call.slots().size());
    const auto options = at::TensorOptions().dtype(dtype).device(call.device);
    for (std::size_t i = 0; i < _results.size(); ++i) {
      const auto& slot = call.slots()[i];
      if (slot.gather == Gather::rows || (slot.gather == Gather::shared && call.batch == 0)) {
        auto sizes = slot.shape;
        sizes.insert(sizes.begin(), call.batch);
        _results[i] = at::empty(sizes, options);
      } else if (slot.gather == Gather::sum && call.batch == 0)
        _results[i] = at::zeros(slot.shape, options);
    }
  }

  /// The results of chunk `index`, rows [first, first + rows), in slot order.
  void add(std::size_t index, std::int64_t first, std::int64_t rows,
           const std::vector<at::Tensor>& chunk) {
    for (std::size_t i = 0; i < _results.size(); ++i)
      if (_call.slots()[i].gather == Gather::rows)
        _results[i].narrow(0, first, rows).copy_(chunk[i]);
    if (_sums_or_shared) {
      auto lock = _lock();
      for (std::size_t i = 0; i < _results.size(); ++i)
        if (_call.slots()[i].gather == Gather::shared && !_shared_taken[i]) {
          _into ? void(_results[i].copy_(chunk[i])) : void(_results[i] = chunk[i]);
          _shared_taken[i] = true;
        } else if (_call.slots()[i].gather == Gather::sum)
          _sums[index].push_back(chunk[i].sum(0));
    }
  }

  /// A chunk whose solve failed in some rows: its results (converged rows filled) and
  /// which rows converged.
  void add_failed_rows(std::size_t index, std::int64_t first, std::int64_t rows,
                       const ConvergenceError& error) {
    if (error.results().size() == _results.size())
      add(index, first, rows, error.results());
    else
      for (std::size_t i = 0; i < _results.size(); ++i)
        if (_call.slots()[i].gather == Gather::rows)
          _results[i].narrow(0, first, rows).fill_(std::numeric_limits<double>::quiet_NaN());
    auto lock = _lock();
    if (!_converged.defined())
      _converged =
          at::ones({_call.batch}, at::TensorOptions().dtype(at::kBool).device(_call.device));
    _converged.narrow(0, first, rows).copy_(error.converged_mask());
    _worst_residual = std::isnan(error.worst_residual()) || std::isnan(_worst_residual)
                          ? std::numeric_limits<double>::quiet_NaN()
                          : std::max(_worst_residual, error.worst_residual());
  }

  /// The gathered results, batch axis as called (the caller's own tensors when it gave
  /// them); a ConvergenceError over the whole batch if any chunk failed in some rows.
  [[nodiscard]] std::vector<at::Tensor> finish() && {
    for (std::size_t i = 0, k = 0; i < _results.size(); ++i) {
      if (_call.slots()[i].gather != Gather::sum || _sums.empty())
        continue;
      at::Tensor total;
      for (const auto& [index, sums] : _sums) // chunk order
        total = total.defined() ? total + sums[k] : sums[k];
      _into ? void(_results[i].copy_(total)) : void(_results[i] = total);
      ++k;
    }
    if (!_into)
      for (std::size_t i = 0; i < _results.size(); ++i)
        _results[i] = as_called(_call, i, _results[i].to(_call.device));
    if (_converged.defined())
      throw_failed_rows(_converged, _worst_residual, std::move(_results));
    return std::move(_results);
  }

private:
  [[nodiscard]] std::unique_lock<std::mutex> _lock() {
    return _concurrent ? std::unique_lock(_mutex) : std::unique_lock<std::mutex>();
  }

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

/// Writes results (as a whole-batch call returns them) into the caller's tensors.
inline void copy_into(const std::vector<at::Tensor>& into, const BoundCall& call,
                      const std::vector<at::Tensor>& results) {
  for (std::size_t i = 0; i < into.size(); ++i) {
    const bool unbatched_rows = call.slots()[i].gather == Gather::rows && !call.batched;
    into[i].copy_(unbatched_rows ? results[i].unsqueeze(0) : results[i]);
  }
}

} // namespace neml2::detail

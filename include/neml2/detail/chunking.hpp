#pragma once

/// @file detail/chunking.hpp
/// @brief Cutting a bound call into row chunks on a compute device, and gathering the
/// chunk results into preallocated outputs on the input device.

#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <neml2/detail/call.hpp>

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

/// @brief Collects chunk results into outputs allocated once, on the input device.
class Gatherer {
public:
  Gatherer(const BoundCall& call, c10::ScalarType dtype)
      : _call(call)
      , _results(call.slots().size()) {
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

  /// The results of rows [first, first + rows), in slot order.
  void add(std::int64_t first, std::int64_t rows, const std::vector<at::Tensor>& chunk) {
    for (std::size_t i = 0; i < _results.size(); ++i) {
      switch (_call.slots()[i].gather) {
      case Gather::rows:
        _results[i].narrow(0, first, rows).copy_(chunk[i]);
        break;
      case Gather::shared:
        if (!_results[i].defined())
          _results[i] = chunk[i];
        break;
      case Gather::sum:
        _results[i] = _results[i].defined() ? _results[i] + chunk[i].sum(0) : chunk[i].sum(0);
        break;
      }
    }
  }

  [[nodiscard]] std::vector<at::Tensor> finish() && {
    for (std::size_t i = 0; i < _results.size(); ++i)
      _results[i] = as_called(_call, i, _results[i].to(_call.device));
    return std::move(_results);
  }

private:
  const BoundCall& _call;
  std::vector<at::Tensor> _results;
};

} // namespace neml2::detail

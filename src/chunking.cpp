// Chunking a bound call and gathering its chunks' results (see chunking.hpp).

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include "chunking.hpp"
#include "worker_pool.hpp"

#include "result_memory.hpp"

namespace neml2::detail {
namespace {
// `to.copy_(from)`; between dense CPU tensors of one shape and dtype, one memcpy on this
// thread: torch's copy costs a dispatch, and above 32768 elements an OpenMP team, which
// on a thread other than the one that made the team waits for it (see performance.md).
// Nothing when `from` is `to` already (it landed in place: see Landing).
void copy_rows(const at::Tensor& to, const at::Tensor& from) {
  if (to.is_cpu() && from.is_cpu() && to.scalar_type() == from.scalar_type() &&
      to.sizes() == from.sizes() && to.is_contiguous() && from.is_contiguous()) {
    if (to.data_ptr() != from.const_data_ptr())
      std::memcpy(to.data_ptr(), from.const_data_ptr(), to.nbytes());
  } else
    to.copy_(from);
}
} // namespace

at::Tensor take_rows(const at::Tensor& t, std::int64_t first, std::int64_t rows,
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

namespace {
void take_rows_of(const std::vector<at::Tensor>& from, std::int64_t first, std::int64_t rows,
                  c10::Device device, std::vector<at::Tensor>& to) {
  to.clear();
  to.reserve(from.size());
  for (const auto& t : from)
    to.push_back(take_rows(t, first, rows, device));
}
} // namespace

void take_rows(const BoundCall& call, std::int64_t first, std::int64_t rows, c10::Device device,
               ChunkArgs& chunk) {
  chunk.rows = rows;
  take_rows_of(call.inputs, first, rows, device, chunk.inputs);
  take_rows_of(call.params, first, rows, device, chunk.params);
  take_rows_of(call.extras, first, rows, device, chunk.extras);
}

void take_all(BoundCall& call, c10::Device device, ChunkArgs& chunk) {
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

void throw_failed_rows(const at::Tensor& converged, double worst_residual,
                       std::vector<at::Tensor> results) {
  const auto failed = converged.numel() - converged.sum().item<std::int64_t>();
  throw ConvergenceError(std::to_string(failed) + " of " + std::to_string(converged.numel()) +
                             " rows did not converge (worst residual norm " +
                             std::to_string(worst_residual) +
                             "); the converged rows' results are in outputs(): cut the "
                             "step where converged_mask() is false and retry those rows",
                         converged, worst_residual, std::move(results));
}

namespace {
// Result `i` without its batch axis when nothing in the call had one.
at::Tensor as_called(const BoundCall& call, std::size_t i, const at::Tensor& result) {
  return call.slots()[i].gather == Gather::rows && !call.batched ? result.squeeze(0) : result;
}

} // namespace

std::vector<at::Tensor> finish_whole(const BoundCall& call, std::vector<at::Tensor> results) {
  for (std::size_t i = 0; i < results.size(); ++i)
    results[i] =
        call.slots()[i].gather == Gather::sum ? results[i].sum(0) : as_called(call, i, results[i]);
  return results;
}

std::int64_t piece_rows(const BoundCall& call, c10::ScalarType dtype) {
  if (!call.device.is_cpu())
    return 0;
  std::int64_t values = 0; // per row, read and written
  for (const auto* tensors : {&call.inputs, &call.params, &call.extras})
    for (const auto& t : *tensors)
      if (t.defined() && t.dim() > 0 && t.size(0) == call.batch && t.size(0) > 0)
        values += t.numel() / t.size(0);
  for (const auto& slot : call.slots())
    if (slot.gather == Gather::rows)
      values += numel(slot.shape);
  const auto row_bytes =
      std::max<std::int64_t>(values, 1) * static_cast<std::int64_t>(c10::elementSize(dtype));
  const auto rows = std::clamp(piece_bytes / row_bytes, min_piece_rows, max_piece_rows);
  const auto piece = static_cast<std::int64_t>(std::bit_floor(static_cast<std::uint64_t>(rows)));
  return call.batch > piece ? piece : 0;
}

Places places(const BoundCall& call, const std::vector<at::Tensor>& results, std::int64_t first,
              std::int64_t rows) {
  Places at(results.size());
  if (!call.device.is_cpu())
    return at;
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    if (call.slots()[i].gather != Gather::rows || r.dim() == 0 || r.size(0) == 0)
      continue;
    const auto whole = place_of(r); // rows of a dense tensor: a dense range of it
    const auto row = whole.bytes / static_cast<std::size_t>(r.size(0));
    if (whole.data)
      at[i] = {static_cast<char*>(whole.data) + static_cast<std::size_t>(first) * row,
               static_cast<std::size_t>(rows) * row};
  }
  return at;
}

std::string shape_text(c10::IntArrayRef shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i)
    text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

std::vector<at::Tensor> writable(const BoundCall& call, c10::ScalarType dtype,
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

Gatherer::Gatherer(const BoundCall& call, c10::ScalarType dtype, bool concurrent,
                   std::vector<at::Tensor> into)
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
      _results[i] = call.device.is_cpu() ? empty_result(sizes, dtype) : at::empty(sizes, options);
    } else if (slot.gather == Gather::sum && call.batch == 0)
      _results[i] = at::zeros(slot.shape, options);
  }
}

void Gatherer::add(std::size_t index, std::int64_t first, std::int64_t rows,
                   const std::vector<at::Tensor>& chunk) {
  for (std::size_t i = 0; i < _results.size(); ++i)
    if (_call.slots()[i].gather == Gather::rows)
      copy_rows(_results[i].narrow(0, first, rows), chunk[i]);
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

void Gatherer::add_failed_rows(std::size_t index, std::int64_t first, std::int64_t rows,
                               const ConvergenceError& error) {
  if (error.results().size() == _results.size())
    add(index, first, rows, error.results());
  else
    for (std::size_t i = 0; i < _results.size(); ++i)
      if (_call.slots()[i].gather == Gather::rows)
        _results[i].narrow(0, first, rows).fill_(std::numeric_limits<double>::quiet_NaN());
  auto lock = _lock();
  if (!_converged.defined())
    _converged = at::ones({_call.batch}, at::TensorOptions().dtype(at::kBool).device(_call.device));
  _converged.narrow(0, first, rows).copy_(error.converged_mask());
  _worst_residual = std::isnan(error.worst_residual()) || std::isnan(_worst_residual)
                        ? std::numeric_limits<double>::quiet_NaN()
                        : std::max(_worst_residual, error.worst_residual());
}

std::vector<at::Tensor> Gatherer::finish() && {
  // What chunks made on workers' streams (shared blocks, sums, the converged mask) goes to
  // the calling thread, which finishes every call: its stream owns them from now on.
  if (!_into)
    for (const auto& t : _results)
      own_on_this_stream(t);
  for (const auto& [index, sums] : _sums)
    for (const auto& t : sums)
      own_on_this_stream(t);
  own_on_this_stream(_converged);
  for (std::size_t i = 0, k = 0; i < _results.size(); ++i) {
    if (_call.slots()[i].gather != Gather::sum || _sums.empty())
      continue;
    // Chunk order, each sum first moved to the input device: chunks computed on several
    // devices add on one (cuda:0 + cuda:1, or cpu + cuda, would throw).
    at::Tensor total;
    for (const auto& [index, sums] : _sums) {
      const auto sum = sums[k].to(_call.device);
      total = total.defined() ? total + sum : sum;
    }
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

std::unique_lock<std::mutex> Gatherer::_lock() {
  return _concurrent ? std::unique_lock(_mutex) : std::unique_lock<std::mutex>();
}

void copy_into(const std::vector<at::Tensor>& into, const BoundCall& call,
               const std::vector<at::Tensor>& results) {
  for (std::size_t i = 0; i < into.size(); ++i) {
    const bool unbatched_rows = call.slots()[i].gather == Gather::rows && !call.batched;
    copy_rows(into[i], unbatched_rows ? results[i].unsqueeze(0) : results[i]);
  }
}

} // namespace neml2::detail

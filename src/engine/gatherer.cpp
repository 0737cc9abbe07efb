// Gathering a call's chunk results (see gatherer.hpp).

#include "engine/gatherer.hpp"

#include <cmath>
#include <limits>

#include <ATen/ATen.h>

namespace neml2::detail {

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
                   const std::vector<at::Tensor>& chunk, std::size_t piece) {
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
        _sums[{index, piece}].push_back(chunk[i].sum(0));
  }
}

void Gatherer::add_failed_rows(std::size_t index, std::int64_t first, std::int64_t rows,
                               const ConvergenceError& error, std::size_t piece) {
  if (error.results().size() == _results.size())
    add(index, first, rows, error.results(), piece);
  else
    for (std::size_t i = 0; i < _results.size(); ++i)
      if (_call.slots()[i].gather == Gather::rows)
        _results[i].narrow(0, first, rows).fill_(std::numeric_limits<double>::quiet_NaN());
  auto lock = _lock();
  if (!_converged.defined()) { // the other chunks' rows converged
    const auto options = at::TensorOptions().device(_call.device);
    _converged = at::ones({_call.batch}, options.dtype(at::kBool));
    _reasons = at::zeros({_call.batch}, options.dtype(at::kChar)); // RowFailure::none
    _residual_norms = at::zeros({_call.batch}, options.dtype(at::kDouble));
  }
  _converged.narrow(0, first, rows).copy_(error.converged_mask());
  _reasons.narrow(0, first, rows).copy_(error.reasons());
  _residual_norms.narrow(0, first, rows).copy_(error.residual_norms());
  _worst_residual = std::isnan(error.worst_residual()) || std::isnan(_worst_residual)
                        ? std::numeric_limits<double>::quiet_NaN()
                        : std::max(_worst_residual, error.worst_residual());
}

std::vector<at::Tensor> Gatherer::finish() && {
  for (std::size_t i = 0, k = 0; i < _results.size(); ++i) {
    if (_call.slots()[i].gather != Gather::sum || _sums.empty())
      continue;
    // Chunk order, each sum first moved to the input device: chunks computed on several
    // devices add on one (cuda:0 + cuda:1, or cpu + cuda, would throw).
    at::Tensor total;
    for (const auto& [chunk, sums] : _sums) {
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
    throw_failed_rows(_converged, _worst_residual, std::move(_results), _reasons, _residual_norms);
  return std::move(_results);
}

std::unique_lock<std::mutex> Gatherer::_lock() {
  return _concurrent ? std::unique_lock(_mutex) : std::unique_lock<std::mutex>();
}

} // namespace neml2::detail

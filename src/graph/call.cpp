// A chunk's arguments taken from a bound call, and a call's results as it was made.

#include "graph/call.hpp"

#include <ATen/ATen.h>

namespace neml2::detail {

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

at::Tensor as_called(const BoundCall& call, std::size_t i, const at::Tensor& result) {
  return call.slots()[i].gather == Gather::rows && !call.batched ? result.squeeze(0) : result;
}

std::vector<at::Tensor> finish_whole(const BoundCall& call, std::vector<at::Tensor> results) {
  for (std::size_t i = 0; i < results.size(); ++i)
    results[i] =
        call.slots()[i].gather == Gather::sum ? results[i].sum(0) : as_called(call, i, results[i]);
  return results;
}

std::vector<at::Tensor> empty_results(const BoundCall& call, c10::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype).device(call.device);
  std::vector<at::Tensor> results;
  for (std::size_t i = 0; i < call.slots().size(); ++i) {
    const auto& slot = call.slots()[i];
    auto sizes = slot.shape;
    if (slot.gather != Gather::sum)
      sizes.insert(sizes.begin(), 0);
    results.push_back(slot.gather == Gather::sum ? at::zeros(sizes, options)
                                                 : as_called(call, i, at::empty(sizes, options)));
  }
  return results;
}

void throw_failed_rows(const at::Tensor& converged, double worst_residual,
                       std::vector<at::Tensor> results, const at::Tensor& reasons,
                       const at::Tensor& residual_norms) {
  const auto failed = converged.numel() - converged.sum().item<std::int64_t>();
  throw ConvergenceError(
      std::to_string(failed) + " of " + std::to_string(converged.numel()) +
          " rows did not converge (worst residual norm " + std::to_string(worst_residual) +
          "); the converged rows' results are in outputs(): cut the "
          "step where converged_mask() is false and retry those rows",
      converged, worst_residual, std::move(results), {}, reasons, residual_norms);
}

} // namespace neml2::detail

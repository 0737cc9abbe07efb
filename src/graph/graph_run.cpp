// Running one compiled graph: every call's arguments checked against its signature,
// padded or split to its exported batch range, its results checked; on the CPU, the model
// container called directly.

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/ScopeExit.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <neml2/errors.hpp>

#include "core/shape_text.hpp"
#include "graph/container_entry.hpp"
#include "graph/graph.hpp"
#include "graph/graph_calls.hpp"
#include "graph/graph_padding.hpp"
#include "graph/landing.hpp"
#include "graph/recycling.hpp"

namespace neml2::detail {
namespace {

std::atomic<const GraphCallObserver*> graph_call_observer{nullptr};

// The calling thread's current stream of `device`, for the runner (which, given none, takes
// the current stream of whichever device is current); none on the CPU.
void* stream_of(c10::Device device) {
  return device.is_cpu()
             ? nullptr
             : c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
}

} // namespace

void observe_graph_calls(GraphCallObserver observer) {
  const auto* kept = observer ? new GraphCallObserver(std::move(observer)) : nullptr;
  delete graph_call_observer.exchange(kept);
}

std::vector<at::Tensor> Graph::run(const std::vector<at::Tensor>& given) const {
  // Graphs read their arguments as dense row-major arrays, but results of other graphs can
  // come back column-major (J2's flow direction has strides (1, B)).
  std::vector<at::Tensor> dense;
  for (std::size_t i = 0; i < given.size(); ++i)
    if (given[i].defined() && !given[i].is_contiguous()) {
      if (dense.empty())
        dense = given;
      dense[i] = given[i].contiguous();
    }
  const auto& args = dense.empty() ? given : dense;
  if (args.size() != _signature.num_inputs)
    fail(fmt::format("called with {} arguments, it takes {}", args.size(), _signature.num_inputs));
  std::int64_t rows = -1;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const auto& in = _signature.inputs[i];
    const auto& t = args[i];
    bool ok = t.defined() && t.dim() == static_cast<std::int64_t>(in.sizes.size());
    for (std::size_t d = 0; ok && d < in.sizes.size(); ++d)
      ok = in.sizes[d] < 0 || t.size(static_cast<std::int64_t>(d)) == in.sizes[d];
    if (ok && in.batched()) {
      ok = rows < 0 || t.size(0) == rows;
      rows = t.size(0);
    }
    if (!ok)
      fail(fmt::format("argument {} has shape {}, the graph takes {}", i,
                       t.defined() ? shape_text(t.sizes()) : "undefined", shape_of(in.sizes)));
  }
  if (_rows_differ && rows >= 0 && rows != _fixed_rows)
    throw FatalError(fmt::format(
        "graph '{}' was compiled for exactly {} rows (neml2-compile with [Settings] "
        "dynamic_batch = false) and gives equal rows different results (a per-row tensor baked "
        "into it, e.g. a [Tensors] entry bound to a coefficient), so a call of {} rows has no "
        "meaning: call it with batches of exactly {} rows (SyncChunking batch_size = {}), or "
        "make that tensor a promoted parameter (-p) and recompile with a dynamic batch",
        _file, _fixed_rows, rows, _fixed_rows, _fixed_rows));
  if (rows > _max_rows)
    return run_split(args, rows);
  if (const auto* observer = graph_call_observer.load(std::memory_order_acquire)) {
    const LandingPause not_the_graph; // what the observer allocates and keeps is its own
    (*observer)(_file, rows < 0 ? 1 : rows);
  }
  if (rows >= 0 && rows < _min_rows && !(rows == 1 && _runs_one_row))
    return run_padded(args, rows);
  return run_checked(args);
}

// Fewer rows than the graph was exported for (one host point, an active set down to one
// row): the last row repeated (zeros for none), the results cut back in place.
std::vector<at::Tensor> Graph::run_padded(const std::vector<at::Tensor>& args,
                                          std::int64_t rows) const {
  std::unique_lock<std::mutex> reuse; // this graph's padded arguments, unless a call has them
  if (_padding)
    reuse = std::unique_lock(_padding->mutex, std::try_to_lock);
  std::vector<at::Tensor> own(reuse.owns_lock() ? 0 : args.size());
  auto& padded = reuse.owns_lock() ? _padding->args : own;
  const auto release = c10::make_scope_exit([&] { // the caller's tensors are not kept
    for (std::size_t i = 0; i < args.size(); ++i)
      if (!_signature.inputs[i].batched())
        padded[i].reset();
  });
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (!_signature.inputs[i].batched()) {
      padded[i] = args[i];
      continue;
    }
    c10::DimVector sizes(args[i].sizes());
    sizes[0] = _min_rows;
    if (rows == 0)
      padded[i] = at::zeros(sizes, args[i].options());
    else if (args[i].is_cpu()) { // copied by hand: a third of the cost of cat/expand
      auto& kept = padded[i];
      if (!kept.defined() || kept.sizes() != c10::IntArrayRef(sizes) ||
          kept.dtype() != args[i].dtype())
        kept = at::empty(sizes, args[i].options());
      const auto row = args[i].nbytes() / rows;
      auto* to = static_cast<char*>(padded[i].data_ptr());
      const auto* from = static_cast<const char*>(args[i].const_data_ptr());
      std::memcpy(to, from, rows * row);
      for (auto r = rows; r < _min_rows; ++r)
        std::memcpy(to + r * row, from + (rows - 1) * row, row);
    } else {
      sizes[0] = _min_rows - rows;
      padded[i] = at::cat({args[i], args[i].narrow(0, rows - 1, 1).expand(sizes)});
    }
  }
  auto results = run_checked(padded);
  for (auto& r : results) {
    if (r.dim() == 0 || r.size(0) != _min_rows)
      continue;
    // A result that is a padded argument (an input passed through, as the same tensor) is
    // copied: the buffer is written again by the next padded call.
    if (std::any_of(padded.begin(), padded.end(),
                    [&](const at::Tensor& a) { return a.defined() && a.is_alias_of(r); }))
      r = r.clone();
    // The graph's own fresh result, cut to the rows asked for in place (strides kept):
    // what narrow() gives without a dispatch.
    r.unsafeGetTensorImpl()->set_size(0, rows);
  }
  return results;
}

// More rows than the graph was exported for: pieces of the largest batch it takes (the
// last padded if need be), their per-row results joined.
std::vector<at::Tensor> Graph::run_split(const std::vector<at::Tensor>& args,
                                         std::int64_t rows) const {
  std::vector<std::vector<at::Tensor>> pieces;
  for (std::int64_t first = 0; first < rows; first += _max_rows) {
    auto part = args;
    for (std::size_t i = 0; i < part.size(); ++i)
      if (_signature.inputs[i].batched())
        part[i] = args[i].narrow(0, first, std::min(_max_rows, rows - first));
    pieces.push_back(run(part));
  }
  auto results = std::move(pieces.front());
  for (std::size_t r = 0; r < results.size(); ++r) {
    if (results[r].dim() == 0 || results[r].size(0) != _max_rows)
      continue; // the same for every row
    std::vector<at::Tensor> parts = {results[r]};
    for (std::size_t p = 1; p < pieces.size(); ++p)
      parts.push_back(pieces[p][r]);
    results[r] = at::cat(parts);
  }
  return results;
}

// One call of the model container on the CPU: new handles for the arguments (the
// container takes them), the results taken from the handles it returns (one tensor may
// come back under several outputs, as one handle).
std::vector<at::Tensor> Graph::run_container(const std::vector<at::Tensor>& args) const {
  namespace aoti = torch::aot_inductor;
  auto& runner = *_loader->get_runner();
  c10::SmallVector<AtenTensorHandle, 8> in, out(_container_outputs, nullptr);
  for (const auto& t : args)
    in.push_back(aoti::new_tensor_handle(at::Tensor(t)));
  const Recycling small_blocks;
  const auto error =
      ContainerEntry::run(runner)(ContainerEntry::container(runner), in.data(), in.size(),
                                  out.data(), out.size(), nullptr, ContainerEntry::proxy(runner));
  if (error != AOTI_RUNTIME_SUCCESS) // the handles are left: taken or not, nothing says
    throw FatalError(fmt::format("running '{}' on {}: the AOTI runtime's call failed (its reason "
                                 "is printed above, on standard error); a graph that fails on "
                                 "inputs this library accepted does not match its artifact: "
                                 "recompile it with neml2-compile",
                                 _file, _device));
  std::vector<at::Tensor> results(out.size());
  for (std::size_t r = 0; r < out.size(); ++r) {
    if (!out[r])
      continue;
    const auto first = std::find(out.begin(), out.begin() + r, out[r]);
    if (first != out.begin() + r) {
      results[r] = results[first - out.begin()];
      continue;
    }
    auto* t = aoti::tensor_handle_to_tensor_pointer(out[r]);
    results[r] = std::move(*t);
    delete t;
  }
  return results;
}

std::vector<at::Tensor> Graph::run_checked(const std::vector<at::Tensor>& args) const {
  std::vector<at::Tensor> results;
  if (_torch_device.is_cpu())
    results = run_container(args);
  else // the runner of each accelerator has its own run_impl(); it is not bypassed
    try {
      results = _loader->run(args, stream_of(_torch_device));
    } catch (const std::exception& e) {
      throw FatalError(fmt::format("running '{}' on {}: {}", _file, _device, first_lines(e.what())),
                       e.what());
    }
  if (results.size() != _signature.num_outputs)
    fail(fmt::format("it returned {} results, its signature says {}", results.size(),
                     _signature.num_outputs));
  if (_results.empty())
    return results;
  std::int64_t rows = 1;
  for (std::size_t i = 0; i < args.size(); ++i)
    if (_signature.inputs[i].batched())
      rows = args[i].size(0);
  for (std::size_t r = 0; r < results.size(); ++r) {
    const auto& t = results[r];
    const auto& expected = _results[r].trailing;
    bool ok = t.defined() && t.scalar_type() == _result_dtype &&
              t.dim() == static_cast<std::int64_t>(expected.size()) + 1 &&
              (t.size(0) == rows || t.size(0) == 1);
    for (std::size_t d = 0; ok && d < expected.size(); ++d) {
      const auto size = t.size(static_cast<std::int64_t>(d) + 1);
      ok = size == expected[d] || (_results[r].broadcast && size == 1);
    }
    if (!ok)
      fail(fmt::format("result {} is {} {}, metadata.json implies {} (B, {})", r,
                       t.defined() ? c10::toString(t.scalar_type()) : "undefined",
                       t.defined() ? shape_text(t.sizes()) : "", c10::toString(_result_dtype),
                       fmt::join(expected, ", ")));
  }
  return results;
}

} // namespace neml2::detail

// Loading one compiled graph and checking it: against its own file name and against what
// metadata.json implies (the checks on every call: graph_run.cpp).

#include "graph/graph.hpp"

#include <algorithm>
#include <iostream>
#include <mutex>
#include <streambuf>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/ScopeExit.h>
#include <fmt/format.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/library.h>

#include <neml2/errors.hpp>

#include "graph/container_entry.hpp"
#include "graph/graph_padding.hpp"

namespace fs = std::filesystem;

namespace neml2::detail {
namespace {

// Some artifacts call neml2::opaque_pow (a pow hidden from Inductor's fusion).
void register_custom_operators() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (c10::Dispatcher::singleton().findSchema({"neml2::opaque_pow", ""}).has_value())
      return;
    static torch::Library library(torch::Library::FRAGMENT, "neml2", std::nullopt, __FILE__,
                                  __LINE__);
    library.def(
        "opaque_pow(Tensor base, Tensor exponent) -> Tensor",
        [](const at::Tensor& base, const at::Tensor& exponent) { return at::pow(base, exponent); });
  });
}

} // namespace

Graph::Graph(const fs::path& leaf, const std::string& package, const c10::Device& device,
             c10::ScalarType dtype, std::size_t runners, std::string listed_as)
    : _file((leaf / package).string())
    , _listed_as(std::move(listed_as))
    , _device(device.str())
    , _torch_device(device) {
  const fs::path file = _file;
  std::error_code ec;
  // A FIFO or a device in its place is read_graph_signature's error: it is no file.
  if (const auto status = fs::status(file, ec); !fs::exists(status) || fs::is_directory(status))
    throw FatalError(fmt::format("graph file '{}' (metadata.json {}) is missing; the artifact "
                                 "is incomplete: recompile it with neml2-compile",
                                 _file, _listed_as));
  _signature = read_graph_signature(file);
  if (_signature.archive_name != file.stem().string())
    throw FatalError(fmt::format(
        "graph file '{}' (metadata.json {}) holds the graph '{}', not '{}': a file was copied "
        "or renamed over another; recompile the artifact with neml2-compile",
        _file, _listed_as, _signature.archive_name, file.stem().string()));
  if (!_signature.device_type.empty() &&
      _signature.device_type != c10::DeviceTypeName(device.type(), true))
    throw FatalError(fmt::format("graph '{}' was compiled for {}, but it sits in the folder of "
                                 "graphs for {}: recompile with neml2-compile --device {}",
                                 _file, _signature.device_type, _device,
                                 c10::DeviceTypeName(device.type(), true)));
  const auto expected = dtype_folder(dtype);
  for (std::size_t i = 0; i < _signature.inputs.size(); ++i) {
    const auto& found = _signature.inputs[i].dtype;
    if (found.starts_with("float") && found != expected)
      throw FatalError(fmt::format(
          "graph '{}' takes {} inputs, but it sits in a {} folder: the artifact's graphs are "
          "not in the dtype their folder names (neml2-compile 3.1 --dtype float32 writes "
          "float64 graphs), and running them on {} data would give garbage. Compile with "
          "--dtype {} and pass {} inputs",
          _file, found, expected, expected, found, found));
  }
  for (const auto& in : _signature.inputs)
    if (in.batched()) {
      _min_rows = std::max(_min_rows, in.min_rows);
      _max_rows = std::min(_max_rows, in.max_rows);
    }
  if (_max_rows < std::max<std::int64_t>(_min_rows, 1))
    fail(fmt::format("its batch range [{}, {}] is empty", _min_rows, _max_rows));
  if (_min_rows > 1 && device.is_cpu()) {
    _padding = std::make_unique<Padding>();
    for (const auto& in : _signature.inputs) {
      auto sizes = in.sizes;
      if (!in.batched() ||
          std::any_of(sizes.begin() + 1, sizes.end(), [](auto d) { return d < 0; })) {
        _padding->args.emplace_back();
        continue;
      }
      sizes.front() = _min_rows;
      const auto type = in.dtype.empty() ? dtype : dtype_from_name(in.dtype);
      _padding->args.push_back(at::empty(sizes, at::TensorOptions().dtype(type)));
    }
  }

  // Loader construction is not thread-safe in torch: one at a time, process-wide.
  static std::mutex construction;
  std::lock_guard lock(construction);
  // Loading for cuda:N makes N the thread's current device: the guard puts back the one
  // the caller had (the probe call of expect() takes the stream of _torch_device anyway).
  c10::OptionalDeviceGuard restore;
  if (!device.is_cpu())
    restore.reset_device(device);
  register_custom_operators();
  _loader =
      translate_foreign_errors(fmt::format("loading '{}' for {}", _file, _device).c_str(), [&] {
        return std::make_unique<torch::inductor::AOTIModelPackageLoader>(
            _file, "model", /*run_single_threaded=*/false,
            /*num_runners=*/runners, device.index());
      });
  _container_outputs = ContainerEntry::outputs(*_loader->get_runner(), _file);
  // Constants folded now, not at the first call: that call folds them under the
  // container's exclusive lock while holding a runner, and a call that holds the shared
  // lock while it waits for a runner would then wait for ever (more threads calling the
  // graph at once than it has runners: CPU lanes beside host threads).
  if (_torch_device.is_cpu()) {
    // (A graph compiled without runtime constant folding says so on std::cerr: nothing to
    // fold, and nothing the user should see. Loads hold a process-wide lock.)
    struct Discard : std::streambuf {
      int overflow(int c) override { return c; }
    } discard;
    auto* const cerr = std::cerr.rdbuf(&discard);
    const auto restore_cerr = c10::make_scope_exit([&] { std::cerr.rdbuf(cerr); });
    translate_foreign_errors(fmt::format("folding the constants of '{}'", _file).c_str(), [&] {
      _loader->get_runner()->run_const_fold(/*use_inactive=*/false);
      return 0;
    });
  }
}

Graph::Graph() = default;
Graph::~Graph() = default;
Graph::Graph(Graph&&) noexcept = default;
Graph& Graph::operator=(Graph&&) noexcept = default;

void Graph::fail(const std::string& what) const {
  throw FatalError(fmt::format("graph '{}' (metadata.json {}) does not match metadata.json: {}; "
                               "the graph belongs to another model or the metadata was edited: "
                               "recompile the artifact with neml2-compile",
                               _file, _listed_as, what));
}

// A graph exported with a static batch (neml2-compile `[Settings] dynamic_batch = false`)
// checks a fixed leading size where a dynamic one checks a range: its batch axes are those
// metadata.json calls batched (-1), or, where it does not say, every input's leading axis
// when all share one size. They become a range [N, N], so the padding and splitting below
// serve other batch sizes; a probe of one row repeated tells whether rows are
// interchangeable at all (a per-row tensor baked in makes each row different).
void Graph::pin_fixed_batch(const std::vector<std::optional<Shape>>& arguments) {
  auto& inputs = _signature.inputs;
  if (_fixed_rows > 0 || inputs.empty() ||
      std::any_of(inputs.begin(), inputs.end(), [](const GraphInput& in) { return in.batched(); }))
    return;
  std::vector<std::size_t> axes;
  for (std::size_t i = 0; i < inputs.size() && i < arguments.size(); ++i)
    if (arguments[i] && !arguments[i]->empty() && arguments[i]->front() < 0)
      axes.push_back(i);
  if (axes.empty() &&
      std::none_of(arguments.begin(), arguments.end(), [](const auto& a) { return a.has_value(); }))
    for (std::size_t i = 0; i < inputs.size(); ++i)
      if (!inputs[i].sizes.empty())
        axes.push_back(i);
  if (axes.empty())
    return;
  const auto rows = inputs[axes.front()].sizes.front();
  for (auto i : axes)
    if (inputs[i].sizes.empty() || inputs[i].sizes.front() != rows)
      return; // no common batch: the argument checks below say what differs
  for (auto i : axes) {
    inputs[i].sizes.front() = -1;
    inputs[i].min_rows = inputs[i].max_rows = rows;
  }
  _fixed_rows = _min_rows = _max_rows = rows;
  if (rows < 2)
    return;
  std::vector<at::Tensor> probe;
  for (const auto& in : inputs) {
    auto sizes = in.sizes;
    const auto options = at::TensorOptions()
                             .dtype(in.dtype.empty() ? _result_dtype : dtype_from_name(in.dtype))
                             .device(_torch_device);
    if (!in.batched()) {
      probe.push_back(at::zeros(sizes, options));
      continue;
    }
    sizes.front() = 1;
    const auto row = at::linspace(0.3, 0.7, numel(Shape(sizes.begin(), sizes.end())), options);
    sizes.front() = rows;
    probe.push_back(row.reshape(Shape(sizes.begin() + 1, sizes.end())).expand(sizes).contiguous());
  }
  std::vector<at::Tensor> results;
  try {
    results = run_checked(probe);
  } catch (const FatalError&) { // cannot tell: refuse other batch sizes rather than guess
    _rows_differ = true;
    return;
  }
  for (const auto& r : results) {
    if (r.dim() == 0 || r.size(0) != rows)
      continue;
    const auto first = r.narrow(0, 0, 1);
    const auto same =
        ((r - first).abs() <= 1e-12 * (1 + first.abs())) | (at::isnan(r) & at::isnan(first));
    _rows_differ = _rows_differ || !same.all().item<bool>();
  }
}

void Graph::expect(const std::vector<std::optional<Shape>>& arguments, std::size_t results) {
  pin_fixed_batch(arguments);
  if (results == unchecked_results)
    return;
  if (_signature.num_inputs != arguments.size())
    fail(fmt::format("it takes {} arguments, metadata.json implies {}", _signature.num_inputs,
                     arguments.size()));
  if (_signature.num_outputs != results)
    fail(fmt::format("it returns {} results, metadata.json implies {}", _signature.num_outputs,
                     results));
  for (std::size_t i = 0; i < arguments.size(); ++i)
    if (arguments[i] && _signature.inputs[i].sizes != *arguments[i])
      fail(fmt::format("argument {} is {} in the graph but {} in metadata.json", i,
                       shape_of(_signature.inputs[i].sizes), shape_of(*arguments[i])));
}

void Graph::expect(const std::vector<std::optional<Shape>>& arguments, std::vector<Result> results,
                   c10::ScalarType dtype) {
  expect(arguments, results.size());
  _results = std::move(results);
  _result_dtype = dtype;
  static_cast<void>(run(zeros(dtype)));
}

void Graph::probe_one_row(c10::ScalarType dtype) {
  if (_min_rows != 2 || _fixed_rows > 0 || !_torch_device.is_cpu() || _max_rows < 2)
    return;
  auto two = zeros(dtype); // two rows of distinct values, then the first alone
  std::vector<at::Tensor> one;
  for (std::size_t i = 0; i < two.size(); ++i) {
    auto& t = two[i];
    if (_signature.inputs[i].batched() && t.is_floating_point())
      t = at::linspace(0.3, 0.7, t.numel(), t.options()).reshape(t.sizes());
    one.push_back(_signature.inputs[i].batched() ? t.narrow(0, 0, 1).contiguous() : t);
  }
  std::vector<at::Tensor> from_two, from_one;
  try {
    from_two = run_checked(two);
    from_one = run_checked(one);
  } catch (const std::exception&) { // cannot tell: stay padded
    return;
  }
  if (from_two.size() != from_one.size())
    return;
  for (std::size_t r = 0; r < from_two.size(); ++r) {
    const auto& a = from_two[r];
    const auto& b = from_one[r];
    const bool per_row = a.dim() > 0 && a.size(0) == 2;
    const auto expected = per_row ? a.narrow(0, 0, 1) : a;
    if (b.sizes() != expected.sizes() || b.dtype() != expected.dtype())
      return;
    if (b.is_floating_point()) {
      if (!((b == expected) | (at::isnan(b) & at::isnan(expected))).all().item<bool>())
        return;
    } else if (!at::equal(b, expected))
      return;
  }
  _runs_one_row = true;
}

std::vector<Shape> Graph::result_shapes(c10::ScalarType dtype) const {
  const auto rows = std::max<std::int64_t>(_min_rows, 1);
  std::vector<Shape> shapes;
  for (const auto& r : run(zeros(dtype))) {
    if (r.dim() == 0 || r.size(0) != rows)
      throw FatalError(fmt::format("graph '{}' (metadata.json {}) returned a result of shape {} "
                                   "from {} rows: every result must have one row per row; "
                                   "recompile the artifact with neml2-compile",
                                   _file, _listed_as, shape_of(r.sizes().vec()), rows));
    shapes.emplace_back(r.sizes().begin() + 1, r.sizes().end());
  }
  return shapes;
}

// Zeros of the shapes the graph takes, at its smallest batch.
std::vector<at::Tensor> Graph::zeros(c10::ScalarType dtype) const {
  std::vector<at::Tensor> args;
  for (const auto& in : _signature.inputs) {
    auto sizes = in.sizes;
    for (auto& d : sizes)
      d = d < 0 ? std::max<std::int64_t>(_min_rows, 1) : d;
    const auto type = in.dtype.empty() ? dtype : dtype_from_name(in.dtype);
    args.push_back(at::zeros(sizes, at::TensorOptions().dtype(type).device(_torch_device)));
  }
  return args;
}

} // namespace neml2::detail

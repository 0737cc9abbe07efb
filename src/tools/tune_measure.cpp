// Measuring a real model: inputs generated or tiled to each size, calls timed through
// DispatchedModel<SyncChunking> (one load serves every size; the CPU's chunks on the lanes
// asked for), each device swept, then the overlap and lane tests.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <neml2/detail/tune_decisions.hpp>
#include <neml2/detail/tune_measure.hpp>
#include <neml2/dispatched_model.hpp>
#include <neml2/tune.hpp>

#include "core/cpu_lanes.hpp"
#include "core/stopwatch.hpp"
#include "tools/cuda_driver.hpp"

namespace neml2 {

std::map<std::string, at::Tensor> detail::tune_inputs(const Artifact& artifact,
                                                      const TuneInputs& inputs, std::int64_t rows,
                                                      const Device& device, c10::ScalarType dtype) {
  std::vector<std::string> names;
  for (const auto& v : artifact.inputs)
    names.push_back(v.public_name);
  const auto check_names = [&](const auto& given, const char* what) {
    for (const auto& [name, value] : given)
      if (std::find(names.begin(), names.end(), name) == names.end())
        throw FatalError(fmt::format("tuning inputs: {} names '{}', which is not an input of the "
                                     "model; its inputs are {}",
                                     what, name, fmt::join(names, ", ")));
  };
  check_names(inputs.sample, "the sample");
  check_names(inputs.ranges, "a range");
  const auto options = at::TensorOptions().dtype(dtype).device(device.torch());
  std::map<std::string, at::Tensor> out;
  auto generator = at::detail::createCPUGenerator(inputs.seed);
  for (const auto& v : artifact.inputs) {
    Shape shape = {rows};
    shape.insert(shape.end(), v.sub_batch_shape.begin(), v.sub_batch_shape.end());
    shape.insert(shape.end(), v.base_shape.begin(), v.base_shape.end());
    if (!inputs.sample.empty()) {
      const auto it = inputs.sample.find(v.public_name);
      if (it == inputs.sample.end())
        throw FatalError(fmt::format("tuning inputs: the sample has no '{}'; give every input of "
                                     "the model ({}), or no sample to generate them",
                                     v.public_name, fmt::join(names, ", ")));
      const auto& s = it->second;
      if (s.dim() == 0 || s.size(0) < 1)
        throw FatalError(fmt::format("tuning inputs: the sample's '{}' has no rows; give it as "
                                     "(n, *base) with n >= 1",
                                     v.public_name));
      const auto index = at::arange(rows, at::kLong).remainder(s.size(0)).to(s.device());
      out[v.public_name] = s.index_select(0, index).to(options).contiguous();
      continue;
    }
    const auto range = inputs.ranges.find(v.public_name);
    if (range == inputs.ranges.end() && v.public_name.ends_with("~1")) {
      out[v.public_name] = at::zeros(shape, options);
      continue;
    }
    const auto [low, high] =
        range == inputs.ranges.end() ? std::pair{inputs.low, inputs.high} : range->second;
    if (!(low <= high) || !std::isfinite(low) || !std::isfinite(high))
      throw FatalError(fmt::format("tuning inputs: '{}' would be drawn from [{}, {}]; give its "
                                   "range (or low and high) finite, with low <= high",
                                   v.public_name, low, high));
    out[v.public_name] = at::empty(shape, at::TensorOptions().dtype(dtype))
                             .uniform_(low, high, generator)
                             .to(options);
  }
  return out;
}

namespace {
bool out_of_memory(const std::string& message) {
  for (const char* sign : {"out of memory", "can't allocate", "bad_alloc", "OutOfMemory"})
    if (message.find(sign) != std::string::npos)
      return true;
  return false;
}

// Waits for the device's queued work (a no-op on the CPU).
void synchronize(const Device& device) {
  if (!device.is_accelerator())
    return;
  const auto d = device.torch();
  c10::impl::getDeviceGuardImpl(d.type())->synchronizeDevice(d.has_index() ? d.index() : 0);
}

// Rows that fit: a share of the device's free memory over what one row's inputs and
// outputs take (times a margin for intermediates).
std::int64_t rows_that_fit(const Artifact& artifact, const Device& device, c10::ScalarType dtype) {
  double bytes_per_row = 0;
  for (const auto* list : {&artifact.inputs, &artifact.outputs})
    for (const auto& v : *list)
      bytes_per_row +=
          static_cast<double>(detail::numel(v.sub_batch_shape) * detail::numel(v.base_shape));
  bytes_per_row *= static_cast<double>(c10::elementSize(dtype)) * 16;
  double available = 0;
  if (device.family() == DeviceFamily::cpu) {
    std::ifstream in("/proc/meminfo"); // lines "Key:  N kB" (some without the unit)
    for (std::string line; std::getline(in, line);)
      if (line.starts_with("MemAvailable:")) {
        available = std::strtod(line.c_str() + 13, nullptr) * 1024;
        break;
      }
  }
  if (device.family() == DeviceFamily::cuda)
    available =
        static_cast<double>(detail::cuda_query(device.has_index() ? device.index() : 0).bytes);
  if (available <= 0 || bytes_per_row <= 0)
    return std::numeric_limits<std::int64_t>::max();
  const auto rows = available / bytes_per_row; // a double: converted only once in range
  return rows >= 9.2e18 ? std::numeric_limits<std::int64_t>::max()
                        : std::max<std::int64_t>(1, static_cast<std::int64_t>(rows));
}

} // namespace

Timing detail::measure_calls(const std::function<void()>& call, const Device& device, int warmup,
                             int repeats) {
  const auto start = detail::steady_clock::now();
  Timing timing;
  try {
    for (int i = 0; i < warmup; ++i) {
      call();
      synchronize(device);
    }
    for (int i = 0; i < repeats; ++i) {
      const auto t = detail::steady_clock::now();
      call();
      synchronize(device);
      timing.seconds.push_back(detail::seconds_since(t));
    }
  } catch (const ConvergenceError&) {
    throw;
  } catch (const std::exception& e) {
    if (!out_of_memory(e.what()))
      throw;
    timing = Timing{.out_of_memory = true};
  }
  timing.elapsed = detail::seconds_since(start);
  return timing;
}

namespace {
// SyncChunking whose chunk size the tuner changes between measurements, so that one model
// (one load of the graphs) serves every size; on the CPU `cpu_lanes` chunks run at once.
struct TuningChunks {
  using dispatch_mode = synchronous;
  Device device;
  std::int64_t cpu_lanes = 0;
  std::shared_ptr<std::int64_t> rows = std::make_shared<std::int64_t>(0);
  [[nodiscard]] std::array<Device, 1> devices() const { return {device}; }
  [[nodiscard]] Device compute_device() const { return device; }
  [[nodiscard]] std::int64_t chunk_rows(std::int64_t) const { return *rows; }
};
static_assert(DispatchPolicy<TuningChunks>);

// Times one operation on `rows` rows; inputs that do not converge are the caller's to fix.
template <class Model>
Timing time_operation(const Model& model, const Device& device, const TuneOptions& options,
                      const std::map<std::string, at::Tensor>& inputs, std::int64_t rows) {
  try {
    return detail::measure_calls([&] { detail::call_operation(model, options.operation, inputs); },
                                 device, options.warmup, options.repeats);
  } catch (const ConvergenceError& e) {
    throw FatalError(fmt::format("tuning {} rows on {}: the inputs did not converge ({}); give "
                                 "ranges that keep the model convergent (--range NAME=LOW:HIGH) "
                                 "or a sample of real states",
                                 rows, device.str(), e.what()));
  }
}

// The lane test: calls of batch_rows in chunks at the knee, through the calling thread (on
// the CPU, one chunk per lane) and then through a pool of one device at the chunk recommend()
// gives it (on the CPU, the knee times the lanes, shared by them), each run back to back as
// a host runs them (alternating the two hid a slowdown of the lane that only a busy worker
// shows: J2 in issue 13's bench); what the pool's chunk costs beyond the calling thread's.
double lane_overhead(const DispatchedModel<TuningChunks>& chunked, const TuningChunks& chunks,
                     const std::shared_ptr<const Artifact>& artifact, const DeviceCurve& curve,
                     const TuneOptions& options, int cpu_lanes, std::size_t d) {
  const auto knee = curve.knee().rows;
  const auto pooled = detail::pool_chunk_rows(curve.device, knee, cpu_lanes);
  const auto batch = std::max(options.batch_rows, pooled);
  const auto inputs =
      detail::tune_inputs(*artifact, options.inputs, batch, curve.device, options.dtype);
  const DispatchedModel<GreedyPriorityCapacity> pool(
      artifact,
      GreedyPriorityCapacity{
          .devices = {curve.device}, .batch_sizes = {pooled}, .cpu_lanes = options.cpu_lanes},
      options.dtype);
  *chunks.rows = knee;
  const auto direct = time_operation(chunked, curve.device, options, inputs, batch);
  const auto lane = time_operation(pool, curve.device, options, inputs, batch);
  const auto per_call = batch / pooled + (batch % pooled != 0);
  if (options.on_lane_test)
    options.on_lane_test(d, direct, lane, per_call);
  return detail::chunk_overhead_from(direct.seconds, lane.seconds, per_call);
}
} // namespace

int detail::choose_overlap_chunks(const std::vector<std::pair<int, double>>& measured,
                                  double improvement) {
  double best = 0;
  for (const auto& [chunks, rate] : measured)
    best = std::max(best, rate);
  int chosen = 0;
  for (const auto& [chunks, rate] : measured)
    if (rate * (1 + improvement) >= best && (chosen == 0 || chunks < chosen))
      chosen = chunks;
  return std::max(chosen, 1);
}

double detail::chunk_overhead_from(std::vector<double> direct, std::vector<double> lane,
                                   std::int64_t chunks) {
  if (direct.empty() || lane.empty() || chunks < 1)
    return 0;
  const auto median = [](std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  return std::max(0.0, (median(lane) - median(direct)) / static_cast<double>(chunks));
}

TuneResult tune(const Artifact& artifact, const std::vector<Device>& devices,
                const TuneOptions& options, const std::string& model) {
  if (devices.empty())
    throw FatalError("tune(): no device given; give at least one, e.g. {\"cpu\"}");
  if (options.operation != "forward" && options.operation != "jacobian" &&
      options.operation != "param_jacobian")
    throw FatalError(fmt::format("tune(): operation '{}' is not one tune() measures; use forward, "
                                 "jacobian or param_jacobian",
                                 options.operation));
  if (options.repeats < 1 || options.warmup < 0 || options.batch_rows < 1 || options.max_chunks < 1)
    throw FatalError(fmt::format("tune(): repeats is {}, warmup {}, batch_rows {} and max_chunks "
                                 "{}; give repeats, batch_rows and max_chunks >= 1 and warmup "
                                 ">= 0",
                                 options.repeats, options.warmup, options.batch_rows,
                                 options.max_chunks));
  (void)detail::Sweep(options.sweep); // the sweep as given (each device's own raises min_rows)
  // Lanes out of range refused in tune()'s words (the models below resolve them).
  (void)detail::resolve_cpu_lanes(options.cpu_lanes, {}, detail::LanesAskedBy::tune);
  const auto call_rows = [&](std::int64_t rows) { return std::max(options.batch_rows, rows); };
  // The lanes the CPU is measured on, as the models below resolve them (stated in the file).
  TuneResult result{.model = model,
                    .operation = options.operation,
                    .machine = current_machine(options.dtype, options.cpu_lanes)};
  const auto shared = std::make_shared<const Artifact>(artifact);
  for (std::size_t d = 0; d < devices.size(); ++d) {
    const auto& device = devices[d];
    DeviceCurve curve{.device = device,
                      .device_name = device_name(device),
                      .artifact_hash = artifact_hash(artifact, device, options.dtype)};
    const TuningChunks chunks{.device = device, .cpu_lanes = options.cpu_lanes};
    const DispatchedModel<TuningChunks> chunked(shared, chunks, options.dtype);
    auto sweep_options = options.sweep;
    sweep_options.min_rows =
        std::max(sweep_options.min_rows, (options.batch_rows - 1) / options.max_chunks + 1);
    const auto fit = rows_that_fit(artifact, device, options.dtype);
    // The inputs and outputs alone of a batch past 16 x fit (its margin) exceed the memory.
    if (fit <= std::numeric_limits<std::int64_t>::max() / 16 && options.batch_rows > 16 * fit)
      throw FatalError(fmt::format("tune(): a batch of {} rows does not fit in the free memory of "
                                   "{} (about {} rows do); give a smaller batch",
                                   options.batch_rows, device.str(), 16 * fit));
    sweep_options.max_rows =
        std::max(sweep_options.min_rows, std::min(sweep_options.max_rows, fit));
    sweep_options.also.push_back(std::min(options.batch_rows, sweep_options.max_rows));
    // One call of batch_rows (or of the size, when larger) in chunks of the size.
    const auto sweep = detail::run_sweep(
        [&](std::int64_t rows) {
          const auto batch = call_rows(rows);
          const auto inputs =
              detail::tune_inputs(artifact, options.inputs, batch, device, options.dtype);
          *chunks.rows = rows;
          auto timing = time_operation(chunked, device, options, inputs, rows);
          timing.rows_per_call = batch;
          return timing;
        },
        sweep_options,
        [&](const TunePoint& p, const detail::Sweep& s) {
          if (options.on_point)
            options.on_point(
                d, p, {.spent_seconds = s.spent(), .budget_seconds = s.options().budget_seconds});
        });
    curve.points = sweep.points();
    curve.stop = sweep.stop();
    // Accelerators overlap copies with compute: how many chunks in flight pay.
    if (device.is_accelerator() && options.overlap_test) {
      const auto knee = curve.knee().rows;
      const auto inputs =
          detail::tune_inputs(artifact, options.inputs, 8 * knee, device, options.dtype);
      std::vector<std::pair<int, double>> measured;
      for (const int chunks : {1, 2, 4}) {
        const DispatchedModel<GreedyPriorityCapacity> pool(
            shared,
            GreedyPriorityCapacity{
                .devices = {device}, .batch_sizes = {knee}, .capacities = {chunks * knee}},
            options.dtype);
        const auto timing = time_operation(pool, device, options, inputs, 8 * knee);
        if (!timing.out_of_memory)
          measured.emplace_back(chunks, detail::summarize(8 * knee, timing).median);
      }
      curve.overlap_chunks = detail::choose_overlap_chunks(measured, options.sweep.improvement);
    }
    if (options.lane_test)
      curve.chunk_overhead =
          lane_overhead(chunked, chunks, shared, curve, options, result.machine.cpu_lanes, d);
    result.devices.push_back(std::move(curve));
  }
  return result;
}

} // namespace neml2

// The tuner: the sweep's decisions, the table, recommendations, the tune file, and the
// measurement of a real model through DispatchedModel<SyncChunking>.

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/hash.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/headeronly/version.h>

#include <neml2/dispatched_model.hpp>
#include <neml2/tune.hpp>

#include "artifact/files.hpp"

namespace neml2 {

using json = nlohmann::json;

// ---------------------------------------------------------------------------- the sweep

std::string to_string(SweepStop stop) {
  switch (stop) {
  case SweepStop::finished:
    return "finished";
  case SweepStop::budget:
    return "budget";
  case SweepStop::out_of_memory_wall:
    return "out_of_memory_wall";
  case SweepStop::cap:
    return "cap";
  }
  return "finished";
}

static std::optional<SweepStop> sweep_stop_from(const std::string& text) {
  for (auto s :
       {SweepStop::finished, SweepStop::budget, SweepStop::out_of_memory_wall, SweepStop::cap})
    if (to_string(s) == text)
      return s;
  return std::nullopt;
}

TunePoint summarize(std::int64_t rows, const Timing& timing) {
  TunePoint p{.rows = rows, .out_of_memory = timing.out_of_memory};
  if (timing.out_of_memory)
    return p;
  if (timing.seconds.empty())
    throw FatalError(fmt::format("the measurement of {} rows gave no timings; a measurement "
                                 "returns one time per repeat (or out_of_memory)",
                                 rows));
  const auto per_call = static_cast<double>(timing.rows_per_call > 0 ? timing.rows_per_call : rows);
  std::vector<double> rate;
  for (const auto s : timing.seconds)
    rate.push_back(per_call / std::max(s, 1e-12));
  std::sort(rate.begin(), rate.end());
  const auto n = rate.size();
  p.median = n % 2 ? rate[n / 2] : 0.5 * (rate[n / 2 - 1] + rate[n / 2]);
  p.low = rate.front();
  p.high = rate.back();
  p.repeats = static_cast<int>(n);
  return p;
}

Sweep::Sweep(SweepOptions options)
    : _options(options)
    , _next_growth(options.min_rows) {
  const auto refuse = [](const char* field, const std::string& value, const char* rule) {
    throw FatalError(fmt::format("SweepOptions.{} is {}; {}", field, value, rule));
  };
  if (options.min_rows < 1)
    refuse("min_rows", std::to_string(options.min_rows), "it must be >= 1");
  if (options.max_rows < options.min_rows)
    refuse("max_rows", std::to_string(options.max_rows), "it must be >= min_rows");
  if (options.patience < 1)
    refuse("patience", std::to_string(options.patience), "it must be >= 1");
  if (options.refine_rounds < 0)
    refuse("refine_rounds", std::to_string(options.refine_rounds), "it must be >= 0");
  if (!(options.budget_seconds > 0))
    refuse("budget_seconds", fmt::format("{}", options.budget_seconds), "it must be > 0");
  if (!(options.improvement >= 0))
    refuse("improvement", fmt::format("{}", options.improvement), "it must be >= 0");
}

bool Sweep::known(std::int64_t rows) const {
  return std::any_of(_points.begin(), _points.end(),
                     [&](const TunePoint& p) { return p.rows == rows; }) ||
         (_wall && rows >= *_wall);
}

const TunePoint* Sweep::best() const {
  const TunePoint* best = nullptr;
  for (const auto& p : _points)
    if (p.measured() && (!best || p.median > best->median))
      best = &p;
  return best;
}

std::optional<std::int64_t> Sweep::next() {
  if (_pending)
    return _pending;
  if (_spent >= _options.budget_seconds) {
    if (_growing || _round < _options.refine_rounds || !_queue.empty())
      _stop = SweepStop::budget;
    return std::nullopt;
  }
  if (_growing)
    return _pending = _next_growth;
  for (const auto rows : _options.also)
    if (rows >= _options.min_rows && rows <= _options.max_rows && !known(rows))
      return _pending = rows;
  return _pending = next_refinement();
}

std::optional<std::int64_t> Sweep::next_refinement() {
  while (true) {
    while (!_queue.empty()) {
      const auto rows = _queue.front();
      _queue.erase(_queue.begin());
      if (!known(rows))
        return rows;
    }
    if (_round >= _options.refine_rounds)
      return std::nullopt;
    ++_round;
    const auto* b = best();
    if (!b)
      return std::nullopt;
    // The nearest sizes tried on either side (a size that did not fit counts).
    std::optional<std::int64_t> below, above;
    for (const auto& p : _points) {
      if (p.rows < b->rows && (!below || p.rows > *below))
        below = p.rows;
      if (p.rows > b->rows && (!above || p.rows < *above))
        above = p.rows;
    }
    const auto midpoint = [&](std::int64_t other) {
      const auto m = static_cast<std::int64_t>(
          std::llround(std::sqrt(static_cast<double>(other) * static_cast<double>(b->rows))));
      if (m != other && m != b->rows && !known(m))
        _queue.push_back(m);
    };
    if (below)
      midpoint(*below);
    if (above)
      midpoint(*above);
    if (_queue.empty()) // nothing left between neighbours
      _round = _options.refine_rounds;
  }
}

void Sweep::record(std::int64_t rows, const Timing& timing) {
  if (_pending == rows)
    _pending.reset();
  double elapsed = timing.elapsed;
  if (elapsed <= 0)
    for (const auto s : timing.seconds)
      elapsed += s;
  _spent += elapsed;
  const auto point = summarize(rows, timing);
  const auto at = std::lower_bound(_points.begin(), _points.end(), rows,
                                   [](const TunePoint& p, std::int64_t r) { return p.rows < r; });
  if (at != _points.end() && at->rows == rows)
    *at = point;
  else
    _points.insert(at, point);
  if (point.out_of_memory)
    _wall = std::min(_wall.value_or(rows), rows);

  if (!_growing || rows != _next_growth)
    return;
  if (point.out_of_memory) {
    _growing = false;
    _stop = SweepStop::out_of_memory_wall;
    return;
  }
  if (point.median > _best_growth * (1 + _options.improvement)) {
    _best_growth = point.median;
    _not_better = 0;
  } else if (++_not_better >= _options.patience) {
    _growing = false;
    _stop = SweepStop::finished;
    return;
  }
  if (_next_growth >= _options.max_rows) {
    _growing = false;
    _stop = SweepStop::cap;
    return;
  }
  _next_growth = _next_growth > _options.max_rows / 2 ? _options.max_rows : _next_growth * 2;
}

Sweep run_sweep(const std::function<Timing(std::int64_t rows)>& measure, SweepOptions options,
                const std::function<void(const TunePoint&, const Sweep&)>& on_point) {
  Sweep sweep(options);
  while (const auto rows = sweep.next()) {
    sweep.record(*rows, measure(*rows));
    if (on_point)
      for (const auto& p : sweep.points())
        if (p.rows == *rows)
          on_point(p, sweep);
  }
  return sweep;
}

// ---------------------------------------------------------------------------- the table

const TunePoint& DeviceCurve::best() const {
  const TunePoint* best = nullptr;
  for (const auto& p : points)
    if (p.measured() && (!best || p.median > best->median))
      best = &p;
  if (!best)
    throw FatalError(fmt::format("the tuning of {} has no measured size (every size tried ran out "
                                 "of memory, or none was tried); re-tune with a smaller "
                                 "--min-rows or a larger --budget",
                                 device.str()));
  return *best;
}

const TunePoint& DeviceCurve::knee(double fraction) const {
  const auto& b = best();
  for (const auto& p : points) // by size
    if (p.measured() && p.median >= fraction * b.median)
      return p;
  return b;
}

int choose_overlap_chunks(const std::vector<std::pair<int, double>>& measured, double improvement) {
  double best = 0;
  for (const auto& [chunks, rate] : measured)
    best = std::max(best, rate);
  int chosen = 0;
  for (const auto& [chunks, rate] : measured)
    if (rate * (1 + improvement) >= best && (chosen == 0 || chunks < chosen))
      chosen = chunks;
  return std::max(chosen, 1);
}

static double three_digits(double x) {
  if (x <= 0)
    return x;
  const auto scale = std::pow(10.0, 2 - std::floor(std::log10(x)));
  return std::round(x * scale) / scale;
}

Recommendations recommend(const TuneResult& result, double knee_fraction, double sync_fraction) {
  if (result.devices.empty())
    throw FatalError("the tuning result lists no device; tune at least one (--device cpu)");
  Recommendations r;
  double fastest = 0;
  for (std::size_t d = 0; d < result.devices.size(); ++d) {
    const auto& curve = result.devices[d];
    const auto& best = curve.best();
    r.sync.push_back(
        SyncChunking{.device = curve.device, .batch_size = curve.knee(sync_fraction).rows});
    if (best.median > fastest) {
      fastest = best.median;
      r.fastest = d;
    }
  }
  for (const auto& curve : result.devices) {
    const auto knee = curve.knee(knee_fraction).rows;
    r.pool.devices.push_back(curve.device);
    r.pool.batch_sizes.push_back(knee);
    const std::int64_t overlap = std::max(curve.overlap_chunks, 1);
    r.pool.capacities.push_back(knee > std::numeric_limits<std::int64_t>::max() / overlap
                                    ? std::numeric_limits<std::int64_t>::max()
                                    : knee * overlap);
    r.pool.priorities.push_back(three_digits(curve.best().median / fastest));
    r.mpi.devices.push_back(curve.device);
    r.mpi.batch_sizes.push_back(curve.knee(sync_fraction).rows);
  }
  return r;
}

static std::string quoted_devices(const std::vector<Device>& devices) {
  std::vector<std::string> names;
  for (const auto& d : devices)
    names.push_back('"' + d.str() + '"');
  return fmt::format("{{{}}}", fmt::join(names, ", "));
}

std::string to_cpp(const SyncChunking& p) {
  return fmt::format("neml2::SyncChunking{{.device = \"{}\", .batch_size = {}}}", p.device.str(),
                     p.batch_size);
}

std::string to_cpp(const GreedyPriorityCapacity& p) {
  return fmt::format("neml2::GreedyPriorityCapacity{{.devices = {},\n"
                     "                              .batch_sizes = {{{}}},\n"
                     "                              .capacities = {{{}}},\n"
                     "                              .priorities = {{{}}}}}",
                     quoted_devices(p.devices), fmt::join(p.batch_sizes, ", "),
                     fmt::join(p.capacities, ", "), fmt::join(p.priorities, ", "));
}

std::string to_cpp(const MPIRankAssignSettings& s) {
  return fmt::format("neml2::MPIRankAssign({{.devices = {}, .batch_sizes = {{{}}}}})",
                     quoted_devices(s.devices), fmt::join(s.batch_sizes, ", "));
}

std::string to_cpp(const Recommendations& r) {
  std::string text;
  for (const auto& s : r.sync)
    text += "// " + s.device.str() + " alone\n" + to_cpp(s) + "\n";
  text += "// every device at once\n" + to_cpp(r.pool) + "\n";
  text += "// one device per MPI rank\n" + to_cpp(r.mpi) + "\n";
  return text;
}

static json device_names(const std::vector<Device>& devices) {
  json names = json::array();
  for (const auto& d : devices)
    names.push_back(d.str());
  return names;
}

static json as_json(const SyncChunking& p) {
  return {{"policy", "SyncChunking"}, {"device", p.device.str()}, {"batch_size", p.batch_size}};
}
static json as_json(const GreedyPriorityCapacity& p) {
  return {{"policy", "GreedyPriorityCapacity"},
          {"devices", device_names(p.devices)},
          {"batch_sizes", p.batch_sizes},
          {"capacities", p.capacities},
          {"priorities", p.priorities}};
}
static json as_json(const MPIRankAssignSettings& s) {
  return {{"policy", "MPIRankAssign"},
          {"devices", device_names(s.devices)},
          {"batch_sizes", s.batch_sizes}};
}
static json as_json(const Recommendations& r) {
  json sync = json::array();
  for (const auto& s : r.sync)
    sync.push_back(as_json(s));
  return {{"sync", sync}, {"pool", as_json(r.pool)}, {"mpi", as_json(r.mpi)}};
}

std::string to_json(const SyncChunking& p) {
  return as_json(p).dump();
}
std::string to_json(const GreedyPriorityCapacity& p) {
  return as_json(p).dump();
}
std::string to_json(const MPIRankAssignSettings& s) {
  return as_json(s).dump();
}
std::string to_json(const Recommendations& r) {
  return as_json(r).dump(2);
}

std::string format_table(const TuneResult& result) {
  std::string text = fmt::format("{:<10} {:>10} {:>14} {:>14} {:>14}\n", "device", "rows",
                                 "median rows/s", "lowest", "highest");
  for (const auto& curve : result.devices) {
    const auto* best = &curve.best();
    for (const auto& p : curve.points) {
      if (p.out_of_memory)
        text += fmt::format("{:<10} {:>10} {:>14}\n", curve.device.str(), p.rows, "out of memory");
      else
        text += fmt::format("{:<10} {:>10} {:>14.4g} {:>14.4g} {:>14.4g}{}\n", curve.device.str(),
                            p.rows, p.median, p.low, p.high, &p == best ? "  best" : "");
    }
  }
  for (const auto& curve : result.devices)
    text += fmt::format("{}: a pool's lane costs {:.3g} us per chunk beyond the curve, {} "
                        "chunk(s) in flight\n",
                        curve.device.str(), 1e6 * curve.chunk_overhead, curve.overlap_chunks);
  return text;
}

// ---------------------------------------------------------------------------- the file

static constexpr const char* tune_format = "neml2-dispatch tune file";
static constexpr int tune_format_version = 2; // 2: chunk_overhead

std::string tune_file_text(const TuneResult& result) {
  json devices = json::array();
  for (const auto& curve : result.devices) {
    json points = json::array();
    for (const auto& p : curve.points)
      points.push_back({{"rows", p.rows},
                        {"median", p.median},
                        {"low", p.low},
                        {"high", p.high},
                        {"repeats", p.repeats},
                        {"out_of_memory", p.out_of_memory}});
    devices.push_back({{"device", curve.device.str()},
                       {"device_name", curve.device_name},
                       {"artifact_hash", curve.artifact_hash},
                       {"stop", to_string(curve.stop)},
                       {"overlap_chunks", curve.overlap_chunks},
                       {"chunk_overhead", curve.chunk_overhead},
                       {"points", points}});
  }
  json file = {{"format", tune_format},
               {"version", tune_format_version},
               {"model", result.model},
               {"operation", result.operation},
               {"dtype", result.machine.dtype},
               {"torch_version", result.machine.torch_version},
               {"intra_op_threads", result.machine.intra_op_threads},
               {"host_cpu", result.machine.host_cpu},
               {"devices", devices}};
  try { // for people reading the file; not read back (recomputed from the table)
    file["recommendations"] = as_json(recommend(result));
  } catch (const FatalError&) {
  }
  return file.dump(2) + "\n";
}

namespace {
constexpr std::string_view retune =
    "re-tune to write a new file (neml2-dispatch tune STUB --device ... --out FILE)";

// Reads fields by name; a missing or mistyped one is a FatalError naming it.
struct FieldReader {
  const std::string& where;

  [[noreturn]] void fail(const std::string& field, const std::string& problem) const {
    throw FatalError(fmt::format("tune file {}: field '{}' {}; re-tune to write a new file "
                                 "(neml2-dispatch tune STUB --device ... --out FILE)",
                                 where, field, problem));
  }
  const json& at(const json& object, const std::string& key, const std::string& field) const {
    if (!object.is_object())
      fail(field.substr(0, field.rfind('.')), "is not an object");
    const auto it = object.find(key);
    if (it == object.end())
      fail(field, "is missing");
    return *it;
  }
  std::string text(const json& object, const std::string& key, const std::string& field) const {
    const auto& v = at(object, key, field);
    if (!v.is_string())
      fail(field, "must be a string, not " + std::string(v.type_name()));
    return v.get<std::string>();
  }
  std::int64_t integer(const json& object, const std::string& key, const std::string& field) const {
    const auto& v = at(object, key, field);
    if (!v.is_number_integer())
      fail(field, "must be an integer, not " + std::string(v.type_name()));
    return v.get<std::int64_t>();
  }
  double number(const json& object, const std::string& key, const std::string& field) const {
    const auto& v = at(object, key, field);
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0)
      fail(field, "must be a non-negative number");
    return v.get<double>();
  }
  bool boolean(const json& object, const std::string& key, const std::string& field) const {
    const auto& v = at(object, key, field);
    if (!v.is_boolean())
      fail(field, "must be true or false, not " + std::string(v.type_name()));
    return v.get<bool>();
  }
  const json& array(const json& object, const std::string& key, const std::string& field) const {
    const auto& v = at(object, key, field);
    if (!v.is_array())
      fail(field, "must be an array, not " + std::string(v.type_name()));
    return v;
  }
};
} // namespace

TuneResult parse_tune_file(const std::string& text, const std::string& where) {
  // Bounded before nlohmann sees it (a real tune file is a few KB, 5 deep).
  detail::check_size(text.size(), detail::max_tune_bytes, "tune file", where, retune);
  detail::check_json_bounds(text, "tune file " + where, retune);
  json file;
  try {
    file = json::parse(text);
  } catch (const json::exception& e) { // parse_error, or out_of_range for 1e400 (fuzz_tune)
    throw FatalError(fmt::format("tune file {} is not valid JSON ({}); re-tune to write a new "
                                 "file (neml2-dispatch tune STUB --device ... --out FILE)",
                                 where, e.what()));
  }
  const FieldReader r{where};
  if (!file.is_object())
    r.fail("(top level)", "must be an object");
  if (r.text(file, "format", "format") != tune_format)
    r.fail("format", fmt::format("is not '{}'", tune_format));
  if (const auto v = r.integer(file, "version", "version"); v != tune_format_version)
    r.fail("version", fmt::format("is {}; this library reads version {}", v, tune_format_version));
  TuneResult result;
  result.model = r.text(file, "model", "model");
  result.operation = r.text(file, "operation", "operation");
  result.machine.dtype = r.text(file, "dtype", "dtype");
  result.machine.torch_version = r.text(file, "torch_version", "torch_version");
  result.machine.intra_op_threads =
      static_cast<int>(r.integer(file, "intra_op_threads", "intra_op_threads"));
  result.machine.host_cpu = r.text(file, "host_cpu", "host_cpu");
  const auto& devices = r.array(file, "devices", "devices");
  for (std::size_t d = 0; d < devices.size(); ++d) {
    const auto f = fmt::format("devices[{}]", d);
    const auto& entry = devices[d];
    DeviceCurve curve;
    try {
      curve.device = Device(r.text(entry, "device", f + ".device"));
    } catch (const FatalError& e) {
      if (std::string(e.what()).starts_with("tune file"))
        throw;
      r.fail(f + ".device", std::string("is not a device: ") + e.what());
    }
    curve.device_name = r.text(entry, "device_name", f + ".device_name");
    curve.artifact_hash = r.text(entry, "artifact_hash", f + ".artifact_hash");
    const auto stop = r.text(entry, "stop", f + ".stop");
    if (const auto known = sweep_stop_from(stop))
      curve.stop = *known;
    else
      r.fail(f + ".stop",
             "is '" + stop + "'; expected finished, budget, out_of_memory_wall or cap");
    curve.overlap_chunks =
        static_cast<int>(r.integer(entry, "overlap_chunks", f + ".overlap_chunks"));
    if (curve.overlap_chunks < 1)
      r.fail(f + ".overlap_chunks", "must be >= 1");
    curve.chunk_overhead = r.number(entry, "chunk_overhead", f + ".chunk_overhead");
    const auto& points = r.array(entry, "points", f + ".points");
    for (std::size_t i = 0; i < points.size(); ++i) {
      const auto g = fmt::format("{}.points[{}]", f, i);
      TunePoint p;
      p.rows = r.integer(points[i], "rows", g + ".rows");
      if (p.rows < 1)
        r.fail(g + ".rows", "must be >= 1");
      p.median = r.number(points[i], "median", g + ".median");
      p.low = r.number(points[i], "low", g + ".low");
      p.high = r.number(points[i], "high", g + ".high");
      p.repeats = static_cast<int>(r.integer(points[i], "repeats", g + ".repeats"));
      p.out_of_memory = r.boolean(points[i], "out_of_memory", g + ".out_of_memory");
      if (!p.out_of_memory)
        for (const auto& [value, key] :
             {std::pair{p.median, "median"}, {p.low, "low"}, {p.high, "high"}})
          if (!(std::isfinite(value) && value > 0))
            r.fail(g + "." + key, "must be a finite number > 0 (rows per second); re-tune");
      if (!p.out_of_memory && (p.repeats < 1 || !(p.low <= p.median && p.median <= p.high)))
        r.fail(g, "must have repeats >= 1 and low <= median <= high");
      if (!curve.points.empty() && p.rows <= curve.points.back().rows)
        r.fail(g + ".rows", "must be larger than the previous point's (points by size)");
      curve.points.push_back(p);
    }
    result.devices.push_back(std::move(curve));
  }
  if (result.devices.empty())
    r.fail("devices", "is empty");
  return result;
}

void write_tune_file(const std::filesystem::path& file, const TuneResult& result) {
  std::ofstream out(file);
  out << tune_file_text(result);
  out.close();
  if (!out)
    throw FatalError(fmt::format("cannot write the tune file {}; check that its folder exists and "
                                 "is writable",
                                 file.string()));
}

TuneResult read_tune_file(const std::filesystem::path& file) {
  // Never opened when it is a FIFO or a device (it would block, or not end).
  const auto status = detail::status_of(file, "tune file");
  if (std::filesystem::is_regular_file(status) ? !std::ifstream(file)
                                               : !std::filesystem::exists(status))
    throw FatalError(fmt::format("cannot read the tune file {}; tune first (neml2-dispatch tune "
                                 "STUB --device ... --out {})",
                                 file.string(), file.string()));
  return parse_tune_file(detail::read_text(file, "tune file", detail::max_tune_bytes, retune),
                         file.string());
}

// -------------------------------------------------------------------- the machine key

static std::string host_cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.starts_with("model name")) {
      const auto colon = line.find(':');
      auto name = line.substr(colon == std::string::npos ? line.size() : colon + 1);
      name.erase(0, name.find_first_not_of(" \t"));
      return name;
    }
  return "unknown CPU";
}

MachineKey current_machine(c10::ScalarType dtype) {
  return {.torch_version = TORCH_VERSION,
          .intra_op_threads = at::get_num_threads(),
          .host_cpu = host_cpu_name(),
          .dtype = dtype_folder(dtype)};
}

// A device this process can run on (index within the count), or a FatalError naming it.
static void require_usable(const Device& device) {
  const auto count = device_count(device.family());
  if (count == 0)
    throw FatalError(fmt::format("device {} cannot be used here: this process sees no {} device "
                                 "(torch built without it, or no driver); tune only the devices "
                                 "this machine has, e.g. --device cpu",
                                 device.str(), device.folder()));
  if (device.has_index() && static_cast<std::size_t>(device.index()) >= count)
    throw FatalError(fmt::format("device {} cannot be used here: this process sees {} {} "
                                 "device(s), {}:0 to {}:{}",
                                 device.str(), count, device.folder(), device.folder(),
                                 device.folder(), count - 1));
}

namespace {
// A CUDA device's name and memory from the driver API (libcuda, loaded where torch found a
// GPU), so that no CUDA header is needed to build. Empty where the driver is absent.
struct CudaDriverQuery {
  std::string name;
  std::size_t bytes = 0;
};
CudaDriverQuery cuda_query(int ordinal) {
  CudaDriverQuery q;
  void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (!driver)
    driver = dlopen("libcuda.so.1", RTLD_LAZY);
  if (!driver)
    return q;
  using Init = int (*)(unsigned);
  using Get = int (*)(int*, int);
  using Name = int (*)(char*, int, int);
  using Memory = int (*)(std::size_t*, int);
  const auto init = reinterpret_cast<Init>(dlsym(driver, "cuInit"));
  const auto get = reinterpret_cast<Get>(dlsym(driver, "cuDeviceGet"));
  const auto name = reinterpret_cast<Name>(dlsym(driver, "cuDeviceGetName"));
  const auto memory = reinterpret_cast<Memory>(dlsym(driver, "cuDeviceTotalMem_v2"));
  int device = 0;
  if (init && get && init(0) == 0 && get(&device, ordinal) == 0) {
    char text[256] = {};
    if (name && name(text, sizeof(text), device) == 0)
      q.name = text;
    if (memory)
      (void)memory(&q.bytes, device);
  }
  return q;
}
} // namespace

std::string device_name(const Device& device) {
  require_usable(device);
  if (device.family() == DeviceFamily::cpu)
    return host_cpu_name();
  if (device.family() == DeviceFamily::cuda)
    if (auto q = cuda_query(device.has_index() ? device.index() : 0); !q.name.empty())
      return q.name;
  return std::string(device.folder());
}

std::string artifact_hash(const Artifact& artifact, const Device& device, c10::ScalarType dtype) {
  const auto read = [](const std::filesystem::path& file) {
    std::ifstream in(file, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  std::string content = read(artifact.root / "metadata.json");
  const auto leaf = artifact.leaf(device, dtype);
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(leaf))
    if (entry.is_regular_file())
      files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  for (const auto& f : files)
    content += "\n" + std::filesystem::relative(f, leaf).string() + "\n" + read(f);
  return c10::sha1(content).str();
}

void check_tune_matches(const TuneResult& result, const Artifact& artifact, c10::ScalarType dtype,
                        const std::filesystem::path& file) {
  std::vector<std::string> devices;
  for (const auto& c : result.devices)
    devices.push_back("--device " + c.device.str());
  const auto retune =
      fmt::format("re-tune on this machine: neml2-dispatch tune {} {} --dtype {} --out {}",
                  artifact.root.string(), fmt::join(devices, " "), dtype_folder(dtype),
                  file.empty() ? std::string("FILE") : file.string());
  const auto differ = [&](const std::string& key, const std::string& theirs,
                          const std::string& ours) {
    if (theirs != ours)
      throw FatalError(fmt::format("tune file {} does not match: its {} is '{}', but here it is "
                                   "'{}'; {}",
                                   file.empty() ? std::string("(in memory)") : file.string(), key,
                                   theirs, ours, retune));
  };
  const auto here = current_machine(dtype);
  differ("dtype", result.machine.dtype, here.dtype);
  differ("torch_version", result.machine.torch_version, here.torch_version);
  differ("intra_op_threads", std::to_string(result.machine.intra_op_threads),
         std::to_string(here.intra_op_threads));
  differ("host_cpu", result.machine.host_cpu, here.host_cpu);
  for (std::size_t d = 0; d < result.devices.size(); ++d) {
    const auto& curve = result.devices[d];
    const auto where = fmt::format("devices[{}] ({})", d, curve.device.str());
    differ(where + " device_name", curve.device_name, device_name(curve.device));
    differ(where + " artifact_hash (the artifact's metadata.json or graphs changed)",
           curve.artifact_hash, artifact_hash(artifact, curve.device, dtype));
  }
}

TuneResult load_tuning(const std::filesystem::path& file, const Artifact& artifact,
                       c10::ScalarType dtype) {
  auto result = read_tune_file(file);
  check_tune_matches(result, artifact, dtype, file);
  return result;
}

// ------------------------------------------------------------- measuring a real model

std::map<std::string, at::Tensor> tune_inputs(const Artifact& artifact, const TuneInputs& inputs,
                                              std::int64_t rows, const Device& device,
                                              c10::ScalarType dtype) {
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
using clock = std::chrono::steady_clock;

double seconds_since(clock::time_point start) {
  return std::chrono::duration<double>(clock::now() - start).count();
}

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
    available = static_cast<double>(cuda_query(device.has_index() ? device.index() : 0).bytes);
  if (available <= 0 || bytes_per_row <= 0)
    return std::numeric_limits<std::int64_t>::max();
  const auto rows = available / bytes_per_row; // a double: converted only once in range
  return rows >= 9.2e18 ? std::numeric_limits<std::int64_t>::max()
                        : std::max<std::int64_t>(1, static_cast<std::int64_t>(rows));
}

} // namespace

Timing measure_calls(const std::function<void()>& call, const Device& device, int warmup,
                     int repeats) {
  const auto start = clock::now();
  Timing timing;
  try {
    for (int i = 0; i < warmup; ++i) {
      call();
      synchronize(device);
    }
    for (int i = 0; i < repeats; ++i) {
      const auto t = clock::now();
      call();
      synchronize(device);
      timing.seconds.push_back(seconds_since(t));
    }
  } catch (const ConvergenceError&) {
    throw;
  } catch (const std::exception& e) {
    if (!out_of_memory(e.what()))
      throw;
    timing = Timing{.out_of_memory = true};
  }
  timing.elapsed = seconds_since(start);
  return timing;
}

namespace {
// SyncChunking whose chunk size the tuner changes between measurements, so that one model
// (one load of the graphs) serves every size.
struct TuningChunks {
  using dispatch_mode = synchronous;
  Device device;
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
    return measure_calls([&] { call_operation(model, options.operation, inputs); }, device,
                         options.warmup, options.repeats);
  } catch (const ConvergenceError& e) {
    throw FatalError(fmt::format("tuning {} rows on {}: the inputs did not converge ({}); give "
                                 "ranges that keep the model convergent (--range NAME=LOW:HIGH) "
                                 "or a sample of real states",
                                 rows, device.str(), e.what()));
  }
}

// The lane test: calls of batch_rows in chunks at the knee, through the calling thread and
// then through a pool of one lane, each run back to back as a host runs them (alternating
// the two hid a slowdown of the lane that only a busy worker shows: J2 in issue 13's
// bench); what the lane costs per chunk beyond the calling thread.
double lane_overhead(const DispatchedModel<TuningChunks>& chunked, const TuningChunks& chunks,
                     const std::shared_ptr<const Artifact>& artifact, const DeviceCurve& curve,
                     const TuneOptions& options, std::size_t d) {
  const auto knee = curve.knee().rows;
  const auto batch = std::max(options.batch_rows, knee);
  const auto inputs = tune_inputs(*artifact, options.inputs, batch, curve.device, options.dtype);
  const DispatchedModel<GreedyPriorityCapacity> pool(
      artifact, GreedyPriorityCapacity{.devices = {curve.device}, .batch_sizes = {knee}},
      options.dtype);
  *chunks.rows = knee;
  const auto direct = time_operation(chunked, curve.device, options, inputs, batch);
  const auto lane = time_operation(pool, curve.device, options, inputs, batch);
  const auto per_call = batch / knee + (batch % knee != 0);
  if (options.on_lane_test)
    options.on_lane_test(d, direct, lane, per_call);
  return chunk_overhead_from(direct.seconds, lane.seconds, per_call);
}
} // namespace

double chunk_overhead_from(std::vector<double> direct, std::vector<double> lane,
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
  (void)Sweep(options.sweep); // the sweep as given (each device's own raises min_rows)
  const auto call_rows = [&](std::int64_t rows) { return std::max(options.batch_rows, rows); };
  TuneResult result{
      .model = model, .operation = options.operation, .machine = current_machine(options.dtype)};
  const auto shared = std::make_shared<const Artifact>(artifact);
  for (std::size_t d = 0; d < devices.size(); ++d) {
    const auto& device = devices[d];
    DeviceCurve curve{.device = device,
                      .device_name = device_name(device),
                      .artifact_hash = artifact_hash(artifact, device, options.dtype)};
    const TuningChunks chunks{.device = device};
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
    const auto sweep = run_sweep(
        [&](std::int64_t rows) {
          const auto batch = call_rows(rows);
          const auto inputs = tune_inputs(artifact, options.inputs, batch, device, options.dtype);
          *chunks.rows = rows;
          auto timing = time_operation(chunked, device, options, inputs, rows);
          timing.rows_per_call = batch;
          return timing;
        },
        sweep_options,
        [&](const TunePoint& p, const Sweep& s) {
          if (options.on_point)
            options.on_point(d, p, s);
        });
    curve.points = sweep.points();
    curve.stop = sweep.stop();
    // Accelerators overlap copies with compute: how many chunks in flight pay.
    if (device.is_accelerator() && options.overlap_test) {
      const auto knee = curve.knee().rows;
      const auto inputs = tune_inputs(artifact, options.inputs, 8 * knee, device, options.dtype);
      std::vector<std::pair<int, double>> measured;
      for (const int chunks : {1, 2, 4}) {
        const DispatchedModel<GreedyPriorityCapacity> pool(
            shared,
            GreedyPriorityCapacity{
                .devices = {device}, .batch_sizes = {knee}, .capacities = {chunks * knee}},
            options.dtype);
        const auto timing = time_operation(pool, device, options, inputs, 8 * knee);
        if (!timing.out_of_memory)
          measured.emplace_back(chunks, summarize(8 * knee, timing).median);
      }
      curve.overlap_chunks = choose_overlap_chunks(measured, options.sweep.improvement);
    }
    if (options.lane_test)
      curve.chunk_overhead = lane_overhead(chunked, chunks, shared, curve, options, d);
    result.devices.push_back(std::move(curve));
  }
  return result;
}

} // namespace neml2

// The table and what it recommends: each device's best size and knee, the policies built
// from them, and those policies as C++ to paste or as JSON.

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <neml2/detail/tune_decisions.hpp>
#include <neml2/tune.hpp>

#include "tools/recommendations_json.hpp"

namespace neml2 {

using json = nlohmann::json;

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

static double three_digits(double x) {
  if (x <= 0)
    return x;
  const auto scale = std::pow(10.0, 2 - std::floor(std::log10(x)));
  return std::round(x * scale) / scale;
}

static bool on_cpu(const Device& device) {
  return device.family() == DeviceFamily::cpu;
}

std::int64_t detail::pool_chunk_rows(const Device& device, std::int64_t knee, int cpu_lanes) {
  const std::int64_t lanes = on_cpu(device) ? std::max(cpu_lanes, 1) : 1;
  return knee > std::numeric_limits<std::int64_t>::max() / lanes
             ? std::numeric_limits<std::int64_t>::max()
             : knee * lanes;
}

Recommendations recommend(const TuneResult& result, double knee_fraction, double sync_fraction) {
  if (result.devices.empty())
    throw FatalError("the tuning result lists no device; tune at least one (--device cpu)");
  Recommendations r;
  double fastest = 0;
  const auto lanes = result.machine.cpu_lanes;
  for (std::size_t d = 0; d < result.devices.size(); ++d) {
    const auto& curve = result.devices[d];
    const auto& best = curve.best();
    // One lane's chunk: the table's rows (a CPU's chunks ran `lanes` at once).
    r.sync.push_back(SyncChunking{.device = curve.device,
                                  .batch_size = curve.knee(sync_fraction).rows,
                                  .cpu_lanes = on_cpu(curve.device) ? lanes : 0});
    if (best.median > fastest) {
      fastest = best.median;
      r.fastest = d;
    }
  }
  for (const auto& curve : result.devices) {
    const auto knee = detail::pool_chunk_rows(curve.device, curve.knee(knee_fraction).rows, lanes);
    if (on_cpu(curve.device))
      r.pool.cpu_lanes = lanes;
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
  return fmt::format("neml2::SyncChunking{{.device = \"{}\", .batch_size = {}{}}}", p.device.str(),
                     p.batch_size,
                     p.cpu_lanes != 0 ? fmt::format(", .cpu_lanes = {}", p.cpu_lanes) : "");
}

std::string to_cpp(const GreedyPriorityCapacity& p) {
  return fmt::format("neml2::GreedyPriorityCapacity{{.devices = {},\n"
                     "                              .batch_sizes = {{{}}},\n"
                     "                              .capacities = {{{}}},\n"
                     "                              .priorities = {{{}}}{}}}",
                     quoted_devices(p.devices), fmt::join(p.batch_sizes, ", "),
                     fmt::join(p.capacities, ", "), fmt::join(p.priorities, ", "),
                     p.cpu_lanes != 0 ? fmt::format(",\n                              "
                                                    ".cpu_lanes = {}",
                                                    p.cpu_lanes)
                                      : "");
}

std::string to_cpp(const MPIRankAssignSettings& s) {
  return fmt::format("neml2::MPIRankAssign({{.devices = {}, .batch_sizes = {{{}}}}})",
                     quoted_devices(s.devices), fmt::join(s.batch_sizes, ", "));
}

std::string to_cpp(const Recommendations& r) {
  std::string text;
  for (const auto& s : r.sync)
    text += "// " + s.device.str() + " alone" +
            (s.cpu_lanes > 0 ? fmt::format(": chunks of {} rows, one per lane, on {} lane(s)",
                                           s.batch_size, s.cpu_lanes)
                             : "") +
            "\n" + to_cpp(s) + "\n";
  std::string shared;
  for (std::size_t d = 0; d < r.pool.devices.size(); ++d)
    if (on_cpu(r.pool.devices[d]) && r.pool.cpu_lanes > 0)
      shared = fmt::format(": the cpu's chunk of {} rows is shared by its {} lane(s)",
                           r.pool.batch_size(d), r.pool.cpu_lanes);
  text += "// every device at once" + shared + "\n" + to_cpp(r.pool) + "\n";
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
  return {{"policy", "SyncChunking"},
          {"device", p.device.str()},
          {"batch_size", p.batch_size},
          {"cpu_lanes", p.cpu_lanes}};
}
static json as_json(const GreedyPriorityCapacity& p) {
  return {{"policy", "GreedyPriorityCapacity"}, {"devices", device_names(p.devices)},
          {"batch_sizes", p.batch_sizes},       {"capacities", p.capacities},
          {"priorities", p.priorities},         {"cpu_lanes", p.cpu_lanes}};
}
static json as_json(const MPIRankAssignSettings& s) {
  return {{"policy", "MPIRankAssign"},
          {"devices", device_names(s.devices)},
          {"batch_sizes", s.batch_sizes}};
}

json detail::recommendations_json(const Recommendations& r) {
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
  return detail::recommendations_json(r).dump(2);
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
  for (const auto& curve : result.devices) {
    if (on_cpu(curve.device))
      text += fmt::format("{}: measured on {} lane(s); rows are one lane's chunk, rates all "
                          "lanes' together\n",
                          curve.device.str(), result.machine.cpu_lanes);
    text += fmt::format("{}: a pool's lane costs {:.3g} us per chunk beyond the curve, {} "
                        "chunk(s) in flight\n",
                        curve.device.str(), 1e6 * curve.chunk_overhead, curve.overlap_chunks);
  }
  return text;
}

} // namespace neml2

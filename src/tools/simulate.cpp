// The simulator's non-template parts: throughput curves, the virtual node's clock, and
// the report.

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <neml2/simulate.hpp>

#include "core/cpu_lanes.hpp"

namespace neml2 {

ThroughputCurve::ThroughputCurve(std::vector<std::pair<std::int64_t, double>> points)
    : _points(std::move(points)) {
  if (_points.empty())
    throw FatalError("a throughput curve needs at least one (rows, rows per second) point");
  for (std::size_t i = 0; i < _points.size(); ++i) {
    const auto [rows, rate] = _points[i];
    if (rows < 1 || !(rate > 0) || !std::isfinite(rate))
      throw FatalError(fmt::format("throughput curve point {} is ({} rows, {} rows/s); rows must "
                                   "be >= 1 and the rate finite and > 0",
                                   i, rows, rate));
    if (i > 0 && rows <= _points[i - 1].first)
      throw FatalError(fmt::format("throughput curve point {} ({} rows) does not follow point {} "
                                   "({} rows); give the points by increasing rows",
                                   i, rows, i - 1, _points[i - 1].first));
  }
}

ThroughputCurve ThroughputCurve::constant(double rows_per_second) {
  return ThroughputCurve({{1, rows_per_second}});
}

ThroughputCurve ThroughputCurve::from(const DeviceCurve& curve, int lanes) {
  if (lanes < 1)
    throw FatalError(fmt::format("ThroughputCurve::from({}): lanes is {}; give the lanes the curve "
                                 "was measured on (>= 1; a tune file's cpu_lanes on the CPU)",
                                 curve.device.str(), lanes));
  std::vector<std::pair<std::int64_t, double>> points;
  for (const auto& p : curve.points)
    if (p.measured())
      points.emplace_back(p.rows, p.median / lanes);
  if (points.empty())
    throw FatalError(fmt::format("the tuning of {} has no measured size to simulate; re-tune it",
                                 curve.device.str()));
  return ThroughputCurve(std::move(points));
}

double ThroughputCurve::rows_per_second(std::int64_t rows) const {
  if (_points.empty())
    throw FatalError("a simulated device has no throughput curve; give it one");
  if (rows <= _points.front().first)
    return _points.front().second;
  if (rows >= _points.back().first)
    return _points.back().second;
  const auto after = std::lower_bound(_points.begin(), _points.end(), rows,
                                      [](const auto& p, std::int64_t r) { return p.first < r; });
  const auto before = after - 1;
  if (after->first == rows)
    return after->second;
  const auto x0 = std::log(static_cast<double>(before->first));
  const auto x1 = std::log(static_cast<double>(after->first));
  const auto w = (std::log(static_cast<double>(rows)) - x0) / (x1 - x0);
  return std::exp((1 - w) * std::log(before->second) + w * std::log(after->second));
}

double ThroughputCurve::peak() const {
  double peak = 0;
  for (const auto& p : _points)
    peak = std::max(peak, p.second);
  return peak;
}

namespace detail {

void simulate_refuse(const std::string& message) {
  throw FatalError("simulate(): " + message);
}

void check_chunk_count(std::size_t scheduled, std::size_t per_call, std::size_t more_calls,
                       std::int64_t batch, std::size_t calls) {
  const auto room = max_simulated_chunks - std::min(scheduled, max_simulated_chunks);
  if (per_call > 0 && more_calls > room / per_call)
    simulate_refuse(fmt::format("{} call(s) of {} rows take more than {} chunks, the most one "
                                "simulation schedules; simulate fewer calls, fewer rows or "
                                "larger chunks",
                                calls, batch, max_simulated_chunks));
}

std::vector<std::size_t> simulated_lanes(const std::vector<Device>& devices,
                                         std::span<const SimulatedDevice> simulated,
                                         std::size_t requested) {
  std::vector<std::size_t> lanes(devices.size(), 1);
  for (std::size_t d = 0; d < devices.size(); ++d) {
    if (devices[d].family() != DeviceFamily::cpu)
      continue;
    const auto threads = simulated[d].intra_op_threads;
    if (requested == 0 && (threads < 1 || threads > max_cpu_lanes))
      simulate_refuse(fmt::format("simulated device {} ({}) has intra_op_threads {}, the lanes a "
                                  "policy's cpu_lanes of 0 runs on; give 1 to {}",
                                  d, devices[d].str(), threads, max_cpu_lanes));
    // A model's rule on a virtual node: 0 stands for its simulated threads (read only for 0,
    // checked above); no runners to cap them, never inside a lane.
    lanes[d] = resolve_cpu_lanes(static_cast<std::int64_t>(requested),
                                 {.threads = static_cast<std::size_t>(threads)});
  }
  return lanes;
}

VirtualNode::VirtualNode(std::vector<SimulatedDevice> devices, std::vector<std::size_t> in_flight,
                         std::vector<std::size_t> lanes)
    : _devices(std::move(devices))
    , _busy(_devices.size(), 0) {
  for (std::size_t d = 0; d < _devices.size(); ++d) {
    const auto& dev = _devices[d];
    (void)dev.curve.rows_per_second(1); // no curve: refused now
    if (dev.chunk_overhead < 0 || dev.transfer_seconds_per_row < 0)
      simulate_refuse(fmt::format("simulated device {} has chunk_overhead {} and "
                                  "transfer_seconds_per_row {}; both must be >= 0",
                                  d, dev.chunk_overhead, dev.transfer_seconds_per_row));
    _slot_free.emplace_back(in_flight[d], 0.0);
    _compute_free.emplace_back(std::max<std::size_t>(lanes[d], 1), 0.0);
  }
}

std::pair<double, double> VirtualNode::run(SimulatedChunk& chunk, double now, bool cut) {
  const auto d = chunk.device;
  const auto& dev = _devices[d];
  auto& slots = _slot_free[d];
  const auto slot = std::min_element(slots.begin(), slots.end());
  chunk.dispatched = now;
  chunk.start = std::max(now, *slot);
  const auto copied = chunk.start + static_cast<double>(chunk.rows) * dev.transfer_seconds_per_row;
  auto& lanes = _compute_free[d];
  const auto count = static_cast<std::int64_t>(lanes.size());
  double compute = 0;
  if (cut || count == 1) { // on every lane at once, each with ceil(rows / lanes) rows
    const auto per_lane = chunk.rows / count + (chunk.rows % count != 0);
    chunk.compute_start = std::max(copied, *std::max_element(lanes.begin(), lanes.end()));
    compute =
        dev.chunk_overhead + static_cast<double>(per_lane) / dev.curve.rows_per_second(per_lane);
    chunk.end = chunk.compute_start + compute;
    std::fill(lanes.begin(), lanes.end(), chunk.end);
    _busy[d] += compute;
  } else { // on the first free lane, beside the others
    const auto lane = std::min_element(lanes.begin(), lanes.end());
    chunk.compute_start = std::max(copied, *lane);
    compute = dev.chunk_overhead +
              static_cast<double>(chunk.rows) / dev.curve.rows_per_second(chunk.rows);
    chunk.end = chunk.compute_start + compute;
    *lane = chunk.end;
    _busy[d] += compute / static_cast<double>(count);
  }
  *slot = chunk.end;
  return {chunk.end, chunk.end - chunk.start};
}

Simulation VirtualNode::finish(std::int64_t batch, std::size_t calls, double makespan,
                               std::vector<double> call_ends,
                               std::vector<SimulatedChunk> timeline) const {
  Simulation sim{.batch = batch,
                 .calls = calls,
                 .makespan = makespan,
                 .busy = _busy,
                 .call_ends = std::move(call_ends),
                 .timeline = std::move(timeline)};
  double total = 0;
  for (std::size_t d = 0; d < _devices.size(); ++d) {
    sim.lanes.push_back(_compute_free[d].size());
    total += _devices[d].curve.peak() * static_cast<double>(_compute_free[d].size());
  }
  sim.ideal = static_cast<double>(batch) * static_cast<double>(calls) / total;
  for (const auto b : _busy)
    sim.idle.push_back(std::max(0.0, makespan - b));
  return sim;
}

} // namespace detail

static std::string name_of(const std::vector<std::string>& names, std::size_t d) {
  return d < names.size() ? names[d] : "device " + std::to_string(d);
}

std::string format_simulation(const Simulation& sim, const std::vector<std::string>& names) {
  std::string text = fmt::format(
      "{} call(s) of {} rows: makespan {:.4g} s, ideal {:.4g} s (sum of peak throughputs), "
      "{:.1f} % of ideal\n",
      sim.calls, sim.batch, sim.makespan, sim.ideal, 100 * sim.efficiency());
  text += fmt::format("{:<12} {:>5} {:>8} {:>12} {:>12} {:>8}\n", "device", "lanes", "chunks",
                      "busy s", "idle s", "rows %");
  for (std::size_t d = 0; d < sim.busy.size(); ++d) {
    std::size_t chunks = 0;
    std::int64_t rows = 0;
    for (const auto& c : sim.timeline)
      if (c.device == d) {
        ++chunks;
        rows += c.rows;
      }
    const auto all = static_cast<double>(sim.batch) * static_cast<double>(sim.calls);
    text += fmt::format("{:<12} {:>5} {:>8} {:>12.4g} {:>12.4g} {:>8.1f}\n", name_of(names, d),
                        d < sim.lanes.size() ? sim.lanes[d] : 1, chunks, sim.busy[d], sim.idle[d],
                        all > 0 ? 100 * static_cast<double>(rows) / all : 0);
  }
  return text;
}

std::string simulation_json(const Simulation& sim, const std::vector<std::string>& names) {
  nlohmann::json devices = nlohmann::json::array(), chunks = nlohmann::json::array();
  for (std::size_t d = 0; d < sim.busy.size(); ++d)
    devices.push_back({{"name", name_of(names, d)},
                       {"lanes", d < sim.lanes.size() ? sim.lanes[d] : 1},
                       {"busy", sim.busy[d]},
                       {"idle", sim.idle[d]}});
  for (const auto& c : sim.timeline)
    chunks.push_back({{"call", c.call},
                      {"index", c.index},
                      {"device", c.device},
                      {"first", c.first},
                      {"rows", c.rows},
                      {"dispatched", c.dispatched},
                      {"start", c.start},
                      {"compute_start", c.compute_start},
                      {"end", c.end}});
  return nlohmann::json{{"batch", sim.batch},
                        {"calls", sim.calls},
                        {"makespan", sim.makespan},
                        {"ideal", sim.ideal},
                        {"efficiency", sim.efficiency()},
                        {"devices", devices},
                        {"timeline", chunks}}
             .dump(1) +
         "\n";
}

} // namespace neml2

#pragma once

/// @file simulate.hpp
/// @brief A node on a virtual clock: per-device throughput curves (from a tune file, or
/// entered by hand) replayed through a real dispatch policy, to plan a node one does not
/// have (eight GPUs beside the CPU) before running on it.
///
/// The policy is asked exactly as DispatchedModel asks it, through the same protocol
/// (detail/policy_protocol.hpp: the same checks, the same errors): compute_device() and
/// chunk_rows() once per call; or, through the same schedule as the asynchronous engine
/// (detail/async_schedule.hpp), next_chunk() with the rows in flight per device until it
/// waits, on_dispatched() per chunk, on_completed() with the chunk's seconds as each
/// completes (in completion order; ties in dispatch order). A chunk
/// waits for a free slot of its device (chunks_in_flight, on accelerators), copies its rows
/// (`transfer_seconds_per_row`, overlapping other chunks' compute), then computes for
/// `chunk_overhead` + rows / throughput(rows), one chunk at a time per device.
///
/// The CPU has L lanes, as in a model: the policy's `cpu_lanes`, or for 0 the simulated
/// CPU's `intra_op_threads`; its curve is one lane's rate. A chunk the library cuts over
/// the lanes (an asynchronous policy's CPU chunk, a synchronous policy's whole batch) of B
/// rows computes for `chunk_overhead` + time(ceil(B / L)) on all of them; a synchronous
/// policy's smaller chunks run L at once, one per lane. Deterministic: no clock, no thread.
/// @code
/// std::vector<neml2::SimulatedDevice> node = {{neml2::ThroughputCurve::constant(2e6)}};
/// for (int g = 0; g < 8; ++g)
///   node.push_back({gpu_curve, 20e-6, 1e-8});
/// auto sim = neml2::simulate(pool_policy, node, 1 << 24);
/// std::printf("%.1f %% of ideal\n", 100 * sim.efficiency());
/// @endcode
/// @see docs/tuning.md

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <neml2/detail/async_schedule.hpp>
#include <neml2/detail/policy_protocol.hpp>
#include <neml2/errors.hpp>
#include <neml2/policy.hpp>
#include <neml2/tune.hpp>

namespace neml2 {

/// @brief Rows per second against rows per call: interpolated linearly in log-log between
/// the given sizes, flat beyond the first and the last. On the CPU, one lane's rate (while
/// the others run too).
class ThroughputCurve {
public:
  ThroughputCurve() = default;
  /// (rows, rows per second) pairs, by increasing rows, every rate > 0.
  explicit ThroughputCurve(std::vector<std::pair<std::int64_t, double>> points);
  /// A flat curve: `rows_per_second` at every size.
  [[nodiscard]] static ThroughputCurve constant(double rows_per_second);
  /// The measured points of a tuned device's curve (medians) over `lanes`: a tune file's CPU
  /// rates are those of its MachineKey::cpu_lanes lanes together; give them for one lane's.
  [[nodiscard]] static ThroughputCurve from(const DeviceCurve& curve, int lanes = 1);

  /// The rate, in rows per second, of chunks of `rows` rows (a FatalError for an empty curve).
  [[nodiscard]] double rows_per_second(std::int64_t rows) const;
  /// The highest rate of the curve.
  [[nodiscard]] double peak() const;
  /// The (rows, rows per second) pairs it interpolates, by increasing rows.
  [[nodiscard]] const std::vector<std::pair<std::int64_t, double>>& points() const noexcept {
    return _points;
  }

private:
  std::vector<std::pair<std::int64_t, double>> _points = {};
};

/// One device of a simulated node.
struct SimulatedDevice {
  ThroughputCurve curve = {};          ///< its compute rate (a CPU lane's) against rows per chunk
  double chunk_overhead = 0;           ///< seconds per chunk (launch, dispatch)
  double transfer_seconds_per_row = 0; ///< copying a row's inputs and results
  /// On the CPU: torch's intra-op thread count, the lanes a policy's cpu_lanes of 0 runs on
  /// (>= 1; ignored elsewhere).
  std::int64_t intra_op_threads = 1;
};

/// One chunk on the virtual clock.
struct SimulatedChunk {
  /// @var call
  /// The call it is part of, from 0.
  /// @var index
  /// Its place in its call's dispatch order, from 0.
  /// @var device
  /// Its device, as an index into the policy's devices() and the simulated devices.
  std::size_t call = 0, index = 0, device = 0;
  /// @var first
  /// The first row of the call's batch that it takes.
  /// @var rows
  /// The rows it takes.
  std::int64_t first = 0, rows = 0;
  /// @var dispatched
  /// When the policy dispatched it, in seconds on the virtual clock.
  /// @var start
  /// When it took a free slot of its device and began copying its rows, in seconds.
  /// @var compute_start
  /// When it began computing (its rows copied, its lanes free), in seconds.
  /// @var end
  /// When it completed, in seconds on the virtual clock.
  double dispatched = 0, start = 0, compute_start = 0, end = 0;
};

/// What a simulation found.
struct Simulation {
  std::int64_t batch = 0; ///< rows per call
  std::size_t calls = 1;  ///< calls simulated, one after another
  double makespan = 0;    ///< from the first call to the end of the last
  /// Every row at the sum of the devices' peak rates (the CPU's times its lanes), no overhead.
  double ideal = 0;
  /// Per device: seconds computing (overhead included; on the CPU, averaged over its lanes).
  std::vector<double> busy = {};
  std::vector<double> idle = {};       ///< per device: makespan - busy
  std::vector<std::size_t> lanes = {}; ///< per device: the lanes it computed on (1 off the CPU)
  std::vector<double> call_ends = {};  ///< per call: when its last chunk completed
  std::vector<SimulatedChunk> timeline = {}; ///< every chunk of every call, in dispatch order
  /// ideal / makespan: 1 when the devices ran at their peak rates throughout (1 for no work).
  [[nodiscard]] double efficiency() const { return makespan > 0 ? ideal / makespan : 1; }
};

/// The report as text: makespan against ideal, then a row per device (`names` label them).
[[nodiscard]] std::string format_simulation(const Simulation& sim,
                                            const std::vector<std::string>& names);
/// The report and timeline as JSON (what tools/plot_tune.py draws).
[[nodiscard]] std::string simulation_json(const Simulation& sim,
                                          const std::vector<std::string>& names);

namespace detail {
// The virtual node: slots for chunks in flight, compute lanes and chunk times
// (src/tools/simulate.cpp).
class VirtualNode {
public:
  /// Per device: the chunks it may have in flight, and the lanes it computes on.
  VirtualNode(std::vector<SimulatedDevice> devices, std::vector<std::size_t> in_flight,
              std::vector<std::size_t> lanes);
  /// Schedules a chunk dispatched at `now`, cut over all its device's lanes (`cut`) or on
  /// the first free one; returns its completion time and its seconds from taking a slot to
  /// completing (what DispatchedModel reports).
  std::pair<double, double> run(SimulatedChunk& chunk, double now, bool cut = true);
  [[nodiscard]] Simulation finish(std::int64_t batch, std::size_t calls, double makespan,
                                  std::vector<double> call_ends,
                                  std::vector<SimulatedChunk> timeline) const;
  [[nodiscard]] std::size_t size() const noexcept { return _devices.size(); }

private:
  std::vector<SimulatedDevice> _devices;
  std::vector<std::vector<double>> _slot_free;    // per device, per chunk in flight
  std::vector<std::vector<double>> _compute_free; // per device, per lane
  std::vector<double> _busy;
};

/// The lanes each of `devices` computes on for a policy asking `requested` CPU lanes: on the
/// CPU `requested`, or for 0 its simulated intra_op_threads (checked >= 1), as a model
/// resolves them (detail::resolve_cpu_lanes, src/core/cpu_lanes.hpp); 1 elsewhere.
[[nodiscard]] std::vector<std::size_t> simulated_lanes(const std::vector<Device>& devices,
                                                       std::span<const SimulatedDevice> simulated,
                                                       std::size_t requested);

[[noreturn]] void simulate_refuse(const std::string& message);
/// Refuses a simulation that would pass max_simulated_chunks (its timeline alone would take
/// gigabytes and its run minutes) with `scheduled` chunks and `per_call` more in each of
/// `more_calls` calls, naming the numbers.
void check_chunk_count(std::size_t scheduled, std::size_t per_call, std::size_t more_calls,
                       std::int64_t batch, std::size_t calls);
} // namespace detail

/// The most chunks one simulate() call schedules (every call's chunks together).
inline constexpr std::size_t max_simulated_chunks = std::size_t{1} << 21;

/// @brief Runs `calls` calls of `batch` rows through `policy` on `devices` (one per device
/// the policy lists, in its order). The policy's state lives across calls, as it does in a
/// model, so an adaptive policy learns in the first call. A policy's bad answer is the
/// FatalError DispatchedModel throws for it, word for word.
template <DispatchPolicy Policy>
Simulation simulate(const Policy& policy, std::span<const SimulatedDevice> devices,
                    std::int64_t batch, std::size_t calls = 1) {
  detail::validate_policy(policy);
  const auto listed = listed_devices(policy);
  if (listed.size() != devices.size())
    detail::simulate_refuse("the policy lists " + std::to_string(listed.size()) + " devices but " +
                            std::to_string(devices.size()) +
                            " simulated devices were given; give one curve per listed device");
  if (batch < 0 || calls < 1)
    detail::simulate_refuse("a simulation needs batch >= 0 and calls >= 1 (batch " +
                            std::to_string(batch) + ", calls " + std::to_string(calls) + ")");
  const auto lanes = detail::simulated_lanes(listed, devices, detail::requested_cpu_lanes(policy));
  auto in_flight = detail::chunks_in_flight(policy, listed);
  if constexpr (!is_asynchronous_policy_v<Policy>) // a synchronous call's chunks: one a lane
    for (std::size_t d = 0; d < in_flight.size(); ++d)
      in_flight[d] = std::max(in_flight[d], lanes[d]);
  detail::VirtualNode node({devices.begin(), devices.end()}, std::move(in_flight), lanes);
  std::vector<SimulatedChunk> timeline;
  std::vector<double> call_ends;
  double now = 0;

  if constexpr (is_asynchronous_policy_v<Policy>) {
    detail::PolicyWithState<Policy> asked(policy);
    detail::AsyncSchedule schedule(asked, listed);
    struct Pending {
      double end, seconds;
      std::size_t order; // into timeline
      detail::ScheduledChunk chunk;
    };
    std::vector<Pending> pending;
    for (std::size_t call = 0; call < calls; ++call) {
      detail::ScheduledCall scheduled(batch);
      const auto dispatch = [&](detail::ScheduledCall& c) {
        schedule.dispatch(
            c,
            [&](const detail::ScheduledChunk&) {
              detail::check_chunk_count(timeline.size(), 1, 1, batch, calls);
            },
            [&](const detail::ScheduledChunk& chunk) {
              SimulatedChunk simulated{.call = call,
                                       .index = chunk.index,
                                       .device = chunk.device,
                                       .first = chunk.first,
                                       .rows = chunk.rows};
              const auto [end, seconds] = node.run(simulated, now);
              pending.push_back({end, seconds, timeline.size(), chunk});
              timeline.push_back(simulated);
            });
      };
      dispatch(scheduled);
      while (!pending.empty()) { // completions in time order, ties in dispatch order
        const auto next = std::min_element(
            pending.begin(), pending.end(), [](const Pending& a, const Pending& b) {
              return a.end < b.end || (a.end == b.end && a.order < b.order);
            });
        const auto done = *next;
        pending.erase(next);
        now = std::max(now, done.end);
        schedule.complete(scheduled, done.chunk, done.seconds);
        schedule.for_each_call_with_room(scheduled, dispatch);
      }
      schedule.close(scheduled);
      call_ends.push_back(now);
    }
  } else {
    for (std::size_t call = 0; call < calls; ++call) {
      // Not a structured binding: the lambda below captures them (clang 14 cannot).
      const auto decision = detail::decide_synchronous(policy, listed, batch);
      const auto d = decision.device;
      const auto rows = decision.rows;
      if (batch > 0) // every call's chunks counted before any is scheduled
        detail::check_chunk_count(timeline.size(), static_cast<std::size_t>((batch - 1) / rows + 1),
                                  calls - call, batch, calls);
      // Dispatched together at the call's start; a whole batch is cut over the lanes, smaller
      // chunks take the lanes one each, as they free up.
      const auto start = now;
      const bool whole = rows >= batch;
      detail::for_each_chunk(
          batch, rows, [&](std::int64_t first, std::int64_t n, std::size_t index) {
            SimulatedChunk chunk{
                .call = call, .index = index, .device = d, .first = first, .rows = n};
            now = std::max(now, node.run(chunk, start, whole).first);
            timeline.push_back(chunk);
          });
      call_ends.push_back(now);
    }
  }
  return node.finish(batch, calls, now, std::move(call_ends), std::move(timeline));
}

} // namespace neml2

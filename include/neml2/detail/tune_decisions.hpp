#pragma once

// What tune() decides from measurements, as plain code that only the tuner and its tests
// call (fed synthetic timings there): a sweep's sizes and when it stops, a measurement's
// point, how many chunks in flight pay, a pool's chunk on the CPU's lanes, and what a
// pool's lane costs per chunk.

#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include <neml2/tune.hpp>

namespace neml2::detail {

/// @brief The sweep's decisions, without a clock: ask next() for a size, measure it, give
/// the Timing to record(); repeat until next() is empty.
///
/// Sizes double from min_rows until `patience` sizes in a row were not better, a size did
/// not fit (the out-of-memory wall: nothing at or above it is tried again), or max_rows;
/// then refinement measures the geometric midpoints between the best size and its
/// neighbours. Nothing is measured once the budget is spent.
class Sweep {
public:
  /// A sweep that follows `options` (a FatalError names a field out of range).
  explicit Sweep(SweepOptions options = {});

  /// The size to measure next (the same one until it is recorded); empty once the sweep
  /// is over.
  [[nodiscard]] std::optional<std::int64_t> next();
  /// Records the measurement of `rows`: its point (replacing one of that size), its
  /// seconds against the budget, and what it means for doubling.
  void record(std::int64_t rows, const Timing& timing);

  /// The points measured so far, by size.
  [[nodiscard]] const std::vector<TunePoint>& points() const noexcept { return _points; }
  /// Why the sweep ended (final once next() is empty).
  [[nodiscard]] SweepStop stop() const noexcept { return _stop; }
  /// Seconds the measurements took so far.
  [[nodiscard]] double spent() const noexcept { return _spent; }
  /// The options the sweep follows.
  [[nodiscard]] const SweepOptions& options() const noexcept { return _options; }

private:
  [[nodiscard]] std::optional<std::int64_t> next_refinement();
  [[nodiscard]] const TunePoint* best() const;
  [[nodiscard]] bool known(std::int64_t rows) const;

  SweepOptions _options;
  std::vector<TunePoint> _points;
  std::optional<std::int64_t> _pending;
  std::int64_t _next_growth;
  std::optional<std::int64_t> _wall; // the smallest size that did not fit
  int _not_better = 0;
  double _best_growth = 0;
  bool _growing = true;
  int _round = 0;
  std::vector<std::int64_t> _queue; // midpoints of the current refinement round
  double _spent = 0;
  SweepStop _stop = SweepStop::finished;
};

/// The point of a Timing (rows per second from each repeat's seconds).
[[nodiscard]] TunePoint summarize(std::int64_t rows, const Timing& timing);

/// Runs a sweep with `measure`; `on_point` (optional) sees each point as it is measured.
[[nodiscard]] Sweep
run_sweep(const std::function<Timing(std::int64_t rows)>& measure, SweepOptions options = {},
          const std::function<void(const TunePoint&, const Sweep&)>& on_point = {});

/// The fewest chunks in flight whose throughput is within `improvement` of the best of
/// an overlap test: (chunks in flight, rows per second) pairs. 1 when none is given.
[[nodiscard]] int choose_overlap_chunks(const std::vector<std::pair<int, double>>& measured,
                                        double improvement = 0.03);

/// The rows of a pool's chunk on `device` for a knee of `knee` rows (one lane's chunk)
/// measured on `cpu_lanes` lanes: on the CPU a GreedyPriorityCapacity chunk is shared by its
/// lanes, so the knee times the lanes (at most INT64_MAX); the knee elsewhere. What
/// recommend() gives the pool and what the lane test times.
[[nodiscard]] std::int64_t pool_chunk_rows(const Device& device, std::int64_t knee, int cpu_lanes);

/// The lane test's verdict: seconds per chunk that a pool's lane added, from timings of the
/// same call through the calling thread (`direct`) and through the pool (`lane`), each of
/// `chunks` chunks: the difference of the medians over `chunks`, >= 0 (0 when either list
/// is empty, as for a size that ran out of memory).
[[nodiscard]] double chunk_overhead_from(std::vector<double> direct, std::vector<double> lane,
                                         std::int64_t chunks);

} // namespace neml2::detail

#pragma once

// What tune() decides from measurements, as plain code that only the tuner and its tests
// call (fed synthetic timings there): running a sweep, how many chunks in flight pay, and
// what a pool's lane costs per chunk.

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include <neml2/tune.hpp>

namespace neml2::detail {

/// Runs a sweep with `measure`; `on_point` (optional) sees each point as it is measured.
[[nodiscard]] Sweep
run_sweep(const std::function<Timing(std::int64_t rows)>& measure, SweepOptions options = {},
          const std::function<void(const TunePoint&, const Sweep&)>& on_point = {});

/// The fewest chunks in flight whose throughput is within `improvement` of the best of
/// an overlap test: (chunks in flight, rows per second) pairs. 1 when none is given.
[[nodiscard]] int choose_overlap_chunks(const std::vector<std::pair<int, double>>& measured,
                                        double improvement = 0.03);

/// The lane test's verdict: seconds per chunk that a pool's lane added, from timings of the
/// same call through the calling thread (`direct`) and through the pool (`lane`), each of
/// `chunks` chunks: the difference of the medians over `chunks`, >= 0 (0 when either list
/// is empty, as for a size that ran out of memory).
[[nodiscard]] double chunk_overhead_from(std::vector<double> direct, std::vector<double> lane,
                                         std::int64_t chunks);

} // namespace neml2::detail

#pragma once

// A user-written asynchronous policy, against the public concept only: it learns each
// device's rows per second while running and sizes chunks so that the devices finish
// together. Walked through in docs/custom-policy.md.

#include <algorithm>
#include <optional>
#include <span>
#include <vector>

#include <neml2/dispatch.hpp>

struct ThroughputBalancing {
  using dispatch_mode = neml2::asynchronous;
  struct state_type {
    std::vector<double> rows_per_second; // per device; 0 until measured
  };

  std::vector<neml2::Device> devices;
  std::int64_t first_chunk = 4096; // rows for a device whose speed is not known yet
  std::int64_t min_chunk = 512;    // never smaller (per-chunk overhead)
  int rounds = 4;                  // chunks per device over what is left: shrinks to the end

  std::optional<neml2::ChunkChoice> next_chunk(std::span<const std::int64_t> rows_in_flight,
                                               std::int64_t remaining, state_type& s) const {
    auto& speed = s.rows_per_second;
    speed.resize(devices.size());
    std::optional<std::size_t> idle; // the fastest idle device
    double total = 0;
    for (std::size_t d = 0; d < devices.size(); ++d) {
      total += speed[d];
      if (rows_in_flight[d] == 0 && (!idle || speed[d] > speed[*idle]))
        idle = d;
    }
    if (!idle)
      return std::nullopt;
    if (speed[*idle] == 0)
      return neml2::ChunkChoice{*idle, std::min(remaining, first_chunk)};
    // Its share of what is left, in proportion to its speed, over a few rounds.
    const auto share = static_cast<double>(remaining) * speed[*idle] / total / rounds;
    const auto rows = std::max(min_chunk, static_cast<std::int64_t>(share));
    return neml2::ChunkChoice{*idle, std::min(remaining, rows)};
  }

  void on_dispatched(std::size_t, std::int64_t, state_type&) const {}

  void on_completed(std::size_t d, std::int64_t rows, double seconds, state_type& s) const {
    const auto measured = static_cast<double>(rows) / std::max(seconds, 1e-9);
    auto& speed = s.rows_per_second[d];
    speed = speed == 0 ? measured : 0.7 * speed + 0.3 * measured; // smoothed over calls
  }
};

static_assert(neml2::DispatchPolicy<ThroughputBalancing>);

#pragma once

// Which graph the row pass checks its rows with at each Newton iteration, learned from the
// solves before: the residual graph alone where most rows leave at the check (a history's
// step after a converged one: one update, then converged), the jacobian graph (the residual
// and A in one call) where most stay. The two graphs' residuals can differ in the last bits
// (models/gtn_viscoplasticity.i's do), so the residual graph alone decides only rows well
// clear of their tolerance (newton_rows.cpp): the choice changes what a solve costs, not
// which iterate a row ends at. It also keeps what each graph costs a row, from which the
// chord (newton_rows.hpp) judges whether it pays. Private to src/implicit/.

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>

namespace neml2::detail {

/// For tests: every check takes A (1), none does (0), or the schedule decides (-1).
inline std::atomic<int> forced_newton_schedule{-1};

/// The chord pays where A (the jacobian graph) costs a row more than this many residuals.
inline constexpr double chord_pays_above = 3;

/// Whether the chord pays at these costs a row (seconds; 0: not measured yet, when it is
/// assumed to).
[[nodiscard]] inline bool chord_pays(double residual_per_row, double jacobian_per_row) {
  return !(residual_per_row > 0 && jacobian_per_row > 0) ||
         jacobian_per_row > chord_pays_above * residual_per_row;
}

/// Whether a chord row takes A again after a step that cut its ||r|| by `rate`, `left`
/// times above its tolerance, with `iterations` left: where the rate is above `chord_rate`,
/// or where at that rate it would not converge in time (Newton's own cap). (Weighing the
/// steps still needed against A's measured cost lets more rows go on slowly, and is slower:
/// a chord step costs its pass and compaction too, more than the residual graph alone.)
[[nodiscard]] inline bool chord_refactors(double rate, double left, std::int64_t iterations,
                                          double chord_rate) {
  if (!(rate <= chord_rate))
    return true;
  return left > 1 && std::log(left) / -std::log(rate) >= static_cast<double>(iterations);
}

class NewtonSchedule {
public:
  /// Checks tracked (0: at the initial guess); later ones are as the last.
  static constexpr std::size_t tracked = 8;

  NewtonSchedule() {
    for (std::size_t k = 0; k < tracked; ++k)
      _stayed[k].store(k == 0 ? 0 : static_cast<std::uint32_t>(one), std::memory_order_relaxed);
  }

  /// Whether check `k` takes A along: most rows stayed at that check in recent solves. With
  /// nothing recorded: A from check 1 on (the rows that stay at the initial guess need it).
  [[nodiscard]] bool with_a(std::int64_t k) const {
    if (const auto forced = forced_newton_schedule.load(std::memory_order_relaxed); forced >= 0)
      return forced == 1;
    return _stayed[slot(k)].load(std::memory_order_relaxed) >= half;
  }

  /// `stayed` of the `checked` rows of check `k` iterate on: an average over recent solves
  /// (each weighs a quarter). Racing solves may lose an update; either graph is correct.
  void record(std::int64_t k, std::int64_t checked, std::int64_t stayed) {
    if (checked <= 0)
      return;
    auto& share = _stayed[slot(k)];
    const auto now = static_cast<std::int64_t>(share.load(std::memory_order_relaxed));
    const auto seen = stayed * one / checked;
    share.store(static_cast<std::uint32_t>(now + (seen - now) / 4), std::memory_order_relaxed);
  }

  /// Calls of fewer rows do not tell what a row costs (the call's own cost dominates).
  static constexpr std::int64_t costed_rows = 256;

  /// A call of the residual (or jacobian) graph on `rows` rows took `seconds`: the cost a
  /// row, averaged over recent calls of at least `costed_rows` (each weighs a quarter).
  void record_cost(bool jacobian, std::int64_t rows, double seconds) {
    if (rows < costed_rows)
      return;
    auto& cost = jacobian ? _jacobian_cost : _residual_cost;
    const auto now = cost.load(std::memory_order_relaxed);
    const auto seen = seconds / static_cast<double>(rows);
    cost.store(now > 0 ? now + (seen - now) / 4 : seen, std::memory_order_relaxed);
  }
  /// chord_pays at the costs measured.
  [[nodiscard]] bool chord_pays() const {
    return detail::chord_pays(_residual_cost.load(std::memory_order_relaxed),
                              _jacobian_cost.load(std::memory_order_relaxed));
  }

private:
  static constexpr std::int64_t one = 1 << 16, half = one / 2;
  static std::size_t slot(std::int64_t k) {
    return static_cast<std::size_t>(k < static_cast<std::int64_t>(tracked) ? k : tracked - 1);
  }
  std::array<std::atomic<std::uint32_t>, tracked> _stayed;  // in 1/65536 of the rows
  std::atomic<double> _residual_cost{0}, _jacobian_cost{0}; // seconds a row
};

} // namespace neml2::detail

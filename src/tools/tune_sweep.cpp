// The sweep: sizes doubled while they pay, then refined around the best, within a time
// budget; the points it makes from timings, and the names of why it stopped.

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include <neml2/detail/tune_decisions.hpp>
#include <neml2/tune.hpp>

namespace neml2 {

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

TunePoint detail::summarize(std::int64_t rows, const Timing& timing) {
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

detail::Sweep::Sweep(SweepOptions options)
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

bool detail::Sweep::known(std::int64_t rows) const {
  return std::any_of(_points.begin(), _points.end(),
                     [&](const TunePoint& p) { return p.rows == rows; }) ||
         (_wall && rows >= *_wall);
}

const TunePoint* detail::Sweep::best() const {
  const TunePoint* best = nullptr;
  for (const auto& p : _points)
    if (p.measured() && (!best || p.median > best->median))
      best = &p;
  return best;
}

std::optional<std::int64_t> detail::Sweep::next() {
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

std::optional<std::int64_t> detail::Sweep::next_refinement() {
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

void detail::Sweep::record(std::int64_t rows, const Timing& timing) {
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

detail::Sweep
detail::run_sweep(const std::function<Timing(std::int64_t rows)>& measure, SweepOptions options,
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

} // namespace neml2

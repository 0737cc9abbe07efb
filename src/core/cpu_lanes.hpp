#pragma once

// A call's CPU work on several lanes at once: the calling thread and torch's own OpenMP
// team (src/core/cpu_lanes.cpp, the one file compiled with OpenMP).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>

namespace neml2::detail {

/// What a CPU call's lanes are resolved against (resolve_cpu_lanes).
struct LaneLimits {
  static constexpr std::size_t none = std::numeric_limits<std::size_t>::max();
  /// The lanes a request of 0 stands for: torch's intra-op thread count in a model
  /// (lane_limits_here()), a simulated node's in the simulator.
  std::size_t threads = 1;
  /// The graphs' AOTI runners: a lane beyond them would wait for one.
  std::size_t runners = none;
  /// The pieces (or chunks) the call runs: a lane beyond them would have none.
  std::size_t work = none;
  /// Inside a lane or another OpenMP parallel region: the call runs on its own thread.
  bool nested = false;
};

/// The limits of a CPU call on this thread now, whose graphs have `runners` runners, of
/// `work` pieces: torch's intra-op thread count as it was before any CallOnItsLanes of this
/// thread (at::get_num_threads(), at least 1), and whether the thread is in a lane or in
/// any OpenMP parallel region.
[[nodiscard]] LaneLimits lane_limits_here(std::size_t runners, std::size_t work = LaneLimits::none);

/// The AOTI runners a CPU session makes for `concurrency` calls at once: one per hardware
/// thread, and at least `concurrency` (a model's CPU session: one per lane its policy asks
/// for).
[[nodiscard]] std::size_t cpu_runners(std::size_t concurrency);

/// Whose lane count resolve_cpu_lanes refuses: each is refused in its own words.
enum class LanesAskedBy {
  policy,          ///< a policy's cpu_lanes (DispatchedModel, simulate())
  tune,            ///< TuneOptions::cpu_lanes (tune())
  current_machine, ///< current_machine()'s cpu_lanes (the machine key of a tune file)
};

/// The lanes a CPU call runs on, the one rule (a model's calls, a tune file's machine key,
/// the simulator's virtual node): `requested` (a policy's cpu_lanes) must be 0 to
/// max_cpu_lanes, else a FatalError in `asker`'s words; then 1 when `limits.nested`,
/// else `requested`, 0 standing for `limits.threads`, at most `limits.runners` and
/// `limits.work`, and at least 1.
[[nodiscard]] std::size_t resolve_cpu_lanes(std::int64_t requested, const LaneLimits& limits,
                                            LanesAskedBy asker = LanesAskedBy::policy);

/// @brief While it lives, MKL (LAPACK, BLAS) runs on this thread alone; nothing without MKL.
class MklOnThisThread {
public:
  MklOnThisThread() noexcept;
  ~MklOnThisThread();
  MklOnThisThread(const MklOnThisThread&) = delete;
  MklOnThisThread& operator=(const MklOnThisThread&) = delete;

private:
  int _before = 0;
};

/// @brief While it lives, torch's parallel loops and MKL run on this thread alone, as they do
/// on a lane: a call's CPU work runs on the lanes it was given, and on no team besides (the
/// calling thread's own work between them included: binding, gathering, a small call).
class CallOnItsLanes {
public:
  CallOnItsLanes() noexcept;
  ~CallOnItsLanes();
  CallOnItsLanes(const CallOnItsLanes&) = delete;
  CallOnItsLanes& operator=(const CallOnItsLanes&) = delete;

private:
  int _threads_before;
  int _mkl_before = 0;
  int _outer;
};

/// Runs `work(lane)` on up to `lanes` threads at once, lane 0 on the calling thread, the
/// others on torch's OpenMP team, and returns when every lane has returned. Each lane runs
/// with the caller's grad and inference modes; torch's parallel loops and MKL inside it run
/// on that lane alone. Lanes beyond the first are shared by the calls running at once: a
/// call gets those the calls before it left of its own count (at least the calling thread).
/// What `work` throws is rethrown once every lane has returned (the first lane's to throw).
void run_on_lanes(std::size_t lanes, const std::function<void(std::size_t lane)>& work);

} // namespace neml2::detail

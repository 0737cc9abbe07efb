#pragma once

// A call's CPU work on several lanes at once: the calling thread and torch's own OpenMP
// team (src/core/cpu_lanes.cpp, the one file compiled with OpenMP).

#include <cstddef>
#include <functional>

namespace neml2::detail {

/// The lanes a CPU call asking for `requested` (0: torch's intra-op thread count,
/// at::get_num_threads(), as it was before any CallOnItsLanes of this thread) may run on: 1
/// inside a lane, or inside any OpenMP parallel region.
[[nodiscard]] std::size_t cpu_lanes(std::size_t requested);

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

// CPU lanes (see cpu_lanes.hpp). Torch's team, not threads of our own: its threads already
// run torch's parallel loops, a torch loop inside a lane sees the parallel region and runs
// inline (no team per lane), and a program that never uses lanes starts nothing. The region
// is opened through libgomp's own entry point (GOMP_parallel, what GCC's `omp parallel`
// compiles to), so any compiler builds this file without OpenMP flags, and the library links
// torch's libgomp (cmake/TorchWheel.cmake): one runtime.

#include "core/cpu_lanes.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>

#include <neml2/device.hpp>
#include <neml2/errors.hpp>

#if defined(__SANITIZE_THREAD__)
#define NEML2_DISPATCH_LANES_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define NEML2_DISPATCH_LANES_TSAN 1
#endif
#endif
#ifdef NEML2_DISPATCH_LANES_TSAN
#include <sanitizer/tsan_interface.h>
#endif

// MKL's threads for the calling thread alone (weak: a torch without MKL has none).
extern "C" int MKL_Set_Num_Threads_Local(int threads) __attribute__((weak));

// libgomp's interface (torch's libgomp.so.1): a parallel region runs fn(data) on a team of
// `threads`, the calling thread as number 0, and returns after the team's join.
extern "C" {
void GOMP_parallel(void (*fn)(void*), void* data, unsigned threads, unsigned flags);
int omp_get_thread_num();
int omp_in_parallel();
void omp_set_num_threads(int threads);
}

namespace neml2::detail {
namespace {

// ThreadSanitizer cannot see libgomp's barriers (torch's libgomp is not instrumented): the
// region's start and end are told to it as a release and an acquire.
void happens_before([[maybe_unused]] void* token) noexcept {
#ifdef NEML2_DISPATCH_LANES_TSAN
  __tsan_release(token);
#endif
}
void happens_after([[maybe_unused]] void* token) noexcept {
#ifdef NEML2_DISPATCH_LANES_TSAN
  __tsan_acquire(token);
#endif
}

// Lanes beyond the calling threads', in use by the calls running now.
std::atomic<std::size_t> extra_lanes_in_use{0};

// Takes up to `wanted` extra lanes, as many as `wanted` less those in use, and gives them
// back when it goes.
class ExtraLanes {
public:
  explicit ExtraLanes(std::size_t wanted) noexcept {
    auto in_use = extra_lanes_in_use.load();
    do
      _taken = wanted - std::min(wanted, in_use);
    while (_taken > 0 && !extra_lanes_in_use.compare_exchange_weak(in_use, in_use + _taken));
  }
  ~ExtraLanes() {
    if (_taken > 0)
      extra_lanes_in_use -= _taken;
  }
  ExtraLanes(const ExtraLanes&) = delete;
  ExtraLanes& operator=(const ExtraLanes&) = delete;
  [[nodiscard]] std::size_t taken() const noexcept { return _taken; }

private:
  std::size_t _taken = 0;
};

thread_local bool in_lane = false;
// torch's intra-op thread count before this thread's outermost CallOnItsLanes (0: none).
thread_local int threads_outside_call = 0;
} // namespace

MklOnThisThread::MklOnThisThread() noexcept {
  if (MKL_Set_Num_Threads_Local)
    _before = MKL_Set_Num_Threads_Local(1);
}

MklOnThisThread::~MklOnThisThread() {
  if (MKL_Set_Num_Threads_Local)
    MKL_Set_Num_Threads_Local(_before);
}

LaneLimits lane_limits_here(std::size_t runners, std::size_t work) {
  const auto threads = threads_outside_call > 0 ? threads_outside_call : at::get_num_threads();
  return {.threads = static_cast<std::size_t>(std::max(1, threads)),
          .runners = runners,
          .work = work,
          .nested = in_lane || omp_in_parallel() != 0};
}

std::size_t cpu_runners(std::size_t concurrency) {
  return std::max<std::size_t>({concurrency, 1, std::thread::hardware_concurrency()});
}

std::size_t resolve_cpu_lanes(std::int64_t requested, const LaneLimits& limits,
                              LanesAskedBy asker) {
  if (requested < 0 || requested > max_cpu_lanes) {
    const auto count = std::to_string(requested), most = std::to_string(max_cpu_lanes);
    switch (asker) {
    case LanesAskedBy::tune:
      throw FatalError("tune(): cpu_lanes is " + count +
                       "; give 0 (torch's intra-op thread count) to " + most +
                       " (the lanes the CPU's chunks are measured on)");
    case LanesAskedBy::current_machine:
      throw FatalError("cpu_lanes is " + count + "; give 0 (torch's intra-op thread count) to " +
                       most + " (the lanes the CPU's chunks run on)");
    case LanesAskedBy::policy:
      break;
    }
    throw FatalError("the dispatch policy's cpu_lanes is " + count +
                     "; it must be 0 (one lane per intra-op thread: at::get_num_threads()) to " +
                     most +
                     " (threads that run the CPU's chunks side by side, the calling one included)");
  }
  if (limits.nested)
    return 1;
  const auto asked = requested > 0 ? static_cast<std::size_t>(requested)
                                   : std::max<std::size_t>(limits.threads, 1);
  return std::max<std::size_t>(std::min({asked, limits.runners, limits.work}), 1);
}

CallOnItsLanes::CallOnItsLanes() noexcept
    : _threads_before(at::get_num_threads()) // (torch sets the thread up first)
    , _outer(threads_outside_call) {
  if (_outer == 0)
    threads_outside_call = std::max(1, _threads_before);
  omp_set_num_threads(1);
  if (MKL_Set_Num_Threads_Local)
    _mkl_before = MKL_Set_Num_Threads_Local(1);
}

CallOnItsLanes::~CallOnItsLanes() {
  if (MKL_Set_Num_Threads_Local)
    MKL_Set_Num_Threads_Local(_mkl_before);
  omp_set_num_threads(std::max(1, _threads_before));
  threads_outside_call = _outer;
}

void run_on_lanes(std::size_t lanes, const std::function<void(std::size_t lane)>& work) {
  const ExtraLanes extra(lanes > 1 ? lanes - 1 : 0);
  if (extra.taken() == 0) {
    work(0);
    return;
  }
  struct Region {
    explicit Region(const std::function<void(std::size_t)>& w)
        : work(w) {}
    const std::function<void(std::size_t)>& work;
    bool grad = at::GradMode::is_enabled();
    bool inference = c10::InferenceMode::is_enabled();
    std::exception_ptr error;
    std::once_flag first_error;
    char started = 0, ended = 0; // ThreadSanitizer's tokens
  } region{work};
  happens_before(&region.started);
  GOMP_parallel(
      [](void* data) {
        auto& r = *static_cast<Region*>(data);
        happens_after(&r.started);
        const auto lane = static_cast<std::size_t>(omp_get_thread_num());
        try {
          const c10::InferenceMode inference_mode(r.inference);
          const at::AutoGradMode grad_mode(r.grad);
          const MklOnThisThread mkl;
          in_lane = true;
          r.work(lane);
          in_lane = false;
        } catch (...) {
          in_lane = false;
          std::call_once(r.first_error, [&] { r.error = std::current_exception(); });
        }
        happens_before(&r.ended);
      },
      &region, static_cast<unsigned>(extra.taken() + 1), 0);
  happens_after(&region.ended);
  if (region.error)
    std::rethrow_exception(region.error);
}

} // namespace neml2::detail

// The asynchronous engine: a call's chunks go where the policy says as devices have room,
// on a worker per accelerator and on the calling thread for the CPU; the policy, its state
// and the devices' loads are shared by every call under one lock (see
// include/neml2/detail/async_engine.hpp).

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>

#include <ATen/ATen.h>

#include <neml2/detail/async_engine.hpp>
#include <neml2/detail/async_schedule.hpp>

#include "core/cpu_lanes.hpp"
#include "core/stopwatch.hpp"
#include "core/worker_pool.hpp"
#include "engine/async/streams.hpp"
#include "engine/chunk_runner.hpp"

namespace neml2::detail {
namespace {
// Callbacks of asynchronous models running on this thread: the policy's hooks and the
// chunk observer run under their model's lock, so a call into a model of an asynchronous
// policy from one would wait for that lock, or for room only the outer call can free.
thread_local int callbacks_running = 0;
struct InCallback {
  InCallback() noexcept { ++callbacks_running; }
  ~InCallback() { --callbacks_running; }
  InCallback(const InCallback&) = delete;
  InCallback& operator=(const InCallback&) = delete;
};

// One error is rethrown as it is; several become an AggregateError in chunk order.
void rethrow(std::vector<std::pair<std::size_t, std::exception_ptr>>& errors) {
  if (errors.empty())
    return;
  std::stable_sort(errors.begin(), errors.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  if (errors.size() == 1)
    std::rethrow_exception(errors.front().second);
  std::vector<std::exception_ptr> all;
  for (auto& [index, error] : errors)
    all.push_back(error);
  throw AggregateError(std::move(all));
}

// One call of an asynchronous policy: its place in the schedule, its chunks for the
// calling thread, its failures. Lives on the calling thread's stack; guarded by
// Engine::mutex.
struct Progress : ScheduledCall {
  Progress(const CallContext& context, BoundCall& call, std::vector<at::Tensor> targets)
      : ScheduledCall(call.batch)
      , context(context)
      , call(call)
      , targets(std::move(targets)) {}
  const CallContext& context;
  BoundCall& call;
  std::vector<at::Tensor> targets;          // the caller's tensors, until `results` takes them
  std::optional<Gatherer> results;          // made before the first chunk goes to the pool
  CallerStreams caller;                     // recorded then: what workers wait for
  std::deque<ScheduledChunk> caller_chunks; // for the calling thread's lane, not yet run
  std::vector<std::pair<std::size_t, std::exception_ptr>> errors; // (chunk, error)
  bool interrupted = false;         // the interrupt check stopped the call
  std::condition_variable finished; // the calling thread sleeps here (or runs caller_chunks)
  // Records a failure of chunk `chunk`: no chunk is dispatched after it.
  void fail(std::size_t chunk, std::exception_ptr error) {
    errors.emplace_back(chunk, std::move(error));
    stopped = true;
  }
};

// What every call and worker of one asynchronous model shares, under one lock (the
// schedule, and so the policy's state, included).
struct Engine {
  Engine(AsyncPolicyCalls& policy, std::vector<Device> devices,
         const std::vector<WorkerPool::Lane>& lanes)
      : schedule(policy, std::move(devices))
      , pool(lanes) {}
  std::mutex mutex;
  AsyncSchedule schedule;
  std::mutex caller_lane; // held by the thread running a chunk there
  WorkerPool pool;        // last: joined before the rest goes
};
} // namespace

struct AsyncEngine::Impl {
  Impl(const ModelCore& model, AsyncPolicyCalls& policy)
      : core(model.state()) {
    const auto& compute = core.compute;
    const auto cpu = std::find_if(compute.begin(), compute.end(),
                                  [](const c10::Device& d) { return d.is_cpu(); });
    if (cpu != compute.end())
      _caller_lane = static_cast<std::size_t>(cpu - compute.begin());
    std::vector<WorkerPool::Lane> lanes;
    for (std::size_t d = 0; d < compute.size(); ++d)
      lanes.push_back({compute[d], d == _caller_lane ? 0 : core.chunks_in_flight[d]});
    _engine = std::make_unique<Engine>(policy, core.devices, lanes);
  }

  [[nodiscard]] const Session& session() const noexcept { return core.sessions.front(); }

  std::vector<at::Tensor> run(Request& request) const {
    const CallOnItsLanes on_its_lanes; // the caller's CPU work, on its lanes only
    auto [call, targets, context] = bind(core, request);
    return dispatch_async(context, call, std::move(targets));
  }

  // The calling thread dispatches what the policy allows, then sleeps until the call is
  // done: a worker that completes a chunk dispatches the next ones itself, so nobody is
  // woken per chunk.
  std::vector<at::Tensor> dispatch_async(const CallContext& context, BoundCall& call,
                                         std::vector<at::Tensor> targets) const {
    if (call.batch == 0)
      return Gatherer(call, session().dtype(), false, std::move(targets)).finish();
    auto& engine = *_engine;
    Progress progress(context, call, std::move(targets));
    std::vector<at::Tensor> direct;
    std::unique_lock lock(engine.mutex);
    if (const auto d = dispatch_ready(progress, /*may_run_here=*/true)) {
      lock.unlock(); // one chunk in place: no pool, no copy
      {
        std::unique_lock<std::mutex> lane; // the CPU's: one chunk at a time across calls
        if (d == _caller_lane)
          lane = std::unique_lock(engine.caller_lane);
        complete({0, *d, 0, call.batch}, progress, [&] {
          direct = run_whole(core, context, call, *d, progress.targets);
          finished_on(core, *d); // the policy's seconds end when the results are ready
        });
      }
      lock.lock();
    } else if (!progress.results && !progress.stopped) {
      try { // the policy made it wait: started here, not on a worker
        start_on_pool(progress);
      } catch (...) { // then it waits for nothing: no chunk is booked, none will be
        progress.fail(progress.index,
                      as_library_error(std::current_exception(), "allocating the outputs"));
      }
    }
    // From here on the call leaves only when it is done (no chunk of it in flight) and
    // after it is off the list of calls waiting for room.
    run_caller_chunks(progress, lock);
    engine.schedule.close(progress);
    lock.unlock();
    rethrow(progress.errors);
    if (!progress.results)
      return direct;
    // What chunks made on workers' streams goes to the calling thread: its stream owns it.
    progress.results->for_each_made(own_on_this_stream);
    return std::move(*progress.results).finish();
  }

  // The calling thread, until its call is done: runs the call's chunks on the lane it
  // serves, one at a time across calls (Engine::mutex held on entry and exit).
  // A chunk queued before the call's interrupt check stopped it completes without running.
  void run_caller_chunks(Progress& p, std::unique_lock<std::mutex>& lock) const {
    for (;;) {
      wait_for_chunks(p, lock);
      if (p.caller_chunks.empty())
        return;
      const auto chunk = p.caller_chunks.front();
      p.caller_chunks.pop_front();
      const bool stopped = p.interrupted;
      bool interrupted = false;
      lock.unlock();
      {
        const std::lock_guard lane(_engine->caller_lane);
        complete(chunk, p, [&] {
          if (stopped)
            return;
          if (chunk.index > 0) {
            try {
              p.context.ask_interrupt_check();
            } catch (...) {
              interrupted = true;
              throw;
            }
          }
          run_chunk_here(p, chunk);
        });
      }
      lock.lock();
      p.interrupted = p.interrupted || interrupted;
    }
  }

  // Until the call is done or has a chunk for the calling thread; meanwhile its interrupt
  // check every 20 ms until it stops the call (Engine::mutex held on entry and exit,
  // released while the check runs).
  void wait_for_chunks(Progress& p, std::unique_lock<std::mutex>& lock) const {
    const auto ready = [&] { return p.done() || !p.caller_chunks.empty(); };
    if (!p.context.interruptible()) {
      p.finished.wait(lock, ready);
      return;
    }
    while (!p.finished.wait_for(lock, std::chrono::milliseconds(20), ready)) {
      if (p.interrupted)
        continue; // stopped: the chunks in flight finish
      lock.unlock();
      std::exception_ptr stop;
      try {
        p.context.ask_interrupt_check();
      } catch (...) {
        stop = std::current_exception();
      }
      lock.lock();
      if (stop) {
        p.fail(p.index, stop);
        p.interrupted = true;
      }
    }
  }

  // A call's first chunk for the pool (on the calling thread, Engine::mutex held): where its
  // streams stand, and its outputs allocated on them, before any worker sees the call.
  void start_on_pool(Progress& p) const {
    p.caller.record(p.call, p.targets);
    p.results.emplace(p.call, session().dtype(), /*concurrent=*/true, std::move(p.targets));
  }

  // Dispatches the chunks the policy allows now (Engine::mutex held; any thread). Returns
  // the device when the whole batch may run in place on the calling thread instead.
  std::optional<std::size_t> dispatch_ready(Progress& p, bool may_run_here) const {
    auto& engine = *_engine;
    std::optional<std::size_t> whole;
    try {
      const InCallback in_callback;
      const auto whole_here = [&](const ScheduledChunk& c) {
        return may_run_here && c.rows == p.batch && p.call.device == core.compute[c.device];
      };
      engine.schedule.dispatch(
          p,
          [&](const ScheduledChunk& c) {
            // Outputs first (only on the calling thread: dispatch_async starts the others):
            // a failure leaves nothing booked with the policy or the loads.
            if (!whole_here(c) && !p.results)
              start_on_pool(p);
          },
          [&](const ScheduledChunk& c) {
            if (whole_here(c))
              whole = c.device;
            else if (c.device == _caller_lane) {
              p.caller_chunks.push_back(c);
              p.finished.notify_one(); // the calling thread runs it
            } else {
              engine.pool.submit(c.device, [this, &p, c] {
                complete(c, p, [&] {
                  p.caller.wait(); // after what the caller queued: its inputs, readers of outputs
                  run_chunk_here(p, c);
                });
              });
            }
          });
    } catch (...) {
      p.fail(p.index, as_library_error(std::current_exception(),
                                       "the dispatch policy's next_chunk() or on_dispatched()"));
    }
    return whole;
  }

  // Runs a chunk, then books its completion (the schedule, the observer, the call) and
  // dispatches what the freed room allows, for its call and for calls waiting for room.
  template <class Run>
  void complete(const ScheduledChunk& chunk, Progress& progress, Run&& run) const {
    const auto start = steady_clock::now();
    std::exception_ptr error;
    try {
      run();
    } catch (...) {
      error = as_library_error(std::current_exception(),
                               "running a chunk on " + core.devices[chunk.device].str());
    }
    const auto seconds = seconds_since(start);
    auto& engine = *_engine;
    std::lock_guard lock(engine.mutex);
    try {
      const InCallback in_callback;
      engine.schedule.complete(progress, chunk, seconds);
      if (progress.context.observed())
        (*progress.context.observer)(
            core.event(chunk.index, chunk.device, chunk.first, chunk.rows, seconds));
    } catch (...) {
      if (!error)
        error = as_library_error(std::current_exception(),
                                 "the dispatch policy's on_completed() or the chunk "
                                 "observer, after a chunk completed");
    }
    if (error)
      progress.fail(chunk.index, error);
    // Notified under the lock: a finished call's Progress goes as soon as it is released.
    engine.schedule.for_each_call_with_room(progress, [&](ScheduledCall& call) {
      auto& other = static_cast<Progress&>(call);
      dispatch_ready(other, false);
      if (other.done())
        other.finished.notify_one();
    });
  }

  // One chunk's rows, taken onto device d (staged through pinned memory from the host to an
  // accelerator), run and put in place (any thread); a CPU chunk in pieces over the lanes.
  void run_chunk_here(Progress& p, const ScheduledChunk& c) const {
    const auto device = core.compute[c.device];
    if (device.is_cpu()) { // in pieces over the CPU's lanes
      run_chunk_on_lanes(core, p.context, p.call, *p.results, c.device, c.first, c.rows, c.index);
      return;
    }
    ChunkArgs chunk;
    if (device == p.call.device)
      take_rows(p.call, c.first, c.rows, device, chunk);
    else
      take_rows_staged(p.call, c.first, c.rows, device, chunk);
    run_chunk(core, p.context, chunk, *p.results, c.device, c.first, c.index);
    finished_on(core, c.device); // its results ready (and this thread's staging buffers free)
  }

  const ModelCore::State& core;
  std::unique_ptr<Engine> _engine;
  // The first CPU device: its chunks run on the thread that made the call, while it waits
  // (no worker: a worker's OpenMP team would be a second one, and libgomp stops spinning
  // once it manages more threads than there are cores).
  std::optional<std::size_t> _caller_lane;
};

AsyncEngine::AsyncEngine(const ModelCore& core, AsyncPolicyCalls& policy)
    : _impl(std::make_unique<Impl>(core, policy)) {}

AsyncEngine::~AsyncEngine() = default;

std::vector<at::Tensor> AsyncEngine::run(Request& request) const {
  if (callbacks_running > 0)
    throw FatalError("a model of an asynchronous policy was called from a chunk observer or a "
                     "policy hook of an asynchronous model, which run under their model's lock: "
                     "the call would wait for ever. Call it after the outer call returns (a "
                     "model of a synchronous policy may be called there)");
  return _impl->run(request);
}

} // namespace neml2::detail

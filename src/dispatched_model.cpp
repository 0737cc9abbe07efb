// The engine behind every DispatchedModel<Policy>: binding a call, cutting it into chunks
// where the policy says (on the calling thread for a synchronous policy, on the worker pool
// for an asynchronous one), and gathering the results. The policy is reached through
// detail::PolicyCalls, so this is compiled once for every policy.

#include <neml2/dispatched_model.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>

#include <ATen/ATen.h>

#include "chunking.hpp"
#include "session_access.hpp"
#include "worker_pool.hpp"

namespace neml2 {

namespace {
using clock = std::chrono::steady_clock;

double seconds_since(clock::time_point start) {
  return std::chrono::duration<double>(clock::now() - start).count();
}

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

// One call of an asynchronous policy: what is left to dispatch, its chunks in flight, its
// failures. Lives on the calling thread's stack; guarded by Engine::mutex.
struct Progress {
  Progress(Operation op, detail::BoundCall& call, std::vector<at::Tensor> targets)
      : op(op)
      , call(call)
      , targets(std::move(targets)) {}
  Operation op;
  detail::BoundCall& call;
  std::vector<at::Tensor> targets;         // the caller's tensors, until `results` takes them
  std::optional<detail::Gatherer> results; // made before the first chunk goes to the pool
  detail::CallerStreams caller;            // recorded then: what workers wait for
  std::int64_t first = 0;                  // the next row to dispatch
  std::size_t index = 0;                   // the next chunk's number
  std::size_t in_flight = 0;
  struct Chunk {
    std::int64_t first, rows;
    std::size_t index;
  };
  std::deque<Chunk> caller_chunks; // for the lane the calling thread serves, not yet run
  std::vector<std::pair<std::size_t, std::exception_ptr>> errors; // (chunk, error)
  std::condition_variable finished; // the calling thread sleeps here (or runs caller_chunks)
  [[nodiscard]] bool done() const {
    return in_flight == 0 && (first == call.batch || !errors.empty());
  }
};

// What every call and worker of one asynchronous model shares, under one lock (the
// policy's state included: PolicyCalls is called only with it held).
struct Engine {
  Engine(std::size_t devices, const std::vector<detail::WorkerPool::Lane>& lanes)
      : rows_in_flight(devices, 0)
      , pool(lanes) {}
  std::mutex mutex;
  std::vector<std::int64_t> rows_in_flight; // per device
  std::vector<Progress*> waiting_for_room;  // calls the policy told to wait
  std::mutex caller_lane;                   // held by the thread running a chunk there
  detail::WorkerPool pool;                  // last: joined before the rest goes
};
} // namespace

struct AnyDispatchedModel::Impl {
  using Access = detail::SessionAccess;
  using ChunkHook = std::function<void(const ChunkEvent&)>;

  Impl(std::shared_ptr<const Artifact> artifact, std::unique_ptr<detail::PolicyCalls> calls,
       c10::ScalarType dtype)
      : _policy(std::move(calls))
      , _asynchronous(_policy->asynchronous())
      , _listed(_policy->devices()) {
    if (_listed.empty())
      throw FatalError("the dispatch policy lists no devices; list at least one");
    for (std::size_t d = 0; d < _listed.size(); ++d) {
      _sessions.emplace_back(artifact, _listed[d], dtype, chunks_in_flight(d));
      _compute.push_back(_sessions.back().device().torch());
    }
    if (_asynchronous) {
      const auto cpu = std::find_if(_compute.begin(), _compute.end(),
                                    [](const c10::Device& d) { return d.is_cpu(); });
      if (cpu != _compute.end())
        _caller_lane = static_cast<std::size_t>(cpu - _compute.begin());
      std::vector<detail::WorkerPool::Lane> lanes;
      for (std::size_t d = 0; d < _listed.size(); ++d)
        lanes.push_back({_compute[d], d == _caller_lane ? 0 : chunks_in_flight(d)});
      _engine = std::make_unique<Engine>(_listed.size(), lanes);
    } else
      (void)session_of(_policy->compute_device()); // a device it does not list fails now
  }

  // The first session holds the master parameters and answers metadata queries.
  [[nodiscard]] const Session& session() const noexcept { return _sessions.front(); }
  [[nodiscard]] Session& session() noexcept { return _sessions.front(); }

  [[nodiscard]] std::size_t chunks_in_flight(std::size_t d) const {
    if (_listed[d].is_accelerator())
      return static_cast<std::size_t>(std::max<std::int64_t>(_policy->chunks_in_flight(d), 1));
    return 1;
  }

  [[nodiscard]] std::size_t session_of(const Device& device) const {
    for (std::size_t d = 0; d < _listed.size(); ++d)
      if (_listed[d] == device)
        return d;
    throw FatalError("the dispatch policy's compute_device() is " + device.str() +
                     ", which its devices() does not list (" + listed_text() +
                     "); list it there, or compute on a listed device");
  }

  [[nodiscard]] std::string listed_text() const {
    std::string text;
    for (const auto& d : _listed)
      text += (text.empty() ? "{" : ", ") + d.str();
    return text + "}";
  }

  // A per-row ConvergenceError leaves a public call with the outputs by name.
  template <class F>
  auto named(F&& f) const {
    try {
      return f();
    } catch (const ConvergenceError& e) {
      if (!e.per_row() || !e.outputs().empty() || e.results().empty())
        throw;
      auto results = e.results();
      throw ConvergenceError(e.what(), e.converged_mask(), e.worst_residual(), e.results(),
                             Access::forward_result(session(), std::move(results)));
    }
  }

  void into(Operation op, const TensorMap& inputs, const TensorMap& extras, const TensorMap& values,
            const TensorMap& tangents, const VariablePairJacobian& blocks) const {
    named([&] {
      const auto destinations = detail::translate_foreign_errors("neml2::DispatchedModel", [&] {
        return Access::destinations(session(), op, values, tangents, blocks);
      });
      return dispatch(op, inputs, extras, &destinations);
    });
  }

  // `inputs`: by name (a TensorMap) or in input_names() order (a vector). `into`: the
  // caller's tensors for the results (see Session::destinations).
  template <class Inputs>
  std::vector<at::Tensor> dispatch(Operation op, Inputs&& inputs, const TensorMap& extras,
                                   const detail::Destinations* into = nullptr) const {
    return detail::translate_foreign_errors("neml2::DispatchedModel", [&] {
      auto call = Access::bind(session(), op, std::forward<Inputs>(inputs), extras,
                               session().named_parameters(), {});
      auto targets =
          into ? detail::writable(call, session().dtype(), *into) : std::vector<at::Tensor>{};
      if (_asynchronous)
        return dispatch_async(op, call, std::move(targets));
      return dispatch_sync(op, call, std::move(targets));
    });
  }

  // forward() of a whole batch on the CPU straight through the value graph, when the policy
  // runs it as one chunk there and the call needs nothing bind() would convert, broadcast
  // or refuse (SessionAccess::batch_as_given): no BoundCall, no chunk. nullopt: take the
  // bound path.
  std::optional<std::vector<at::Tensor>>
  forward_as_given(const std::vector<at::Tensor>& inputs) const {
    if (_asynchronous || _observer || _before_chunk || !session().named_parameters().empty())
      return std::nullopt;
    return detail::translate_foreign_errors(
        "neml2::DispatchedModel", [&]() -> std::optional<std::vector<at::Tensor>> {
          const auto d = session_of(_policy->compute_device());
          const auto batch = Access::batch_as_given(_sessions[d], inputs);
          if (batch == 0 || batch > detail::min_piece_rows)
            return std::nullopt;
          if (const auto rows = _policy->chunk_rows(batch); rows != 0 && rows < batch)
            return std::nullopt;
          return Access::forward_as_given(_sessions[d], inputs);
        });
  }

  // The whole call as one chunk on the input device: no slicing, no copy (but into the
  // caller's tensors, when given). A large batch on the CPU runs in cache-sized pieces
  // instead, into outputs from kept memory or the caller's tensors.
  std::vector<at::Tensor> run_direct(Operation op, detail::BoundCall& call, std::size_t d,
                                     const std::vector<at::Tensor>& targets) const {
    if (call.batch > detail::min_piece_rows)
      if (const auto piece = detail::piece_rows(call, session().dtype()); piece > 0)
        return run_pieces(op, call, d, piece, targets);
    detail::ChunkArgs chunk;
    detail::take_all(call, _compute[d], chunk);
    const auto deliver = [&](std::vector<at::Tensor> results) {
      if (!targets.empty() && results.size() == targets.size()) {
        detail::copy_into(targets, call, results);
        return targets;
      }
      return results;
    };
    std::vector<at::Tensor> results;
    try {
      if (_before_chunk)
        _before_chunk(event(0, d, 0, call.batch, 0));
      results = Access::run(_sessions[d], op, chunk,
                            targets.empty() ? detail::Places{}
                                            : detail::places(call, targets, 0, call.batch));
    } catch (const ConvergenceError& e) {
      if (!e.per_row())
        throw;
      detail::throw_failed_rows(e.converged_mask(), e.worst_residual(),
                                deliver(detail::finish_whole(call, e.results())));
    }
    return deliver(detail::finish_whole(call, std::move(results)));
  }

  // The whole call on the CPU in pieces of `piece` rows, one after the other: each piece's
  // results are copied into place while still in cache.
  std::vector<at::Tensor> run_pieces(Operation op, const detail::BoundCall& call, std::size_t d,
                                     std::int64_t piece,
                                     const std::vector<at::Tensor>& targets) const {
    detail::Gatherer results(call, session().dtype(), /*concurrent=*/false, targets);
    if (_before_chunk)
      _before_chunk(event(0, d, 0, call.batch, 0));
    detail::ChunkArgs chunk;
    std::size_t index = 0;
    for (std::int64_t first = 0; first < call.batch; first += piece, ++index) {
      const auto rows = std::min(piece, call.batch - first);
      detail::take_rows(call, first, rows, _compute[d], chunk);
      try {
        results.add(index, first, rows,
                    Access::run(_sessions[d], op, chunk, results.places(first, rows)));
      } catch (const ConvergenceError& e) {
        if (!e.per_row())
          throw;
        results.add_failed_rows(index, first, rows, e);
      }
    }
    return std::move(results).finish();
  }

  // One chunk's rows, run on device d and put in place (any thread).
  void run_chunk(Operation op, const detail::BoundCall& call, detail::Gatherer& results,
                 std::size_t d, std::int64_t first, std::int64_t rows, std::size_t index) const {
    const auto device = _compute[d];
    detail::ChunkArgs chunk;
    if (device.is_cpu() || device == call.device)
      detail::take_rows(call, first, rows, device, chunk);
    else
      detail::take_rows_staged(call, first, rows, device, chunk);
    try {
      if (_before_chunk)
        _before_chunk(event(index, d, first, rows, 0));
      results.add(index, first, rows,
                  Access::run(_sessions[d], op, chunk,
                              device.is_cpu() ? results.places(first, rows) : detail::Places{}));
    } catch (const ConvergenceError& e) {
      if (!e.per_row())
        throw;
      results.add_failed_rows(index, first, rows, e);
    }
    finished_on(d); // its results ready (and this thread's staging buffers free again)
  }

  std::vector<at::Tensor> dispatch_sync(Operation op, detail::BoundCall& call,
                                        std::vector<at::Tensor> targets) const {
    const auto d = session_of(_policy->compute_device());
    const auto batch = call.batch;
    auto rows = _policy->chunk_rows(batch);
    if (rows < 0)
      throw FatalError("the dispatch policy's chunk_rows(" + std::to_string(batch) + ") returned " +
                       std::to_string(rows) +
                       "; chunk_rows() must return >= 0 (rows per chunk; 0 = the whole batch)");
    rows = rows == 0 ? batch : std::min(rows, batch);
    if (batch > 0 && rows == batch && call.device == _compute[d]) {
      if (!_observer)
        return run_direct(op, call, d, targets);
      const auto start = clock::now();
      auto results = run_direct(op, call, d, targets);
      finished_on(d); // the observer's seconds end when the results are ready
      _observer(event(0, d, 0, batch, seconds_since(start)));
      return results;
    }
    detail::Gatherer results(call, session().dtype(), /*concurrent=*/false, std::move(targets));
    std::size_t index = 0;
    for (std::int64_t first = 0; first < batch; first += rows, ++index) {
      const auto n = std::min(rows, batch - first);
      const auto start = _observer ? clock::now() : clock::time_point{};
      run_chunk(op, call, results, d, first, n, index);
      if (_observer)
        _observer(event(index, d, first, n, seconds_since(start)));
    }
    return std::move(results).finish();
  }

  // ---------------------------------------------------------- asynchronous policies

  // The calling thread dispatches what the policy allows, then sleeps until the call is
  // done: a worker that completes a chunk dispatches the next ones itself, so nobody is
  // woken per chunk.
  std::vector<at::Tensor> dispatch_async(Operation op, detail::BoundCall& call,
                                         std::vector<at::Tensor> targets) const {
    if (call.batch == 0)
      return detail::Gatherer(call, session().dtype(), false, std::move(targets)).finish();
    auto& engine = *_engine;
    Progress progress(op, call, std::move(targets));
    std::vector<at::Tensor> direct;
    std::unique_lock lock(engine.mutex);
    if (const auto d = dispatch_ready(progress, /*may_run_here=*/true)) {
      lock.unlock(); // one chunk in place: no pool, no copy
      complete(*d, 0, call.batch, 0, progress, [&] {
        direct = run_direct(op, call, *d, progress.targets);
        finished_on(*d); // the policy's seconds end when the results are ready
      });
      lock.lock();
    } else if (!progress.results && progress.errors.empty())
      start_on_pool(progress); // the policy made it wait: started here, not on a worker
    run_caller_chunks(progress, lock);
    std::erase(engine.waiting_for_room, &progress);
    lock.unlock();
    rethrow(progress.errors);
    if (!progress.results)
      return direct;
    return std::move(*progress.results).finish(); // on this thread: its stream owns them
  }

  // The calling thread, until its call is done: runs the call's chunks on the lane it
  // serves, one at a time across calls (Engine::mutex held on entry and exit).
  void run_caller_chunks(Progress& p, std::unique_lock<std::mutex>& lock) const {
    for (;;) {
      p.finished.wait(lock, [&] { return p.done() || !p.caller_chunks.empty(); });
      if (p.caller_chunks.empty())
        return;
      const auto chunk = p.caller_chunks.front();
      p.caller_chunks.pop_front();
      lock.unlock();
      {
        const std::lock_guard lane(_engine->caller_lane);
        complete(*_caller_lane, chunk.first, chunk.rows, chunk.index, p, [&] {
          run_chunk(p.op, p.call, *p.results, *_caller_lane, chunk.first, chunk.rows, chunk.index);
        });
      }
      lock.lock();
    }
  }

  // A call's first chunk for the pool (on the calling thread, Engine::mutex held): where its
  // streams stand, and its outputs allocated on them, before any worker sees the call.
  void start_on_pool(Progress& p) const {
    p.caller.record(p.call, p.targets);
    p.results.emplace(p.call, session().dtype(), /*concurrent=*/true, std::move(p.targets));
  }

  // Waits for the work of this thread on accelerator d (nothing on the CPU).
  void finished_on(std::size_t d) const {
    if (!_compute[d].is_cpu())
      detail::synchronize_current_stream(_compute[d]);
  }

  // Dispatches the chunks the policy allows now (Engine::mutex held; any thread). Returns
  // the device when the whole batch may run in place on the calling thread instead.
  std::optional<std::size_t> dispatch_ready(Progress& p, bool may_run_here) const {
    auto& engine = *_engine;
    const auto batch = p.call.batch;
    try {
      while (p.first < batch && p.errors.empty()) {
        const auto choice = _policy->next_chunk(
            std::span<const std::int64_t>(engine.rows_in_flight), batch - p.first);
        if (!choice) {
          if (std::all_of(engine.rows_in_flight.begin(), engine.rows_in_flight.end(),
                          [](std::int64_t r) { return r == 0; }))
            throw FatalError("the dispatch policy's next_chunk() gave no chunk while every "
                             "device was idle (" +
                             std::to_string(batch - p.first) + " of " + std::to_string(batch) +
                             " rows left); return a ChunkChoice when a device has room, and "
                             "nullopt only to wait for a chunk in flight");
          if (std::find(engine.waiting_for_room.begin(), engine.waiting_for_room.end(), &p) ==
              engine.waiting_for_room.end())
            engine.waiting_for_room.push_back(&p);
          return std::nullopt;
        }
        check(*choice, batch - p.first);
        // Not a structured binding: the lambda below captures them (clang 14, the fuzz
        // build's compiler, cannot capture bindings).
        const auto d = choice->device;
        const auto n = choice->rows;
        _policy->on_dispatched(d, n);
        engine.rows_in_flight[d] += n;
        ++p.in_flight;
        const auto first = p.first;
        const auto index = p.index++;
        p.first += n;
        if (may_run_here && n == batch && p.call.device == _compute[d])
          return d;
        try {
          if (!p.results) // only on the calling thread: dispatch_async starts the others
            start_on_pool(p);
          if (d == _caller_lane) {
            p.caller_chunks.push_back({first, n, index});
            p.finished.notify_one(); // the calling thread runs it
            continue;
          }
          engine.pool.submit(d, [this, &p, d, n, first, index] {
            complete(d, first, n, index, p, [&] {
              p.caller.wait(); // after what the caller queued: its inputs, readers of outputs
              run_chunk(p.op, p.call, *p.results, d, first, n, index);
            });
          });
        } catch (...) { // not queued: it will never complete
          engine.rows_in_flight[d] -= n;
          --p.in_flight;
          throw;
        }
      }
    } catch (...) {
      p.errors.emplace_back(p.index, detail::as_library_error(std::current_exception(),
                                                              "the dispatch policy's next_chunk() "
                                                              "or on_dispatched()"));
    }
    return std::nullopt;
  }

  // Runs a chunk, then books its completion (loads, the policy, the observer, the call)
  // and dispatches what the freed room allows, for its call and for calls waiting for room.
  template <class Run>
  void complete(std::size_t d, std::int64_t first, std::int64_t rows, std::size_t index,
                Progress& progress, Run&& run) const {
    const auto start = clock::now();
    std::exception_ptr error;
    try {
      run();
    } catch (...) {
      error = detail::as_library_error(std::current_exception(),
                                       "running a chunk on " + _listed[d].str());
    }
    const auto seconds = seconds_since(start);
    auto& engine = *_engine;
    std::lock_guard lock(engine.mutex);
    engine.rows_in_flight[d] -= rows;
    try {
      _policy->on_completed(d, rows, seconds);
      if (_observer)
        _observer(event(index, d, first, rows, seconds));
    } catch (...) {
      if (!error)
        error = detail::as_library_error(std::current_exception(),
                                         "the dispatch policy's on_completed() or the chunk "
                                         "observer, after a chunk completed");
    }
    if (error)
      progress.errors.emplace_back(index, error);
    --progress.in_flight;
    // Notified under the lock: a finished call's Progress goes as soon as it is released.
    dispatch_ready(progress, false);
    if (progress.done())
      progress.finished.notify_one();
    for (auto* other : std::exchange(engine.waiting_for_room, {})) {
      dispatch_ready(*other, false);
      if (other->done())
        other->finished.notify_one();
    }
  }

  void check(const ChunkChoice& choice, std::int64_t remaining) const {
    if (choice.device >= _listed.size())
      throw FatalError("the dispatch policy's next_chunk() chose device index " +
                       std::to_string(choice.device) + ", but the policy lists " +
                       std::to_string(_listed.size()) + " device(s) " + listed_text() +
                       "; return an index into its devices");
    if (choice.rows < 1 || choice.rows > remaining)
      throw FatalError("the dispatch policy's next_chunk() chose " + std::to_string(choice.rows) +
                       " rows for " + _listed[choice.device].str() + " with " +
                       std::to_string(remaining) +
                       " rows remaining; a chunk takes 1 to the remaining rows");
  }

  [[nodiscard]] ChunkEvent event(std::size_t index, std::size_t d, std::int64_t first,
                                 std::int64_t rows, double seconds) const {
    return {index, d, _listed[d], first, rows, seconds};
  }

  std::unique_ptr<detail::PolicyCalls> _policy; // the policy and its state
  bool _asynchronous;
  std::vector<Device> _listed;       // as the policy lists them
  std::vector<Session> _sessions;    // one per listed device
  std::vector<c10::Device> _compute; // each session's device, resolved once
  ChunkObserver _observer;           // empty: nothing timed, nothing called
  ChunkHook _before_chunk;           // tests inject faults here (detail::ModelAccess)
  std::unique_ptr<Engine> _engine;   // asynchronous policies only
  // The first CPU device of an asynchronous policy: its chunks run on the thread that made
  // the call, while it waits (no worker: a worker's OpenMP team would be a second one,
  // and libgomp stops spinning once it manages more threads than there are cores).
  std::optional<std::size_t> _caller_lane;
};

// ------------------------------------------------------------------ AnyDispatchedModel

AnyDispatchedModel::AnyDispatchedModel(std::shared_ptr<const Artifact> artifact,
                                       std::unique_ptr<detail::PolicyCalls> policy,
                                       c10::ScalarType dtype)
    : _impl(std::make_unique<Impl>(std::move(artifact), std::move(policy), dtype)) {}
AnyDispatchedModel::~AnyDispatchedModel() = default;
AnyDispatchedModel::AnyDispatchedModel(AnyDispatchedModel&&) noexcept = default;
AnyDispatchedModel& AnyDispatchedModel::operator=(AnyDispatchedModel&&) noexcept = default;

TensorMap AnyDispatchedModel::forward(const TensorMap& inputs) const {
  const auto& m = *_impl;
  return m.named([&] {
    auto positional = detail::translate_foreign_errors(
        "neml2::DispatchedModel", [&] { return Impl::Access::positional(m.session(), inputs); });
    auto results = m.forward_as_given(positional);
    return Impl::Access::forward_result(
        m.session(), results ? std::move(*results)
                             : m.dispatch(Operation::forward, std::move(positional), {}));
  });
}

std::pair<TensorMap, TensorMap> AnyDispatchedModel::jvp(const TensorMap& inputs,
                                                        const TensorMap& tangents) const {
  const auto& m = *_impl;
  return m.named([&] {
    return Impl::Access::jvp_result(m.session(), m.dispatch(Operation::jvp, inputs, tangents));
  });
}

std::pair<TensorMap, VariablePairJacobian>
AnyDispatchedModel::jacobian(const TensorMap& inputs) const {
  const auto& m = *_impl;
  return m.named([&] {
    return Impl::Access::jacobian_result(m.session(), m.dispatch(Operation::jacobian, inputs, {}));
  });
}

std::pair<TensorMap, VariablePairJacobian>
AnyDispatchedModel::param_jacobian(const TensorMap& inputs) const {
  const auto& m = *_impl;
  return m.named([&] {
    return Impl::Access::param_jacobian_result(m.session(),
                                               m.dispatch(Operation::param_jacobian, inputs, {}));
  });
}

TensorMap AnyDispatchedModel::param_vjp(const TensorMap& inputs,
                                        const TensorMap& cotangents) const {
  const auto& m = *_impl;
  return Impl::Access::param_vjp_result(m.session(),
                                        m.dispatch(Operation::param_vjp, inputs, cotangents));
}

void AnyDispatchedModel::forward_into(const TensorMap& inputs, const TensorMap& outputs) const {
  _impl->into(Operation::forward, inputs, {}, outputs, {}, {});
}

void AnyDispatchedModel::jvp_into(const TensorMap& inputs, const TensorMap& tangents,
                                  const TensorMap& outputs,
                                  const TensorMap& output_tangents) const {
  _impl->into(Operation::jvp, inputs, tangents, outputs, output_tangents, {});
}

void AnyDispatchedModel::jacobian_into(const TensorMap& inputs, const TensorMap& outputs,
                                       const VariablePairJacobian& J) const {
  _impl->into(Operation::jacobian, inputs, {}, outputs, {}, J);
}

void AnyDispatchedModel::param_jacobian_into(const TensorMap& inputs, const TensorMap& outputs,
                                             const VariablePairJacobian& P) const {
  _impl->into(Operation::param_jacobian, inputs, {}, outputs, {}, P);
}

void AnyDispatchedModel::param_vjp_into(const TensorMap& inputs, const TensorMap& cotangents,
                                        const TensorMap& gradients) const {
  _impl->into(Operation::param_vjp, inputs, cotangents, gradients, {}, {});
}

PreparedCall AnyDispatchedModel::prepare(std::vector<std::string> names) const {
  return {*_impl, std::move(names)};
}

void AnyDispatchedModel::set_observer(ChunkObserver observer) {
  _impl->_observer = std::move(observer);
}

TensorMap& AnyDispatchedModel::named_parameters() noexcept {
  return _impl->session().named_parameters();
}
const TensorMap& AnyDispatchedModel::named_parameters() const noexcept {
  return _impl->session().named_parameters();
}
void AnyDispatchedModel::set_parameter(const std::string& name, const at::Tensor& value) {
  _impl->session().set_parameter(name, value);
}

const std::vector<std::string>& AnyDispatchedModel::input_names() const noexcept {
  return _impl->session().input_names();
}
const std::vector<std::string>& AnyDispatchedModel::output_names() const noexcept {
  return _impl->session().output_names();
}
const std::vector<Shape>& AnyDispatchedModel::input_base_shapes() const noexcept {
  return _impl->session().input_base_shapes();
}
const std::vector<Shape>& AnyDispatchedModel::output_base_shapes() const noexcept {
  return _impl->session().output_base_shapes();
}
const std::map<std::string, Shape>& AnyDispatchedModel::parameter_base_shapes() const noexcept {
  return _impl->session().parameter_base_shapes();
}
const Device& AnyDispatchedModel::device() const noexcept { return _impl->session().device(); }
const std::vector<Session>& AnyDispatchedModel::sessions() const noexcept {
  return _impl->_sessions;
}
c10::ScalarType AnyDispatchedModel::dtype() const noexcept { return _impl->session().dtype(); }
const Artifact& AnyDispatchedModel::artifact() const noexcept {
  return _impl->session().artifact();
}

const SolverConfig& AnyDispatchedModel::solver_config() const {
  return _impl->session().solver_config();
}
void AnyDispatchedModel::set_solver_config(const SolverConfig& config) {
  for (auto& s : _impl->_sessions)
    s.set_solver_config(config);
}

const detail::PolicyCalls& AnyDispatchedModel::policy_calls() const noexcept {
  return *_impl->_policy;
}

void detail::ModelAccess::before_chunk(AnyDispatchedModel& model,
                                       std::function<void(const ChunkEvent&)> hook) {
  model._impl->_before_chunk = std::move(hook);
}

// ------------------------------------------------------------------------ PreparedCall

PreparedCall::PreparedCall(const AnyDispatchedModel::Impl& model, std::vector<std::string> names)
    : _model(&model)
    , _names(names.empty() ? model.session().input_names() : std::move(names)) {
  const auto& all = model.session().input_names();
  if (_names.size() != all.size())
    throw FatalError("prepare(): " + std::to_string(_names.size()) + " names given, but the " +
                     "model takes " + std::to_string(all.size()) + " inputs; name each once");
  for (const auto& name : _names) {
    const auto it = std::find(all.begin(), all.end(), name);
    if (it == all.end() || std::count(_names.begin(), _names.end(), name) > 1)
      throw FatalError("prepare(): '" + name + "' is " +
                       (it == all.end() ? "not an input of this model" : "named twice") +
                       "; name each input once");
    _positions.push_back(static_cast<std::size_t>(it - all.begin()));
  }
  for (std::size_t i = 0; i < _positions.size(); ++i)
    _in_order = _in_order && _positions[i] == i;
  for (const auto& name : model.session().output_names())
    _output_labels.push_back("output '" + name + "'");
}

namespace {
std::vector<at::Tensor> in_model_order(std::span<const at::Tensor> inputs,
                                       const std::vector<std::size_t>& positions, bool in_order) {
  if (inputs.size() != positions.size())
    throw FatalError(std::to_string(inputs.size()) + " input tensors given, but this call " +
                     "was prepared for " + std::to_string(positions.size()) +
                     "; pass them in the order given to prepare()");
  if (in_order)
    return {inputs.begin(), inputs.end()};
  std::vector<at::Tensor> ordered(inputs.size());
  for (std::size_t k = 0; k < inputs.size(); ++k)
    ordered[positions[k]] = inputs[k];
  return ordered;
}
} // namespace

std::vector<at::Tensor> PreparedCall::forward(std::span<const at::Tensor> inputs) const {
  auto ordered = in_model_order(inputs, _positions, _in_order);
  if (auto results = _model->forward_as_given(ordered))
    return std::move(*results);
  return _model->dispatch(Operation::forward, std::move(ordered), {});
}

void PreparedCall::forward_into(std::span<const at::Tensor> inputs,
                                std::span<const at::Tensor> outputs) const {
  if (outputs.size() != _output_labels.size())
    throw FatalError(std::to_string(outputs.size()) + " output tensors given, but the model " +
                     "has " + std::to_string(_output_labels.size()) +
                     " outputs; pass one per output, in output_names() order");
  const detail::Destinations into{{outputs.begin(), outputs.end()}, _output_labels};
  _model->named([&] {
    return _model->dispatch(Operation::forward, in_model_order(inputs, _positions, _in_order), {},
                            &into);
  });
}

} // namespace neml2

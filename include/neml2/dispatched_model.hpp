#pragma once

/// @file dispatched_model.hpp
/// @brief DispatchedModel<Policy>: a compiled model whose batched calls are cut into
/// chunks and run where the policy says, with results gathered on the input device.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include <neml2/artifact.hpp>
#include <neml2/detail/chunking.hpp>
#include <neml2/detail/session_access.hpp>
#include <neml2/detail/worker_pool.hpp>
#include <neml2/errors.hpp>
#include <neml2/observer.hpp>
#include <neml2/policies/sync_chunking.hpp>
#include <neml2/policy.hpp>
#include <neml2/session.hpp>

namespace neml2 {

namespace detail {
struct ModelAccess;
}
template <class Policy>
class PreparedCall;

/// @brief A compiled model dispatched by `Policy`: the Session surface, chunked.
///
/// One session per device the policy lists, loaded at construction. Inputs may live on
/// any one device; each chunk is moved to its compute device, run, and written into
/// outputs preallocated on the input device. When one chunk covers the batch on the
/// input device, the session is called directly: no slicing, no copy, no thread.
///
/// A synchronous policy runs on the calling thread and costs no thread, queue or lock.
/// An asynchronous one runs chunks on a worker per device; several host threads may call
/// one model at once: each call gets its own results, and the devices' loads and the
/// policy's state are shared by all calls (one model-wide lock).
/// @code
/// auto model = neml2::load_model("aoti/model_aoti.i", "model",
///                                neml2::SyncChunking{.device = "cpu", .batch_size = 16384});
/// auto out = model.forward({{"strain", strain}});
/// @endcode
///
/// Thread safety: any number of threads may call the evaluation functions (and their
/// `*_into` forms) on one model at once; each call gets its own results. Configuration
/// (`set_parameter`, writes through `named_parameters()`, `set_solver_config`,
/// `set_observer`) must not overlap a call or another configuration. See
/// docs/thread-safety.md.
/// @see SyncChunking, GreedyPriorityCapacity, load_model
template <class Policy>
class DispatchedModel {
  static_assert(detail::check_policy<Policy>());
  static constexpr bool asynchronous = is_asynchronous_policy_v<Policy>;
  using clock = std::chrono::steady_clock;

public:
  /// Loads one session of `artifact` per device `policy` lists, in `dtype`; the policy is
  /// validated first (its `validate()`, when it has one). Throws FatalError.
  DispatchedModel(std::shared_ptr<const Artifact> artifact, Policy policy,
                  c10::ScalarType dtype = c10::kDouble)
      : _policy(validated(std::move(policy)))
      , _listed(listed_devices(_policy)) {
    if (_listed.empty())
      throw FatalError("the dispatch policy lists no devices; list at least one");
    for (std::size_t d = 0; d < _listed.size(); ++d) {
      _sessions.emplace_back(artifact, _listed[d], dtype, chunks_in_flight(d));
      _compute.push_back(_sessions.back().device().torch());
    }
    if constexpr (asynchronous) {
      std::vector<detail::WorkerPool::Lane> lanes;
      for (std::size_t d = 0; d < _listed.size(); ++d)
        lanes.push_back({_compute[d], chunks_in_flight(d)});
      _engine = std::make_unique<Engine>(_listed.size(), lanes);
    } else
      (void)session_of(_policy.compute_device()); // a device it does not list fails now
  }

  /// @name Evaluation (see Session for the shapes).
  ///@{
  /// The outputs by name.
  [[nodiscard]] TensorMap forward(const TensorMap& inputs) const {
    return named([&] {
      return Access::forward_result(session(), dispatch(Operation::forward, inputs, {}));
    });
  }
  /// {outputs, d(outputs)} along `tangents` (missing = 0).
  [[nodiscard]] std::pair<TensorMap, TensorMap> jvp(const TensorMap& inputs,
                                                    const TensorMap& tangents) const {
    return named(
        [&] { return Access::jvp_result(session(), dispatch(Operation::jvp, inputs, tangents)); });
  }
  /// {outputs, J}, `J[out][in]` of shape `(B, *out_base, *in_base)`.
  [[nodiscard]] std::pair<TensorMap, VariablePairJacobian> jacobian(const TensorMap& inputs) const {
    return named([&] {
      return Access::jacobian_result(session(), dispatch(Operation::jacobian, inputs, {}));
    });
  }
  /// {outputs, P}, `P[out][parameter]` of shape `(B, *out_base, *param_base)`.
  [[nodiscard]] std::pair<TensorMap, VariablePairJacobian>
  param_jacobian(const TensorMap& inputs) const {
    return named([&] {
      return Access::param_jacobian_result(session(),
                                           dispatch(Operation::param_jacobian, inputs, {}));
    });
  }
  /// dL/d(parameter) for L = sum of <cotangent, output>, summed over the batch (per row
  /// for a batched parameter).
  [[nodiscard]] TensorMap param_vjp(const TensorMap& inputs, const TensorMap& cotangents) const {
    return Access::param_vjp_result(session(), dispatch(Operation::param_vjp, inputs, cotangents));
  }
  ///@}

  /// @name Evaluation into the caller's tensors: one per result, keyed as the results
  /// above are, of the result's shape, in the model's dtype, on any device, with any
  /// strides whose elements are distinct (a slice, a transposed view). Chunks write
  /// straight into the caller's rows; nothing of the outputs' size is allocated. Checked
  /// before anything runs: a wrong tensor is a FatalError and the caller's data is left
  /// as it was.
  /// @code
  /// auto stress = at::empty({batch, 6}, at::kDouble);   // allocated once, reused
  /// model.forward_into({{"strain", strain}}, {{"stress", stress}});
  /// @endcode
  ///@{
  /// forward(), into `outputs`.
  void forward_into(const TensorMap& inputs, const TensorMap& outputs) const {
    into(Operation::forward, inputs, {}, outputs, {}, {});
  }
  /// jvp(), into `outputs` and `output_tangents`.
  void jvp_into(const TensorMap& inputs, const TensorMap& tangents, const TensorMap& outputs,
                const TensorMap& output_tangents) const {
    into(Operation::jvp, inputs, tangents, outputs, output_tangents, {});
  }
  /// jacobian(), into `outputs` and the blocks `J`.
  void jacobian_into(const TensorMap& inputs, const TensorMap& outputs,
                     const VariablePairJacobian& J) const {
    into(Operation::jacobian, inputs, {}, outputs, {}, J);
  }
  /// param_jacobian(), into `outputs` and the blocks `P`.
  void param_jacobian_into(const TensorMap& inputs, const TensorMap& outputs,
                           const VariablePairJacobian& P) const {
    into(Operation::param_jacobian, inputs, {}, outputs, {}, P);
  }
  /// param_vjp(), into `gradients`.
  void param_vjp_into(const TensorMap& inputs, const TensorMap& cotangents,
                      const TensorMap& gradients) const {
    into(Operation::param_vjp, inputs, cotangents, gradients, {}, {});
  }
  ///@}

  /// A call bound once to `names` (default: input_names()), for hosts that call with the
  /// same inputs over and over: then tensors in that order, results in output_names()
  /// order, no name lookups and no maps. It refers to this model, which must outlive it.
  [[nodiscard]] PreparedCall<Policy> prepare(std::vector<std::string> names = {}) const {
    return PreparedCall<Policy>(*this, std::move(names));
  }

  /// Calls `observer` once per chunk (see ChunkEvent); an empty one turns it off. Set it
  /// while no call is running.
  void set_observer(ChunkObserver observer) { _observer = std::move(observer); }

  /// @name Promoted parameters: one master map, used by every device's chunks.
  ///@{
  /// The master parameters by public name; an in-place change is seen by the next call.
  [[nodiscard]] TensorMap& named_parameters() noexcept { return session().named_parameters(); }
  /// The master parameters by public name.
  [[nodiscard]] const TensorMap& named_parameters() const noexcept {
    return session().named_parameters();
  }
  /// Replaces parameter `name` (its base shape, or batched); a FatalError names a wrong one.
  void set_parameter(const std::string& name, const at::Tensor& value) {
    session().set_parameter(name, value);
  }
  ///@}

  /// @name Metadata.
  ///@{
  [[nodiscard]] const std::vector<std::string>& input_names() const noexcept {
    return session().input_names();
  }
  [[nodiscard]] const std::vector<std::string>& output_names() const noexcept {
    return session().output_names();
  }
  [[nodiscard]] const std::vector<Shape>& input_base_shapes() const noexcept {
    return session().input_base_shapes();
  }
  [[nodiscard]] const std::vector<Shape>& output_base_shapes() const noexcept {
    return session().output_base_shapes();
  }
  [[nodiscard]] const std::map<std::string, Shape>& parameter_base_shapes() const noexcept {
    return session().parameter_base_shapes();
  }
  /// The first listed device, resolved (a bare `cuda` becomes the current CUDA device).
  [[nodiscard]] const Device& device() const noexcept { return session().device(); }
  /// Every listed device's session, in the policy's order.
  [[nodiscard]] const std::vector<Session>& sessions() const noexcept { return _sessions; }
  [[nodiscard]] c10::ScalarType dtype() const noexcept { return session().dtype(); }
  [[nodiscard]] const Artifact& artifact() const noexcept { return session().artifact(); }
  [[nodiscard]] const Policy& policy() const noexcept { return _policy; }
  ///@}

  /// @name Newton settings of an implicit model (see Session::solver_config); a change
  /// reaches every device's session. Not while calls are running.
  ///@{
  /// The Newton settings in force.
  [[nodiscard]] const SolverConfig& solver_config() const { return session().solver_config(); }
  /// Replaces them on every device's session (checked first).
  void set_solver_config(const SolverConfig& config) {
    for (auto& s : _sessions)
      s.set_solver_config(config);
  }
  ///@}

private:
  friend struct detail::ModelAccess;
  friend class PreparedCall<Policy>;
  using Access = detail::SessionAccess;
  using ChunkHook = std::function<void(const ChunkEvent&)>;

  // The first session holds the master parameters and answers metadata queries.
  [[nodiscard]] const Session& session() const noexcept { return _sessions.front(); }
  [[nodiscard]] Session& session() noexcept { return _sessions.front(); }

  static Policy validated(Policy policy) {
    if constexpr (requires { policy.validate(); })
      policy.validate();
    return policy;
  }

  [[nodiscard]] std::size_t chunks_in_flight(std::size_t d) const {
    if constexpr (requires { _policy.chunks_in_flight(d); })
      if (_listed[d].is_accelerator())
        return std::max<std::size_t>(static_cast<std::size_t>(_policy.chunks_in_flight(d)), 1);
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
      auto call =
          Access::bind(session(), op, std::forward<Inputs>(inputs), extras, named_parameters(), {});
      auto targets =
          into ? detail::writable(call, session().dtype(), *into) : std::vector<at::Tensor>{};
      if constexpr (asynchronous)
        return dispatch_async(op, call, std::move(targets));
      else
        return dispatch_sync(op, call, std::move(targets));
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
      results = Access::run(_sessions[d], op, chunk);
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
        results.add(index, first, rows, Access::run(_sessions[d], op, chunk));
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
      results.add(index, first, rows, Access::run(_sessions[d], op, chunk));
    } catch (const ConvergenceError& e) {
      if (!e.per_row())
        throw;
      results.add_failed_rows(index, first, rows, e);
    }
    finished_on(d); // its results ready (and this thread's staging buffers free again)
  }

  std::vector<at::Tensor> dispatch_sync(Operation op, detail::BoundCall& call,
                                        std::vector<at::Tensor> targets) const {
    const auto d = session_of(_policy.compute_device());
    const auto batch = call.batch;
    auto rows = static_cast<std::int64_t>(_policy.chunk_rows(batch));
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

  // ------------------------------------------------------------ asynchronous policies

  // One call: what is left to dispatch, its chunks in flight, its failures. Lives on the
  // calling thread's stack; guarded by Engine::mutex.
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
    std::vector<std::pair<std::size_t, std::exception_ptr>> errors; // (chunk, error)
    std::condition_variable finished; // the calling thread sleeps here
    [[nodiscard]] bool done() const {
      return in_flight == 0 && (first == call.batch || !errors.empty());
    }
  };

  // What every call and worker of one model shares, under one lock.
  struct Engine {
    Engine(std::size_t devices, const std::vector<detail::WorkerPool::Lane>& lanes)
        : rows_in_flight(devices, 0)
        , pool(lanes) {}
    std::mutex mutex;
    std::vector<std::int64_t> rows_in_flight; // per device
    policy_state_t<Policy> state;
    std::vector<Progress*> waiting_for_room; // calls the policy told to wait
    detail::WorkerPool pool;                 // last: joined before the rest goes
  };

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
    progress.finished.wait(lock, [&] { return progress.done(); });
    std::erase(engine.waiting_for_room, &progress);
    lock.unlock();
    rethrow(progress.errors);
    if (!progress.results)
      return direct;
    return std::move(*progress.results).finish(); // on this thread: its stream owns them
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
        const auto choice = _policy.next_chunk(std::span<const std::int64_t>(engine.rows_in_flight),
                                               batch - p.first, engine.state);
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
        _policy.on_dispatched(d, n, engine.state);
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
      _policy.on_completed(d, rows, seconds, engine.state);
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

  // One error is rethrown as it is; several become an AggregateError in chunk order.
  static void rethrow(std::vector<std::pair<std::size_t, std::exception_ptr>>& errors) {
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

  [[nodiscard]] ChunkEvent event(std::size_t index, std::size_t d, std::int64_t first,
                                 std::int64_t rows, double seconds) const {
    return {index, d, _listed[d], first, rows, seconds};
  }

  static double seconds_since(clock::time_point start) {
    return std::chrono::duration<double>(clock::now() - start).count();
  }

  struct NoEngine {};

  Policy _policy;
  std::vector<Device> _listed;       // as the policy lists them
  std::vector<Session> _sessions;    // one per listed device
  std::vector<c10::Device> _compute; // each session's device, resolved once
  ChunkObserver _observer;           // empty: nothing timed, nothing called
  ChunkHook _before_chunk;           // tests inject faults here (detail::ModelAccess)
  std::conditional_t<asynchronous, std::unique_ptr<Engine>, NoEngine> _engine;
};

namespace detail {
/// For tests: run `hook` as each chunk starts (it may throw to fail that chunk).
struct ModelAccess {
  template <class Policy>
  static void before_chunk(DispatchedModel<Policy>& model,
                           std::function<void(const ChunkEvent&)> hook) {
    model._before_chunk = std::move(hook);
  }
};
} // namespace detail

/// @brief A DispatchedModel call bound once to input names (see DispatchedModel::prepare).
/// @code
/// const auto step = model.prepare({"strain"});
/// auto stress = at::empty({batch, 6}, at::kDouble);
/// for (...) step.forward_into({strain}, {stress});   // same results as forward()
/// @endcode
template <class Policy>
class PreparedCall {
public:
  /// The outputs, in the model's output_names() order.
  [[nodiscard]] std::vector<at::Tensor> forward(std::span<const at::Tensor> inputs) const {
    return _model->dispatch(Operation::forward, in_model_order(inputs), {});
  }
  /// Into the caller's tensors, one per output in output_names() order.
  void forward_into(std::span<const at::Tensor> inputs, std::span<const at::Tensor> outputs) const {
    if (outputs.size() != _output_labels.size())
      throw FatalError(std::to_string(outputs.size()) + " output tensors given, but the model " +
                       "has " + std::to_string(_output_labels.size()) +
                       " outputs; pass one per output, in output_names() order");
    const detail::Destinations into{{outputs.begin(), outputs.end()}, _output_labels};
    _model->named(
        [&] { return _model->dispatch(Operation::forward, in_model_order(inputs), {}, &into); });
  }
  /// The input names this call takes, in order.
  [[nodiscard]] const std::vector<std::string>& input_names() const noexcept { return _names; }

private:
  friend class DispatchedModel<Policy>;

  PreparedCall(const DispatchedModel<Policy>& model, std::vector<std::string> names)
      : _model(&model)
      , _names(names.empty() ? model.input_names() : std::move(names)) {
    const auto& all = model.input_names();
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
    for (const auto& name : model.output_names())
      _output_labels.push_back("output '" + name + "'");
  }

  std::vector<at::Tensor> in_model_order(std::span<const at::Tensor> inputs) const {
    if (inputs.size() != _positions.size())
      throw FatalError(std::to_string(inputs.size()) + " input tensors given, but this call " +
                       "was prepared for " + std::to_string(_positions.size()) +
                       "; pass them in the order given to prepare()");
    if (_in_order)
      return {inputs.begin(), inputs.end()};
    std::vector<at::Tensor> ordered(inputs.size());
    for (std::size_t k = 0; k < inputs.size(); ++k)
      ordered[_positions[k]] = inputs[k];
    return ordered;
  }

  const DispatchedModel<Policy>* _model;
  std::vector<std::string> _names;
  std::vector<std::size_t> _positions; // the k-th tensor given is input _positions[k]
  bool _in_order = true;               // _positions is 0, 1, 2, ...
  std::vector<std::string> _output_labels;
};

/// @name Loading a model
/// A stub (`<name>_aoti.i`) or an artifact root folder -> a DispatchedModel. The model name
/// may be left out when the stub holds one model (a FatalError lists the names when it
/// holds several); a folder is the root itself and needs none.
/// @code
/// auto model = neml2::load_model("aoti/elasticity_aoti.i");            // CPU, whole batches
/// auto chunked = neml2::load_model("aoti/elasticity_aoti.i", neml2::SyncChunking{.batch_size =
/// 4096});
/// @endcode
/// @{

/// @brief Loads `name` from a stub (or an artifact root) and runs whole batches on the CPU.
inline DispatchedModel<SyncChunking> load_model(const std::filesystem::path& path,
                                                const std::string& name,
                                                c10::ScalarType dtype = c10::kDouble) {
  return {std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(path, name))),
          SyncChunking{}, dtype};
}

/// @brief Loads `name` from a stub (or an artifact root), dispatched by `policy`.
template <class Policy>
DispatchedModel<Policy> load_model(const std::filesystem::path& path, const std::string& name,
                                   Policy policy, c10::ScalarType dtype = c10::kDouble) {
  return {std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(path, name))),
          std::move(policy), dtype};
}

/// @brief Loads the one model of a stub (or an artifact root) and runs whole batches on
/// the CPU.
inline DispatchedModel<SyncChunking> load_model(const std::filesystem::path& path,
                                                c10::ScalarType dtype = c10::kDouble) {
  return {std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(path))),
          SyncChunking{}, dtype};
}

/// @brief Loads the one model of a stub (or an artifact root), dispatched by `policy`.
/// (A name in the second place is the overload above that takes one.)
template <class Policy>
requires(!std::convertible_to<Policy, std::string>) DispatchedModel<Policy> load_model(
    const std::filesystem::path& path, Policy policy, c10::ScalarType dtype = c10::kDouble) {
  return {std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(path))),
          std::move(policy), dtype};
}

/// @}

} // namespace neml2

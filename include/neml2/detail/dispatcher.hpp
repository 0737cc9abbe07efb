#pragma once

/// @file detail/dispatcher.hpp
/// @brief How a model's calls reach its policy. DispatcherOf<Policy> holds the policy by
/// value beside the compiled ModelCore: a synchronous policy's chunk loop is the template
/// below, its calls inlined; an asynchronous one's calls go to the AsyncEngine. Calls
/// through AnyDispatchedModel reach the same code by one virtual call per call.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <neml2/detail/async_engine.hpp>
#include <neml2/detail/model_core.hpp>
#include <neml2/policy.hpp>

namespace neml2::detail {

/// The sessions and how a call runs, on the heap (prepared calls keep its address).
class Dispatcher {
public:
  Dispatcher(std::shared_ptr<const Artifact> artifact, std::vector<Device> devices,
             const std::vector<std::size_t>& concurrency, c10::ScalarType dtype)
      : core(std::move(artifact), std::move(devices), concurrency, dtype) {}
  virtual ~Dispatcher() = default;
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  /// Runs a request to its results, in slot order.
  [[nodiscard]] virtual std::vector<at::Tensor> run(Request& request) const = 0;
  /// forward() of inputs in input_names() order: straight through the value graph when
  /// the policy runs a small dense CPU batch whole (ModelCore::batch_as_given).
  [[nodiscard]] virtual std::vector<at::Tensor> forward(std::vector<at::Tensor> inputs) const = 0;

  ModelCore core;
};

/// A synchronous policy's call: bound, then whole or chunk by chunk on the calling thread.
template <class Policy>
std::vector<at::Tensor> run_synchronous(const Policy& policy, const ModelCore& core,
                                        Request& request) {
  SyncCall call(core, request);
  const auto d = core.device_index(policy.compute_device());
  const auto rows = call.rows_per_chunk(static_cast<std::int64_t>(policy.chunk_rows(call.batch())));
  if (call.runs_whole(d, rows))
    return call.run_whole(d);
  for_each_chunk(call.batch(), rows, [&](std::int64_t first, std::int64_t n, std::size_t index) {
    call.run_chunk(d, first, n, index);
  });
  return call.finish();
}

/// How many chunks `policy` may keep in flight on device `d`: its chunks_in_flight(d) on
/// an accelerator (at least 1), 1 on the CPU.
template <class Policy>
std::vector<std::size_t> chunks_in_flight(const Policy& policy,
                                          const std::vector<Device>& devices) {
  std::vector<std::size_t> n(devices.size(), 1);
  if constexpr (requires { policy.chunks_in_flight(std::size_t{}); })
    for (std::size_t d = 0; d < devices.size(); ++d)
      if (devices[d].is_accelerator())
        n[d] = static_cast<std::size_t>(
            std::max<std::int64_t>(static_cast<std::int64_t>(policy.chunks_in_flight(d)), 1));
  return n;
}

template <class Policy>
class DispatcherOf final : public Dispatcher {
public:
  // The base is made before `policy` takes `p`.
  DispatcherOf(std::shared_ptr<const Artifact> artifact, Policy p, c10::ScalarType dtype)
      : Dispatcher(std::move(artifact), listed_devices(p), chunks_in_flight(p, listed_devices(p)),
                   dtype)
      , policy(std::move(p)) {
    if constexpr (is_asynchronous_policy_v<Policy>)
      _engine =
          std::make_unique<AsyncEngine>(core, _calls, chunks_in_flight(policy, core.devices()));
    else
      (void)core.device_index(policy.compute_device()); // one it does not list fails now
  }

  std::vector<at::Tensor> run(Request& request) const final {
    if constexpr (is_asynchronous_policy_v<Policy>)
      return _engine->run(request);
    else
      return run_synchronous(policy, core, request);
  }

  std::vector<at::Tensor> forward(std::vector<at::Tensor> inputs) const final {
    if constexpr (!is_asynchronous_policy_v<Policy>) {
      const auto d = core.device_index(policy.compute_device());
      if (const auto batch = core.batch_as_given(d, inputs); batch > 0)
        if (const auto rows = static_cast<std::int64_t>(policy.chunk_rows(batch));
            rows == 0 || rows >= batch)
          return core.forward_as_given(d, inputs);
    }
    Request request{Operation::forward, std::move(inputs)};
    return run(request);
  }

  const Policy policy;

private:
  // The asynchronous policy's calls with its state, for the engine (under its lock).
  struct PolicyWithState final : AsyncPolicyCalls {
    explicit PolicyWithState(const Policy& p)
        : policy(p) {}
    std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t> rows_in_flight,
                                          std::int64_t remaining) override {
      if constexpr (is_asynchronous_policy_v<Policy>)
        return policy.next_chunk(rows_in_flight, remaining, state);
      else
        return std::nullopt;
    }
    void on_dispatched(std::size_t device, std::int64_t rows) override {
      if constexpr (is_asynchronous_policy_v<Policy>)
        policy.on_dispatched(device, rows, state);
    }
    void on_completed(std::size_t device, std::int64_t rows, double seconds) override {
      if constexpr (is_asynchronous_policy_v<Policy>)
        policy.on_completed(device, rows, seconds, state);
    }
    const Policy& policy;
    policy_state_t<Policy> state;
  };

  struct NoEngine {};
  // Only an asynchronous policy names the engine: a synchronous model links none of it.
  using Engine =
      std::conditional_t<is_asynchronous_policy_v<Policy>, std::unique_ptr<AsyncEngine>, NoEngine>;

  PolicyWithState _calls{policy};
  [[no_unique_address]] Engine _engine;
};

/// The evaluation calls, written once over a dispatcher `D`: Dispatcher (the policy
/// reached by one virtual call) or DispatcherOf<Policy> (its final overrides, inlined).
template <class D>
struct EvaluationCalls {
  // Foreign errors become the library's; a per-row failure of a call whose results start
  // with the outputs carries them by name.
  template <class F>
  static auto guarded(const D& d, Operation op, F&& f) {
    return translate_foreign_errors("neml2::DispatchedModel", [&] {
      try {
        return f();
      } catch (const ConvergenceError& e) {
        if (op == Operation::param_vjp)
          throw;
        d.core.rethrow_with_outputs(e);
      }
    });
  }

  template <class Convert>
  static auto evaluate(const D& d, Operation op, const TensorMap& inputs, const TensorMap* extras,
                       Convert&& convert) {
    return guarded(d, op, [&] {
      Request request{op, d.core.positional(inputs), extras};
      return convert(d.run(request));
    });
  }

  static TensorMap forward(const D& d, const TensorMap& inputs) {
    return guarded(d, Operation::forward,
                   [&] { return d.core.forward_result(d.forward(d.core.positional(inputs))); });
  }
  static std::pair<TensorMap, TensorMap> jvp(const D& d, const TensorMap& inputs,
                                             const TensorMap& tangents) {
    return evaluate(d, Operation::jvp, inputs, &tangents,
                    [&](auto&& r) { return d.core.jvp_result(std::move(r)); });
  }
  static std::pair<TensorMap, VariablePairJacobian> jacobian(const D& d, const TensorMap& inputs) {
    return evaluate(d, Operation::jacobian, inputs, nullptr,
                    [&](auto&& r) { return d.core.jacobian_result(std::move(r)); });
  }
  static std::pair<TensorMap, VariablePairJacobian> param_jacobian(const D& d,
                                                                   const TensorMap& inputs) {
    return evaluate(d, Operation::param_jacobian, inputs, nullptr,
                    [&](auto&& r) { return d.core.param_jacobian_result(std::move(r)); });
  }
  static TensorMap param_vjp(const D& d, const TensorMap& inputs, const TensorMap& cotangents) {
    return evaluate(d, Operation::param_vjp, inputs, &cotangents,
                    [&](auto&& r) { return d.core.param_vjp_result(std::move(r)); });
  }

  /// Any `_into` call: `values` are the outputs (the gradients of param_vjp), `tangents`
  /// the output tangents, `blocks` the Jacobian blocks.
  static void into(const D& d, Operation op, const TensorMap& inputs, const TensorMap* extras,
                   const TensorMap& values, const TensorMap& tangents,
                   const VariablePairJacobian& blocks) {
    guarded(d, op, [&] {
      const auto destinations = d.core.destinations(op, values, tangents, blocks);
      Request request{op, d.core.positional(inputs), extras, &destinations};
      (void)d.run(request);
      return 0;
    });
  }
};

} // namespace neml2::detail

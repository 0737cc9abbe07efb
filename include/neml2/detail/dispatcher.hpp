#pragma once

/// @file detail/dispatcher.hpp
/// @brief How a model's calls reach its policy. DispatcherOf<Policy> holds the policy by
/// value beside the compiled ModelCore: a synchronous policy's chunk loop is the template
/// below, its calls inlined; an asynchronous one's calls go to the AsyncEngine. Calls
/// through AnyDispatchedModel reach the same code by one virtual call per call. What the
/// policy's answers mean is detail/policy_protocol.hpp's.

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
#include <neml2/detail/policy_protocol.hpp>
#include <neml2/detail/request.hpp>
#include <neml2/detail/sync_call.hpp>
#include <neml2/policy.hpp>

namespace neml2::detail {

/// The sessions and how a call runs, on the heap (prepared calls keep its address).
class Dispatcher {
public:
  Dispatcher(std::shared_ptr<const Artifact> artifact, std::vector<Device> devices,
             const std::vector<std::size_t>& concurrency, c10::ScalarType dtype,
             std::size_t cpu_lanes)
      : core(std::move(artifact), std::move(devices), concurrency, dtype, cpu_lanes) {}
  virtual ~Dispatcher() = default;
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  /// Runs a request to its results, in slot order.
  [[nodiscard]] virtual std::vector<at::Tensor> run(Request& request) const = 0;

  ModelCore core;
};

/// A synchronous policy's call, on the calling thread: the policy asked once for its device
/// and once for its rows per chunk, then the call run whole or chunk by chunk (on the CPU,
/// on its lanes: the calling thread and torch's OpenMP team). A forward()
/// of a small dense CPU batch the policy runs whole goes straight to the value graph
/// (ModelCore::batch_as_given).
template <class Policy>
std::vector<at::Tensor> run_synchronous(const Policy& policy, const ModelCore& core,
                                        Request& request) {
  const auto d = decide_device(policy, core.devices());
  std::int64_t rows = 0; // not yet asked
  if (request.op == Operation::forward && !request.into)
    if (const auto batch = core.batch_as_given(d, request.inputs); batch > 0) {
      rows = decide_rows(policy, batch); // the bound call below has this batch too
      if (rows == batch)
        return core.forward_as_given(d, request.inputs);
    }
  SyncCall call(core, request);
  if (rows == 0)
    rows = decide_rows(policy, call.batch());
  if (call.runs_whole(d, rows))
    return call.run_whole(d);
  call.run_chunks(d, rows);
  return call.finish();
}

template <class Policy>
class DispatcherOf final : public Dispatcher {
public:
  // The base is made before `policy` takes `p`.
  DispatcherOf(std::shared_ptr<const Artifact> artifact, Policy p, c10::ScalarType dtype)
      : Dispatcher(std::move(artifact), listed_devices(p), chunks_in_flight(p, listed_devices(p)),
                   dtype, requested_cpu_lanes(p))
      , policy(std::move(p)) {
    if constexpr (is_asynchronous_policy_v<Policy>)
      _engine = std::make_unique<AsyncEngine>(core, _calls);
    else
      (void)decide_device(policy, core.devices()); // one it does not list fails now
  }

  std::vector<at::Tensor> run(Request& request) const final {
    if constexpr (is_asynchronous_policy_v<Policy>)
      return _engine->run(request);
    else
      return run_synchronous(policy, core, request);
  }

  const Policy policy;

private:
  // Only an asynchronous policy has state to keep and an engine to run it: a synchronous
  // model holds neither, and links none of the engine.
  struct NoCalls {
    explicit NoCalls(const Policy&) noexcept {}
  };
  struct NoEngine {};
  template <class P, bool = is_asynchronous_policy_v<P>>
  struct Parts {
    using Calls = NoCalls;
    using Engine = NoEngine;
  };
  template <class P>
  struct Parts<P, true> {
    using Calls = PolicyWithState<P>;
    using Engine = std::unique_ptr<AsyncEngine>;
  };

  [[no_unique_address]] typename Parts<Policy>::Calls _calls{policy};
  [[no_unique_address]] typename Parts<Policy>::Engine _engine;
};

/// The evaluation calls, written once over a dispatcher `D`: Dispatcher (the policy
/// reached by one virtual call) or DispatcherOf<Policy> (its final overrides, inlined).
template <class D>
struct EvaluationCalls {
  // Foreign errors become the library's; a per-row failure of a call whose results start
  // with the outputs, and that carries them only in slot order, carries them by name.
  template <class F>
  static auto guarded(const D& d, Operation op, F&& f) {
    return translate_foreign_errors("neml2::DispatchedModel", [&] {
      try {
        return f();
      } catch (const ConvergenceError& e) {
        if (op == Operation::param_vjp || !e.per_row() || !e.outputs().empty() ||
            e.results().empty())
          throw;
        d.core.names().rethrow_with_outputs(e, e.results());
      }
    });
  }

  // A call by name: its inputs put in position, its results mapped by `to_maps`.
  template <class Result>
  static Result evaluate(const D& d, Operation op, const TensorMap& inputs, const TensorMap* extras,
                         Result (CallNames::*to_maps)(std::vector<at::Tensor>&&) const,
                         NewtonFactors* factors = nullptr) {
    return guarded(d, op, [&] {
      const auto names = d.core.names();
      Request request{op, names.positional(inputs), extras, nullptr, factors};
      return (names.*to_maps)(d.run(request));
    });
  }

  static TensorMap forward(const D& d, const TensorMap& inputs, NewtonFactors* factors = nullptr) {
    return evaluate(d, Operation::forward, inputs, nullptr, &CallNames::forward, factors);
  }
  static std::pair<TensorMap, TensorMap> jvp(const D& d, const TensorMap& inputs,
                                             const TensorMap& tangents) {
    return evaluate(d, Operation::jvp, inputs, &tangents, &CallNames::jvp);
  }
  static std::pair<TensorMap, VariablePairJacobian> jacobian(const D& d, const TensorMap& inputs,
                                                             NewtonFactors* factors = nullptr) {
    return evaluate(d, Operation::jacobian, inputs, nullptr, &CallNames::jacobian, factors);
  }
  static std::pair<TensorMap, VariablePairJacobian> param_jacobian(const D& d,
                                                                   const TensorMap& inputs) {
    return evaluate(d, Operation::param_jacobian, inputs, nullptr, &CallNames::param_jacobian);
  }
  static TensorMap param_vjp(const D& d, const TensorMap& inputs, const TensorMap& cotangents) {
    return evaluate(d, Operation::param_vjp, inputs, &cotangents, &CallNames::param_vjp);
  }

  /// Any `_into` call: `values` are the outputs (the gradients of param_vjp), `tangents`
  /// the output tangents, `blocks` the Jacobian blocks.
  static void into(const D& d, Operation op, const TensorMap& inputs, const TensorMap* extras,
                   const TensorMap& values, const TensorMap& tangents,
                   const VariablePairJacobian& blocks, NewtonFactors* factors = nullptr) {
    guarded(d, op, [&] {
      const auto names = d.core.names();
      const auto destinations = names.destinations(op, values, tangents, blocks);
      Request request{op, names.positional(inputs), extras, &destinations, factors};
      (void)d.run(request);
      return 0;
    });
  }
};

} // namespace neml2::detail

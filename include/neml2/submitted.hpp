#pragma once

/// @file submitted.hpp
/// @brief Calls that return at once, for a host that overlaps its own work (assembly,
/// communication) with the model: they run on the library's worker thread, started by the
/// first submission, and wait() gives what the blocking call would have given, or throws
/// what it would have thrown. A program that submits nothing starts no thread and links
/// none of this.
/// @code
/// auto pending = neml2::submit_forward(model, inputs);
/// assemble_other_terms();              // the host's own work meanwhile
/// const auto outputs = pending.wait(); // or the call's exception
/// @endcode

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <utility>

#include <ATen/core/Tensor.h> // a future of a TensorMap holds tensors

#include <neml2/any_dispatched_model.hpp>

namespace neml2 {

/// @brief A submitted call: wait() once for its result. Destroying the handle waits for
/// the call (its result or error dropped), so a call never outlives what it refers to.
template <class T>
class Submitted {
public:
  Submitted() = default;
  /// The handle of the call that will fulfil `result`; `on_end` runs once the handle is
  /// done with it (after wait(), or when the handle drops it).
  explicit Submitted(std::future<T> result, std::function<void()> on_end = {})
      : _result(std::move(result))
      , _on_end(std::move(on_end)) {}
  /// Takes over `other`'s call.
  Submitted(Submitted&& other) noexcept
      : _result(std::move(other._result))
      , _on_end(std::exchange(other._on_end, {})) {}
  /// Waits for this handle's call, then takes over `other`'s.
  Submitted& operator=(Submitted&& other) noexcept {
    finish();
    _result = std::move(other._result);
    _on_end = std::exchange(other._on_end, {});
    return *this;
  }
  Submitted(const Submitted&) = delete;
  Submitted& operator=(const Submitted&) = delete;
  ~Submitted() { finish(); }

  /// Blocks until the call has ended; its result, or the exception it threw.
  T wait() {
    if (!_result.valid())
      throw FatalError("Submitted::wait(): no call to wait for (a handle is waited for once)");
    struct End {
      Submitted& handle;
      ~End() { handle.end(); }
    } end{*this};
    return _result.get();
  }
  /// True once the call has ended (wait() would not block).
  [[nodiscard]] bool ready() const {
    return _result.valid() &&
           _result.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  /// True until wait() has been called.
  [[nodiscard]] bool valid() const noexcept { return _result.valid(); }

private:
  void finish() noexcept {
    if (_result.valid())
      _result.wait();
    end();
  }
  void end() noexcept {
    if (_on_end)
      std::exchange(_on_end, {})();
  }
  std::future<T> _result;
  std::function<void()> _on_end;
};

namespace detail {
/// Runs `task` on the library's worker thread (started at the first call), with the
/// submitting thread's intra-op thread count. Tasks run one at a time, in order.
void run_submitted(std::function<void()> task);

/// `call()` on the worker thread; its result or exception through the handle (`on_end`: see
/// Submitted).
template <class T, class Call>
Submitted<T> submit_call(Call call, std::function<void()> on_end = {}) {
  auto promise = std::make_shared<std::promise<T>>();
  Submitted<T> handle(promise->get_future(), std::move(on_end));
  run_submitted([promise, call = std::move(call)]() mutable {
    try {
      promise->set_value(call());
    } catch (...) {
      promise->set_exception(std::current_exception());
    }
  });
  return handle;
}
} // namespace detail

/// forward() of `inputs` on the worker thread. The model must outlive the handle.
inline Submitted<TensorMap> submit_forward(const AnyDispatchedModel& model, TensorMap inputs) {
  return detail::submit_call<TensorMap>(
      [&model, inputs = std::move(inputs)] { return model.forward(inputs); });
}

/// jacobian() of `inputs` on the worker thread. The model must outlive the handle.
inline Submitted<std::pair<TensorMap, VariablePairJacobian>>
submit_jacobian(const AnyDispatchedModel& model, TensorMap inputs) {
  return detail::submit_call<std::pair<TensorMap, VariablePairJacobian>>(
      [&model, inputs = std::move(inputs)] { return model.jacobian(inputs); });
}

} // namespace neml2

#pragma once

/// @file detail/policy_protocol.hpp
/// @brief How a policy's answers become decisions, written once for everything that asks a
/// policy: DispatchedModel's synchronous loop and asynchronous engine, the node simulator
/// (simulate.hpp) and the Python policy adapter. The templates ask the policy; the checks
/// and their messages are compiled once (src/engine/policy_protocol.cpp).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <neml2/device.hpp>
#include <neml2/policy.hpp>

namespace neml2::detail {

/// @name The checks, each a FatalError that quotes the policy's answer.
///@{
/// The index of a synchronous policy's `compute_device()` among its devices.
[[nodiscard]] std::size_t compute_device_index(const std::vector<Device>& devices,
                                               const Device& chosen);
/// A synchronous policy's `chunk_rows(batch)` as rows per chunk: 1 to `batch` (0 = `batch`).
[[nodiscard]] std::int64_t rows_per_chunk(std::int64_t answer, std::int64_t batch);
/// An asynchronous policy's `chunks_in_flight(d)` for the accelerator `device`: 1 to
/// max_chunks_in_flight.
[[nodiscard]] std::size_t checked_chunks_in_flight(std::int64_t answer, const Device& device);
/// A policy's `cpu_lanes`: 0 to max_cpu_lanes (refused by the rule that resolves it at each
/// call, detail::resolve_cpu_lanes in src/core/cpu_lanes.hpp).
[[nodiscard]] std::size_t checked_cpu_lanes(std::int64_t answer);
///@}

/// Calls the policy's `validate()`, when it has one.
template <class Policy>
void validate_policy(const Policy& policy) {
  if constexpr (requires { policy.validate(); })
    policy.validate();
}

/// Where one call of a synchronous policy runs: a device index and rows per chunk.
struct SyncDecision {
  std::size_t device = 0; ///< index into the policy's devices
  std::int64_t rows = 0;  ///< rows per chunk: 1 to the batch (the batch: one chunk)
};

/// Calls f(first, rows, index) for consecutive chunks of `rows` rows (> 0) covering
/// [0, batch): the one row loop of a synchronous call (and of its simulation).
template <class F>
void for_each_chunk(std::int64_t batch, std::int64_t rows, F&& f) {
  std::size_t index = 0;
  for (std::int64_t first = 0; first < batch; ++index) {
    const auto n = rows < batch - first ? rows : batch - first; // first + n never overflows
    f(first, n, index);
    first += n;
  }
}

/// A synchronous policy's device for the next call, as an index into `devices` (asked once).
template <SynchronousPolicy Policy>
std::size_t decide_device(const Policy& policy, const std::vector<Device>& devices) {
  return compute_device_index(devices, Device(policy.compute_device()));
}

/// A synchronous policy's rows per chunk for a call of `batch` rows (asked once).
template <SynchronousPolicy Policy>
std::int64_t decide_rows(const Policy& policy, std::int64_t batch) {
  return rows_per_chunk(static_cast<std::int64_t>(policy.chunk_rows(batch)), batch);
}

/// Both decisions for a call of `batch` rows, each asked once.
template <SynchronousPolicy Policy>
SyncDecision decide_synchronous(const Policy& policy, const std::vector<Device>& devices,
                                std::int64_t batch) {
  const auto device = decide_device(policy, devices);
  return {device, decide_rows(policy, batch)};
}

/// How many chunks `policy` may keep in flight on each of `devices`: its
/// `chunks_in_flight(d)` on an accelerator (checked; 1 without one), 1 on the CPU. Asked
/// once, when a model is loaded.
template <class Policy>
std::vector<std::size_t> chunks_in_flight(const Policy& policy,
                                          const std::vector<Device>& devices) {
  std::vector<std::size_t> n(devices.size(), 1);
  if constexpr (requires { policy.chunks_in_flight(std::size_t{}); })
    for (std::size_t d = 0; d < devices.size(); ++d)
      if (devices[d].is_accelerator())
        n[d] = checked_chunks_in_flight(static_cast<std::int64_t>(policy.chunks_in_flight(d)),
                                        devices[d]);
  return n;
}

/// The lanes a policy asks for its CPU chunks: its `cpu_lanes` (a data member or a member
/// function; checked), or 0 without one (torch's intra-op thread count at each call). Asked
/// once, when a model is loaded.
template <class Policy>
std::size_t requested_cpu_lanes(const Policy& policy) {
  if constexpr (requires { policy.cpu_lanes(); })
    return checked_cpu_lanes(static_cast<std::int64_t>(policy.cpu_lanes()));
  else if constexpr (requires { policy.cpu_lanes; })
    return checked_cpu_lanes(static_cast<std::int64_t>(policy.cpu_lanes));
  else
    return 0;
}

/// What is asked of an asynchronous policy with its state; the caller serializes the calls.
class AsyncPolicyCalls {
public:
  [[nodiscard]] virtual std::optional<ChunkChoice>
  next_chunk(std::span<const std::int64_t> rows_in_flight, std::int64_t remaining) = 0;
  virtual void on_dispatched(std::size_t device, std::int64_t rows) = 0;
  virtual void on_completed(std::size_t device, std::int64_t rows, double seconds) = 0;

protected:
  ~AsyncPolicyCalls() = default;
};

/// An asynchronous policy and the state it learns in, behind AsyncPolicyCalls.
template <AsynchronousPolicy Policy>
class PolicyWithState final : public AsyncPolicyCalls {
public:
  explicit PolicyWithState(const Policy& policy)
      : _policy(policy) {}
  std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t> rows_in_flight,
                                        std::int64_t remaining) override {
    return _policy.next_chunk(rows_in_flight, remaining, _state);
  }
  void on_dispatched(std::size_t device, std::int64_t rows) override {
    _policy.on_dispatched(device, rows, _state);
  }
  void on_completed(std::size_t device, std::int64_t rows, double seconds) override {
    _policy.on_completed(device, rows, seconds, _state);
  }

private:
  const Policy& _policy;
  policy_state_t<Policy> _state{};
};

/// The next chunk of a call with `remaining` of `batch` rows left, checked against
/// `devices`; nullopt: wait for a chunk in flight. A FatalError for a chunk out of range,
/// or for a wait while every device is idle (it would never end).
[[nodiscard]] std::optional<ChunkChoice> next_chunk(AsyncPolicyCalls& policy,
                                                    std::span<const std::int64_t> rows_in_flight,
                                                    std::int64_t remaining, std::int64_t batch,
                                                    const std::vector<Device>& devices);

} // namespace neml2::detail

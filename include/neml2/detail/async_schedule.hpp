#pragma once

/// @file detail/async_schedule.hpp
/// @brief The decisions of an asynchronous policy's calls, written once: which chunk goes
/// where, the devices' loads, the calls that wait for room, and what a completion frees. A
/// plain state machine with no thread and no clock, driven by the asynchronous engine under
/// its lock (src/engine/async/async_engine.cpp) and by the node simulator on its virtual
/// clock (simulate.hpp), so the two cannot disagree (src/engine/async/async_schedule.cpp).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include <neml2/detail/policy_protocol.hpp>
#include <neml2/device.hpp>

namespace neml2::detail {

/// One chunk the policy chose: rows [first, first + rows) of its call on device `device`.
struct ScheduledChunk {
  std::size_t index = 0;  ///< its place in its call's dispatch order, from 0
  std::size_t device = 0; ///< an index into the policy's devices
  std::int64_t first = 0; ///< the call's first row it takes
  std::int64_t rows = 0;  ///< the rows it takes
};

/// One call's way through the schedule; its driver keeps it (on the calling thread's stack).
struct ScheduledCall {
  explicit ScheduledCall(std::int64_t batch) noexcept
      : batch(batch) {}
  std::int64_t batch = 0;
  std::int64_t first = 0;    ///< the next row to dispatch
  std::size_t index = 0;     ///< the next chunk's number
  std::size_t in_flight = 0; ///< chunks booked and not completed
  bool stopped = false;      ///< a failure: no chunk is dispatched after it
  /// Nothing in flight, and nothing left to dispatch.
  [[nodiscard]] bool done() const noexcept {
    return in_flight == 0 && (first == batch || stopped);
  }
};

/// @brief The schedule of one model (or one simulated node): its policy with its state, the
/// rows in flight per device, and the calls the policy told to wait. Every member is called
/// with the driver's lock held (the engine) or from one thread (the simulator).
class AsyncSchedule {
public:
  AsyncSchedule(AsyncPolicyCalls& policy, std::vector<Device> devices);

  /// Dispatches what the policy allows now for `call`, one chunk at a time: the policy's
  /// choice (checked), `prepare(chunk)`, then the chunk booked (on_dispatched, the device's
  /// load, the call's rows), then `launch(chunk)`. Stops when the call is dispatched or
  /// stopped, or the policy waits (the call then waits for room). What throws propagates,
  /// leaving nothing booked for its chunk: a launch that throws is taken back.
  template <class Prepare, class Launch>
  void dispatch(ScheduledCall& call, Prepare&& prepare, Launch&& launch) {
    while (const auto chunk = next(call)) {
      prepare(*chunk);
      book(call, *chunk);
      try {
        launch(*chunk);
      } catch (...) {
        take_back(call, *chunk);
        throw;
      }
    }
  }

  /// Books a completed chunk of `call` after `seconds`: its device's load freed and the
  /// call's count, then the policy's on_completed (its error propagates after the booking).
  void complete(ScheduledCall& call, const ScheduledChunk& chunk, double seconds);

  /// After a completion of `call`'s chunk: `redispatch(c)` for each call to dispatch again,
  /// `call` first, then those that waited for room, each once (the waiting list is emptied
  /// first: a call the policy makes wait again goes back on it).
  template <class Redispatch>
  void for_each_call_with_room(ScheduledCall& call, Redispatch&& redispatch) {
    const auto waited = std::exchange(_waiting_for_room, {});
    redispatch(call);
    for (auto* other : waited)
      if (other != &call)
        redispatch(*other);
  }

  /// Forgets `call` (off the waiting list), before its driver lets it go.
  void close(ScheduledCall& call);

private:
  // The policy's next chunk for `call` (checked), or nullopt: nothing to ask, or it waits.
  std::optional<ScheduledChunk> next(ScheduledCall& call);
  void book(ScheduledCall& call, const ScheduledChunk& chunk);
  void take_back(ScheduledCall& call, const ScheduledChunk& chunk) noexcept;

  AsyncPolicyCalls& _policy;
  std::vector<Device> _devices;
  std::vector<std::int64_t> _rows_in_flight;   // per device
  std::vector<ScheduledCall*> _waiting_for_room; // calls the policy told to wait
};

} // namespace neml2::detail

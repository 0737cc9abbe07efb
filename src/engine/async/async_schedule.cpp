// The decisions of an asynchronous policy's calls (see
// include/neml2/detail/async_schedule.hpp).

#include <algorithm>
#include <utility>

#include <neml2/detail/async_schedule.hpp>

namespace neml2::detail {

AsyncSchedule::AsyncSchedule(AsyncPolicyCalls& policy, std::vector<Device> devices)
    : _policy(policy)
    , _devices(std::move(devices))
    , _rows_in_flight(_devices.size(), 0) {}

std::optional<ScheduledChunk> AsyncSchedule::next(ScheduledCall& call) {
  if (call.first == call.batch || call.stopped)
    return std::nullopt;
  const auto choice =
      next_chunk(_policy, _rows_in_flight, call.batch - call.first, call.batch, _devices);
  if (!choice) {
    if (std::find(_waiting_for_room.begin(), _waiting_for_room.end(), &call) ==
        _waiting_for_room.end())
      _waiting_for_room.push_back(&call);
    return std::nullopt;
  }
  return ScheduledChunk{call.index, choice->device, call.first, choice->rows};
}

void AsyncSchedule::book(ScheduledCall& call, const ScheduledChunk& chunk) {
  _policy.on_dispatched(chunk.device, chunk.rows); // first: if it throws, nothing is booked
  _rows_in_flight[chunk.device] += chunk.rows;
  ++call.in_flight;
  ++call.index;
  call.first += chunk.rows;
}

// Not launched, so it will never complete: its load and count go (the policy, told of its
// dispatch, is not told of a completion).
void AsyncSchedule::take_back(ScheduledCall& call, const ScheduledChunk& chunk) noexcept {
  _rows_in_flight[chunk.device] -= chunk.rows;
  --call.in_flight;
  call.stopped = true;
}

void AsyncSchedule::complete(ScheduledCall& call, const ScheduledChunk& chunk, double seconds) {
  _rows_in_flight[chunk.device] -= chunk.rows;
  --call.in_flight;
  _policy.on_completed(chunk.device, chunk.rows, seconds);
}

void AsyncSchedule::close(ScheduledCall& call) {
  std::erase(_waiting_for_room, &call);
}

} // namespace neml2::detail

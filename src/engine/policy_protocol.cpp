// The checks of a policy's answers and their messages, for everything that asks a policy
// (see include/neml2/detail/policy_protocol.hpp).

#include <algorithm>
#include <string>

#include <neml2/detail/policy_protocol.hpp>
#include <neml2/errors.hpp>

#include "core/cpu_lanes.hpp"

namespace neml2::detail {

std::size_t compute_device_index(const std::vector<Device>& devices, const Device& chosen) {
  for (std::size_t d = 0; d < devices.size(); ++d)
    if (devices[d] == chosen)
      return d;
  throw FatalError("the dispatch policy's compute_device() is " + chosen.str() +
                   ", which its devices() does not list (" + devices_text(devices) +
                   "); list it there, or compute on a listed device");
}

std::int64_t rows_per_chunk(std::int64_t answer, std::int64_t batch) {
  if (answer < 0)
    throw FatalError("the dispatch policy's chunk_rows(" + std::to_string(batch) + ") returned " +
                     std::to_string(answer) +
                     "; chunk_rows() must return >= 0 (rows per chunk; 0 = the whole batch)");
  return answer == 0 ? batch : std::min(answer, batch);
}

std::size_t checked_chunks_in_flight(std::int64_t answer, const Device& device) {
  if (answer < 1 || answer > max_chunks_in_flight)
    throw FatalError("the dispatch policy's chunks_in_flight() returned " + std::to_string(answer) +
                     " for " + device.str() + "; it must return 1 to " +
                     std::to_string(max_chunks_in_flight) +
                     " (the chunks that may run on the device at once)");
  return static_cast<std::size_t>(answer);
}

std::size_t checked_cpu_lanes(std::int64_t answer) {
  // Refused by the rule itself, when the model is made; resolved at each call (bind, CallContext::lanes).
  (void)resolve_cpu_lanes(answer, {});
  return static_cast<std::size_t>(answer);
}

std::optional<ChunkChoice> next_chunk(AsyncPolicyCalls& policy,
                                      std::span<const std::int64_t> rows_in_flight,
                                      std::int64_t remaining, std::int64_t batch,
                                      const std::vector<Device>& devices) {
  const auto choice = policy.next_chunk(rows_in_flight, remaining);
  if (!choice) {
    if (std::all_of(rows_in_flight.begin(), rows_in_flight.end(),
                    [](std::int64_t r) { return r == 0; }))
      throw FatalError("the dispatch policy's next_chunk() gave no chunk while every device was "
                       "idle (" +
                       std::to_string(remaining) + " of " + std::to_string(batch) +
                       " rows left); return a ChunkChoice when a device has room, and nullopt "
                       "only to wait for a chunk in flight");
    return choice;
  }
  if (choice->device >= devices.size()) // an index below 0 arrives wrapped: said as given
    throw FatalError("the dispatch policy's next_chunk() chose device index " +
                     std::to_string(static_cast<std::int64_t>(choice->device)) +
                     ", but the policy lists " + std::to_string(devices.size()) + " device(s) " +
                     devices_text(devices) + "; return an index into its devices");
  if (choice->rows < 1 || choice->rows > remaining)
    throw FatalError("the dispatch policy's next_chunk() chose " + std::to_string(choice->rows) +
                     " rows for " + devices[choice->device].str() + " with " +
                     std::to_string(remaining) +
                     " rows remaining; a chunk takes 1 to the remaining rows");
  return choice;
}

} // namespace neml2::detail

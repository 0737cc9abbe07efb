#pragma once

// What a ModelCore holds (include/neml2/detail/model_core.hpp), for the engine's files.

#include <functional>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include <neml2/detail/model_core.hpp>

namespace neml2::detail {

struct ModelCore::State {
  std::vector<Device> devices;                         // as the policy lists them
  std::vector<Session> sessions;                       // one per device
  std::vector<c10::Device> compute;                    // each session's device, resolved once
  std::vector<std::size_t> chunks_in_flight;           // per device: chunks that run at once
  std::size_t cpu_lanes = 0;                           // the policy's; 0: intra-op threads
  ChunkObserver observer;                              // empty: nothing timed, nothing called
  InterruptCheck interrupt_check;                      // empty: a call is never asked
  std::function<void(const ChunkEvent&)> before_chunk; // tests inject faults here

  [[nodiscard]] ChunkEvent event(std::size_t index, std::size_t d, std::int64_t first,
                                 std::int64_t rows, double seconds, std::size_t lane = 0) const {
    return {index, d, devices[d], first, rows, seconds, lane};
  }
};

} // namespace neml2::detail

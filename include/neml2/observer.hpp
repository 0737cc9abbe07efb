#pragma once

/// @file observer.hpp
/// @brief What a chunk observer sees: where each chunk of a call ran and how long it took.
/// Tests use it to prove a policy is obeyed; users use it to profile. And the check that
/// may stop a long call between its chunks.
/// @code
/// model.set_observer([](const neml2::ChunkEvent & c) {
///   std::printf("chunk %zu: rows [%lld, +%lld) on %s, %.3f ms\n", c.index, c.first, c.rows,
///               c.device.str().c_str(), 1e3 * c.seconds);
/// });
/// @endcode

#include <cstddef>
#include <cstdint>
#include <functional>

#include <neml2/device.hpp>

namespace neml2 {

/// One chunk of a call, reported when it completes (failed chunks too). A plain value
/// (thread safety: see ChunkObserver for where it is delivered).
struct ChunkEvent {
  std::size_t index = 0;        ///< order of assignment within the call: 0, 1, 2, ...
  std::size_t device_index = 0; ///< position of the device in the policy's list
  Device device;                ///< that device, as the policy listed it
  std::int64_t first = 0;       ///< first row of the batch
  std::int64_t rows = 0;        ///< number of rows
  double seconds = 0;           ///< from taking the rows to the results in place
  /// The CPU lane that ran it: 0 is the calling thread (and every chunk off the CPU). A
  /// chunk the library cut into pieces over the lanes (a whole batch, an asynchronous
  /// policy's CPU chunk) is one event, of lane 0.
  std::size_t lane = 0;
};

/// Called once per chunk. With an asynchronous policy, from worker threads and from the
/// calling thread (which runs the CPU's chunks), serialized by the model's lock: it may call
/// models of synchronous policies only (a FatalError otherwise). With a synchronous one, on
/// the calling thread (so concurrently when several threads call one model: guard what the
/// observer writes); it may call any model, its own included. A synchronous call whose
/// chunks run on several CPU lanes calls it from each lane's thread, one chunk at a time.
using ChunkObserver = std::function<void(const ChunkEvent&)>;

/// Asked between a call's chunks whether the call goes on: it returns to go on and throws
/// to stop the call (a host's Ctrl-C, a deadline, a rank that gave up). Always on the
/// calling thread: before each chunk after the first that thread runs and, while an
/// asynchronous policy's call waits for chunks on other devices, every 20 ms. A call of one
/// chunk never asks. See AnyDispatchedModel::set_interrupt_check.
using InterruptCheck = std::function<void()>;

} // namespace neml2

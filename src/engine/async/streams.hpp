#pragma once

// The streams of asynchronous calls (src/engine/async/streams.cpp): chunks staged onto
// accelerators through pinned buffers, and the calling thread's streams ordered before the
// workers'.

#include <cstdint>
#include <vector>

#include <c10/core/Device.h>

#include "graph/call.hpp"

namespace c10 {
struct Event;
}

namespace neml2::detail {

/// Rows [first, first + rows) of a call as one chunk on accelerator `device`: host tensors
/// go through this thread's pinned staging buffers (kept and reused across calls) and are
/// copied without blocking, on the current stream.
void take_rows_staged(const BoundCall& call, std::int64_t first, std::int64_t rows,
                      c10::Device device, ChunkArgs& chunk);

/// @brief Where a calling thread's streams stood when its call went to the workers: an
/// event on its current stream of each accelerator the call's tensors (and the caller's
/// output tensors) live on. Workers wait for them before touching the call's tensors, so
/// kernels the caller queued before the call (producing its inputs, reading its outputs)
/// come first. Costs nothing when every tensor is on the CPU.
class CallerStreams {
public:
  CallerStreams();
  ~CallerStreams();
  CallerStreams(const CallerStreams&) = delete;
  CallerStreams& operator=(const CallerStreams&) = delete;

  /// Records on this thread's current streams (call once, on the calling thread).
  void record(const BoundCall& call, const std::vector<at::Tensor>& targets);
  /// Makes this thread's current streams of those devices wait for the events.
  void wait() const;

private:
  std::vector<c10::Event> _events;
};

/// The calling thread now owns `t`, made on another thread's stream: the allocator does not
/// give its memory to other work until what this thread has queued on it is done. Nothing
/// for a tensor off CUDA (the only allocator with per-stream pools).
void own_on_this_stream(const at::Tensor& t);

} // namespace neml2::detail

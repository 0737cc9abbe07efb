#pragma once

// The threads behind asynchronous policies (src/worker_pool.cpp), and what orders the
// calling thread's streams before theirs.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <c10/core/Device.h>

#include "call.hpp"

namespace c10 {
struct Event;
}

namespace neml2::detail {

/// @brief One lane per device, each a FIFO queue served by its own worker threads.
/// A worker on an accelerator holds a device guard and a stream of its own for life, so
/// a lane with several workers keeps that many chunks in flight on its device. A lane
/// with none is served by the threads that make calls, and takes no task.
class WorkerPool {
public:
  struct Lane {
    c10::Device device = c10::kCPU;
    std::size_t workers = 1;
  };

  explicit WorkerPool(const std::vector<Lane>& lanes);
  /// Runs what was submitted, then joins every worker.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  /// Runs `task` on a worker of `lane`. A task reports its own errors; one that throws
  /// anyway is swallowed rather than terminating the process.
  void submit(std::size_t lane, std::function<void()> task);

  /// Worker threads alive in this process, across pools (for tests: synchronous models
  /// start none).
  [[nodiscard]] static std::size_t live_threads() noexcept;

private:
  struct Impl;
  std::unique_ptr<Impl> _impl;
};

/// Rows [first, first + rows) of a call as one chunk on accelerator `device`: host tensors
/// go through this thread's pinned staging buffers (kept and reused across calls) and are
/// copied without blocking, on the current stream.
void take_rows_staged(const BoundCall& call, std::int64_t first, std::int64_t rows,
                      c10::Device device, ChunkArgs& chunk);

/// Waits until the work queued on this thread's current stream of `device` is done.
void synchronize_current_stream(c10::Device device);

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

// The worker thread behind submitted calls (a worker pool of one CPU lane, core/), started
// by the first submission, and MaterialState::submit. In an object of its own: a program
// that never submits links none of it (nor the worker pool).

#include <ATen/Parallel.h>

#include <neml2/material_state.hpp>
#include <neml2/submitted.hpp>

#include "core/worker_pool.hpp"

namespace neml2 {

void detail::run_submitted(std::function<void()> task) {
  static WorkerPool worker({{c10::kCPU, 1}});
  // The submitting thread's intra-op threads, not the worker's default (OpenMP's count is
  // per thread).
  worker.submit(0, [threads = at::get_num_threads(), task = std::move(task)] {
    if (at::get_num_threads() != threads)
      at::set_num_threads(threads);
    task();
  });
}

Submitted<const StepResult&> MaterialState::submit(const TensorMap& forces,
                                                   const StepOptions& options) {
  refuse_while_submitted("submit");
  // Checked and copied here: the host may reuse its buffers once submit() returns.
  auto values = checked_forces(forces, options, true);
  auto kept = options; // its index buffers too: the host's to reuse once submit() returns
  if (kept.points.defined())
    kept.points = kept.points.clone();
  if (kept.into.points.defined())
    kept.into.points = kept.into.points.clone();
  auto ended = std::make_shared<std::promise<void>>();
  _submitted = ended->get_future().share();
  _unwaited = std::make_shared<std::atomic<bool>>(true);
  return detail::submit_call<const StepResult&>(
      [this, values = std::move(values), options = std::move(kept),
       ended]() mutable -> const StepResult& {
        struct End {
          std::promise<void>& ended;
          ~End() { ended.set_value(); }
        } end{*ended};
        return run_step(std::move(values), options);
      },
      [unwaited = _unwaited] { unwaited->store(false, std::memory_order_release); });
}

Submitted<const StepResult&> MaterialState::submit(const TensorMap& forces, const at::Tensor& t,
                                                   const StepOptions& options) {
  return submit(with_time(forces, t), options);
}

} // namespace neml2

#pragma once

/// @file policies/greedy_priority_capacity.hpp
/// @brief One batch over the CPU and the GPUs at once: each chunk goes to the
/// highest-priority device with room for it.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <neml2/errors.hpp>
#include <neml2/policy.hpp>

namespace neml2 {

/// @brief Spreads a batch over several devices at once. Each chunk goes to the device of
/// highest priority whose rows in flight plus its batch size stay within its capacity
/// (ties to the earlier device). `capacities` and `priorities` are optional; a list of
/// length 1 applies to every device. Capacity counts rows in flight (default: one
/// chunk); on a GPU, a capacity of k chunks keeps k chunks in flight, each on its own
/// stream, so copies overlap compute. The CPU runs one chunk at a time (the calling thread
/// runs it), cut into pieces over its `cpu_lanes` lanes: its batch size is the rows all of
/// its lanes take at once.
/// @code
/// auto model = neml2::load_model("aoti/model_aoti.i", "model",
///     neml2::GreedyPriorityCapacity{.devices = {"cpu", "cuda:0"},
///                                   .batch_sizes = {1024, 65536},
///                                   .capacities = {1024, 4 * 65536}});
/// @endcode
///
/// Thread safety: a plain value, never changed by the model that holds it (the rows in
/// flight are the model's, under its lock); one DispatchedModel<GreedyPriorityCapacity>
/// may be called from several threads at once, their chunks sharing the devices.
/// @see DispatchedModel, SyncChunking
struct GreedyPriorityCapacity {
  using dispatch_mode = asynchronous; ///< chunks run concurrently, one lane per device

  std::vector<Device> devices;               ///< the pool: one CPU at most, each device once
  std::vector<std::int64_t> batch_sizes;     ///< rows per chunk: one per device, or one for all
  std::vector<std::int64_t> capacities = {}; ///< rows in flight; empty: one chunk
  std::vector<double> priorities = {};       ///< higher first; empty: all equal
  std::int64_t cpu_lanes = 0; ///< threads a CPU chunk runs on; 0: torch's intra-op count

  /// Rows per chunk on device `d`.
  [[nodiscard]] std::int64_t batch_size(std::size_t d) const { return of(batch_sizes, d); }
  /// Rows device `d` may have in flight.
  [[nodiscard]] std::int64_t capacity(std::size_t d) const {
    return capacities.empty() ? batch_size(d) : of(capacities, d);
  }
  /// Device `d`'s priority (1 when none given).
  [[nodiscard]] double priority(std::size_t d) const {
    return priorities.empty() ? 1 : of(priorities, d);
  }

  /// The next chunk: the device of highest priority with room, or nullopt to wait.
  [[nodiscard]] std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t> rows_in_flight,
                                                      std::int64_t remaining, no_state&) const {
    std::optional<std::size_t> best;
    for (std::size_t d = 0; d < devices.size(); ++d)
      if (batch_size(d) <= capacity(d) - rows_in_flight[d] && // no overflow near INT64_MAX
          (!best || priority(d) > priority(*best)))
        best = d;
    if (!best)
      return std::nullopt;
    return ChunkChoice{*best, std::min(remaining, batch_size(*best))};
  }
  /// Nothing to learn: the loads are the model's.
  void on_dispatched(std::size_t, std::int64_t, no_state&) const {}
  /// Nothing to learn from timings.
  void on_completed(std::size_t, std::int64_t, double, no_state&) const {}

  /// Chunks a device may have in flight at once: capacity over batch size.
  [[nodiscard]] std::size_t chunks_in_flight(std::size_t d) const {
    return static_cast<std::size_t>(capacity(d) / batch_size(d));
  }

  /// A FatalError naming the field for a bad pool or list (run at construction of the model).
  void validate() const {
    validate_device_pool(devices, "GreedyPriorityCapacity.devices");
    const auto n = devices.size();
    const auto check_length = [&](std::size_t size, const char* field, bool optional) {
      if ((size == 0 && !optional) || (size > 1 && size != n))
        throw FatalError(std::string("GreedyPriorityCapacity.") + field + " has " +
                         std::to_string(size) + " entries for " + std::to_string(n) +
                         " devices; give one per device, or one for all" +
                         (optional ? " (or none for the default)" : ""));
    };
    check_length(batch_sizes.size(), "batch_sizes", false);
    check_length(capacities.size(), "capacities", true);
    check_length(priorities.size(), "priorities", true);
    for (std::size_t d = 0; d < n; ++d) {
      const auto where = " for " + devices[d].str() + " (device " + std::to_string(d) + ")";
      if (batch_size(d) < 1)
        throw FatalError("GreedyPriorityCapacity.batch_sizes is " + std::to_string(batch_size(d)) +
                         where + "; it must be >= 1 (rows per chunk)");
      if (capacity(d) < batch_size(d))
        throw FatalError("GreedyPriorityCapacity.capacities is " + std::to_string(capacity(d)) +
                         where + ", below its batch size " + std::to_string(batch_size(d)) +
                         "; capacity counts rows in flight: make it at least one chunk");
      if (devices[d].is_accelerator() && capacity(d) / batch_size(d) > max_chunks_in_flight)
        throw FatalError("GreedyPriorityCapacity.capacities is " + std::to_string(capacity(d)) +
                         where + ", " + std::to_string(capacity(d) / batch_size(d)) +
                         " times its batch size; at most " + std::to_string(max_chunks_in_flight) +
                         " chunks run on an accelerator at once: make it at most that many "
                         "batch sizes");
    }
  }

private:
  template <class T>
  static T of(const std::vector<T>& list, std::size_t d) {
    return list.size() == 1 ? list.front() : list.at(d);
  }
};

static_assert(DispatchPolicy<GreedyPriorityCapacity>);
static_assert(AsynchronousPolicy<GreedyPriorityCapacity>);

} // namespace neml2

#pragma once

/// @file policies/sync_chunking.hpp
/// @brief The whole batch on one device, in chunks of a fixed size, on the calling thread.

#include <array>
#include <cstdint>
#include <string>

#include <neml2/errors.hpp>
#include <neml2/policy.hpp>

namespace neml2 {

/// @brief Runs a batch on one device in chunks of `batch_size` rows (0 = one call), on the
/// CPU `cpu_lanes` chunks at once. Use it to fit a batch into device memory, or to tune the
/// per-call size.
/// @code
/// auto model = neml2::load_model("aoti/model_aoti.i", "model",
///                                neml2::SyncChunking{.device = "cuda:0", .batch_size = 4096});
/// @endcode
///
/// Thread safety: a plain value, never changed by the model that holds it; one
/// DispatchedModel<SyncChunking> may be called from several threads at once (each call
/// runs on its caller's thread).
/// @see DispatchedModel
struct SyncChunking {
  using dispatch_mode = synchronous; ///< runs on the calling thread

  Device device = DeviceFamily::cpu; ///< where every chunk runs
  std::int64_t batch_size = 0;       ///< rows per graph call; 0: the whole batch at once
  /// Threads that run the chunks on the CPU side by side, the calling one included (1 to
  /// 1024; 0: torch's intra-op thread count at each call). A whole batch is cut into pieces
  /// for them. Results are the same bits on any number.
  std::int64_t cpu_lanes = 0;

  /// The one device.
  [[nodiscard]] std::array<Device, 1> devices() const { return {device}; }
  /// Where the chunks run: `device`.
  [[nodiscard]] Device compute_device() const { return device; }
  /// Rows per chunk: `batch_size`.
  [[nodiscard]] std::int64_t chunk_rows(std::int64_t /*batch*/) const { return batch_size; }

  /// A FatalError for a negative batch_size (run at construction of the model).
  void validate() const {
    if (batch_size < 0)
      throw FatalError("SyncChunking.batch_size is " + std::to_string(batch_size) +
                       "; it must be >= 0 (rows per chunk; 0 runs the whole batch in one call)");
  }
};

static_assert(DispatchPolicy<SyncChunking>);

} // namespace neml2

#pragma once

/// @file memory.hpp
/// @brief The memory the library keeps for results: the outputs of the allocating calls
/// (`forward()`, `jacobian()`, ...) on the CPU come from blocks that earlier results gave
/// back, so a host that calls the same model on same-sized batches faults no new pages.
///
/// A block goes back to the library only when every tensor using it is gone: a result is
/// valid for as long as the caller keeps it, and no block a caller holds is handed out
/// again. Thread-safe. What is kept, waiting for reuse, is bounded by a byte limit; the
/// blocks released longest ago are freed first.
///
/// Results are computed in place: a compiled graph of a model without a solve, run on the
/// CPU, writes a chunk's results straight into their rows of the call's outputs (kept
/// memory, or the caller's dense tensors for the `_into` calls) instead of memory of its
/// own that is then copied. For this the library wraps torch's CPU allocator when it
/// loads (at the lowest priority, over whatever allocator is set then); an allocator a
/// host sets later replaces it, and results are then copied as before.
/// @code
/// neml2::set_result_memory_limit(std::size_t(2) << 30); // keep up to 2 GiB
/// neml2::set_result_memory_limit(0);                    // keep nothing (allocate per call)
/// @endcode

#include <cstddef>

namespace neml2 {

/// The limit when none was set: 1 GiB.
inline constexpr std::size_t default_result_memory_limit = std::size_t(1) << 30;

/// Keeps at most `bytes` of released result memory for reuse (0 turns reuse off); what is
/// kept beyond the new limit is freed now.
void set_result_memory_limit(std::size_t bytes);
/// The current limit.
[[nodiscard]] std::size_t result_memory_limit() noexcept;
/// Bytes kept now: released by callers, waiting for reuse.
[[nodiscard]] std::size_t result_memory_kept() noexcept;
/// Frees every kept block (blocks in use stay with their tensors).
void release_result_memory();

} // namespace neml2

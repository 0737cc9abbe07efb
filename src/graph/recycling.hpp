#pragma once

// Small blocks of torch's CPU allocator recycled per thread (see Recycling).

#include <cstddef>

#include <c10/core/Allocator.h>

namespace neml2::detail {

/// @brief While it lives, this thread's small allocations on torch's CPU allocator (at most
/// Recycling::largest bytes: a graph's intermediates and results at small batches, an
/// implicit step's working set) are blocks of a power-of-two size taken from the blocks
/// this thread freed, instead of new memory from glibc's aligned allocation (whose cost was
/// most of a one-row graph call; and from a kilobyte up, glibc merges the small blocks
/// freed before, slowing the thousand small allocations a graph call makes for its tensors).
/// A block freed on a thread that has recycled, scope or not, is kept for it, up to
/// Recycling::kept bytes a thread (the rest, and every block freed on any other thread, is
/// freed); a thread's kept blocks are freed when it ends. A Landing's targets come first.
class Recycling {
public:
  static constexpr std::size_t largest = std::size_t{1} << 20;
  static constexpr std::size_t kept = std::size_t{8} << 20;

  Recycling() noexcept;
  ~Recycling();
  Recycling(const Recycling&) = delete;
  Recycling& operator=(const Recycling&) = delete;

  /// How many allocations on this thread were a kept block so far (for tests).
  [[nodiscard]] static std::size_t reused_on_this_thread() noexcept;

  /// @name For the CPU allocator (landing.cpp).
  ///@{
  /// Whether this thread's allocation of `bytes` is a block now.
  [[nodiscard]] static bool serves(std::size_t bytes) noexcept;
  /// A block for `bytes` (serves() said so): one this thread kept, else a new one.
  [[nodiscard]] static c10::DataPtr block(std::size_t bytes);
  /// Keeps or frees `data` when it is a block; false when it is not one.
  [[nodiscard]] static bool release(void* data);
  ///@}

private:
  bool _outer;
};

} // namespace neml2::detail

#pragma once

// Torch's CPU allocator, wrapped for the whole process: while a graph runs, where its
// results land (the caller's memory, see Landing) and its small blocks come from
// (recycling.hpp).

#include <initializer_list>
#include <span>
#include <vector>

#include <ATen/Tensor.h>
#include <c10/util/SmallVector.h>

namespace neml2::detail {

/// Memory a result may be written to: `bytes` from `data`, dense (undefined: nowhere).
struct Place {
  void* data = nullptr;
  std::size_t bytes = 0;
};
/// Places of each result of a call, in slot order.
using Places = c10::SmallVector<Place, 8>;

/// Where `t` is, if it is a dense CPU tensor aligned as torch aligns its allocations;
/// otherwise nowhere.
[[nodiscard]] Place place_of(const at::Tensor& t) noexcept;

/// @brief Where the results of a graph run on this thread may be written: while a Landing
/// lives, an allocation on torch's CPU allocator of exactly one target's size is that
/// target's memory (each target once), so a graph's result lands in place (the caller's
/// tensor, or a chunk's rows of kept memory) instead of memory of its own that is then
/// copied. Nothing depends on it happening: a result whose data is its target's is not
/// copied again (copy_rows in src/engine/placement.cpp), any other is copied as before.
/// Code other than the graph's that runs meanwhile on the thread (an observer, a call it
/// makes) runs under a LandingPause, so that nothing it keeps can be a target.
class Landing {
public:
  /// `targets[i]` is the memory for result i; none where it is nowhere, not aligned as
  /// torch aligns its allocations, or shares memory with an earlier target or with any
  /// tensor the run `reads`.
  Landing(std::span<const Place> targets,
          std::initializer_list<const std::vector<at::Tensor>*> reads);
  ~Landing();
  Landing(const Landing&) = delete;
  Landing& operator=(const Landing&) = delete;

  /// Ends the landing (this thread allocates as before) once the graph has run, before
  /// any result is written to a target: a result that uses a claimed target's memory
  /// other than exactly as its own target (an intermediate of that size came first, or a
  /// view) is copied out of it, so that writing the targets cannot overwrite it.
  void settle(std::vector<at::Tensor>& results);

  /// The memory of an unclaimed target of exactly `bytes`, now claimed; null if none.
  [[nodiscard]] void* claim(std::size_t bytes) noexcept;

  /// How many results have landed on this thread so far (for tests).
  [[nodiscard]] static std::size_t landed_on_this_thread() noexcept;

private:
  struct Target : Place {
    bool claimed = false;
  };
  void end() noexcept;

  c10::SmallVector<Target, 8> _targets;
  Landing* _outer;
  bool _armed = true;
};

/// @brief While it lives, this thread's allocations are its own, whatever Landing is
/// active (code that is not the graph's: an observer, memory the library keeps).
class LandingPause {
public:
  LandingPause() noexcept;
  ~LandingPause();
  LandingPause(const LandingPause&) = delete;
  LandingPause& operator=(const LandingPause&) = delete;

private:
  Landing* _paused;
};

/// Whether the allocator the library wrapped frees through its raw deleter what its raw
/// interface gave: without that, a block handed out there could not come back (Recycling).
[[nodiscard]] bool cpu_allocator_frees_raw() noexcept;

} // namespace neml2::detail

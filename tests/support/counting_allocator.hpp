#pragma once

// A CPU allocator that counts the bytes torch allocates: live now, and the peak since
// reset(); it can fail allocations of one size on a thread (fail_bytes). Install it with
// c10::SetCPUAllocator(&counting, priority); it must outlive every tensor it allocates (make it
// static).

#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>

#include <c10/core/CPUAllocator.h>

namespace test {

struct CountingAllocator final : c10::Allocator {
  c10::Allocator* base = c10::GetDefaultCPUAllocator();
  std::atomic<std::int64_t> live{0}, peak{0};
  /// Allocations of at least `count_above` bytes (set it to the size of interest).
  std::atomic<std::int64_t> count_above{std::numeric_limits<std::int64_t>::max()};
  std::atomic<std::int64_t> allocations_above{0};
  struct Block {
    c10::DataPtr inner;
    std::int64_t bytes;
    CountingAllocator* owner;
  };
  /// On this thread, an allocation of exactly `fail_bytes` (0: none) throws a foreign
  /// error tagged "{fault alloc foreign}" (the stress test's tag) and counts in `failed`.
  static inline thread_local std::size_t fail_bytes = 0;
  static inline thread_local int failed = 0;
  c10::DataPtr allocate(std::size_t n) override {
    if (fail_bytes != 0 && n == fail_bytes) {
      ++failed;
      throw std::runtime_error("{fault alloc foreign} injected foreign fault: out of memory");
    }
    auto inner = base->allocate(n);
    if (static_cast<std::int64_t>(n) >= count_above)
      ++allocations_above;
    void* data = inner.get();
    const auto now = live += static_cast<std::int64_t>(n);
    for (auto seen = peak.load(); now > seen && !peak.compare_exchange_weak(seen, now);)
      ;
    return {data, new Block{std::move(inner), static_cast<std::int64_t>(n), this}, &release,
            c10::Device(c10::kCPU)};
  }
  static void release(void* block) {
    auto* b = static_cast<Block*>(block);
    b->owner->live -= b->bytes;
    delete b;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  /// The peak starts again from what is live now; returns that.
  std::int64_t reset() {
    peak = live.load();
    return live;
  }
};

} // namespace test

// Result memory kept across calls: a CPU allocator whose blocks, when their last tensor
// goes, wait in a list for the next result of the same size instead of going back to the
// system (glibc unmaps blocks above 32 MiB on free, so each fresh result of that size
// faults in every page again).

#include "session/result_memory.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>

#include <neml2/memory.hpp>

namespace neml2 {
namespace detail {
namespace {

class ResultPool final : public c10::Allocator {
public:
  c10::DataPtr allocate(std::size_t bytes) override {
    if (bytes == 0)
      return {nullptr, c10::Device(c10::kCPU)};
    Block* block = nullptr;
    {
      std::lock_guard lock(_mutex);
      // The most recently released block of this size: the likeliest to be in cache.
      const auto it = std::find_if(_idle.rbegin(), _idle.rend(),
                                   [&](const Block* b) { return b->bytes == bytes; });
      if (it != _idle.rend()) {
        block = *it;
        _idle.erase(std::next(it).base());
        _kept -= bytes;
      }
    }
    if (!block)
      block = new Block{c10::GetCPUAllocator()->allocate(bytes), bytes};
    return {block->memory.get(), block, &give_back, c10::Device(c10::kCPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  void set_limit(std::size_t bytes) {
    std::vector<Block*> freed;
    {
      std::lock_guard lock(_mutex);
      _limit = bytes;
      evict_to(_limit, freed);
    }
    free_all(freed);
  }
  [[nodiscard]] std::size_t limit() const noexcept { return _limit.load(); }
  [[nodiscard]] std::size_t kept() const noexcept { return _kept.load(); }

private:
  struct Block {
    c10::DataPtr memory; // from torch's CPU allocator
    std::size_t bytes;
  };

  // The last tensor of a block is gone: keep it (evicting the oldest) or free it.
  static void give_back(void* context) {
    auto* block = static_cast<Block*>(context);
    auto& pool = instance();
    std::vector<Block*> freed;
    {
      std::lock_guard lock(pool._mutex);
      if (block->bytes <= pool._limit) {
        pool.evict_to(pool._limit - block->bytes, freed);
        pool._idle.push_back(block);
        pool._kept += block->bytes;
        block = nullptr;
      }
    }
    delete block;
    free_all(freed);
  }

  // Frees the oldest idle blocks until at most `bytes` are kept (the lock held; the
  // blocks are deleted after it is released).
  void evict_to(std::size_t bytes, std::vector<Block*>& freed) {
    auto it = _idle.begin();
    for (; it != _idle.end() && _kept > bytes; ++it) {
      _kept -= (*it)->bytes;
      freed.push_back(*it);
    }
    _idle.erase(_idle.begin(), it);
  }

  static void free_all(const std::vector<Block*>& blocks) {
    for (auto* b : blocks)
      delete b;
  }

  std::mutex _mutex;
  std::vector<Block*> _idle; // oldest released first
  std::atomic<std::size_t> _kept{0}, _limit{default_result_memory_limit};

public:
  // Never destroyed: results may outlive main() (static tensors), and their deleters
  // come back here.
  static ResultPool& instance() {
    static auto* pool = new ResultPool;
    return *pool;
  }
};

// ------------------------------------------------------------------ landing

thread_local Landing* current_landing = nullptr;
thread_local std::size_t landed = 0;

void leave_in_place(void*) {} // a target's memory is its tensor's owner's

// Torch's CPU allocator for the whole process, wrapped: while this thread has a Landing,
// an allocation of a target's size is the target; anything else is the allocator it
// wraps, unchanged (its DataPtr and deleter as they were).
class LandingAllocator final : public c10::Allocator {
public:
  explicit LandingAllocator(c10::Allocator* next)
      : _next(next) {}

  c10::DataPtr allocate(std::size_t bytes) override {
    if (auto* landing = current_landing; landing && bytes > 0)
      if (void* target = landing->claim(bytes))
        // The context is not the data: raw_allocate() refuses it rather than free it later.
        return {target, landing, &leave_in_place, c10::Device(c10::kCPU)};
    return _next->allocate(bytes);
  }
  c10::DeleterFnPtr raw_deleter() const override { return _next->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    _next->copy_data(dest, src, count);
  }

private:
  c10::Allocator* _next;
};

// Installed when the library loads, over whatever CPU allocator torch has then (at the
// lowest priority: an allocator the host sets later replaces it, and results are then
// copied as before). Built in static storage and never destroyed: tensors may be
// allocated after main() returns (and nothing on the heap to report as leaked once
// another allocator has replaced it).
alignas(LandingAllocator) unsigned char landing_storage[sizeof(LandingAllocator)];
[[maybe_unused]] const bool landing_installed = [] {
  c10::SetCPUAllocator(new (landing_storage) LandingAllocator(c10::GetCPUAllocator()),
                       /*priority=*/0);
  return true;
}();

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto* x = static_cast<const char*>(a);
  const auto* y = static_cast<const char*>(b);
  return a && b && x < y + b_bytes && y < x + a_bytes;
}

// Whether [data, data + bytes) and t's memory (its storage's, unless t is dense) overlap.
bool overlaps(const void* data, std::size_t bytes, const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || !t.is_cpu())
    return false;
  return t.is_contiguous() ? overlaps(data, bytes, t.data_ptr(), t.nbytes())
                           : overlaps(data, bytes, t.storage().data(), t.storage().nbytes());
}
} // namespace

Place place_of(const at::Tensor& t) noexcept {
  if (!t.defined() || !t.is_cpu() || !t.is_contiguous() || t.nbytes() == 0 ||
      reinterpret_cast<std::uintptr_t>(t.data_ptr()) % c10::gAlignment != 0)
    return {};
  return {t.data_ptr(), t.nbytes()};
}

Landing::Landing(std::span<const Place> targets,
                 std::initializer_list<const std::vector<at::Tensor>*> reads)
    : _outer(current_landing) {
  for (std::size_t i = 0; i < targets.size(); ++i) {
    const auto& t = targets[i];
    auto& target = _targets.emplace_back();
    if (!t.data || reinterpret_cast<std::uintptr_t>(t.data) % c10::gAlignment != 0)
      continue;
    const auto shares_earlier =
        std::any_of(targets.begin(), targets.begin() + static_cast<std::ptrdiff_t>(i),
                    [&](const Place& e) { return overlaps(t.data, t.bytes, e.data, e.bytes); });
    const auto read = std::any_of(reads.begin(), reads.end(), [&](const auto* tensors) {
      return std::any_of(tensors->begin(), tensors->end(),
                         [&](const at::Tensor& r) { return overlaps(t.data, t.bytes, r); });
    });
    if (!shares_earlier && !read)
      static_cast<Place&>(target) = t;
  }
  current_landing = this;
}

Landing::~Landing() {
  end();
}

void Landing::end() noexcept {
  if (_armed)
    current_landing = _outer;
  _armed = false;
}

void* Landing::claim(std::size_t bytes) noexcept {
  for (auto& t : _targets)
    if (!t.claimed && t.bytes == bytes) {
      t.claimed = true;
      ++landed;
      return t.data;
    }
  return nullptr;
}

std::size_t Landing::landed_on_this_thread() noexcept {
  return landed;
}

void Landing::settle(std::vector<at::Tensor>& results) {
  end();
  for (std::size_t i = 0; i < results.size(); ++i) {
    auto& r = results[i];
    for (std::size_t j = 0; j < _targets.size(); ++j) {
      const auto& t = _targets[j];
      if (!t.claimed || !overlaps(t.data, t.bytes, r))
        continue;
      if (j != i || r.data_ptr() != t.data || !r.is_contiguous() || r.nbytes() != t.bytes) {
        r = r.clone(at::MemoryFormat::Contiguous);
        break;
      }
    }
  }
}

at::Tensor empty_result(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  return at::detail::empty_generic(sizes, &ResultPool::instance(),
                                   c10::DispatchKeySet(c10::DispatchKey::CPU), dtype, std::nullopt);
}

} // namespace detail

void set_result_memory_limit(std::size_t bytes) {
  detail::ResultPool::instance().set_limit(bytes);
}

std::size_t result_memory_limit() noexcept {
  return detail::ResultPool::instance().limit();
}

std::size_t result_memory_kept() noexcept {
  return detail::ResultPool::instance().kept();
}

void release_result_memory() {
  auto& pool = detail::ResultPool::instance();
  const auto limit = pool.limit();
  pool.set_limit(0);
  pool.set_limit(limit);
}

} // namespace neml2

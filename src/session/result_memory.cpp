// Result memory kept across calls: a CPU allocator whose blocks, when their last tensor
// goes, wait in a list for the next result of the same size instead of going back to the
// system (glibc unmaps blocks above 32 MiB on free, so each fresh result of that size
// faults in every page again).

#include "session/result_memory.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>

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
    if (!block) {
      const LandingPause own_memory; // never a graph's target: the pool keeps it
      block = new Block{c10::GetCPUAllocator()->allocate(bytes), bytes};
    }
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
  // Frees every kept block; the limit stays.
  void release() {
    std::vector<Block*> freed;
    {
      std::lock_guard lock(_mutex);
      evict_to(0, freed);
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

} // namespace

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
  detail::ResultPool::instance().release();
}

} // namespace neml2

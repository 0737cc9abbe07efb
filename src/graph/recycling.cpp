// Small blocks of torch's CPU allocator recycled per thread: power-of-two classes, kept
// by the thread that freed them while it recycles (the allocator that hands them out:
// landing.cpp).

#include "graph/recycling.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <unordered_set>
#include <vector>

#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>

#include "graph/landing.hpp"

namespace neml2::detail {
namespace {

// Recycled blocks: 64 bytes to Recycling::largest in power-of-two classes, each with its
// class in a header before its data (data and header aligned as torch aligns).
thread_local bool recycling = false;
thread_local std::size_t reused = 0;
constexpr std::size_t smallest_block = 64;
constexpr std::size_t block_classes =
    std::bit_width(Recycling::largest) - std::bit_width(smallest_block) + 1;
constexpr std::size_t block_header = c10::gAlignment;

std::size_t class_of(std::size_t bytes) {
  return std::bit_width(std::max(bytes, smallest_block) - 1) - std::bit_width(smallest_block - 1);
}
std::size_t block_bytes(std::size_t block_class) {
  return smallest_block << block_class;
}
std::size_t& class_of_block(void* data) {
  return *reinterpret_cast<std::size_t*>(static_cast<char*>(data) - block_header);
}

// Every block made and not yet freed, by data address: how the raw deleter knows one.
struct LiveBlocks {
  std::shared_mutex mutex;
  std::unordered_set<void*> data;
};
LiveBlocks& blocks() {
  static auto* made = new LiveBlocks; // never destroyed: tensors may die after main()
  return *made;
}

void* new_block(std::size_t block_class) {
  auto* data =
      static_cast<char*>(c10::alloc_cpu(block_header + block_bytes(block_class))) + block_header;
  class_of_block(data) = block_class;
  try {
    std::unique_lock lock(blocks().mutex);
    blocks().data.insert(data);
  } catch (...) {
    c10::free_cpu(data - block_header);
    throw;
  }
  return data;
}

void free_block(void* data) noexcept {
  {
    std::unique_lock lock(blocks().mutex);
    blocks().data.erase(data);
  }
  c10::free_cpu(static_cast<char*>(data) - block_header);
}

// The blocks kept by a thread that has recycled, by class (`kept_here` once it has).
struct KeptBlocks;
thread_local KeptBlocks* kept_here = nullptr;
thread_local bool kept_ended = false; // the thread's KeptBlocks destroyed (it is ending)
struct KeptBlocks {
  std::array<std::vector<void*>, block_classes> free;
  std::size_t bytes = 0;
  ~KeptBlocks() {
    kept_here = nullptr; // a block freed later on this thread is freed
    kept_ended = true;
    for (auto& blocks_of_class : free)
      for (void* data : blocks_of_class)
        free_block(data);
  }
};

void recycled_delete(void* data) {
  if (auto* kept = kept_here) {
    const auto block_class = class_of_block(data);
    if (kept->bytes + block_bytes(block_class) <= Recycling::kept)
      try {
        kept->free[block_class].push_back(data);
        kept->bytes += block_bytes(block_class);
        return;
      } catch (const std::bad_alloc&) {
      }
  }
  free_block(data);
}

} // namespace

Recycling::Recycling() noexcept
    : _outer(recycling) {
  if (kept_ended || !cpu_allocator_frees_raw()) // (raw_allocate() could not free a block)
    return;
  thread_local KeptBlocks kept;
  kept_here = &kept;
  recycling = true;
}

Recycling::~Recycling() {
  recycling = _outer;
}

std::size_t Recycling::reused_on_this_thread() noexcept {
  return reused;
}

bool Recycling::serves(std::size_t bytes) noexcept {
  return recycling && kept_here && bytes > 0 && bytes <= Recycling::largest;
}

c10::DataPtr Recycling::block(std::size_t bytes) {
  const auto block_class = class_of(bytes);
  auto& free = kept_here->free[block_class];
  void* data = nullptr;
  if (free.empty())
    data = new_block(block_class);
  else {
    data = free.back();
    free.pop_back();
    kept_here->bytes -= block_bytes(block_class);
    ++reused;
  }
  return {data, data, &recycled_delete, c10::Device(c10::kCPU)};
}

bool Recycling::release(void* data) {
  bool recycled = false;
  {
    std::shared_lock lock(blocks().mutex);
    recycled = blocks().data.contains(data);
  }
  if (recycled)
    recycled_delete(data);
  return recycled;
}

} // namespace neml2::detail

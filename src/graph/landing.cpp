// Torch's CPU allocator wrapped: while a Landing is active on a thread, an allocation of a
// target's size is that target; while a Recycling is, a small allocation is a kept block.

#include "graph/landing.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <unordered_set>

#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>

namespace neml2::detail {
namespace {

thread_local Landing* current_landing = nullptr;
thread_local std::size_t landed = 0;

// The targets handed out and not yet let go, by address (one entry per claim): their
// memory is their tensor's owner's, never freed here.
struct HandedOut {
  std::mutex mutex;
  std::vector<void*> data;
};
HandedOut& handed_out() {
  static auto* kept = new HandedOut; // never destroyed: tensors may die after main()
  return *kept;
}

c10::Allocator* beneath = nullptr; // the allocator the landing wraps

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
struct Blocks {
  std::shared_mutex mutex;
  std::unordered_set<void*> data;
};
Blocks& blocks() {
  static auto* made = new Blocks; // never destroyed: tensors may die after main()
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

c10::DataPtr recycled_block(std::size_t bytes) {
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

// The deleter of every landed target, and the raw deleter: a target is let go, anything
// else goes to the allocator beneath (the raw interface of c10::Allocator frees through
// raw_deleter() what raw_allocate() gave, landed or not).
void landing_delete(void* data) {
  {
    auto& h = handed_out();
    std::lock_guard lock(h.mutex);
    if (const auto it = std::find(h.data.rbegin(), h.data.rend(), data); it != h.data.rend()) {
      h.data.erase(std::next(it).base());
      return;
    }
  }
  bool recycled = false;
  {
    std::shared_lock lock(blocks().mutex);
    recycled = blocks().data.contains(data);
  }
  if (recycled)
    recycled_delete(data);
  else
    beneath->raw_deleter()(data);
}

// Torch's CPU allocator for the whole process, wrapped: while this thread has a Landing,
// an allocation of a target's size is the target (context = data, as raw_allocate()
// needs); anything else is the allocator it wraps, unchanged (its DataPtr and deleter as
// they were).
class LandingAllocator final : public c10::Allocator {
public:
  c10::DataPtr allocate(std::size_t bytes) override {
    if (auto* landing = current_landing; landing && bytes > 0)
      if (void* target = landing->claim(bytes)) {
        {
          auto& h = handed_out();
          std::lock_guard lock(h.mutex);
          h.data.push_back(target);
        }
        return {target, target, &landing_delete, c10::Device(c10::kCPU)};
      }
    if (recycling && kept_here && bytes > 0 && bytes <= Recycling::largest)
      return recycled_block(bytes);
    return beneath->allocate(bytes);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return beneath->raw_deleter() ? &landing_delete : nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    beneath->copy_data(dest, src, count);
  }
};

// Installed when the library loads, over whatever CPU allocator torch has then (at the
// lowest priority: an allocator the host sets later replaces it, and results are then
// copied as before). Built in static storage and never destroyed: tensors may be
// allocated after main() returns (and nothing on the heap to report as leaked once
// another allocator has replaced it).
alignas(LandingAllocator) unsigned char landing_storage[sizeof(LandingAllocator)];
[[maybe_unused]] const bool landing_installed = [] {
  beneath = c10::GetCPUAllocator();
  c10::SetCPUAllocator(new (landing_storage) LandingAllocator, /*priority=*/0);
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

Recycling::Recycling() noexcept
    : _outer(recycling) {
  if (kept_ended || !beneath->raw_deleter()) // (raw_allocate() could not free a block)
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

LandingPause::LandingPause() noexcept
    : _paused(current_landing) {
  current_landing = nullptr;
}

LandingPause::~LandingPause() {
  current_landing = _paused;
}

} // namespace neml2::detail

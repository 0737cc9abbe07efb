// Torch's CPU allocator wrapped for the whole process: while a Landing is active on a
// thread, an allocation of a target's size is that target; while a Recycling is, a small
// allocation is a kept block (recycling.cpp).

#include "graph/landing.hpp"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <new>

#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>

#include "graph/recycling.hpp"

namespace neml2::detail {
namespace {

thread_local Landing* current_landing = nullptr;
thread_local std::size_t landed = 0;

// The targets handed out and not yet let go, by address (one entry per claim): their
// memory is their tensor's owner's, never freed here.
struct HandedOut {
  std::mutex mutex;
  std::vector<void*> data;
  std::atomic<std::size_t> count{0}; // data's size, read without the lock

  // Whether `p` was handed out; if so it is let go.
  bool let_go(void* p) {
    if (count.load(std::memory_order_acquire) == 0) // a free long after any landing: no lock
      return false;
    std::lock_guard lock(mutex);
    const auto it = std::find(data.rbegin(), data.rend(), p);
    if (it == data.rend())
      return false;
    data.erase(std::next(it).base());
    count.store(data.size(), std::memory_order_release);
    return true;
  }
  void hand_out(void* p) {
    std::lock_guard lock(mutex);
    data.push_back(p);
    count.store(data.size(), std::memory_order_release);
  }
};
HandedOut& handed_out() {
  static auto* kept = new HandedOut; // never destroyed: tensors may die after main()
  return *kept;
}

c10::Allocator* beneath = nullptr; // the allocator the landing wraps

// The deleter of every landed target, and the raw deleter: a target is let go, anything
// else goes to the allocator beneath (the raw interface of c10::Allocator frees through
// raw_deleter() what raw_allocate() gave, landed or not).
void landing_delete(void* data) {
  if (handed_out().let_go(data))
    return;
  if (!Recycling::release(data))
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
        handed_out().hand_out(target);
        return {target, target, &landing_delete, c10::Device(c10::kCPU)};
      }
    if (Recycling::serves(bytes))
      return Recycling::block(bytes);
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

bool cpu_allocator_frees_raw() noexcept {
  return beneath->raw_deleter() != nullptr;
}

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

LandingPause::LandingPause() noexcept
    : _paused(current_landing) {
  current_landing = nullptr;
}

LandingPause::~LandingPause() {
  current_landing = _paused;
}

} // namespace neml2::detail

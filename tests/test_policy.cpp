// The policy concept: what models it, what does not, and the synchronous trait.

#include <neml2/dispatch.hpp>

#include "doctest_torch.hpp"

using namespace neml2;

namespace {
struct Minimal {
  using dispatch_mode = synchronous;
  std::vector<Device> devices() const { return {"cpu"}; }
  Device compute_device() const { return "cpu"; }
  int chunk_rows(std::int64_t) const { return 0; } // any integer type will do
};
struct NoMode {
  std::vector<Device> devices() const { return {"cpu"}; }
  Device compute_device() const { return "cpu"; }
  std::int64_t chunk_rows(std::int64_t) const { return 0; }
};
struct WrongMode : Minimal {
  using dispatch_mode = int;
};
struct DevicesNotARange : Minimal {
  Device devices() const { return "cpu"; }
};
struct NoChunkRows {
  using dispatch_mode = synchronous;
  std::vector<Device> devices() const { return {"cpu"}; }
  Device compute_device() const { return "cpu"; }
};
struct Async { // tagged asynchronous, but without the asynchronous members
  using dispatch_mode = asynchronous;
  std::vector<Device> devices() const { return {"cpu"}; }
};
struct NotCopyable : Minimal {
  NotCopyable() = default;
  NotCopyable(const NotCopyable&) = delete;
};
struct AsyncComplete {
  using dispatch_mode = asynchronous;
  std::vector<Device> devices = {"cpu", "cuda:0"}; // a data member works as well
  std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t>, std::int64_t,
                                        no_state&) const {
    return ChunkChoice{0, 1};
  }
  void on_dispatched(std::size_t, std::int64_t, no_state&) const {}
  void on_completed(std::size_t, std::int64_t, double, no_state&) const {}
};
struct WrongState : AsyncComplete {
  struct state_type {
    explicit state_type(int) {}
  };
};
struct AsyncWithSyncMembers : Minimal { // synchronous members do not make it asynchronous
  using dispatch_mode = asynchronous;
};
} // namespace

static_assert(DispatchPolicy<SyncChunking>);
static_assert(SynchronousPolicy<SyncChunking>);
static_assert(!is_asynchronous_policy_v<SyncChunking>);
static_assert(DispatchPolicy<Minimal>);
static_assert(!DispatchPolicy<NoMode>);
static_assert(!DispatchPolicy<WrongMode>);
static_assert(!DispatchPolicy<DevicesNotARange>);
static_assert(!DispatchPolicy<NoChunkRows>);
static_assert(is_asynchronous_policy_v<Async>);
static_assert(!SynchronousPolicy<Async>);
static_assert(!DispatchPolicy<Async>);
static_assert(!DispatchPolicy<NotCopyable>);
static_assert(DispatchPolicy<AsyncComplete>);
static_assert(AsynchronousPolicy<AsyncComplete>);
static_assert(!SynchronousPolicy<AsyncComplete>);
static_assert(std::same_as<policy_state_t<AsyncComplete>, no_state>);
static_assert(!DispatchPolicy<WrongState>);
static_assert(!DispatchPolicy<AsyncWithSyncMembers>);
static_assert(DispatchPolicy<GreedyPriorityCapacity>);
// The concept and the model's diagnostics agree: check_policy accepts what the concept does.
static_assert(neml2::detail::check_policy<Minimal>() &&
              neml2::detail::check_policy<AsyncComplete>());

TEST_CASE("a policy lists its devices by function or by data member") {
  CHECK(listed_devices(AsyncComplete{}) == std::vector<Device>{"cpu", "cuda:0"});
  CHECK(listed_devices(SyncChunking{.device = "cuda:1"}) == std::vector<Device>{"cuda:1"});
}

TEST_CASE("SyncChunking is a value built with designated initializers") {
  const SyncChunking p{.device = "cuda:1", .batch_size = 4096};
  CHECK(p.compute_device() == Device("cuda:1"));
  CHECK(p.devices()[0] == Device("cuda:1"));
  CHECK(p.chunk_rows(1 << 20) == 4096);
  const SyncChunking defaults;
  CHECK(defaults.device == Device("cpu"));
  CHECK(defaults.batch_size == 0);
}

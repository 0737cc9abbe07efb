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
struct Async {
  using dispatch_mode = asynchronous;
  std::vector<Device> devices() const { return {"cpu"}; }
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

TEST_CASE("SyncChunking is a value built with designated initializers") {
  const SyncChunking p{.device = "cuda:1", .batch_size = 4096};
  CHECK(p.compute_device() == Device("cuda:1"));
  CHECK(p.devices()[0] == Device("cuda:1"));
  CHECK(p.chunk_rows(1 << 20) == 4096);
  const SyncChunking defaults;
  CHECK(defaults.device == Device("cpu"));
  CHECK(defaults.batch_size == 0);
}

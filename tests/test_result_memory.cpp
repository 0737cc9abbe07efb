// Result memory kept across calls (neml2/memory.hpp): the allocating calls reuse the
// blocks earlier results gave back, never one a caller still holds, within a byte limit.

#include <atomic>
#include <barrier>
#include <set>
#include <thread>

#include <sys/resource.h>

#include <neml2/memory.hpp>

#include "counting_allocator.hpp"
#include "model_checks.hpp"

using namespace neml2;

namespace {

const auto elasticity = [] { return test::stub("elasticity", "elasticity"); };

// torch's CPU allocator counted from the first tensor of this binary on.
test::CountingAllocator& counting() {
  static test::CountingAllocator allocator; // outlives every tensor it allocates
  static const bool installed = [] {
    c10::SetCPUAllocator(&allocator, /*priority=*/100);
    return true;
  }();
  static_cast<void>(installed);
  return allocator;
}

long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

TensorMap strains(std::int64_t batch, double scale) {
  return {{"strain", scale * at::rand({batch, 6}, at::kDouble)}};
}

// The same values from the session's own whole-batch call: the graph's results, handed
// over, no kept memory.
at::Tensor reference_stress(const TensorMap& in) {
  const Session s(std::make_shared<const Artifact>(
                      read_artifact(resolve_artifact_root(elasticity(), "elasticity"))),
                  "cpu");
  return s.forward(in).at("stress").clone();
}

// Restores the limit a test changed.
struct LimitGuard {
  std::size_t kept = result_memory_limit();
  ~LimitGuard() { set_result_memory_limit(kept); }
};

} // namespace

TEST_CASE("1,000 calls of one shape: no new output memory after the first, within the limit") {
  auto& count = counting();
  const LimitGuard guard;
  const std::int64_t batch = 1 << 15;
  const auto output_bytes = batch * 6 * 8;
  count.count_above = output_bytes; // chunk results (4096 rows) are smaller
  const auto in = strains(batch, 1e-3);
  for (const auto policy_rows : {std::int64_t(4096), std::int64_t(0)}) {
    CAPTURE(policy_rows);
    const auto m = load_model(elasticity(), "elasticity", SyncChunking{.batch_size = policy_rows});
    (void)m.forward(in); // the first call: its output's block is kept once released
    const auto allocations = count.allocations_above.load();
    for (int call = 0; call < 1000; ++call) {
      const auto out = m.forward(in);
      REQUIRE(out.at("stress").sizes() == c10::IntArrayRef{batch, 6});
    }
    CHECK(count.allocations_above.load() == allocations);
    CHECK(result_memory_kept() <= result_memory_limit());
    CHECK(result_memory_kept() >= static_cast<std::size_t>(output_bytes));
  }
  // The same calls with nothing kept allocate every time: what the counts above exclude.
  set_result_memory_limit(0);
  CHECK(result_memory_kept() == 0);
  const auto m = load_model(elasticity(), "elasticity", SyncChunking{.batch_size = 4096});
  const auto allocations = count.allocations_above.load();
  for (int call = 0; call < 10; ++call)
    (void)m.forward(in);
  CHECK(count.allocations_above.load() == allocations + 10);
  count.count_above = std::numeric_limits<std::int64_t>::max();
}

// Page faults are glibc's allocator's behaviour; ASan and TSan replace it with their own
// (ASan's quarantine maps fresh memory for every freed chunk result), so there the faults
// measure the sanitizer. The plain suite runs this case; the reuse cases above run anywhere.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool sanitizer_allocator = true;
#else
constexpr bool sanitizer_allocator = false;
#endif

TEST_CASE("outputs above glibc's mmap threshold fault no pages after the first call" *
          doctest::skip(sanitizer_allocator)) {
  counting();
  const LimitGuard guard;
  const std::int64_t batch = 1 << 20; // 48 MiB of stress: mapped and unmapped per call
  const auto in = strains(batch, 1e-3);
  // Two calls first: the graph's chunk results come from glibc's heap, which settles over
  // its first two calls (the first chunk result is mapped, raising glibc's mmap threshold;
  // the heap it then grows is trimmed once).
  const auto faults_over = [&](const auto& model, int calls) {
    (void)model.forward(in);
    (void)model.forward(in);
    const auto before = minor_faults();
    for (int call = 0; call < calls; ++call)
      (void)model.forward(in);
    return minor_faults() - before;
  };
  const auto chunked = load_model(elasticity(), "elasticity", SyncChunking{.batch_size = 16384});
  const auto whole = load_model(elasticity(), "elasticity", SyncChunking{});
  const auto pool = load_model(elasticity(), "elasticity",
                               GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {16384}});
  // Without kept memory every call faults its 48 MiB in again (12,288 pages of 4 KiB). The
  // counts are the process's: the kernel may fault a few pages for reasons of its own (a
  // fresh machine once gave 108 over 20 calls, page migration or the like), so kept memory
  // must fault under a quarter of one call's pages over all 20 calls, where one output
  // mapped again anywhere in them faults a whole call's.
  const long one_call = batch * 6 * 8 / 4096;
  CHECK(faults_over(chunked, 20) < one_call / 4);
  CHECK(faults_over(whole, 20) < one_call / 4); // run in cache-sized pieces into kept memory
  CHECK(faults_over(pool, 20) < one_call / 4);
  set_result_memory_limit(0);
  CHECK(faults_over(chunked, 2) >= 2 * one_call);
}

TEST_CASE("a result kept across later calls keeps its values; held blocks are not reused") {
  counting();
  const std::int64_t batch = 10000;
  const auto first_in = strains(batch, 1e-3);
  const auto expected = reference_stress(first_in);
  for (const auto rows : {std::int64_t(1024), std::int64_t(0)}) {
    CAPTURE(rows);
    const auto m = load_model(elasticity(), "elasticity", SyncChunking{.batch_size = rows});
    const auto kept = m.forward(first_in).at("stress");
    std::set<const void*> held = {kept.const_data_ptr()};
    std::vector<at::Tensor> later;
    for (int call = 0; call < 20; ++call) {
      later.push_back(m.forward(strains(batch, 2e-3 + call)).at("stress"));
      CHECK(held.insert(later.back().const_data_ptr()).second); // no block handed out twice
      if (call % 2)
        later.erase(later.begin()); // released: its block may serve the next call
      held = {kept.const_data_ptr()};
      for (const auto& t : later)
        held.insert(t.const_data_ptr());
    }
    CHECK(at::equal(kept, expected));
  }
}

TEST_CASE("concurrent callers each get their own memory") {
  counting();
  const std::int64_t batch = 8192;
  const auto m = load_model(elasticity(), "elasticity",
                            GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {1024}});
  const auto sync = load_model(elasticity(), "elasticity", SyncChunking{.batch_size = 1024});
  constexpr int threads = 4, calls = 25;
  std::vector<TensorMap> inputs;
  std::vector<at::Tensor> expected;
  for (int t = 0; t < threads; ++t) {
    inputs.push_back(strains(batch, 1e-3 * (t + 1)));
    expected.push_back(reference_stress(inputs.back()));
  }
  std::barrier meet(threads);
  std::vector<std::vector<at::Tensor>> results(threads);
  std::vector<std::thread> callers;
  for (int t = 0; t < threads; ++t)
    callers.emplace_back([&, t] {
      for (int call = 0; call < calls; ++call) {
        results[t].push_back(
            (call % 2 ? m.forward(inputs[t]) : sync.forward(inputs[t])).at("stress"));
        if (results[t].size() > 2)
          results[t].erase(results[t].begin());
        meet.arrive_and_wait(); // every thread's last two results held here at once
      }
    });
  for (auto& c : callers)
    c.join();
  std::set<const void*> blocks;
  for (int t = 0; t < threads; ++t)
    for (const auto& r : results[t]) {
      CHECK(at::equal(r, expected[t]));
      CHECK(blocks.insert(r.const_data_ptr()).second);
    }
}

TEST_CASE("the limit bounds what is kept; release_result_memory() frees it all") {
  auto& count = counting();
  const LimitGuard guard;
  const std::int64_t batch = 4096;
  const auto block = static_cast<std::size_t>(batch * 6 * 8);
  const auto m = load_model(elasticity(), "elasticity", SyncChunking{.batch_size = 1024});
  release_result_memory();
  CHECK(result_memory_kept() == 0);
  set_result_memory_limit(2 * block);
  {
    std::vector<TensorMap> held;
    for (int call = 0; call < 5; ++call)
      held.push_back(m.forward(strains(batch, 1e-3)));
    CHECK(result_memory_kept() == 0); // all five still held
  }
  CHECK(result_memory_kept() == 2 * block); // five released, two kept
  const auto live = count.live.load();
  release_result_memory();
  CHECK(result_memory_kept() == 0);
  CHECK(count.live.load() == live - static_cast<std::int64_t>(2 * block));
  // A result larger than the limit is never kept.
  set_result_memory_limit(block - 1);
  (void)m.forward(strains(batch, 1e-3));
  CHECK(result_memory_kept() == 0);
}

TEST_CASE("release_result_memory() keeps a limit another thread sets meanwhile") {
  const LimitGuard guard;
  std::atomic<bool> done{false};
  std::thread releaser([&] {
    while (!done.load())
      release_result_memory();
  });
  int lost = 0;
  for (std::size_t limit = 1; limit <= 20000; ++limit) {
    set_result_memory_limit(limit << 10);
    lost += result_memory_limit() != limit << 10 ? 1 : 0;
  }
  done = true;
  releaser.join();
  CHECK(lost == 0);
  CHECK(result_memory_limit() == std::size_t{20000} << 10);
}

// GreedyPriorityCapacity: its choices, its validation, and the pool running it on the CPU
// with results identical to SyncChunking.

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include <neml2/detail/testing.hpp> // before_chunk

#include "graph/graph_calls.hpp" // the library's private parts
#include "model_checks.hpp"

using namespace neml2;
using test::contains;

namespace {

// Rows in flight per device, as the model would pass them.
std::optional<ChunkChoice> choose(const GreedyPriorityCapacity& p, std::vector<std::int64_t> loads,
                                  std::int64_t remaining = 1000) {
  no_state state;
  return p.next_chunk(loads, remaining, state);
}

std::string validation_message(const GreedyPriorityCapacity& p) {
  return test::fatal_message([&] { p.validate(); });
}

struct Chunks {
  std::vector<ChunkEvent> events;
  ChunkObserver observer() {
    return [this](const ChunkEvent& e) { events.push_back(e); };
  }
  // By order of assignment (completion order may differ).
  std::vector<ChunkEvent> in_order() const {
    auto sorted = events;
    std::sort(sorted.begin(), sorted.end(),
              [](const auto& a, const auto& b) { return a.index < b.index; });
    return sorted;
  }
};

} // namespace

TEST_CASE("each chunk goes to the highest-priority device with room; ties to the earlier") {
  const GreedyPriorityCapacity p{.devices = {"cpu", "cuda:0", "cuda:1"},
                                 .batch_sizes = {10, 100, 100},
                                 .capacities = {10, 200, 100},
                                 .priorities = {1, 3, 3}};
  CHECK(choose(p, {0, 0, 0})->device == 1);   // priority 3, earlier of the two
  CHECK(choose(p, {0, 100, 0})->device == 1); // still room for one more chunk (capacity 200)
  CHECK(choose(p, {0, 200, 0})->device == 2); // full: the other priority-3 device
  CHECK(choose(p, {0, 200, 100})->device == 0);
  CHECK_FALSE(choose(p, {10, 200, 100}).has_value()); // nothing has room: wait
  CHECK(choose(p, {0, 0, 0}, 42)->rows == 42);        // the rest, when fewer than a chunk
  CHECK(choose(p, {0, 200, 100}, 1000)->rows == 10);
}

TEST_CASE("lists of length 1 apply to every device; capacity defaults to one chunk") {
  const GreedyPriorityCapacity p{.devices = {"cpu", "cuda:0"}, .batch_sizes = {64}};
  CHECK(p.batch_size(1) == 64);
  CHECK(p.capacity(0) == 64);
  CHECK(p.priority(1) == 1);
  CHECK(choose(p, {0, 0})->device == 0);
  CHECK(choose(p, {64, 0})->device == 1);
  CHECK_FALSE(choose(p, {64, 1}).has_value());
  CHECK(GreedyPriorityCapacity{.devices = {"cuda:0"}, .batch_sizes = {64}, .capacities = {256}}
            .chunks_in_flight(0) == 4);
}

TEST_CASE("invalid configurations say what to change") {
  using P = GreedyPriorityCapacity;
  CHECK(contains(validation_message(P{.devices = {}, .batch_sizes = {1}}),
                 "GreedyPriorityCapacity.devices is empty"));
  CHECK(
      contains(validation_message(P{.devices = {"cpu", "cuda:0", "cuda:1"}, .batch_sizes = {1, 2}}),
               "GreedyPriorityCapacity.batch_sizes has 2 entries for 3 devices"));
  CHECK(contains(validation_message(P{.devices = {"cpu"}, .batch_sizes = {}}),
                 "batch_sizes has 0 entries"));
  CHECK(
      contains(validation_message(P{.devices = {"cpu"}, .batch_sizes = {8}, .priorities = {1, 2}}),
               "priorities has 2 entries for 1 devices"));
  CHECK(contains(validation_message(P{.devices = {"cpu", "cuda:0"}, .batch_sizes = {8, 0}}),
                 "batch_sizes is 0 for cuda:0 (device 1); it must be >= 1"));
  CHECK(contains(validation_message(P{.devices = {"cpu"}, .batch_sizes = {8}, .capacities = {4}}),
                 "capacities is 4 for cpu (device 0), below its batch size 8"));
  // More chunks in flight than a device runs: refused by the field, not at load by the
  // chunks_in_flight() it answers (the CPU keeps one chunk whatever its capacity).
  CHECK(contains(
      validation_message(
          P{.devices = {"cpu", "cuda:0"}, .batch_sizes = {8}, .capacities = {8 * 4096, 8 * 1025}}),
      "capacities is 8200 for cuda:0 (device 1), 1025 times its batch size; at most "
      "1024 chunks run on an accelerator at once"));
  CHECK_NOTHROW(P{.devices = {"cpu", "cuda:0"}, .batch_sizes = {8}, .capacities = {8 * 4096, 8192}}
                    .validate());
  CHECK(contains(validation_message(P{.devices = {"cpu", "cpu:0"}, .batch_sizes = {8}}),
                 "lists the CPU 2 times"));
  CHECK(contains(validation_message(P{.devices = {"cuda:1", "cuda:1"}, .batch_sizes = {8}}),
                 "lists 'cuda:1' twice"));
  CHECK(contains(validation_message(P{.devices = {"cuda", "cuda"}, .batch_sizes = {8}}),
                 "lists 'cuda' 2 times"));
  // `cuda` next to `cuda:0`: the same device where one exists, ambiguous otherwise.
  const auto bare_and_pinned =
      validation_message(P{.devices = {"cuda", "cuda:0"}, .batch_sizes = {8}});
  if (device_count(DeviceFamily::cuda) == 1)
    CHECK(contains(bare_and_pinned, "which are the same device here"));
  else
    CHECK(contains(bare_and_pinned, "mixes a bare 'cuda' with pinned 'cuda:N' devices"));
  CHECK(contains(validation_message(P{.devices = {"cuda", "cuda:1"}, .batch_sizes = {8}}),
                 "mixes a bare 'cuda'"));
  // Different families are independent.
  CHECK_NOTHROW(P{.devices = {"cpu", "cuda:0", "xpu:0"}, .batch_sizes = {8}}.validate());
  // Checked when the model is loaded, before any graph is.
  CHECK(contains(test::fatal_message([] {
                   return load_model(test::stub("rates", "eq"), "eq",
                                     P{.devices = {"cpu"}, .batch_sizes = {0}});
                 }),
                 "batch_sizes is 0"));
}

TEST_CASE("a CPU pool gives SyncChunking's results, chunk for chunk") {
  const auto stub = test::stub("elasticity_params", "elasticity");
  const test::Reference ref("elasticity_params");
  for (std::int64_t rows : {1, 3, 7, 64}) {
    CAPTURE(rows);
    auto pool = load_model(stub, "elasticity",
                           GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {rows}});
    const auto sync = load_model(stub, "elasticity", SyncChunking{.batch_size = rows});
    test::check_all_batches(pool, ref, true, true);
    for (const auto* c : {"b7", "b33"}) {
      const auto in = ref.group(std::string(c) + "/in");
      CHECK(test::identical(pool.forward(in), sync.forward(in)));
      CHECK(test::identical(pool.jacobian(in).second.at("stress").at("strain"),
                            sync.jacobian(in).second.at("stress").at("strain")));
      CHECK(test::identical(pool.jvp(in, ref.group(std::string(c) + "/tangent")).second,
                            sync.jvp(in, ref.group(std::string(c) + "/tangent")).second));
      CHECK(test::identical(pool.param_jacobian(in).second.at("stress").at("elasticity.E"),
                            sync.param_jacobian(in).second.at("stress").at("elasticity.E")));
      CHECK(test::identical(pool.param_vjp(in, ref.group(std::string(c) + "/cot")),
                            sync.param_vjp(in, ref.group(std::string(c) + "/cot"))));
    }
    test::check_empty_batch(pool, true);
    test::check_batched_parameter(pool, ref);
  }
}

TEST_CASE("the pool obeys the policy: chunk boundaries, device, order") {
  const test::Reference ref("rates");
  auto m = load_model(
      test::stub("rates", "eq"), "eq",
      GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {5}, .capacities = {10}});
  Chunks chunks;
  m.set_observer(chunks.observer());
  test::check_forward(m, ref, "b33");
  const auto events = chunks.in_order();
  REQUIRE(events.size() == 7);
  for (std::size_t i = 0; i < events.size(); ++i) {
    CHECK(events[i].index == i);
    CHECK(events[i].first == 5 * static_cast<std::int64_t>(i));
    CHECK(events[i].rows == (i < 6 ? 5 : 3));
    CHECK(events[i].device == Device("cpu"));
    CHECK(events[i].seconds >= 0);
  }
}

TEST_CASE("the CPU's chunks run on the calling thread, one chunk or many") {
  auto m = load_model(test::stub("rates", "eq"), "eq",
                      GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {8}});
  const test::Reference ref("rates");
  std::vector<std::thread::id> ran_on;
  neml2::detail::ModelAccess::before_chunk(
      m, [&](const ChunkEvent&) { ran_on.push_back(std::this_thread::get_id()); });
  test::check_forward(m, ref, "b7"); // 7 rows: one chunk, in place
  REQUIRE(ran_on.size() == 1);
  CHECK(ran_on[0] == std::this_thread::get_id());
  ran_on.clear();
  test::check_forward(m, ref, "b33"); // 5 chunks
  REQUIRE(ran_on.size() == 5);
  // The calling thread's OpenMP team does the CPU's work: a worker's would be a second
  // team (see performance.md, the CPU pool against the calling thread).
  for (const auto& id : ran_on)
    CHECK(id == std::this_thread::get_id());
}

TEST_CASE("two callers' CPU chunks run one at a time, even when the capacity allows two") {
  // Room for two chunks on the CPU: both callers' chunks are in flight at once, and each
  // caller runs its own; the lane still runs one chunk at a time, as a worker would.
  auto m = load_model(
      test::stub("rates", "eq"), "eq",
      GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {8}, .capacities = {16}});
  const test::Reference ref("rates");
  std::atomic<int> running{0}, most{0};
  neml2::detail::ModelAccess::before_chunk(m, [&](const ChunkEvent&) {
    const int now = ++running;
    for (int seen = most.load(); now > seen && !most.compare_exchange_weak(seen, now);)
      ;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    --running;
  });
  // 33 rows: chunks; 7 rows: each call one chunk, run in place on its calling thread.
  for (const std::string c : {"b33", "b7"}) {
    CAPTURE(c);
    most = 0;
    std::vector<std::thread> callers;
    for (int t = 0; t < 2; ++t)
      callers.emplace_back([&] {
        for (int k = 0; k < 5; ++k)
          test::check_forward(m, ref, c);
      });
    for (auto& caller : callers)
      caller.join();
    CHECK(most.load() == 1);
  }
}

TEST_CASE("the CPU lane runs exactly the chunks it was given, and nothing else runs") {
  auto m =
      load_model(test::stub("elasticity", "elasticity"), "elasticity",
                 GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {4096}, .cpu_lanes = 1});
  Chunks chunks;
  m.set_observer(chunks.observer());
  const auto in = TensorMap{{"strain", 1e-3 * at::rand({10000, 6}, at::kDouble)}};
  std::vector<std::pair<std::thread::id, std::int64_t>> calls;
  std::mutex mutex;
  neml2::detail::observe_graph_calls([&](const std::string&, std::int64_t rows) {
    std::lock_guard lock(mutex);
    calls.emplace_back(std::this_thread::get_id(), rows);
  });
  const auto out = m.forward(in).at("stress");
  neml2::detail::observe_graph_calls({});
  REQUIRE(calls.size() == 3); // a chunk of fewer than 2 x 8192 rows: one piece
  std::vector<std::int64_t> rows;
  for (const auto& [thread, n] : calls) {
    CHECK(thread == std::this_thread::get_id()); // the CPU lane: the calling thread
    rows.push_back(n);
  }
  std::vector<std::int64_t> given;
  for (const auto& e : chunks.in_order())
    given.push_back(e.rows);
  CHECK(given == std::vector<std::int64_t>{4096, 4096, 1808});
  std::sort(rows.begin(), rows.end());
  std::sort(given.begin(), given.end());
  CHECK(rows == given);
  const auto whole = load_model(test::stub("elasticity", "elasticity"), "elasticity");
  CHECK(at::equal(out, whole.forward(in).at("stress")));
}

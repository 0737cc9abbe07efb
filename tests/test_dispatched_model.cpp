// DispatchedModel's engine with user-written policies: several CPU lanes at once (the
// one-CPU rule belongs to GreedyPriorityCapacity, not to the engine), chunk sizes that
// vary within a call, injected faults, shared parameters, concurrent callers, and what a
// synchronous policy does not pay for.

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <limits>
#include <thread>

#include <neml2/detail/testing.hpp> // before_chunk
#include <neml2/memory.hpp>

#include "counting_allocator.hpp"
#include "internals.hpp" // the library's private parts
#include "model_checks.hpp"
#include "scalar_model.hpp"

using namespace neml2;
using test::contains;
using test::load;

namespace {

// Chunk sizes that vary within a call, over two CPU lanes at once: with r rows left, the
// next chunk takes 1 + (r / 3) % 4 rows on lane (r / 4) % 2, and waits while that lane is
// busy.
struct Lanes {
  using dispatch_mode = asynchronous;
  struct state_type {
    std::size_t dispatched = 0, completed = 0;
  };
  std::vector<Device> devices = {"cpu", "cpu"};

  static ChunkChoice plan(std::int64_t remaining) {
    return {static_cast<std::size_t>(remaining / 4 % 2),
            std::min(remaining, 1 + remaining / 3 % 4)};
  }
  std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t> rows_in_flight,
                                        std::int64_t remaining, state_type&) const {
    const auto choice = plan(remaining);
    if (rows_in_flight[choice.device] > 0)
      return std::nullopt;
    return choice;
  }
  void on_dispatched(std::size_t, std::int64_t, state_type& s) const { ++s.dispatched; }
  void on_completed(std::size_t, std::int64_t, double, state_type& s) const { ++s.completed; }
};

// Every chunk on the second CPU lane, a worker's: the calling thread only waits.
struct WorkerLane {
  using dispatch_mode = asynchronous;
  struct state_type {};
  std::vector<Device> devices = {"cpu", "cpu"};
  std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t> rows_in_flight,
                                        std::int64_t remaining, state_type&) const {
    if (rows_in_flight[1] > 0)
      return std::nullopt;
    return ChunkChoice{1, std::min<std::int64_t>(remaining, 3)};
  }
  void on_dispatched(std::size_t, std::int64_t, state_type&) const {}
  void on_completed(std::size_t, std::int64_t, double, state_type&) const {}
};

// What Lanes assigns, chunk by chunk, for a batch.
std::vector<ChunkEvent> lanes_plan(std::int64_t batch) {
  std::vector<ChunkEvent> plan;
  for (std::int64_t first = 0, k = 0; first < batch; ++k) {
    const auto [device, rows] = Lanes::plan(batch - first);
    plan.push_back({static_cast<std::size_t>(k), device, "cpu", first, rows, 0});
    first += rows;
  }
  return plan;
}

struct Recorder {
  std::mutex mutex;
  std::vector<ChunkEvent> events;
  ChunkObserver observer() {
    return [this](const ChunkEvent& e) {
      std::lock_guard lock(mutex);
      events.push_back(e);
    };
  }
  std::vector<ChunkEvent> in_order() {
    std::lock_guard lock(mutex);
    auto sorted = events;
    std::sort(sorted.begin(), sorted.end(),
              [](const auto& a, const auto& b) { return a.index < b.index; });
    events.clear();
    return sorted;
  }
};

std::size_t threads_in_process() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/task"))
    ++n;
  return n;
}

// What `f` throws.
template <class F>
std::exception_ptr thrown(F&& f) {
  try {
    f();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

// A call stopped by its interrupt check (thrown at its second question), a foreign throw,
// a check that lets the call go on, a call of one chunk, then the model unchanged: for a
// model that runs "rates" in chunks of 3 rows.
template <class Model>
void check_interrupts(Model& m, const test::Reference& ref) {
  const auto in = ref.group("b33/in");
  const auto expected = m.forward(in);
  std::vector<std::size_t> started;
  int asked = 0;
  neml2::detail::ModelAccess::before_chunk(
      m, [&](const ChunkEvent& e) { started.push_back(e.index); });
  m.set_interrupt_check([&] {
    if (++asked == 2)
      throw FatalError("interrupted by the host");
  });
  CHECK(contains(test::fatal_message([&] { return m.forward(in); }), "interrupted by the host"));
  CHECK(asked == 2); // before chunks 1 and 2
  CHECK(started == std::vector<std::size_t>{0, 1});

  // Into the caller's tensors: the rows of chunks 0 and 1 written, the others as they were.
  TensorMap out;
  for (const auto& [name, t] : expected)
    out[name] = at::full_like(t, std::numeric_limits<double>::quiet_NaN());
  asked = 0;
  CHECK(contains(test::fatal_message([&] { m.forward_into(in, out); }), "interrupted by the host"));
  for (const auto& [name, t] : out) {
    CHECK(at::equal(t.narrow(0, 0, 6), expected.at(name).narrow(0, 0, 6)));
    CHECK(t.narrow(0, 6, t.size(0) - 6).isnan().all().template item<bool>());
  }

  m.set_interrupt_check([] { throw std::runtime_error("deadline passed"); });
  CHECK(contains(test::fatal_message([&] { return m.forward(in); }),
                 "the interrupt check: deadline passed"));

  asked = 0;
  m.set_interrupt_check([&] { ++asked; });
  CHECK(test::identical(m.forward(in), expected));
  CHECK(asked == 10); // 11 chunks
  asked = 0;
  (void)m.forward(ref.group("b2/in"));
  CHECK(asked == 0); // one chunk: never asked

  m.set_interrupt_check({});
  neml2::detail::ModelAccess::before_chunk(m, {});
  test::check_all_batches(m, ref, true, false);
}
} // namespace

static_assert(AsynchronousPolicy<Lanes>);

TEST_CASE("several lanes at once: every chunk where the policy put it, results exact") {
  const test::Reference ref("elasticity_params");
  auto m = load<Lanes>("elasticity_params", "elasticity");
  const auto whole = load("elasticity_params", "elasticity", SyncChunking{});
  Recorder chunks;
  m.set_observer(chunks.observer());
  for (const auto* c : {"b1", "b2", "b7", "b33"}) {
    CAPTURE(c);
    const auto in = ref.group(std::string(c) + "/in");
    const auto batch = in.at("strain").size(0);
    const auto check_plan = [&] {
      const auto events = chunks.in_order();
      const auto plan = lanes_plan(batch);
      REQUIRE(events.size() == plan.size());
      for (std::size_t i = 0; i < plan.size(); ++i) {
        CHECK(events[i].index == i);
        CHECK(events[i].device_index == plan[i].device_index);
        CHECK(events[i].first == plan[i].first);
        CHECK(events[i].rows == plan[i].rows);
      }
    };
    CHECK(test::identical(m.forward(in), whole.forward(in)));
    check_plan();
    test::check_jacobian(m, ref, c);
    check_plan();
    test::check_jvp(m, ref, c);
    check_plan();
    test::check_param_jacobian(m, ref, c);
    check_plan();
    test::check_param_vjp(m, ref, c);
    check_plan();
  }
}

TEST_CASE("lanes really overlap, and sums do not depend on completion order") {
  const test::Reference ref("elasticity_params");
  auto m = load<Lanes>("elasticity_params", "elasticity");
  const auto in = ref.group("b33/in");
  const auto cot = ref.group("b33/cot");
  const auto expected = m.param_vjp(in, cot);
  std::atomic<int> running{0}, most{0}, misplaced{0};
  const auto caller = std::this_thread::get_id();
  // Chunk 0 is slow: every other chunk completes before it.
  neml2::detail::ModelAccess::before_chunk(m, [&](const ChunkEvent& e) {
    // the first CPU lane is the calling thread, the second its worker
    if ((std::this_thread::get_id() == caller) != (e.device_index == 0))
      ++misplaced;
    const int now = ++running;
    for (int seen = most.load(); now > seen && !most.compare_exchange_weak(seen, now);)
      ;
    std::this_thread::sleep_for(std::chrono::milliseconds(e.index == 0 ? 60 : 5));
    --running;
  });
  const auto gradients = m.param_vjp(in, cot);
  CHECK(test::identical(gradients, expected));
  for (const auto& [name, g] : gradients)
    CHECK(g.device() == in.begin()->second.device()); // summed where the inputs live
  CHECK(most.load() == 2);
  CHECK(misplaced.load() == 0);
  test::check_param_vjp(m, ref, "b33");
}

TEST_CASE("a failing chunk: its own error, no new chunk after it, the model still usable") {
  const test::Reference ref("rates");
  auto m = load("rates", "eq", GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {3}});
  std::vector<std::size_t> started;
  const auto fail_at = [&](std::size_t chunk, auto error) {
    started.clear();
    neml2::detail::ModelAccess::before_chunk(m, [&started, chunk, error](const ChunkEvent& e) {
      started.push_back(e.index);
      if (e.index == chunk)
        throw error;
    });
  };
  fail_at(2, FatalError("injected fatal fault"));
  CHECK(contains(test::fatal_message([&] { return m.forward(ref.group("b33/in")); }),
                 "injected fatal fault"));
  CHECK(started == std::vector<std::size_t>{0, 1, 2});

  fail_at(1, ConvergenceError("injected divergence"));
  try {
    (void)m.forward(ref.group("b33/in"));
    FAIL("nothing thrown");
  } catch (const ConvergenceError& e) {
    CHECK(e.recoverable());
    CHECK(std::string(e.what()) == "injected divergence");
  }
  CHECK(started == std::vector<std::size_t>{0, 1});

  fail_at(0, std::runtime_error("foreign fault"));
  CHECK(contains(test::fatal_message([&] { return m.forward(ref.group("b33/in")); }),
                 "running a chunk on cpu: foreign fault"));

  neml2::detail::ModelAccess::before_chunk(m, {});
  test::check_all_batches(m, ref, true, false);
}

TEST_CASE("several failing chunks become one AggregateError, in chunk order") {
  const test::Reference ref("rates");
  auto m = load<Lanes>("rates", "eq");
  const auto fail_first_two = [&](auto first_error, auto second_error) {
    // Chunk 0 fails late, chunk 1 at once: completion order is 1, 0.
    neml2::detail::ModelAccess::before_chunk(m, [=](const ChunkEvent& e) {
      if (e.index == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        throw first_error;
      }
      if (e.index == 1)
        throw second_error;
    });
    return thrown([&] { (void)m.forward(ref.group("b33/in")); });
  };
  const auto message = [](const std::exception_ptr& e) -> std::string {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      return x.what();
    }
  };
  const auto both_recoverable =
      fail_first_two(ConvergenceError("chunk 0 diverged"), ConvergenceError("chunk 1 diverged"));
  try {
    std::rethrow_exception(both_recoverable);
  } catch (const AggregateError& e) {
    CHECK(e.recoverable());
    REQUIRE(e.errors().size() == 2);
    CHECK(message(e.errors()[0]) == "chunk 0 diverged");
    CHECK(message(e.errors()[1]) == "chunk 1 diverged");
  } catch (...) {
    FAIL("expected an AggregateError");
  }
  const auto mixed =
      fail_first_two(ConvergenceError("chunk 0 diverged"), FatalError("chunk 1 is broken"));
  try {
    std::rethrow_exception(mixed);
  } catch (const AggregateError& e) {
    CHECK_FALSE(e.recoverable());
    CHECK(contains(e.what(), "chunk 1 is broken"));
  } catch (...) {
    FAIL("expected an AggregateError");
  }
  neml2::detail::ModelAccess::before_chunk(m, {});
  test::check_forward(m, ref, "b33");
}

TEST_CASE("rows that did not converge: one error over the whole batch, one mask") {
  const test::Reference ref("rates");
  const auto in = ref.group("b33/in");
  // Chunks 1 and 3 fail in their last row, with residuals 0.5 and 2.
  const auto inject = [](auto& model) {
    neml2::detail::ModelAccess::before_chunk(model, [](const ChunkEvent& e) {
      if (e.index != 1 && e.index != 3)
        return;
      auto converged = at::ones({e.rows}, at::kBool);
      converged[e.rows - 1] = false;
      throw ConvergenceError("rows failed", converged, e.index == 1 ? 0.5 : 2.0, {});
    });
  };
  auto pool = load<Lanes>("rates", "eq");
  auto sync = load("rates", "eq", SyncChunking{.batch_size = 3});
  inject(pool);
  inject(sync);
  // The last row of chunks 1 and 3 fails; the rest of those chunks has no results.
  const auto failing = [](const std::vector<ChunkEvent>& plan) {
    std::vector<std::int64_t> failed{plan[1].first + plan[1].rows - 1,
                                     plan[3].first + plan[3].rows - 1};
    return std::pair{failed, plan[1].rows + plan[3].rows};
  };
  std::vector<ChunkEvent> sync_plan;
  for (std::int64_t first = 0; first < 33; first += 3)
    sync_plan.push_back(
        {sync_plan.size(), 0, "cpu", first, std::min<std::int64_t>(3, 33 - first), 0});
  for (auto [expected, forward] :
       {std::pair{failing(lanes_plan(33)), std::function([&] { return pool.forward(in); })},
        std::pair{failing(sync_plan), std::function([&] { return sync.forward(in); })}}) {
    const auto [model_failed, rows_without_results] = expected;
    try {
      (void)forward();
      FAIL("nothing thrown");
    } catch (const ConvergenceError& e) {
      REQUIRE(e.per_row());
      CHECK(e.failed_rows() == 2);
      CHECK(e.worst_residual() == 2.0); // the larger of the two chunks'
      REQUIRE(e.converged_mask().sizes() == c10::IntArrayRef{33});
      const auto failed = e.converged_mask().logical_not().nonzero().flatten();
      CHECK(std::vector<std::int64_t>(failed.data_ptr<std::int64_t>(),
                                      failed.data_ptr<std::int64_t>() + failed.numel()) ==
            model_failed);
      // The hook fails before the graph runs, so a failing chunk has no results at all:
      // its rows are NaN; every other row is right.
      const auto failed_mask = e.converged_mask().logical_not();
      for (const auto& [name, reference] : ref.group("b33/out")) {
        const auto& actual = e.outputs().at(name);
        const auto computed = actual.isnan().logical_not();
        CHECK(computed.sum().item<std::int64_t>() == 33 - rows_without_results);
        test::check_close(actual.index({computed}), reference.index({computed}),
                          "computed rows of " + name);
        CHECK(actual.index({failed_mask}).isnan().all().item<bool>());
      }
    }
  }
}

TEST_CASE("a policy's bad answers are errors that say what it did, never a hang") {
  struct BadIndex : Lanes {
    std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t>, std::int64_t,
                                          state_type&) const {
      return ChunkChoice{5, 1};
    }
  };
  struct NoRows : Lanes {
    std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t>, std::int64_t,
                                          state_type&) const {
      return ChunkChoice{0, 0};
    }
  };
  struct TooMany : Lanes {
    std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t>, std::int64_t remaining,
                                          state_type&) const {
      return ChunkChoice{1, remaining + 1};
    }
  };
  struct NeverChooses : Lanes {
    std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t>, std::int64_t,
                                          state_type&) const {
      return std::nullopt;
    }
  };
  struct ThrowsOnCompletion : Lanes {
    void on_completed(std::size_t, std::int64_t, double, state_type&) const {
      throw std::logic_error("bookkeeping bug");
    }
  };
  struct ThrowsInNextChunk : Lanes {
    std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t>, std::int64_t,
                                          state_type&) const {
      throw std::logic_error("planning bug");
    }
  };
  const test::Reference ref("rates");
  const auto in = ref.group("b7/in");
  CHECK(contains(
      test::fatal_message([&] { return load<ThrowsInNextChunk>("rates", "eq").forward(in); }),
      "the dispatch policy's next_chunk() or on_dispatched(): planning bug"));
  CHECK(contains(test::fatal_message([&] { return load<BadIndex>("rates", "eq").forward(in); }),
                 "chose device index 5, but the policy lists 2 device(s) {cpu, cpu}"));
  CHECK(contains(test::fatal_message([&] { return load<NoRows>("rates", "eq").forward(in); }),
                 "chose 0 rows for cpu with 7 rows remaining"));
  CHECK(contains(test::fatal_message([&] { return load<TooMany>("rates", "eq").forward(in); }),
                 "chose 8 rows for cpu with 7 rows remaining"));
  CHECK(contains(test::fatal_message([&] { return load<NeverChooses>("rates", "eq").forward(in); }),
                 "gave no chunk while every device was idle (7 of 7 rows left)"));
  // Both lanes' chunks were in flight: each reports the policy's error.
  const auto throws = load<ThrowsOnCompletion>("rates", "eq");
  for (int call = 0; call < 2; ++call) {
    try {
      (void)throws.forward(in);
      FAIL("nothing thrown");
    } catch (const Exception& e) {
      CHECK_FALSE(e.recoverable());
      CHECK(contains(e.what(), "after a chunk completed: bookkeeping bug"));
    }
  }
}

TEST_CASE("parameters: one master map reaches every lane by the next call") {
  const auto stub = test::stub("elasticity_params", "elasticity");
  const test::Reference ref("elasticity_params");
  const auto in = ref.group("b33/in");
  auto m = load_model(stub, "elasticity", Lanes{});
  Session plain(std::make_shared<Artifact>(read_artifact(stub.parent_path() / "elasticity")),
                "cpu");
  auto& E = m.named_parameters().at("elasticity.E"); // a reference kept across calls
  (void)m.forward(in);
  E.fill_(2 * E.item<double>());
  plain.set_parameter("elasticity.E", E.clone());
  const auto changed = plain.forward(in);
  CHECK_FALSE(test::identical(changed, ref.group("b33/out")));
  CHECK(test::identical(m.forward(in), changed));
  m.set_parameter("elasticity.nu", at::scalar_tensor(0.1, at::kDouble));
  plain.set_parameter("elasticity.nu", at::scalar_tensor(0.1, at::kDouble));
  CHECK(test::identical(m.forward(in), plain.forward(in)));
  // Batched (one value per row): cut with the batch over both lanes.
  test::check_batched_parameter(m, ref);
}

TEST_CASE("eight host threads call one pooled model at once, each gets its own results") {
  const test::Reference ref("rates");
  for (bool greedy : {false, true}) {
    CAPTURE(greedy);
    const auto lanes = load<Lanes>("rates", "eq");
    const auto gpc =
        load("rates", "eq",
             GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {4}, .capacities = {8}});
    const auto whole = load("rates", "eq", SyncChunking{});
    std::vector<TensorMap> inputs, expected, actual(8);
    for (int t = 0; t < 8; ++t) {
      TensorMap in;
      for (const auto& [name, x] : ref.group("b33/in"))
        in[name] = x * (1.0 + 0.25 * t);
      inputs.push_back(in);
      expected.push_back(whole.forward(in));
    }
    std::vector<std::thread> threads;
    std::atomic<int> mismatches{0};
    for (int t = 0; t < 8; ++t)
      threads.emplace_back([&, t] {
        for (int i = 0; i < 25; ++i) {
          actual[t] = greedy ? gpc.forward(inputs[t]) : lanes.forward(inputs[t]);
          if (!test::identical(actual[t], expected[t]))
            ++mismatches;
        }
      });
    for (auto& t : threads)
      t.join();
    CHECK(mismatches.load() == 0);
  }
}

TEST_CASE("pools start their threads with the model and join them when it goes") {
  const auto before = neml2::detail::WorkerPool::live_threads();
  for (int i = 0; i < 10; ++i) {
    const auto m = load<Lanes>("rates", "eq");
    // one worker: the first of its two CPU lanes is served by the calling thread
    CHECK(neml2::detail::WorkerPool::live_threads() == before + 1);
    (void)m.forward(test::Reference("rates").group("b33/in"));
  }
  CHECK(neml2::detail::WorkerPool::live_threads() == before);
}

TEST_CASE("a synchronous policy starts no thread, and every chunk runs where it says") {
  const test::Reference ref("rates");
  const auto pool_threads = neml2::detail::WorkerPool::live_threads();
  auto m = load("rates", "eq", SyncChunking{.batch_size = 7});
  (void)m.forward(ref.group("b33/in")); // torch's own threads start on first use
  const auto threads = threads_in_process();
  Recorder chunks;
  m.set_observer(chunks.observer());
  for (int i = 0; i < 20; ++i)
    test::check_forward(m, ref, "b33");
  CHECK(threads_in_process() == threads);
  CHECK(neml2::detail::WorkerPool::live_threads() == pool_threads);
  auto events = chunks.in_order();
  REQUIRE(events.size() == 20 * 5);
  test::check_forward(m, ref, "b33");
  events = chunks.in_order();
  REQUIRE(events.size() == 5);
  for (std::size_t i = 0; i < 5; ++i) {
    CHECK(events[i].index == i);
    CHECK(events[i].first == 7 * static_cast<std::int64_t>(i));
    CHECK(events[i].rows == (i < 4 ? 7 : 5));
  }
  // The whole batch at once: one chunk.
  auto whole = load("rates", "eq", SyncChunking{});
  whole.set_observer(chunks.observer());
  test::check_forward(whole, ref, "b33");
  events = chunks.in_order();
  REQUIRE(events.size() == 1);
  CHECK(events[0].rows == 33);
}

TEST_CASE("every listed device gets a session; a compute device not listed is refused") {
  struct ListsCuda : SyncChunking {
    std::array<Device, 2> devices() const { return {"cpu", "cuda:0"}; }
  };
  // The CPU computes, but the cuda session is still loaded (and this artifact has none).
  CHECK(contains(test::fatal_message([] { return load<ListsCuda>("rates", "eq"); }),
                 "--device cuda"));
  struct Unlisted : SyncChunking {
    std::array<Device, 1> devices() const { return {"cpu"}; }
    Device compute_device() const { return "cuda:1"; }
  };
  CHECK(contains(test::fatal_message([] { return load<Unlisted>("rates", "eq"); }),
                 "compute_device() is cuda:1, which its devices() does not list ({cpu})"));
}

TEST_CASE("memory of one call: the outputs, plus one chunk's results while it is copied") {
  static test::CountingAllocator counting; // outlives every tensor it allocates
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  // Nothing kept across calls (neml2/memory.hpp): each call's own memory, as allocated.
  const auto limit = result_memory_limit();
  set_result_memory_limit(0);
  const auto stub = test::stub("rates", "eq");
  const auto in = test::zeros_inputs(load_model(stub, "eq"), 1 << 14);
  // three f64 rates; a whole batch runs in pieces of an eighth of it
  const std::int64_t outputs = 3 * (1 << 14) * 8, chunk = 3 * 1024 * 8, piece = 8 * chunk;
  const auto measure = [&](const auto& model) {
    (void)model.forward(in); // warm-up
    const auto before = counting.reset();
    const auto out = model.forward(in);
    return std::pair{counting.live - before, counting.peak - before};
  };
  const auto [whole_kept, whole_peak] =
      measure(load_model(stub, "eq", SyncChunking{.cpu_lanes = 1}));
  CHECK(whole_kept == outputs);
  CHECK(whole_peak == outputs + piece);
  const auto [chunked_kept, chunked_peak] =
      measure(load_model(stub, "eq", SyncChunking{.batch_size = 1024, .cpu_lanes = 1}));
  CHECK(chunked_kept == outputs);
  CHECK(chunked_peak == outputs + chunk);
  const auto [pool_kept, pool_peak] = measure(load_model(
      stub, "eq",
      GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {1024}, .cpu_lanes = 1}));
  CHECK(pool_kept == outputs);
  CHECK(pool_peak == outputs + chunk);
  const auto [direct_kept, direct_peak] = measure(load_model(
      stub, "eq",
      GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {1 << 14}, .cpu_lanes = 1}));
  CHECK(direct_kept == outputs);
  CHECK(direct_peak == outputs + piece); // one chunk in place, in pieces as a whole batch
  // Into the caller's tensors: nothing kept; chunked, one chunk's results at a time.
  TensorMap into;
  for (const auto& [name, t] : load_model(stub, "eq").forward(in))
    into[name] = at::empty_like(t);
  const auto measure_into = [&](const auto& model) {
    model.forward_into(in, into);
    const auto before = counting.reset();
    model.forward_into(in, into);
    return std::pair{counting.live - before, counting.peak - before};
  };
  const auto [chunked_into_kept, chunked_into_peak] =
      measure_into(load_model(stub, "eq", SyncChunking{.batch_size = 1024, .cpu_lanes = 1}));
  CHECK(chunked_into_kept == 0);
  CHECK(chunked_into_peak == chunk);
  const auto [pool_into_kept, pool_into_peak] = measure_into(load_model(
      stub, "eq",
      GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {1024}, .cpu_lanes = 1}));
  CHECK(pool_into_kept == 0);
  CHECK(pool_into_peak == chunk);
  // With result memory kept, a call after the first takes the outputs the one before gave
  // back: nothing new kept, one chunk's results at a time.
  set_result_memory_limit(limit);
  const auto [reused_kept, reused_peak] =
      measure(load_model(stub, "eq", SyncChunking{.batch_size = 1024, .cpu_lanes = 1}));
  CHECK(reused_kept == 0);
  CHECK(reused_peak == chunk);
  c10::SetCPUAllocator(counting.base, /*priority=*/101);
}

TEST_CASE("implicit models through the pool: the same rows, one mask over the batch") {
  const auto stub = [](const char* artifact) { return test::stub(artifact, "model"); };
  // Every implicit model, every row as the whole-batch session solves it.
  for (const auto* artifact : {"scalar_backward_euler", "j2_radial_return",
                               "perzyna_viscoplasticity", "chaboche_viscoplasticity"}) {
    CAPTURE(artifact);
    const test::Reference ref(artifact);
    const auto in = ref.group("s2/in");
    const auto whole = load_model(stub(artifact), "model");
    const auto expected = whole.forward(in);
    const auto [values, J] = whole.jacobian(in);
    const auto lanes = load_model(stub(artifact), "model", Lanes{});
    const auto greedy = load_model(stub(artifact), "model",
                                   GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {3}});
    test::check_close(lanes.forward(in), expected, "lanes", 1e-13);
    test::check_close(greedy.forward(in), expected, "greedy", 1e-13);
    // Blocks through the IFT solve: Chaboche's differ from the whole batch's by up to
    // 2.3e-11 relative (measured): the solve's rounding depends on the rows it is given.
    const auto [lanes_values, lanes_J] = lanes.jacobian(in);
    test::check_close(lanes_values, values, "lanes jacobian values", 1e-13);
    for (const auto& [o, row] : J)
      for (const auto& [i, block] : row)
        test::check_close(lanes_J.at(o).at(i), block, "lanes d" + o + "/d" + i, 1e-10);
  }

  // x' = a - x^2: no real root for a = -50 within the iteration cap, NaN for a = NaN.
  const auto nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> a;
  for (int k = 0; k < 4; ++k)
    for (double v : {1.0, -50.0, 2.0, nan, 0.3})
      a.push_back(v);
  const auto in = test::scalar_inputs(a);
  const auto failure = [&](const auto& model) {
    try {
      (void)model.forward(in);
    } catch (const ConvergenceError& e) {
      return e;
    }
    FAIL("expected a ConvergenceError");
    throw std::logic_error("unreachable");
  };
  const auto whole = failure(load_model(stub("scalar_backward_euler"), "model"));
  REQUIRE(whole.per_row());
  CHECK(whole.failed_rows() == 8);
  for (const auto& e : {failure(load_model(stub("scalar_backward_euler"), "model", Lanes{})),
                        failure(load_model(stub("scalar_backward_euler"), "model",
                                           SyncChunking{.batch_size = 3}))}) {
    REQUIRE(e.per_row());
    CHECK(at::equal(e.converged_mask(), whole.converged_mask()));
    CHECK(e.failed_rows() == 8);
    CHECK(std::isnan(e.worst_residual()));
    const auto converged = whole.converged_mask();
    test::check_close(e.outputs().at("x").index({converged}),
                      whole.outputs().at("x").index({converged}), "converged rows", 1e-13);
    CHECK(e.outputs().at("x").index({converged.logical_not()}).isnan().all().item<bool>());
  }
}

TEST_CASE("callbacks that call back: a synchronous model's observer may call its model; an "
          "asynchronous model's is refused by rule, never a deadlock") {
  const test::Reference ref("elasticity");
  const auto in = ref.group("b33/in");
  const auto expected = ref.group("b33/out");
  // Synchronous: the observer runs on the calling thread, under no lock of ours.
  auto sync = load("elasticity", "elasticity", SyncChunking{.batch_size = 10});
  int nested = 0;
  sync.set_observer([&](const ChunkEvent&) {
    if (nested++ == 0) // one nested call, itself observed
      test::check_close(sync.forward(ref.group("b7/in")), ref.group("b7/out"), "nested");
  });
  test::check_close(sync.forward(in), expected, "outer");
  CHECK(nested > 4);
  // Asynchronous: the observer and the policy's hooks run under the model's lock.
  auto pool = load<Lanes>("elasticity", "elasticity");
  pool.set_observer([&](const ChunkEvent&) { (void)pool.forward(ref.group("b7/in")); });
  // Each chunk's observer fails so: one error, or an AggregateError of several.
  const auto message = [](auto&& call) {
    try {
      (void)call();
    } catch (const Exception& e) {
      return std::string(e.what());
    }
    return std::string("nothing thrown");
  };
  CHECK(contains(message([&] { return pool.forward(in); }),
                 "called from a chunk observer or a policy hook of an asynchronous model"));
  struct CallsBack : Lanes {
    const AnyDispatchedModel* model = nullptr;
    TensorMap inputs;
    std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t> busy, std::int64_t left,
                                          state_type& s) const {
      if (model)
        (void)model->forward(inputs);
      return Lanes::next_chunk(busy, left, s);
    }
  };
  auto other = load<CallsBack>("elasticity", "elasticity");
  CallsBack calls_other;
  calls_other.model = &other;
  calls_other.inputs = ref.group("b7/in");
  auto hooked = load("elasticity", "elasticity", calls_other);
  CHECK(contains(message([&] { return hooked.forward(in); }),
                 "a model of an asynchronous policy was called from a chunk observer or a "
                 "policy hook"));
  // Both still work.
  pool.set_observer({});
  test::check_close(pool.forward(in), expected, "after");
  test::check_close(other.forward(in), expected, "the other model");
}

TEST_CASE("an interrupt check stops a call between chunks, under either kind of policy") {
  const test::Reference ref("rates");
  SUBCASE("SyncChunking") {
    auto m = load("rates", "eq", SyncChunking{.batch_size = 3, .cpu_lanes = 1});
    check_interrupts(m, ref);
  }
  SUBCASE("GreedyPriorityCapacity") {
    auto m = load("rates", "eq",
                  GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {3}, .cpu_lanes = 1});
    check_interrupts(m, ref);
  }
}

TEST_CASE("an interrupt check stops a whole-batch call between its pieces") {
  auto m = load("elasticity", "elasticity",
                SyncChunking{.cpu_lanes = 1}); // (tests/test_cpu_lanes.cpp: on lanes)
  const std::int64_t batch = 300000;
  const TensorMap in{{"strain", at::rand({batch, 6}, at::kDouble) * 1e-3}};
  const auto expected = m.forward(in).at("stress");
  int asked = 0;
  m.set_interrupt_check([&] {
    ++asked;
    throw FatalError("interrupted by the host");
  });
  auto out = at::full_like(expected, std::numeric_limits<double>::quiet_NaN());
  CHECK(contains(test::fatal_message([&] {
                   m.forward_into(in, {{"stress", out}});
                 }),
                 "interrupted by the host"));
  CHECK(asked == 1); // before the second piece
  const auto written = out.isnan().any(1).logical_not().sum().item<std::int64_t>();
  CHECK(written > 0);
  CHECK(written < batch);
  CHECK(at::equal(out.narrow(0, 0, written), expected.narrow(0, 0, written)));
  m.set_interrupt_check({});
  m.forward_into(in, {{"stress", out}});
  CHECK(at::equal(out, expected));
}

TEST_CASE("an asynchronous call waiting for its chunks asks its interrupt check meanwhile") {
  const test::Reference ref("rates");
  auto m = load<WorkerLane>("rates", "eq");
  std::atomic<int> asked{0};
  std::atomic<bool> stopped{false};
  std::vector<std::size_t> started; // by the worker; read once the call returned
  neml2::detail::ModelAccess::before_chunk(m, [&](const ChunkEvent& e) {
    started.push_back(e.index);
    // Chunk 1 runs only once the check stopped the call (bounded, should it never).
    for (int i = 0; e.index == 1 && !stopped && i < 10000; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  m.set_interrupt_check([&] {
    if (++asked == 2) {
      stopped = true;
      throw FatalError("interrupted by the host");
    }
  });
  CHECK(contains(test::fatal_message([&] { return m.forward(ref.group("b33/in")); }),
                 "interrupted by the host"));
  CHECK(stopped.load());
  CHECK(asked.load() == 2); // not asked again once stopped
  CHECK(started.size() >= 2);
  CHECK(started.size() < 11); // 11 chunks uninterrupted
  m.set_interrupt_check({});
  neml2::detail::ModelAccess::before_chunk(m, {});
  test::check_all_batches(m, ref, true, false);
}

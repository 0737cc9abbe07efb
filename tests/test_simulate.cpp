// The node simulator against analytic makespans, through the real policies.

#include <limits>

#include <nlohmann/json.hpp>

#include <neml2/simulate.hpp>

#include "reference.hpp"
#include "throughput_balancing.hpp"

using namespace neml2;

namespace {
SimulatedDevice constant(double rate, double overhead = 0, double transfer = 0) {
  return {ThroughputCurve::constant(rate), overhead, transfer};
}

// The rows each device took over a simulation.
std::vector<std::int64_t> rows_per_device(const Simulation& sim) {
  std::vector<std::int64_t> rows(sim.busy.size(), 0);
  for (const auto& c : sim.timeline)
    rows[c.device] += c.rows;
  return rows;
}

// Records what the simulator tells a policy, and chooses like GreedyPriorityCapacity.
struct Recording {
  using dispatch_mode = asynchronous;
  struct Completion {
    std::size_t device;
    std::int64_t rows;
    double seconds;
  };
  struct state_type {
    std::int64_t in_flight = 0;
  };
  GreedyPriorityCapacity inner;
  std::vector<Completion>* completed = nullptr;
  std::vector<Device> devices() const { return inner.devices; }
  std::size_t chunks_in_flight(std::size_t d) const { return inner.chunks_in_flight(d); }
  std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t> in_flight,
                                        std::int64_t remaining, state_type&) const {
    no_state none;
    return inner.next_chunk(in_flight, remaining, none);
  }
  void on_dispatched(std::size_t, std::int64_t rows, state_type& s) const { s.in_flight += rows; }
  void on_completed(std::size_t d, std::int64_t rows, double seconds, state_type& s) const {
    s.in_flight -= rows;
    REQUIRE(s.in_flight >= 0); // the same state, dispatched before completed
    completed->push_back({d, rows, seconds});
  }
};
} // namespace

TEST_CASE("two constant-throughput devices finish in the batch over the sum of their rates") {
  // 100 and 300 rows/s, chunks of one second each: 4000 rows take 10 rounds of 400.
  const GreedyPriorityCapacity pool{.devices = {"cpu", "cuda:0"}, .batch_sizes = {100, 300}};
  const std::vector<SimulatedDevice> node = {constant(100), constant(300)};
  const auto sim = simulate(pool, node, 4000);
  CHECK(sim.makespan == doctest::Approx(10).epsilon(1e-12));
  CHECK(sim.ideal == doctest::Approx(10).epsilon(1e-12));
  CHECK(sim.efficiency() == doctest::Approx(1));
  CHECK(sim.busy == std::vector<double>{10, 10});
  CHECK(sim.idle[0] == doctest::Approx(0));
  const auto on = [&](std::size_t d) {
    return std::count_if(sim.timeline.begin(), sim.timeline.end(),
                         [&](const SimulatedChunk& c) { return c.device == d; });
  };
  CHECK(on(0) == 10);
  CHECK(on(1) == 10);
  // Every row exactly once, in order of dispatch.
  std::int64_t next = 0;
  for (const auto& c : sim.timeline) {
    CHECK(c.first == next);
    next += c.rows;
  }
  CHECK(next == 4000);
}

TEST_CASE("one device with a per-chunk overhead: ceil(B / c) o + B / T") {
  // T = 1000 rows/s, o = 10 ms, chunks of 300: 1000 rows are 4 chunks.
  const std::vector<SimulatedDevice> cpu = {constant(1000, 0.01)};
  const auto expected = 4 * 0.01 + 1000.0 / 1000;
  CHECK(simulate(SyncChunking{.device = "cpu", .batch_size = 300}, cpu, 1000).makespan ==
        doctest::Approx(expected).epsilon(1e-12));
  const auto greedy =
      simulate(GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {300}}, cpu, 1000);
  CHECK(greedy.makespan == doctest::Approx(expected).epsilon(1e-12));
  CHECK(greedy.timeline.back().rows == 100); // the last chunk takes what is left
  CHECK(simulate(SyncChunking{.device = "cpu"}, cpu, 1000).makespan ==
        doctest::Approx(0.01 + 1).epsilon(1e-12)); // 0: one call
  // Over three calls, three times as long.
  CHECK(simulate(SyncChunking{.device = "cpu", .batch_size = 300}, cpu, 1000, 3).makespan ==
        doctest::Approx(3 * expected).epsilon(1e-12));
}

TEST_CASE("transfers: serial with one chunk in flight, hidden behind compute with two") {
  // 1e-4 s per row copied: one lane copies, then computes, chunk after chunk; two lanes
  // copy the next chunk while the last computes, so only the first copy shows.
  const std::vector<SimulatedDevice> gpu = {constant(1000, 0.01, 1e-4)};
  const auto one =
      simulate(GreedyPriorityCapacity{.devices = {"cuda:0"}, .batch_sizes = {300}}, gpu, 1000);
  CHECK(one.makespan == doctest::Approx(1000 * 1e-4 + 4 * 0.01 + 1).epsilon(1e-12));
  const auto two = simulate(
      GreedyPriorityCapacity{.devices = {"cuda:0"}, .batch_sizes = {300}, .capacities = {600}}, gpu,
      1000);
  CHECK(two.makespan == doctest::Approx(300 * 1e-4 + 4 * 0.01 + 1).epsilon(1e-12));
  // The CPU has no lanes to overlap on, as in DispatchedModel.
  const std::vector<SimulatedDevice> cpu = {constant(1000, 0.01, 1e-4)};
  CHECK(simulate(
            GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {300}, .capacities = {600}},
            cpu, 1000)
            .makespan == doctest::Approx(one.makespan).epsilon(1e-12));
}

TEST_CASE("CPU lanes: a CPU-only batch on 2 lanes takes half the time of 1") {
  // One lane computes 100 rows/s; 1000 rows.
  const std::vector<SimulatedDevice> cpu = {constant(100)};
  const auto makespan = [&](const auto& policy) { return simulate(policy, cpu, 1000).makespan; };
  // SyncChunking's chunks of 100: 1 at a time on one lane, 2 at once on two.
  CHECK(makespan(SyncChunking{.batch_size = 100, .cpu_lanes = 1}) == doctest::Approx(10));
  CHECK(makespan(SyncChunking{.batch_size = 100, .cpu_lanes = 2}) == doctest::Approx(5));
  // A whole batch, and GreedyPriorityCapacity's chunks, cut over the lanes.
  CHECK(makespan(SyncChunking{.cpu_lanes = 1}) == doctest::Approx(10));
  CHECK(makespan(SyncChunking{.cpu_lanes = 2}) == doctest::Approx(5));
  CHECK(makespan(GreedyPriorityCapacity{
            .devices = {"cpu"}, .batch_sizes = {100}, .cpu_lanes = 1}) == doctest::Approx(10));
  CHECK(makespan(GreedyPriorityCapacity{
            .devices = {"cpu"}, .batch_sizes = {100}, .cpu_lanes = 2}) == doctest::Approx(5));
  // cpu_lanes 0: the simulated CPU's intra-op threads (1 unless given).
  CHECK(makespan(SyncChunking{.batch_size = 100}) == doctest::Approx(10));
  std::vector<SimulatedDevice> two_threads = {constant(100)};
  two_threads[0].intra_op_threads = 2;
  const auto sim = simulate(SyncChunking{.batch_size = 100}, two_threads, 1000);
  CHECK(sim.makespan == doctest::Approx(5));
  CHECK(sim.lanes == std::vector<std::size_t>{2});
  // Two chunks at a time, each on its own lane from the call's start.
  REQUIRE(sim.timeline.size() == 10);
  for (std::size_t i = 0; i < 10; ++i) {
    CAPTURE(i);
    CHECK(sim.timeline[i].dispatched == 0);
    CHECK(sim.timeline[i].compute_start == doctest::Approx(static_cast<double>(i / 2)));
    CHECK(sim.timeline[i].end == doctest::Approx(static_cast<double>(i / 2 + 1)));
  }
  // The ideal counts every lane; busy is averaged over them.
  CHECK(sim.ideal == doctest::Approx(5));
  CHECK(sim.efficiency() == doctest::Approx(1));
  CHECK(sim.busy[0] == doctest::Approx(5));
  CHECK(sim.idle[0] == doctest::Approx(0));
  // An explicit cpu_lanes wins over the threads.
  CHECK(simulate(SyncChunking{.batch_size = 100, .cpu_lanes = 1}, two_threads, 1000).makespan ==
        doctest::Approx(10));
  // A chunk cut over L lanes computes ceil(B / L) rows on each: 101 rows, 51 a lane.
  CHECK(simulate(GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {101}, .cpu_lanes = 2},
                 cpu, 101)
            .makespan == doctest::Approx(0.51));
}

TEST_CASE("CPU lanes: a cut chunk runs at the curve's rate for one lane's rows") {
  // Twice as fast per row at 100 rows as at 50: a chunk of 100 cut over 2 lanes (50 each)
  // takes as long as on one lane, and chunks of 100, one per lane, take half.
  const std::vector<SimulatedDevice> cpu = {{ThroughputCurve({{50, 50}, {100, 100}})}};
  const auto cut = [&](std::int64_t lanes) {
    return simulate(
               GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {100}, .cpu_lanes = lanes},
               cpu, 1000)
        .makespan;
  };
  CHECK(cut(1) == doctest::Approx(10));
  CHECK(cut(2) == doctest::Approx(10));
  CHECK(simulate(SyncChunking{.batch_size = 100, .cpu_lanes = 2}, cpu, 1000).makespan ==
        doctest::Approx(5));
}

TEST_CASE("CPU lanes: a hybrid batch's CPU share grows with the CPU's lanes, the GPU's chunks "
          "do not change") {
  // One CPU lane and the GPU: 100 and 300 rows/s, chunks of 100 and 300 (one second each):
  // the CPU takes 1/4 of 4000 rows in 10 s. On 2 lanes a CPU chunk takes 0.5 s: it takes 200
  // rows a second to the GPU's 300, 2/5 of the rows, in 8 s.
  const std::vector<SimulatedDevice> node = {constant(100), constant(300)};
  const auto pool = [](std::int64_t lanes) {
    return GreedyPriorityCapacity{
        .devices = {"cpu", "cuda:0"}, .batch_sizes = {100, 300}, .cpu_lanes = lanes};
  };
  const auto one = simulate(pool(1), node, 4000);
  const auto two = simulate(pool(2), node, 4000);
  CHECK(one.makespan == doctest::Approx(10));
  CHECK(rows_per_device(one) == std::vector<std::int64_t>{1000, 3000});
  CHECK(two.makespan == doctest::Approx(8));
  CHECK(rows_per_device(two) == std::vector<std::int64_t>{1600, 2400});
  CHECK(two.lanes == std::vector<std::size_t>{2, 1});
  CHECK(two.ideal == doctest::Approx(4000.0 / 500));
  for (const auto& c : two.timeline)
    CHECK(c.end - c.compute_start == doctest::Approx(c.device == 0 ? 0.5 : 1.0));
}

TEST_CASE("CPU lanes: a tune file's CPU curve over its lanes is one lane's; bad lanes refused") {
  DeviceCurve tuned{.device = "cpu"};
  tuned.points = {{64, 10, 9, 11, 3}, {256, 30, 29, 31, 3}};
  const auto lane = ThroughputCurve::from(tuned, 2);
  CHECK(lane.rows_per_second(64) == doctest::Approx(5));
  CHECK(lane.rows_per_second(256) == doctest::Approx(15));
  CHECK_THROWS_WITH_AS((void)ThroughputCurve::from(tuned, 0),
                       doctest::Contains("ThroughputCurve::from(cpu): lanes is 0"), FatalError);
  std::vector<SimulatedDevice> none = {constant(1)};
  none[0].intra_op_threads = 0;
  CHECK_THROWS_WITH_AS((void)simulate(SyncChunking{}, none, 10),
                       doctest::Contains("simulate(): simulated device 0 (cpu) has "
                                         "intra_op_threads 0, the lanes a policy's cpu_lanes of 0 "
                                         "runs on; give 1 to 1024"),
                       FatalError);
  // Not asked when the policy gives its lanes, nor off the CPU.
  CHECK(simulate(SyncChunking{.cpu_lanes = 1}, none, 10).makespan == doctest::Approx(10));
  CHECK(simulate(SyncChunking{.device = "cuda:0"}, none, 10).makespan == doctest::Approx(10));
}

TEST_CASE("idle time: a device that runs out of chunks waits for the others") {
  const GreedyPriorityCapacity pool{.devices = {"cpu", "cuda:0"}, .batch_sizes = {100, 100}};
  const std::vector<SimulatedDevice> node = {constant(100), constant(100)};
  const auto sim = simulate(pool, node, 300); // cpu: 2 chunks, cuda: 1 (ties to the first)
  CHECK(sim.makespan == doctest::Approx(2));
  CHECK(sim.idle[0] == doctest::Approx(0));
  CHECK(sim.idle[1] == doctest::Approx(1));
  CHECK(sim.ideal == doctest::Approx(1.5));
  CHECK(sim.efficiency() == doctest::Approx(0.75));
}

TEST_CASE("the policy is told what DispatchedModel tells it: rows dispatched, chunk seconds") {
  std::vector<Recording::Completion> completed;
  const Recording policy{{.devices = {"cpu", "cuda:0"}, .batch_sizes = {100, 300}}, &completed};
  const std::vector<SimulatedDevice> node = {constant(100, 0.5), constant(300, 0, 1e-3)};
  const auto sim = simulate(policy, node, 1000);
  // cpu 100 rows (1.5 s), cuda 300 (0.3 s copy + 1 s); cuda again at 1.3 s, cpu at 1.5 s,
  // cuda takes the last 200 at 2.6 s.
  REQUIRE(sim.timeline.size() == 5);
  CHECK(sim.timeline[4].rows == 200);
  CHECK(sim.makespan == doctest::Approx(2.6 + 0.2 + 200 / 300.0));
  REQUIRE(completed.size() == 5);
  // In completion order, each with its chunk's own seconds (copy and compute).
  const std::vector<std::size_t> order = {1, 0, 2, 3, 4}; // by end: 1.3, 1.5, 2.6, 3.0, 3.47
  for (std::size_t k = 0; k < 5; ++k) {
    const auto& c = sim.timeline[order[k]];
    CHECK(completed[k].device == c.device);
    CHECK(completed[k].rows == c.rows);
    const auto compute = c.device == 0 ? 0.5 + c.rows / 100.0 : c.rows / 300.0;
    const auto copy = c.device == 0 ? 0 : c.rows * 1e-3;
    CHECK(completed[k].seconds == doctest::Approx(copy + compute).epsilon(1e-12));
  }
}

TEST_CASE("curves: log-log interpolation between sizes, flat beyond, checked") {
  const ThroughputCurve c({{100, 1e3}, {10000, 1e5}});
  CHECK(c.rows_per_second(1000) == doctest::Approx(1e4).epsilon(1e-12)); // halfway in log-log
  CHECK(c.rows_per_second(100) == doctest::Approx(1e3));
  CHECK(c.rows_per_second(10) == doctest::Approx(1e3));
  CHECK(c.rows_per_second(1 << 20) == doctest::Approx(1e5));
  CHECK(c.peak() == 1e5);
  CHECK_THROWS_WITH_AS(ThroughputCurve({{100, 1}, {50, 2}}),
                       doctest::Contains("give the points by increasing rows"), FatalError);
  CHECK_THROWS_WITH_AS(ThroughputCurve({{100, 0}}), doctest::Contains("finite and > 0"),
                       FatalError);
  DeviceCurve tuned{.device = "cpu"};
  tuned.points = {{64, 10, 9, 11, 3}, {128, 0, 0, 0, 0, true}, {256, 30, 29, 31, 3}};
  const auto from = ThroughputCurve::from(tuned);
  CHECK(from.points().size() == 2); // the out-of-memory point is left out
  CHECK(from.rows_per_second(128) == doctest::Approx(std::sqrt(10.0 * 30.0)));
}

TEST_CASE("an adaptive policy on a simulated 1 CPU + 8 GPU node: deterministic, and it learns") {
  // The example ThroughputBalancing learns each device's rows per second in the first call
  // (chunks of 4096) and splits the later ones by them.
  ThroughputBalancing policy;
  std::vector<SimulatedDevice> node = {constant(1e6, 1e-5)};
  policy.devices = {"cpu"};
  for (int g = 0; g < 8; ++g) {
    policy.devices.push_back("cuda:" + std::to_string(g));
    node.push_back(constant(2e7, 2e-5, 1e-9));
  }
  const auto a = simulate(policy, node, 1 << 22, 3);
  const auto b = simulate(policy, node, 1 << 22, 3);
  REQUIRE(a.timeline.size() == b.timeline.size());
  for (std::size_t i = 0; i < a.timeline.size(); ++i) {
    CHECK(a.timeline[i].device == b.timeline[i].device);
    CHECK(a.timeline[i].rows == b.timeline[i].rows);
    CHECK(a.timeline[i].end == b.timeline[i].end);
  }
  CHECK(a.makespan == b.makespan);
  const auto first = a.call_ends[0];
  const auto last = a.call_ends[2] - a.call_ends[1];
  MESSAGE("first call ", first, " s, last ", last, " s, ideal per call ", a.ideal / 3, " s");
  CHECK(last < first);
  CHECK(last < 1.1 * a.ideal / 3);
  // Its per-call shares follow the speeds: the CPU takes about 1 / 161 of the last call.
  std::int64_t cpu_rows = 0;
  for (const auto& c : a.timeline)
    if (c.call == 2 && c.device == 0)
      cpu_rows += c.rows;
  CHECK(static_cast<double>(cpu_rows) / (1 << 22) < 3.0 / 161);
}

TEST_CASE("simulate() refuses what DispatchedModel refuses") {
  struct Waits {
    using dispatch_mode = asynchronous;
    std::vector<Device> devices = {"cpu"};
    std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t>, std::int64_t,
                                          no_state&) const {
      return std::nullopt;
    }
    void on_dispatched(std::size_t, std::int64_t, no_state&) const {}
    void on_completed(std::size_t, std::int64_t, double, no_state&) const {}
  };
  const std::vector<SimulatedDevice> one = {constant(1)};
  CHECK_THROWS_WITH_AS((void)simulate(Waits{}, one, 10),
                       doctest::Contains("gave no chunk while every device was idle"), FatalError);
  const std::vector<SimulatedDevice> two = {constant(1), constant(1)};
  CHECK_THROWS_WITH_AS((void)simulate(SyncChunking{}, two, 10),
                       doctest::Contains("lists 1 devices but 2 simulated devices"), FatalError);
  CHECK_THROWS_WITH_AS(
      (void)simulate(GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {0}}, one, 10),
      doctest::Contains("batch_sizes is 0"), FatalError);
  const std::vector<SimulatedDevice> none = {SimulatedDevice{}};
  CHECK_THROWS_WITH_AS((void)simulate(SyncChunking{}, none, 10),
                       doctest::Contains("has no throughput curve"), FatalError);
}

TEST_CASE("simulate() refuses more chunks than it schedules, before scheduling them") {
  const std::vector<SimulatedDevice> one = {constant(1e6)};
  const auto refused = doctest::Contains("take more than 2097152 chunks, the most one simulation "
                                         "schedules; simulate fewer calls, fewer rows or larger "
                                         "chunks");
  // A batch near INT64_MAX in chunks of one row: refused at once, not after hours.
  const auto huge = std::numeric_limits<std::int64_t>::max();
  CHECK_THROWS_WITH_AS((void)simulate(SyncChunking{.batch_size = 1}, one, huge), refused,
                       FatalError);
  CHECK_THROWS_WITH_AS(
      (void)simulate(GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {1}}, one, huge),
      refused, FatalError);
  // The bound counts every call's chunks: one chunk too many in all is refused.
  const auto per_call = std::int64_t{1} << 11;
  CHECK(simulate(SyncChunking{.batch_size = 1}, one, per_call, 1024).timeline.size() ==
        max_simulated_chunks);
  CHECK_THROWS_WITH_AS((void)simulate(SyncChunking{.batch_size = 1}, one, per_call, 1025), refused,
                       FatalError);
  // Chunks of the whole remaining batch near INT64_MAX: two calls, no overflow.
  const auto sim = simulate(SyncChunking{.batch_size = huge / 2 + 1}, one, huge, 2);
  REQUIRE(sim.timeline.size() == 4);
  CHECK(sim.timeline[1].first + sim.timeline[1].rows == huge);
}

TEST_CASE("the report: text per device, JSON with the timeline") {
  const GreedyPriorityCapacity pool{.devices = {"cpu", "cuda:0"}, .batch_sizes = {100, 300}};
  const std::vector<SimulatedDevice> node = {constant(100), constant(300)};
  const auto sim = simulate(pool, node, 4000);
  const auto text = format_simulation(sim, {"cpu", "cuda:0"});
  CHECK(test::contains(text, "makespan 10 s, ideal 10 s"));
  CHECK(test::contains(text, "100.0 % of ideal"));
  CHECK(test::contains(text, "device       lanes   chunks"));
  const auto j = nlohmann::json::parse(simulation_json(sim, {"cpu", "cuda:0"}));
  CHECK(j["timeline"].size() == sim.timeline.size());
  CHECK(j["devices"][1]["name"] == "cuda:0");
  CHECK(j["devices"][0]["lanes"] == 1);
  const auto lanes =
      simulate(GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {100}, .cpu_lanes = 4},
               std::vector<SimulatedDevice>{constant(100)}, 100);
  CHECK(test::contains(format_simulation(lanes, {"cpu"}),
                       "cpu" + std::string(14, ' ') + "4" + std::string(8, ' ') + "1"));
  CHECK(nlohmann::json::parse(simulation_json(lanes, {"cpu"}))["devices"][0]["lanes"] == 4);
  CHECK(j["makespan"].get<double>() == doctest::Approx(10));
}

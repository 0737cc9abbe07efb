// The tuner: the sweep's decisions on synthetic curves (no clock), recommendations on
// analytic tables, the tune file's round trip and every refusal by name, and the
// measurement plumbing on real models (structure only: nothing here is timed).

#include <cmath>
#include <functional>
#include <limits>
#include <set>

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <torch/headeronly/version.h>

#include <neml2/detail/tune_decisions.hpp>
#include <neml2/detail/tune_measure.hpp>
#include <neml2/tune.hpp>

#include "reference.hpp"
#include "scratch.hpp"

using namespace neml2;
using neml2::detail::choose_overlap_chunks; // the tuner's decisions, tested on their own
using neml2::detail::chunk_overhead_from;
using neml2::detail::pool_chunk_rows;
using neml2::detail::run_sweep;
using neml2::detail::summarize;
using neml2::detail::Sweep;
using neml2::detail::tune_inputs; // how it measures
using test::contains;
namespace fs = std::filesystem;

namespace {

// A measurement that replays a throughput curve (rows -> rows/s), noise-free unless
// `repeat_factors` scales each repeat's throughput; it logs the sizes asked for.
struct Synthetic {
  std::function<double(std::int64_t)> rows_per_second;
  std::vector<double> repeat_factors = {1, 1, 1};
  std::function<bool(std::int64_t)> fits = [](std::int64_t) { return true; };
  double elapsed = 0; // per measurement; 0: the repeats' sum
  std::vector<std::int64_t> asked = {};

  Timing operator()(std::int64_t rows) {
    asked.push_back(rows);
    if (!fits(rows))
      return {.out_of_memory = true};
    Timing t{.elapsed = elapsed};
    for (const auto f : repeat_factors)
      t.seconds.push_back(static_cast<double>(rows) / (f * rows_per_second(rows)));
    return t;
  }
};

// The sweep over `s`, with no time budget unless `options` sets one.
Sweep sweep_of(Synthetic& s, SweepOptions options = {.patience = 2, .budget_seconds = 1e9}) {
  return run_sweep([&](std::int64_t rows) { return s(rows); }, options);
}

TunePoint best_of(const Sweep& sweep) {
  return DeviceCurve{.points = sweep.points()}.best();
}

std::vector<std::int64_t> powers_of_two(std::int64_t from, std::int64_t to) {
  std::vector<std::int64_t> sizes;
  for (auto r = from; r <= to; r *= 2)
    sizes.push_back(r);
  return sizes;
}

// The first sizes the sweep asked for (the doubling phase).
std::vector<std::int64_t> first(const std::vector<std::int64_t>& asked, std::size_t n) {
  return {asked.begin(), asked.begin() + static_cast<std::ptrdiff_t>(std::min(n, asked.size()))};
}

} // namespace

TEST_CASE("summarize: rows per second of each repeat, their median and extremes") {
  const auto p = summarize(1000, Timing{.seconds = {0.5, 0.25, 0.1, 2.0}});
  CHECK(p.repeats == 4);
  CHECK(p.median == doctest::Approx(0.5 * (2000 + 4000))); // even count: mean of the middle two
  CHECK(p.low == doctest::Approx(500));
  CHECK(p.high == doctest::Approx(10000));
  CHECK(summarize(10, Timing{.seconds = {1, 2, 4}}).median == doctest::Approx(5));
  // A size timed as the chunk size of a larger call: the call's rows over its seconds.
  const auto chunked = summarize(10, Timing{.seconds = {2}, .rows_per_call = 1000});
  CHECK(chunked.rows == 10);
  CHECK(chunked.median == doctest::Approx(500));
  CHECK(summarize(10, Timing{.out_of_memory = true}).out_of_memory);
  CHECK_THROWS_WITH_AS((void)summarize(10, Timing{}), doctest::Contains("gave no timings"),
                       FatalError);
}

TEST_CASE("a knee: doubling stops after `patience` sizes that are not 3 % better") {
  // rows/s = peak r / (r + r0), r0 = 1000, compared with the best so far: 32768 gains 2.96 %
  // over 16384 (not better), 65536 4.5 % (better), then 131072 and 262144 gain 0.8 % and
  // 1.1 % over 65536: doubling ends at 262144.
  Synthetic s{[](std::int64_t r) { return 1e7 * r / (r + 1000.0); }};
  const auto sweep = sweep_of(s);
  CHECK(first(s.asked, 19) == powers_of_two(1, 262144));
  CHECK(std::find(s.asked.begin(), s.asked.end(), 524288) == s.asked.end());
  CHECK(sweep.stop() == SweepStop::finished);
  // Refinement only between the best size (the largest: the curve only rises) and its
  // measured neighbour: 185364, then 220436.
  const auto best = best_of(sweep);
  CHECK(std::vector<std::int64_t>(s.asked.begin() + 19, s.asked.end()) ==
        std::vector<std::int64_t>{185364, 220436});
  CHECK(best.rows == 262144);
  // The knee: the smallest size reaching 90 % of the best, by brute force over the table.
  const DeviceCurve curve{.device = "cpu", .points = sweep.points()};
  const auto& knee = curve.knee(0.9);
  CHECK(knee.median >= 0.9 * best.median);
  for (const auto& p : sweep.points())
    if (p.rows < knee.rows)
      CHECK(p.median < 0.9 * best.median);
  // The best is 262144 / 263144 = 0.9962 of the peak: 16384 / 17384 = 0.942 reaches 90 % of
  // it, 8192 / 9192 = 0.891 does not.
  CHECK(knee.rows == 16384);
}

TEST_CASE("a dip: one size that is worse does not stop the doubling") {
  // Linear up to 65536, flat after; half as fast at 1024 alone.
  Synthetic s{[](std::int64_t r) {
    const auto base = static_cast<double>(std::min<std::int64_t>(r, 65536));
    return r == 1024 ? 0.5 * base : base;
  }};
  const auto sweep = sweep_of(s);
  CHECK(first(s.asked, 19) == powers_of_two(1, 262144));
  CHECK(best_of(sweep).rows == 65536); // the first of the plateau's equal sizes
  CHECK(sweep.stop() == SweepStop::finished);
}

TEST_CASE("a far second rise: the default patience doubles past a plateau to reach it") {
  // Rising to 1e6 at 4096 rows, flat to 32768, where it steps up to 1.1e6 (10 % better).
  const auto curve = [](std::int64_t r) {
    return r >= 32768 ? 1.1e6 : 1e6 * static_cast<double>(std::min<std::int64_t>(r, 4096)) / 4096;
  };
  Synthetic two{curve};
  CHECK(best_of(sweep_of(two)).rows == 4096); // patience 2: 8192 and 16384 end it
  Synthetic four{curve};
  const auto sweep = sweep_of(four, {.budget_seconds = 1e9}); // the default patience, 4
  CHECK(best_of(sweep).rows == 32768);
  // Four sizes past the rise that are not better end the doubling.
  CHECK(std::find(four.asked.begin(), four.asked.end(), 524288) != four.asked.end());
  CHECK(std::find(four.asked.begin(), four.asked.end(), 1048576) == four.asked.end());
}

TEST_CASE("a plateau: constant throughput stops after patience sizes, the smallest is best") {
  Synthetic s{[](std::int64_t) { return 1e6; }};
  const auto sweep = sweep_of(s, {.patience = 3, .budget_seconds = 1e9});
  CHECK(s.asked == std::vector<std::int64_t>{1, 2, 4, 8}); // midpoints round onto known sizes
  CHECK(best_of(sweep).rows == 1);
  CHECK(DeviceCurve{.device = "cpu", .points = sweep.points()}.knee(0.99).rows == 1);
}

TEST_CASE("an out-of-memory wall: nothing at or above it is tried, refinement stays below") {
  // Faster with every row; 5000 rows and more do not fit.
  Synthetic s{[](std::int64_t r) { return static_cast<double>(r); }};
  s.fits = [](std::int64_t r) { return r < 5000; };
  const auto sweep = sweep_of(s);
  CHECK(sweep.stop() == SweepStop::out_of_memory_wall);
  CHECK(first(s.asked, 14) == powers_of_two(1, 8192));
  // Round 1 between 2048 / 4096 / 8192: 2896 and 5793 (which does not fit: the new wall);
  // round 2 between 2896 / 4096 / 5793: 3444 and 4871.
  CHECK(std::vector<std::int64_t>(s.asked.begin() + 14, s.asked.end()) ==
        std::vector<std::int64_t>{2896, 5793, 3444, 4871});
  CHECK(best_of(sweep).rows == 4871);
  CHECK(std::count(s.asked.begin(), s.asked.end(), 8192) == 1);
  const auto oom = std::count_if(sweep.points().begin(), sweep.points().end(),
                                 [](const TunePoint& p) { return p.out_of_memory; });
  CHECK(oom == 2);
}

TEST_CASE("noise: the median ignores outlying repeats, so the decisions do not change") {
  const auto curve = [](std::int64_t r) { return 1e7 * r / (r + 1000.0); };
  Synthetic clean{curve};
  Synthetic noisy{curve, {1, 0.2, 1, 5, 1}}; // one repeat 5x slower, one 5x faster
  const auto a = sweep_of(clean);
  const auto b = sweep_of(noisy);
  CHECK(noisy.asked == clean.asked);
  REQUIRE(a.points().size() == b.points().size());
  for (std::size_t i = 0; i < a.points().size(); ++i) {
    CHECK(b.points()[i].median == doctest::Approx(a.points()[i].median).epsilon(1e-12));
    CHECK(b.points()[i].low == doctest::Approx(0.2 * a.points()[i].median).epsilon(1e-12));
    CHECK(b.points()[i].high == doctest::Approx(5 * a.points()[i].median).epsilon(1e-12));
  }
}

TEST_CASE("sizes asked for besides the doubling are measured, and refined around when best") {
  // Fast at small sizes, slow in the middle, fastest at 2^20: doubling stops at 64, the
  // whole call of 2^20 rows is measured anyway, and refinement then searches below it.
  Synthetic s{[](std::int64_t r) { return r <= 16 ? 100.0 * r : r < 1 << 20 ? 1000.0 : 1e5; }};
  const auto sweep = sweep_of(s, {.patience = 2, .budget_seconds = 1e9, .also = {1 << 20, 3}});
  CHECK(first(s.asked, 9) == std::vector<std::int64_t>{1, 2, 4, 8, 16, 32, 64, 1 << 20, 3});
  CHECK(best_of(sweep).rows == 1 << 20);
  CHECK(s.asked[9] == 8192); // the geometric midpoint of 64 and 2^20
  Synthetic plain{s.rows_per_second};
  (void)sweep_of(plain);
  CHECK(std::find(plain.asked.begin(), plain.asked.end(), 1 << 20) == plain.asked.end());
}

TEST_CASE("the time budget counts each measurement's elapsed seconds, warm-up included") {
  Synthetic s{[](std::int64_t r) { return static_cast<double>(r); }};
  s.elapsed = 10; // the repeats alone would take 3 s
  const auto sweep = sweep_of(s, {.budget_seconds = 35});
  CHECK(s.asked == std::vector<std::int64_t>{1, 2, 4, 8}); // 0, 10, 20, 30 s spent before each
  CHECK(sweep.stop() == SweepStop::budget);
  CHECK(sweep.spent() == doctest::Approx(40));
}

TEST_CASE("the cap ends the doubling at max_rows itself") {
  Synthetic s{[](std::int64_t r) { return static_cast<double>(r); }};
  const auto sweep = sweep_of(s, {.max_rows = 1000, .refine_rounds = 0, .budget_seconds = 1e9});
  auto expected = powers_of_two(1, 512);
  expected.push_back(1000);
  CHECK(s.asked == expected);
  CHECK(sweep.stop() == SweepStop::cap);
  CHECK(best_of(sweep).rows == 1000);
  const auto from =
      sweep_of(s, {.min_rows = 3, .max_rows = 20, .refine_rounds = 0, .budget_seconds = 1e9});
  CHECK(from.points().front().rows == 3);
  CHECK(from.points().back().rows == 20);
}

TEST_CASE("bad sweep options are refused by name") {
  CHECK_THROWS_WITH_AS(Sweep({.min_rows = 0}), doctest::Contains("SweepOptions.min_rows"),
                       FatalError);
  CHECK_THROWS_WITH_AS(Sweep({.min_rows = 8, .max_rows = 4}),
                       doctest::Contains("SweepOptions.max_rows"), FatalError);
  CHECK_THROWS_WITH_AS(Sweep({.patience = 0}), doctest::Contains("SweepOptions.patience"),
                       FatalError);
  CHECK_THROWS_WITH_AS(Sweep({.budget_seconds = 0}),
                       doctest::Contains("SweepOptions.budget_seconds"), FatalError);
}

namespace {
// Two devices with analytic curves: the CPU peaks at 2e6 rows/s at 4096 rows, the GPU
// saturates at 5e7 rows/s; the GPU's overlap test chose 4 chunks in flight.
TuneResult two_devices() {
  TuneResult r{.model = "analytic", .machine = {"2.12.1", 2, "Some CPU", "float64"}};
  DeviceCurve cpu{
      .device = "cpu", .device_name = "Some CPU", .artifact_hash = "aa", .chunk_overhead = 2.5e-6};
  for (std::int64_t rows : {1024, 2048, 4096, 8192})
    cpu.points.push_back({rows, rows == 4096 ? 2e6 : rows == 2048 ? 1.9e6 : 1e6, 0, 0, 3});
  DeviceCurve gpu{
      .device = "cuda:0", .device_name = "Some GPU", .artifact_hash = "bb", .overlap_chunks = 4};
  for (std::int64_t rows : {1024, 4096, 16384, 65536, 131072})
    gpu.points.push_back({rows, 5e7 * rows / (rows + 8192.0), 0, 0, 3});
  gpu.points.push_back({262144, 0, 0, 0, 0, true});
  for (auto* c : {&cpu, &gpu})
    for (auto& p : c->points)
      p.low = p.high = p.median;
  r.devices = {cpu, gpu};
  return r;
}

// parse_tune_file refuses `file` with a FatalError whose message holds `part`.
void refused(const nlohmann::json& file, const std::string& part) {
  CAPTURE(part);
  CHECK_THROWS_WITH_AS((void)parse_tune_file(file.dump(), "t.json"),
                       doctest::Contains(part.c_str()), FatalError);
}
} // namespace

TEST_CASE("recommendations: best sizes alone, knees for the pool, priorities from speed") {
  const auto r = recommend(two_devices(), 0.9);
  REQUIRE(r.sync.size() == 2);
  CHECK(r.sync[0].device == Device("cpu"));
  CHECK(r.sync[0].batch_size == 4096);
  CHECK(r.sync[1].batch_size == 131072); // the out-of-memory point is never best
  CHECK(r.fastest == 1);
  // Knees at 90 %: the CPU's 2048 (0.95 of 2e6); the GPU's best is 5e7 * 0.941, and 65536
  // reaches 0.889 / 0.941 = 0.944 of it while 16384 reaches 0.667 / 0.941 = 0.708.
  CHECK(r.pool.devices == std::vector<Device>{"cpu", "cuda:0"});
  CHECK(r.pool.batch_sizes == std::vector<std::int64_t>{2048, 65536});
  CHECK(r.pool.capacities == std::vector<std::int64_t>{2048, 4 * 65536});
  const auto gpu_best = 5e7 * 131072 / (131072 + 8192.0);
  CHECK(r.pool.priorities[1] == 1);
  CHECK(r.pool.priorities[0] == doctest::Approx(2e6 / gpu_best).epsilon(5e-3));
  CHECK(r.pool.priorities[0] < r.pool.priorities[1]);
  r.pool.validate();
  CHECK(r.mpi.batch_sizes == std::vector<std::int64_t>{4096, 131072});

  CHECK(to_cpp(r.sync[0]) ==
        R"(neml2::SyncChunking{.device = "cpu", .batch_size = 4096, .cpu_lanes = 1})");
  CHECK(to_cpp(r.sync[1]) == R"(neml2::SyncChunking{.device = "cuda:0", .batch_size = 131072})");
  CHECK(to_cpp(r.mpi) ==
        R"(neml2::MPIRankAssign({.devices = {"cpu", "cuda:0"}, .batch_sizes = {4096, 131072}}))");
  CHECK(contains(to_cpp(r.pool), R"(.batch_sizes = {2048, 65536})"));
  CHECK(contains(to_cpp(r.pool), R"(.capacities = {2048, 262144})"));
  const auto j = nlohmann::json::parse(to_json(r));
  CHECK(j["sync"][1]["batch_size"] == 131072);
  CHECK(j["pool"]["policy"] == "GreedyPriorityCapacity");
  CHECK(j["pool"]["capacities"][1] == 262144);
  CHECK(j["mpi"]["devices"][1] == "cuda:0");
  CHECK(nlohmann::json::parse(to_json(r.sync[0]))["device"] == "cpu");
}

TEST_CASE("on CPU lanes: SyncChunking's size is one lane's chunk, the pool's CPU chunk is shared") {
  // The same table measured on 4 lanes: its CPU rows are one lane's chunk (4 ran at once).
  auto table = two_devices();
  table.machine.cpu_lanes = 4;
  const auto r = recommend(table, 0.9);
  const auto one = recommend(two_devices(), 0.9);
  // SyncChunking: the table's rows, on the lanes they were measured on (none off the CPU).
  CHECK(r.sync[0].batch_size == one.sync[0].batch_size);
  CHECK(r.sync[0].cpu_lanes == 4);
  CHECK(one.sync[0].cpu_lanes == 1);
  CHECK(r.sync[1].cpu_lanes == 0);
  // The pool: the CPU's knee (2048) times its lanes, one chunk in flight; the GPU's as before.
  CHECK(r.pool.batch_sizes == std::vector<std::int64_t>{4 * 2048, 65536});
  CHECK(r.pool.capacities == std::vector<std::int64_t>{4 * 2048, 4 * 65536});
  CHECK(r.pool.cpu_lanes == 4);
  CHECK(r.pool.priorities == one.pool.priorities); // the rates are all lanes' already
  CHECK(r.mpi.batch_sizes == one.mpi.batch_sizes); // a rank's chunk is one lane's too
  r.pool.validate();
  // What to paste says which is which.
  const auto cpp = to_cpp(r);
  CHECK(contains(cpp,
                 "// cpu alone: chunks of 4096 rows, one per lane, on 4 lane(s)\n"
                 R"(neml2::SyncChunking{.device = "cpu", .batch_size = 4096, .cpu_lanes = 4})"));
  CHECK(contains(cpp, "// every device at once: the cpu's chunk of 8192 rows is shared by its 4 "
                      "lane(s)\n"));
  CHECK(contains(cpp, ".cpu_lanes = 4}"));
  const auto j = nlohmann::json::parse(to_json(r));
  CHECK(j["sync"][0]["cpu_lanes"] == 4);
  CHECK(j["pool"]["cpu_lanes"] == 4);
  CHECK(j["pool"]["batch_sizes"][0] == 8192);
  CHECK(contains(format_table(table), "cpu: measured on 4 lane(s); rows are one lane's chunk"));
  // A pool without the CPU asks for no lanes.
  auto gpu_only = table;
  gpu_only.devices.erase(gpu_only.devices.begin());
  CHECK(recommend(gpu_only).pool.cpu_lanes == 0);
  CHECK(!contains(to_cpp(recommend(gpu_only)), "cpu_lanes"));

  CHECK(pool_chunk_rows("cpu", 2048, 4) == 8192);
  CHECK(pool_chunk_rows("cuda:0", 2048, 4) == 2048); // an accelerator has no CPU lanes
  CHECK(pool_chunk_rows("cpu", 2048, 0) == 2048);
  const auto huge = std::numeric_limits<std::int64_t>::max() / 2;
  CHECK(pool_chunk_rows("cpu", huge, 4) == std::numeric_limits<std::int64_t>::max());
}

TEST_CASE("the overlap test keeps the fewest chunks in flight within 3 % of the best") {
  CHECK(choose_overlap_chunks({{1, 100}, {2, 180}, {4, 182}}) == 2);
  CHECK(choose_overlap_chunks({{1, 100}, {2, 101}, {4, 99}}) == 1);
  CHECK(choose_overlap_chunks({{1, 100}, {2, 150}, {4, 200}}) == 4);
  CHECK(choose_overlap_chunks({}) == 1);
}

TEST_CASE("SyncChunking takes the smallest size within 3 % of the best: the rest is noise") {
  auto r = two_devices();
  r.devices[0].points[1].median = 1.95e6; // 2048 rows: 0.975 of 4096's 2e6
  CHECK(recommend(r).sync[0].batch_size == 2048);
  CHECK(recommend(r).mpi.batch_sizes[0] == 2048);
  CHECK(recommend(r, 0.9, 1.0).sync[0].batch_size == 4096); // the best itself
  r.devices[0].points[1].median = 1.93e6;                   // 0.965: 4096 is better
  CHECK(recommend(r).sync[0].batch_size == 4096);
}

TEST_CASE("the lane test: the median difference per chunk, never below 0") {
  // 10 chunks; the lane's median 0.012 s against 0.010 s: 0.2 ms per chunk. One outlier
  // in each list moves neither median.
  CHECK(chunk_overhead_from({0.010, 0.011, 0.009, 0.5, 0.010}, {0.012, 0.013, 0.011, 0.001, 0.012},
                            10) == doctest::Approx(2e-4));
  CHECK(chunk_overhead_from({0.010}, {0.008}, 10) == 0); // a faster lane is not a gain
  CHECK(chunk_overhead_from({}, {0.01}, 10) == 0);
  CHECK(chunk_overhead_from({0.01}, {0.02}, 0) == 0);
}

TEST_CASE("recommend() refuses a table with no device or no measured size") {
  CHECK_THROWS_WITH_AS((void)recommend(TuneResult{}), doctest::Contains("lists no device"),
                       FatalError);
  auto r = two_devices();
  r.devices[1].points = {{1024, 0, 0, 0, 0, true}};
  CHECK_THROWS_WITH_AS((void)recommend(r),
                       doctest::Contains("the tuning of cuda:0 has no measured"), FatalError);
}

TEST_CASE("the tune file round trip keeps every field") {
  auto r = two_devices();
  r.machine.cpu_lanes = 3;
  const auto back = parse_tune_file(tune_file_text(r), "memory");
  CHECK(back.model == r.model);
  CHECK(back.operation == r.operation);
  CHECK(back.machine.torch_version == r.machine.torch_version);
  CHECK(back.machine.intra_op_threads == r.machine.intra_op_threads);
  CHECK(back.machine.cpu_lanes == r.machine.cpu_lanes);
  CHECK(back.machine.host_cpu == r.machine.host_cpu);
  CHECK(back.machine.dtype == r.machine.dtype);
  REQUIRE(back.devices.size() == 2);
  for (std::size_t d = 0; d < 2; ++d) {
    const auto &a = r.devices[d], &b = back.devices[d];
    CHECK(a.device == b.device);
    CHECK(a.device_name == b.device_name);
    CHECK(a.artifact_hash == b.artifact_hash);
    CHECK(a.overlap_chunks == b.overlap_chunks);
    CHECK(a.chunk_overhead == b.chunk_overhead);
    CHECK(a.stop == b.stop);
    REQUIRE(a.points.size() == b.points.size());
    for (std::size_t i = 0; i < a.points.size(); ++i) {
      CHECK(a.points[i].rows == b.points[i].rows);
      CHECK(a.points[i].median == b.points[i].median); // exact: JSON keeps doubles
      CHECK(a.points[i].out_of_memory == b.points[i].out_of_memory);
    }
  }
  CHECK(recommend(back).pool.batch_sizes == recommend(r).pool.batch_sizes);
  // The recommendations written for people are those recommend() makes.
  const auto j = nlohmann::json::parse(tune_file_text(r));
  CHECK(j["cpu_lanes"] == 3); // the lanes the CPU was measured on, stated
  CHECK(j["recommendations"]["pool"]["batch_sizes"][1] == 65536);
  CHECK(j["recommendations"]["pool"]["batch_sizes"][0] == 3 * 2048);
  CHECK(j["recommendations"]["sync"][0]["cpu_lanes"] == 3);
}

TEST_CASE("a malformed tune file is refused, naming the field") {
  const auto good = nlohmann::json::parse(tune_file_text(two_devices()));
  for (const auto* key : {"format", "version", "model", "operation", "dtype", "torch_version",
                          "intra_op_threads", "cpu_lanes", "host_cpu", "devices"}) {
    auto f = good;
    f.erase(key);
    refused(f, std::string("field '") + key + "' is missing");
  }
  for (const auto* key : {"device", "device_name", "artifact_hash", "stop", "overlap_chunks",
                          "chunk_overhead", "points"}) {
    auto f = good;
    f["devices"][1].erase(key);
    refused(f, std::string("field 'devices[1].") + key + "' is missing");
  }
  for (const auto* key : {"rows", "median", "low", "high", "repeats", "out_of_memory"}) {
    auto f = good;
    f["devices"][0]["points"][2][key] = "fast";
    refused(f, std::string("field 'devices[0].points[2].") + key + "' must be");
  }
  auto f = good;
  f["devices"][0]["device"] = "gpu";
  refused(f, "field 'devices[0].device' is not a device");
  f = good;
  f["devices"][0]["stop"] = "tired";
  refused(f, "field 'devices[0].stop'");
  f = good;
  f["devices"][0]["points"][1]["rows"] = 1024; // not increasing
  refused(f, "field 'devices[0].points[1].rows' must be larger");
  f = good;
  f["devices"][0]["points"][1]["low"] = 1e12; // low above the median
  refused(f, "field 'devices[0].points[1]' must have");
  for (const auto* key : {"median", "low", "high"}) { // 0 would make a NaN priority
    f = good;
    f["devices"][0]["points"][0]["median"] = 1.0;
    f["devices"][0]["points"][0]["low"] = 0.5;
    f["devices"][0]["points"][0]["high"] = 2.0;
    f["devices"][0]["points"][0][key] = 0.0;
    refused(f, std::string("field 'devices[0].points[0].") + key + "' must be a finite number > 0");
  }
  f = good;
  f["devices"][0]["chunk_overhead"] = -1e-6;
  refused(f, "field 'devices[0].chunk_overhead' must be a non-negative number");
  f = good;
  f["version"] = 1; // before chunk_overhead
  refused(f, "field 'version' is 1; this library reads version 3");
  f = good;
  f["version"] = 2; // before cpu_lanes: its CPU rows may be one lane's or all lanes'
  refused(f, "field 'version' is 2; this library reads version 3");
  for (const int lanes : {0, 1025}) {
    f = good;
    f["cpu_lanes"] = lanes;
    refused(f, "field 'cpu_lanes' must be from 1 to 1024 (the lanes the CPU was measured on)");
  }
  f = good;
  f["devices"] = nlohmann::json::array();
  refused(f, "field 'devices' is empty");
  CHECK_THROWS_WITH_AS((void)parse_tune_file("{\"format\": ", "t.json"),
                       doctest::Contains("tune file t.json is not valid JSON"), FatalError);
  CHECK_THROWS_WITH_AS((void)read_tune_file("/nonexistent/t.json"),
                       doctest::Contains("cannot read the tune file /nonexistent/t.json"),
                       FatalError);
}

TEST_CASE("a tune file's integers must be integers that fit their fields") {
  // Read with a plain cast before: 2^32 + 2 threads read as 2 (and then matched this
  // machine), 2^64 - 1 rows as -1.
  const auto good = nlohmann::json::parse(tune_file_text(two_devices()));
  auto f = good;
  f["intra_op_threads"] = std::int64_t{4294967298};
  refused(f, "tune file t.json: field 'intra_op_threads' must be an integer from -2147483648 to "
             "2147483647, not 4294967298; re-tune");
  f = good;
  f["devices"][0]["overlap_chunks"] = std::int64_t{4294967297};
  refused(f, "field 'devices[0].overlap_chunks' must be an integer from -2147483648 to "
             "2147483647, not 4294967297");
  f = good;
  f["devices"][0]["points"][0]["repeats"] = std::int64_t{4294967299};
  refused(f, "field 'devices[0].points[0].repeats' must be an integer from");
  f = good;
  f["devices"][0]["points"][0]["rows"] = std::numeric_limits<std::uint64_t>::max();
  refused(f, "field 'devices[0].points[0].rows' must be an integer from -9223372036854775808 to "
             "9223372036854775807, not 18446744073709551615");
  f = good;
  f["version"] = 1e300;
  refused(f, "field 'version' must be an integer, not 1e+300");
  f = good;
  f["devices"][1]["points"][0]["rows"] = 1024.5;
  refused(f, "field 'devices[1].points[0].rows' must be an integer, not 1024.5");
  f = good;
  f["devices"][0]["overlap_chunks"] = true; // nlohmann would read 1
  refused(f, "field 'devices[0].overlap_chunks' must be an integer, not boolean");
  f = good;
  f["devices"][0] = 7;
  refused(f, "field 'devices[0]' must be an object, not number");
}

TEST_CASE("a tune file that is not a regular file, or far larger than any, is refused unread") {
  const test::Scratch s;
  const auto fifo = s.dir / "fifo.tune.json";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0); // opening it to read would wait for a writer
  CHECK_THROWS_WITH_AS(
      (void)read_tune_file(fifo),
      doctest::Contains(
          ("tune file '" + fifo.string() + "' is not a regular file but a FIFO; re-tune").c_str()),
      FatalError);
  const auto device = s.dir / "zero.tune.json";
  fs::create_symlink("/dev/zero", device); // reading it would never end
  CHECK_THROWS_WITH_AS((void)read_tune_file(device),
                       doctest::Contains("is not a regular file but a character device"),
                       FatalError);
  const auto large = s.write("large.tune.json", tune_file_text(two_devices()));
  fs::resize_file(large, std::uintmax_t(1) << 30); // sparse: no disk used
  CHECK_THROWS_WITH_AS((void)read_tune_file(large),
                       doctest::Contains("' is 1073741824 bytes, more than the 16777216 bytes "
                                         "read at most (a real one is far smaller); re-tune"),
                       FatalError);
  // A real one, written and read back, is far within the bounds.
  const auto real = s.write("real.tune.json", tune_file_text(two_devices()));
  CHECK(read_tune_file(real).devices.size() == 2);
}

namespace {
Artifact elasticity() {
  return read_artifact(resolve_artifact_root(test::stub("elasticity", "elasticity"), "elasticity"));
}

// A table whose keys are this machine's for `artifact` on the CPU.
TuneResult matching(const Artifact& artifact) {
  auto r = two_devices();
  r.devices.resize(1);
  r.machine = current_machine(at::kDouble);
  r.devices[0].device_name = device_name("cpu");
  r.devices[0].artifact_hash = artifact_hash(artifact, "cpu", at::kDouble);
  return r;
}
} // namespace

TEST_CASE("a tune file for another artifact or machine is refused, naming the key") {
  const auto artifact = elasticity();
  const auto good = matching(artifact);
  check_tune_matches(good, artifact, at::kDouble, "t.json");
  CHECK(good.machine.torch_version == TORCH_VERSION);
  CHECK(good.machine.intra_op_threads == at::get_num_threads());
  CHECK(!good.machine.host_cpu.empty());

  const auto refused = [&](const TuneResult& r, const std::string& key, c10::ScalarType dtype) {
    CAPTURE(key);
    CHECK_THROWS_WITH_AS(check_tune_matches(r, artifact, dtype, "t.json"),
                         doctest::Contains(("tune file t.json does not match: its " + key).c_str()),
                         FatalError);
  };
  auto r = good;
  r.machine.torch_version = "2.11.0";
  refused(r, "torch_version is '2.11.0', but here it is '" TORCH_VERSION "'", at::kDouble);
  r = good;
  r.machine.intra_op_threads += 3;
  refused(r, "intra_op_threads", at::kDouble);
  r = good;
  r.machine.host_cpu = "Another CPU";
  refused(r, "host_cpu is 'Another CPU'", at::kDouble);
  r = good;
  r.devices[0].device_name = "Another CPU";
  refused(r, "devices[0] (cpu) device_name", at::kDouble);
  r = good;
  r.devices[0].artifact_hash = "0123";
  refused(r, "devices[0] (cpu) artifact_hash", at::kDouble);
  refused(good, "dtype is 'float64', but here it is 'float32'", at::kFloat);
  // The message says how to re-tune.
  try {
    check_tune_matches(r, artifact, at::kDouble, "t.json");
  } catch (const FatalError& e) {
    CHECK(contains(e.what(), "neml2-dispatch tune " + artifact.root.string() +
                                 " --device cpu --dtype float64 --out t.json"));
  }
}

TEST_CASE("a tune file measured on other CPU lanes than the policy asks for is refused") {
  const auto artifact = elasticity();
  auto r = matching(artifact);
  // Made here with the default lanes: torch's intra-op count, at most the hardware threads.
  CHECK(r.machine.cpu_lanes == current_machine(at::kDouble, 0).cpu_lanes);
  CHECK(r.machine.cpu_lanes >= 1);
  CHECK(r.machine.cpu_lanes <= at::get_num_threads());
  CHECK(current_machine(at::kDouble, 3).cpu_lanes == 3); // as asked (its runners are made)
  CHECK_THROWS_WITH_AS((void)current_machine(at::kDouble, -1),
                       doctest::Contains("cpu_lanes is -1; give 0 (torch's intra-op thread "
                                         "count) to 1024"),
                       FatalError);
  check_tune_matches(r, artifact, at::kDouble, "t.json", 0);
  // Measured on 3 lanes: a policy that takes the file's lanes (none asked) matches, one that
  // asks for 3 does, one that asks for 2 (or for the intra-op count, here not 3) does not.
  r.machine.cpu_lanes = 3;
  check_tune_matches(r, artifact, at::kDouble, "t.json");
  check_tune_matches(r, artifact, at::kDouble, "t.json", 3);
  const auto refused = [&](std::int64_t lanes, const std::string& part) {
    CAPTURE(lanes);
    CHECK_THROWS_WITH_AS(check_tune_matches(r, artifact, at::kDouble, "t.json", lanes),
                         doctest::Contains(part.c_str()), FatalError);
  };
  refused(2, "tune file t.json does not match: its cpu_lanes (the lanes its CPU sizes were "
             "measured on) is '3', but here it is '2'; re-tune on this machine: "
             "neml2-dispatch tune " +
                 artifact.root.string() +
                 " --device cpu --dtype float64 --cpu-lanes 2 --out t.json");
  if (current_machine(at::kDouble, 0).cpu_lanes != 3)
    refused(0, "its cpu_lanes (the lanes its CPU sizes were measured on) is '3', but here it is '" +
                   std::to_string(current_machine(at::kDouble, 0).cpu_lanes) + "'");

  // tuned_policy: the file's lanes, or those asked for, checked.
  const test::Scratch scratch;
  const auto file = scratch.dir / "lanes.tune.json";
  write_tune_file(file, r);
  const auto pool = tuned_policy<GreedyPriorityCapacity>(file, artifact);
  CHECK(pool.cpu_lanes == 3);
  CHECK(pool.batch_sizes == std::vector<std::int64_t>{3 * 2048}); // shared by the 3 lanes
  const auto sync = tuned_policy<SyncChunking>(file, artifact);
  CHECK(sync.cpu_lanes == 3);
  CHECK(sync.batch_size == 4096); // one lane's chunk
  CHECK(tuned_policy<SyncChunking>(file, artifact, at::kDouble, 3).cpu_lanes == 3);
  CHECK_THROWS_WITH_AS((void)tuned_policy<GreedyPriorityCapacity>(file, artifact, at::kDouble, 2),
                       doctest::Contains("its cpu_lanes (the lanes its CPU sizes were measured "
                                         "on) is '3', but here it is '2'"),
                       FatalError);
  CHECK_THROWS_WITH_AS((void)load_tuning(file, artifact, at::kDouble, 5),
                       doctest::Contains("is '3', but here it is '5'"), FatalError);
}

TEST_CASE("the artifact hash changes with metadata.json and with the graphs, and only there") {
  const auto artifact = elasticity();
  const auto hash = artifact_hash(artifact, "cpu", at::kDouble);
  CHECK(hash.size() == 40); // sha1 in hex
  CHECK(artifact_hash(artifact, "cpu", at::kDouble) == hash);
  const auto rates = read_artifact(resolve_artifact_root(test::stub("rates", "eq"), "eq"));
  CHECK(artifact_hash(rates, "cpu", at::kDouble) != hash);

  const test::Scratch scratch;
  const auto root = scratch.copy_root("elasticity", "elasticity");
  CHECK(artifact_hash(read_artifact(root), "cpu", at::kDouble) == hash); // same content
  std::ofstream(root / "metadata.json", std::ios::app) << "\n";
  CHECK(artifact_hash(read_artifact(root), "cpu", at::kDouble) != hash);
  const test::Scratch another;
  const auto copy = another.copy_root("elasticity", "elasticity");
  fs::path graph;
  for (const auto& e : fs::recursive_directory_iterator(copy / "cpu"))
    if (e.is_regular_file())
      graph = e.path();
  REQUIRE(!graph.empty());
  std::ofstream(graph, std::ios::app) << "x";
  CHECK(artifact_hash(read_artifact(copy), "cpu", at::kDouble) != hash);
}

TEST_CASE("tuned_policy builds the recommended policies from a checked file") {
  const auto artifact = elasticity();
  const test::Scratch scratch;
  const auto file = scratch.dir / "elasticity.tune.json";
  const auto r = matching(artifact);
  write_tune_file(file, r);
  const auto pool = tuned_policy<GreedyPriorityCapacity>(file, artifact);
  CHECK(pool.devices == recommend(r).pool.devices);
  CHECK(pool.batch_sizes == recommend(r).pool.batch_sizes);
  const auto sync = tuned_policy<SyncChunking>(file, artifact);
  CHECK(sync.batch_size == 4096);
  // A policy from the file runs the model (against a whole-batch call).
  const auto shared = std::make_shared<const Artifact>(artifact);
  const DispatchedModel<GreedyPriorityCapacity> model(shared, pool);
  const DispatchedModel<SyncChunking> whole(shared, SyncChunking{});
  const auto strain = at::rand({5000, 6}, at::kDouble);
  test::check_close(model.forward({{"strain", strain}}).at("stress"),
                    whole.forward({{"strain", strain}}).at("stress"), "stress");
  CHECK_THROWS_WITH_AS((void)tuned_policy<SyncChunking>(file, artifact, at::kFloat),
                       doctest::Contains("its dtype is 'float64'"), FatalError);
}

TEST_CASE("a device this process cannot use is refused by name") {
  if (device_count(DeviceFamily::cuda) > 0)
    return; // only meaningful where there is no CUDA device
  CHECK_THROWS_WITH_AS((void)device_name("cuda:0"),
                       doctest::Contains("device cuda:0 cannot be used here"), FatalError);
  CHECK_THROWS_WITH_AS((void)tune(elasticity(), {"cuda"}),
                       doctest::Contains("device cuda cannot be used here"), FatalError);
}

TEST_CASE("tuning inputs: the caller's sample tiled, or generated within ranges") {
  const auto artifact = elasticity();
  const auto sample = at::arange(18, at::kDouble).reshape({3, 6});
  const auto tiled = tune_inputs(artifact, {.sample = {{"strain", sample}}}, 7, "cpu", at::kDouble);
  const auto& t = tiled.at("strain");
  REQUIRE(t.sizes() == at::IntArrayRef({7, 6}));
  for (std::int64_t r = 0; r < 7; ++r)
    CHECK(at::equal(t[r], sample[r % 3]));

  const auto generated =
      tune_inputs(artifact, {.ranges = {{"strain", {-2.0, -1.0}}}}, 1000, "cpu", at::kDouble);
  const auto& g = generated.at("strain");
  CHECK(g.min().item<double>() >= -2.0);
  CHECK(g.max().item<double>() <= -1.0);
  CHECK(g.max().item<double>() - g.min().item<double>() > 0.9); // spread over the range
  CHECK(at::equal(g, tune_inputs(artifact, {.ranges = {{"strain", {-2.0, -1.0}}}}, 1000, "cpu",
                                 at::kDouble)
                         .at("strain"))); // the seed fixes them
  CHECK_THROWS_WITH_AS(
      (void)tune_inputs(artifact, {.ranges = {{"stress", {0, 1}}}}, 4, "cpu", at::kDouble),
      doctest::Contains("a range names 'stress', which is not an input"), FatalError);
  CHECK_THROWS_WITH_AS(
      (void)tune_inputs(artifact, {.sample = {{"strian", sample}}}, 4, "cpu", at::kDouble),
      doctest::Contains("the sample names 'strian'"), FatalError);
  CHECK_THROWS_WITH_AS(
      (void)tune_inputs(artifact, {.ranges = {{"strain", {1.0, 0.0}}}}, 4, "cpu", at::kDouble),
      doctest::Contains("'strain' would be drawn from [1, 0]"), FatalError);
  CHECK_THROWS_WITH_AS((void)tune_inputs(artifact, {.high = std::nan("")}, 4, "cpu", at::kDouble),
                       doctest::Contains("low <= high"), FatalError);
}

TEST_CASE("tune() refuses sweep options out of range as given, before measuring") {
  TuneOptions options;
  options.sweep.max_rows = 0; // below min_rows: not raised to the sizes a device measures
  CHECK_THROWS_WITH_AS((void)tune(elasticity(), {"cpu"}, options), doctest::Contains("max_rows"),
                       FatalError);
}

TEST_CASE("the default generated inputs keep every implicit model of the repository convergent") {
  for (const auto* name : {"j2_radial_return", "perzyna_viscoplasticity",
                           "chaboche_viscoplasticity", "scalar_backward_euler", "perzyna"}) {
    CAPTURE(name);
    const auto model_name = std::string(name) == "perzyna" ? "perzyna" : "model";
    const auto artifact =
        read_artifact(resolve_artifact_root(test::stub(name, model_name), model_name));
    const DispatchedModel<SyncChunking> model(std::make_shared<const Artifact>(artifact),
                                              SyncChunking{});
    const auto inputs = tune_inputs(artifact, {}, 512, "cpu", at::kDouble);
    for (const auto& v : artifact.inputs)
      if (v.public_name.ends_with("~1"))
        CHECK(inputs.at(v.public_name).abs().max().item<double>() == 0);
    TensorMap out;
    CHECK_NOTHROW(out = model.forward(inputs));
    for (const auto& [o, value] : out)
      CHECK(value.isfinite().all().item<bool>());
  }
}

TEST_CASE("the lane test runs once per device, and its timings make chunk_overhead") {
  const auto artifact = elasticity();
  int lane_tests = 0;
  std::vector<double> direct, lane;
  std::int64_t chunks = 0;
  TuneOptions options{.sweep = {.max_rows = 16, .refine_rounds = 0, .budget_seconds = 5},
                      .repeats = 3,
                      .batch_rows = 64,
                      .max_chunks = 64,
                      .on_lane_test = [&](std::size_t d, const Timing& through_caller,
                                          const Timing& through_pool, std::int64_t per_call) {
                        CHECK(d == 0);
                        ++lane_tests;
                        direct = through_caller.seconds;
                        lane = through_pool.seconds;
                        chunks = per_call;
                      }};
  options.cpu_lanes = 2;
  const auto r = tune(artifact, {"cpu"}, options, "elasticity");
  REQUIRE(lane_tests == 1);
  CHECK(direct.size() == 3);
  CHECK(lane.size() == 3);
  // Calls of 64 rows through the pool in its chunks: the knee (at most 16 rows) times the 2
  // lanes that share each, so at least 2 chunks a call.
  CHECK(r.machine.cpu_lanes == 2);
  const auto pooled = 2 * r.devices[0].knee().rows;
  CHECK(chunks == (64 + pooled - 1) / pooled);
  CHECK(chunks >= 2);
  CHECK(r.devices[0].chunk_overhead == chunk_overhead_from(direct, lane, chunks));

  options.lane_test = false;
  lane_tests = 0;
  CHECK(tune(artifact, {"cpu"}, options).devices[0].chunk_overhead == 0);
  CHECK(lane_tests == 0);
}

TEST_CASE("tune() on a real model: a table whose keys match this machine") {
  const auto artifact = elasticity();
  std::vector<std::int64_t> seen;
  TuneOptions options{
      .sweep = {.max_rows = 64, .refine_rounds = 1, .budget_seconds = 5},
      .repeats = 2,
      .batch_rows = 64,
      .max_chunks = 64,
      .on_point = [&](std::size_t d, const TunePoint& p, const SweepProgress& progress) {
        CHECK(d == 0);
        CHECK(progress.budget_seconds == 5);
        CHECK(progress.spent_seconds > 0);
        seen.push_back(p.rows);
      }};
  const auto r = tune(artifact, {"cpu"}, options, "elasticity");
  REQUIRE(r.devices.size() == 1);
  const auto& curve = r.devices[0];
  CHECK(curve.points.size() == seen.size());
  CHECK(curve.points.front().rows == 1);
  for (const auto& p : curve.points) {
    CHECK(p.rows <= 64);
    CHECK(p.repeats == 2);
    CHECK(p.median > 0);
    CHECK(p.low <= p.median);
    CHECK(p.median <= p.high);
  }
  CHECK(std::isfinite(curve.chunk_overhead));
  CHECK(curve.chunk_overhead >= 0);
  check_tune_matches(r, artifact, at::kDouble); // made here: it matches
  const auto back = parse_tune_file(tune_file_text(r), "memory");
  check_tune_matches(back, artifact, at::kDouble);
  // Measured on the lanes a default policy takes here, and the file says how many.
  CHECK(r.machine.cpu_lanes == current_machine(at::kDouble).cpu_lanes);
  check_tune_matches(back, artifact, at::kDouble, {}, 0);

  options.operation = "jacobian";
  options.sweep.max_rows = 4;
  options.cpu_lanes = 3; // measured on the lanes asked for, and the table says how many
  const auto jacobian = tune(artifact, {"cpu"}, options);
  CHECK(jacobian.devices[0].points.back().rows <= 4);
  CHECK(jacobian.machine.cpu_lanes == 3);
  options.cpu_lanes = -1;
  CHECK_THROWS_WITH_AS((void)tune(artifact, {"cpu"}, options),
                       doctest::Contains("tune(): cpu_lanes is -1; give 0 (torch's intra-op "
                                         "thread count) to 1024"),
                       FatalError);
  options.cpu_lanes = 0;
  options.operation = "jvp";
  CHECK_THROWS_WITH_AS((void)tune(artifact, {"cpu"}, options),
                       doctest::Contains("operation 'jvp' is not one tune() measures"), FatalError);
}

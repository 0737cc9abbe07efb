// The tuner and the simulator checked against measurement, on the CPU:
//  1. per model (elasticity, J2 radial return): tune(), timed; then a dense sweep of chunk
//     sizes over one large batch through SyncChunking; then the dense sweep's best size and
//     the tuned size timed alternately (a fresh measurement of both: the best of many noisy
//     medians is biased upwards): the tuned size must reach 95 % of the dense best, and the
//     tuning of the forward model must take under 30 s;
//  2. the simulator: a CPU pool (GreedyPriorityCapacity{cpu} at the tuned knee) run for
//     real against simulate() on the tuned curve and lane test: within 10 %.
//
//   bench_tune [artifacts-folder]     (exit status 1 when a check fails)

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include <ATen/Parallel.h>

#include <neml2/detail/tune_measure.hpp>
#include <neml2/dispatch.hpp>
#include <neml2/simulate.hpp>
#include <neml2/tune.hpp>

namespace {

using clock_type = std::chrono::steady_clock;

struct Case {
  const char* artifact;
  const char* model;
  std::int64_t batch; // the large batch the chunk sizes are compared on
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds of one call of `inputs` through `model`.
template <class Model>
double seconds_of(const Model& model, const neml2::TensorMap& inputs) {
  const auto start = clock_type::now();
  (void)model.forward(inputs);
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

bool check(bool ok, const char* what) {
  std::printf("  %s: %s\n", ok ? "PASS" : "FAIL", what);
  return ok;
}

} // namespace

int main(int argc, char** argv) try {
  const std::filesystem::path artifacts = argc > 1 ? argv[1] : NEML2_DISPATCH_BENCH_ARTIFACTS;
  bool ok = true;
  std::printf("threads: %d (the machine may be loaded: ratios are from one run)\n",
              at::get_num_threads());
  for (const Case c : {Case{"elasticity_forward", "elasticity", 1 << 20},
                       Case{"j2_radial_return", "model", 1 << 17}}) {
    const auto stub = artifacts / c.artifact / (std::string(c.model) + "_aoti.i");
    const auto artifact = neml2::read_artifact(neml2::resolve_artifact_root(stub, c.model));
    const auto shared = std::make_shared<const neml2::Artifact>(artifact);
    std::printf("\n%s (%lld rows per batch)\n", c.artifact, static_cast<long long>(c.batch));

    const auto start = clock_type::now();
    const auto tuned = neml2::tune(artifact, {"cpu"}, {.batch_rows = c.batch}, c.model);
    const auto tuning = std::chrono::duration<double>(clock_type::now() - start).count();
    const auto rows = neml2::recommend(tuned).sync.front().batch_size;
    std::printf("  tune(): %.1f s, %zu sizes, best %lld rows (%.3e rows/s), stop: %s\n", tuning,
                tuned.devices[0].points.size(), static_cast<long long>(rows),
                tuned.devices[0].best().median, neml2::to_string(tuned.devices[0].stop).c_str());
    if (std::string(c.artifact) == "elasticity_forward")
      ok &= check(tuning < 30, "tuning a forward model on the CPU takes under 30 s");

    // Dense: every power of two and the midpoints between them, from 64 rows to the batch.
    std::vector<std::int64_t> dense;
    for (std::int64_t r = 64; r <= c.batch; r *= 2) {
      dense.push_back(r);
      if (2 * r <= c.batch)
        dense.push_back(static_cast<std::int64_t>(std::llround(r * std::sqrt(2.0))));
    }
    const auto inputs = neml2::detail::tune_inputs(artifact, {}, c.batch, "cpu", at::kDouble);
    const auto model_with = [&](std::int64_t chunk) {
      return neml2::DispatchedModel<neml2::SyncChunking>(shared,
                                                         {.device = "cpu", .batch_size = chunk});
    };
    double sweep_best = 0;
    std::int64_t best_rows = 0;
    for (const auto chunk : dense) {
      const auto m = model_with(chunk);
      (void)seconds_of(m, inputs);
      std::vector<double> times;
      for (int k = 0; k < 3; ++k)
        times.push_back(seconds_of(m, inputs));
      const auto rate = static_cast<double>(c.batch) / median(times);
      if (rate > sweep_best) {
        sweep_best = rate;
        best_rows = chunk;
      }
    }
    // The two sizes again, alternately: load drifts hit both alike.
    const auto tuned_model = model_with(rows), best_model = model_with(best_rows);
    (void)seconds_of(tuned_model, inputs);
    (void)seconds_of(best_model, inputs);
    std::vector<double> tuned_times, best_times;
    for (int k = 0; k < 15; ++k) {
      tuned_times.push_back(seconds_of(tuned_model, inputs));
      best_times.push_back(seconds_of(best_model, inputs));
    }
    const auto tuned_rate = static_cast<double>(c.batch) / median(tuned_times);
    const auto best_dense = static_cast<double>(c.batch) / median(best_times);
    std::printf("  dense sweep: %zu chunk sizes, best %lld rows (%.3e rows/s in the sweep); "
                "again beside the tuned %lld rows: %.3e against %.3e rows/s, %.1f %% of the "
                "best\n",
                dense.size(), static_cast<long long>(best_rows), sweep_best,
                static_cast<long long>(rows), best_dense, tuned_rate,
                100 * tuned_rate / best_dense);
    ok &= check(tuned_rate >= 0.95 * best_dense,
                "the tuned size reaches 95 % of the dense sweep's best");

    // The simulator against a real CPU pool at the knee: a CPU chunk is the knee's rows on
    // each of the lanes the sizes were measured on.
    const auto knee = tuned.devices[0].knee().rows;
    const auto lanes = tuned.machine.cpu_lanes;
    const neml2::GreedyPriorityCapacity pool{
        .devices = {"cpu"}, .batch_sizes = {knee * lanes}, .cpu_lanes = lanes};
    const neml2::DispatchedModel<neml2::GreedyPriorityCapacity> real(shared, pool);
    (void)seconds_of(real, inputs);
    std::vector<double> measured;
    for (int k = 0; k < 5; ++k)
      measured.push_back(seconds_of(real, inputs));
    const std::vector<neml2::SimulatedDevice> node = {
        {neml2::ThroughputCurve::from(tuned.devices[0], lanes), tuned.devices[0].chunk_overhead}};
    const auto sim = neml2::simulate(pool, node, c.batch);
    const auto ratio = sim.makespan / median(measured);
    std::printf(
        "  GreedyPriorityCapacity{cpu, %lld}: measured %.4f s, simulated %.4f s (%.1f %%; lane "
        "test %.3g us per chunk)\n",
        static_cast<long long>(knee * lanes), median(measured), sim.makespan, 100 * ratio,
        1e6 * tuned.devices[0].chunk_overhead);
    ok &= check(std::abs(ratio - 1) <= 0.10, "the simulated makespan is within 10 % of the run");
  }
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_tune failed: %s\n", neml2::detail::first_lines(e.what()).c_str());
  return 1;
}

// Implicit models against NEML2's own C++ runtime (neml2::aoti, from the neml2 wheel), same
// artifact, same process: J2 radial return (one unknown, a predictor) and Chaboche
// viscoplasticity (19 unknowns in one dense solve), every row plastic and 10 % plastic (the
// rest elastic).
//
// `<runtime>_<model>_<call>/BATCH/PLASTIC_PERCENT`: runtime `peer` (NEML2's runtime,
// SimpleScheduler on the CPU), `rows` (ours: the CPU's row pass, the default) or `tensor`
// (ours with row_pass = false: the tensor path accelerators take); model `j2` or
// `chaboche`; call `forward` or `jacobian`. NEML2_DISPATCH_BENCH_THREADS sets the intra-op
// threads (default 1, single_thread_main.cpp).
//
// `dispatched` / `compact_never` / `compact_always`, J2 forward on the tensor path,
// NAME/BATCH/PLASTIC_PERCENT: the working set compacted once at most half of it iterates
// (the default), never (converged rows masked) or whenever a row converges: the bounds that
// set compact_below's default for the tensor path (docs/performance.md).
//
// `scalar_plain` / `scalar_substepping`: the scalar backward-Euler model compiled without
// and with substepping (max_substepping_level = 3), NAME/BATCH/SUBSTEPPED_PERCENT: what
// substepping costs the rows that converge in one step (0 %), and with a few rows that
// need three spans (10 %).
//
// `<runtime>_binned_history/BATCH`: runtime `peer`, `rows` or `tensor` over a 100-step
// history of binned_precipitation (a number density over 8 size bins, solved per point),
// each step's bins the next step's `~1` input, homologous temperatures 0.5 to 1.5 across
// the points; items are point-steps.
//
// `lanes_<model>_<call>/BATCH/LANES`: ours on 1 or 2 CPU lanes (see on_lanes).
//
// `pool_sync` / `pool_greedy`, NAME/BATCH/CHUNK, all rows plastic: SyncChunking against
// GreedyPriorityCapacity on the CPU alone at the same chunk size (the pool's CPU lane
// against the calling thread).

#include <algorithm>
#include <filesystem>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <neml2/csrc/dispatchers/SimpleScheduler.h>
#include <neml2/csrc/dispatchers/factory.h>
#include <neml2/dispatch.hpp>

#include "graph/graph_calls.hpp" // the library's private hook: graph calls counted

namespace {

const auto stub =
    std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) / "j2_radial_return" / "model_aoti.i";

// One step from a stress-free state: the first `percent` of the rows strained past yield
// (yield strain 1e-2), the others well below it.
std::map<std::string, at::Tensor> inputs(std::int64_t batch, std::int64_t percent) {
  const auto opts = at::TensorOptions(at::kDouble);
  const auto direction = at::tensor({1.0, -0.5, -0.5, 0.2, 0.0, 0.0}, opts);
  const auto plastic = (at::arange(batch, opts) < batch * percent / 100.0).to(at::kDouble);
  const auto size = (2e-3 + 3e-2 * plastic) * (1 + 0.1 * at::rand({batch}, opts));
  return {{"E", size.unsqueeze(1) * direction},
          {"plastic_strain~1", at::zeros({batch, 6}, opts)},
          {"equivalent_plastic_strain~1", at::zeros({batch}, opts)},
          {"t", at::ones({batch}, opts)},
          {"t~1", at::zeros({batch}, opts)},
          {"flow_rate~1", at::zeros({batch}, opts)}};
}

// Chaboche viscoplasticity, one step from a stress-free state: the first `percent` of the
// rows strained well past yield (a yield stress of 5 at a modulus of 1e5), the others below.
const auto chaboche_stub = std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) /
                           "chaboche_viscoplasticity" / "model_aoti.i";

std::map<std::string, at::Tensor> chaboche_inputs(std::int64_t batch, std::int64_t percent) {
  const auto opts = at::TensorOptions(at::kDouble);
  const auto artifact = neml2::read_artifact(neml2::resolve_artifact_root(chaboche_stub, "model"));
  std::map<std::string, at::Tensor> x;
  for (const auto& input : artifact.inputs) {
    auto shape = input.base_shape;
    shape.insert(shape.begin(), batch);
    x[input.name] = at::zeros(shape, opts);
  }
  const auto direction = at::tensor({1.0, -0.5, -0.5, 0.2, 0.0, 0.0}, opts);
  const auto plastic = (at::arange(batch, opts) < batch * percent / 100.0).to(at::kDouble);
  const auto size = (2e-5 + 1e-3 * plastic) * (1 + 0.1 * at::rand({batch}, opts));
  x.at("E") = size.unsqueeze(1) * direction;
  x.at("t") = at::ones({batch}, opts);
  return x;
}

// A call on the case's inputs, after a few that are not measured: the first calls of a
// graph are slow (lazy initialization in the runtime).
template <class Model>
void measure(benchmark::State& state, Model& model, const std::map<std::string, at::Tensor>& x,
             bool jacobian) {
  const auto call = [&] {
    if (jacobian)
      benchmark::DoNotOptimize(model.jacobian(x));
    else
      benchmark::DoNotOptimize(model.forward(x));
  };
  for (int i = 0; i < (state.range(0) >= (1 << 14) ? 1 : 5); ++i)
    call();
  for (auto _ : state)
    call();
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
template <class Model>
void measure(benchmark::State& state, Model& model, std::int64_t percent) {
  measure(state, model, inputs(state.range(0), percent), false);
}
template <class Model>
void measure(benchmark::State& state, Model& model) {
  measure(state, model, state.range(1));
}

enum class Runtime { peer, rows, tensor };

// One family: a runtime on a model's call, BATCH/PLASTIC_PERCENT.
void versus_peer(benchmark::State& state, Runtime runtime, bool chaboche, bool jacobian) {
  const auto& path = chaboche ? chaboche_stub : stub;
  const auto x = chaboche ? chaboche_inputs(state.range(0), state.range(1))
                          : inputs(state.range(0), state.range(1));
  if (runtime == Runtime::peer) {
    auto model = neml2::aoti::load_model(path, "model",
                                         std::make_shared<neml2::aoti::SimpleScheduler>(
                                             neml2::aoti::SimpleScheduler::Config{"cpu", 0}));
    measure(state, model, x, jacobian);
    return;
  }
  auto model = neml2::load_model(path, "model", neml2::SyncChunking{.device = "cpu"});
  auto config = model.solver_config();
  config.row_pass = runtime == Runtime::rows;
  model.set_solver_config(config);
  // Rows x Newton iterations of one call: the rows each call of the jacobian graph takes
  // (one per iteration of a row; the derivative's own call included for jacobian()).
  std::int64_t row_iterations = 0;
  neml2::detail::observe_graph_calls([&](const std::string& file, std::int64_t rows) {
    row_iterations += file.ends_with("_jacobian.pt2") ? rows : 0;
  });
  benchmark::DoNotOptimize(jacobian ? model.jacobian(x).first : model.forward(x));
  neml2::detail::observe_graph_calls({});
  measure(state, model, x, jacobian);
  state.counters["row_iterations"] = static_cast<double>(row_iterations);
}

const auto binned_stub =
    std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) / "binned_precipitation" / "model_aoti.i";

// A 100-step history from empty bins: one forward call a step, its bins carried on.
template <class Model>
void run_history(benchmark::State& state, Model& model) {
  const auto batch = state.range(0);
  const auto opts = at::TensorOptions(at::kDouble);
  const auto temperature = at::linspace(0.5, 1.5, batch, opts);
  const auto history = [&] {
    auto bins = at::zeros({batch, 8}, opts);
    for (int step = 1; step <= 100; ++step)
      bins = model
                 .forward({{"T", temperature},
                           {"number_density~1", bins},
                           {"t", at::full({batch}, 0.1 * step, opts)},
                           {"t~1", at::full({batch}, 0.1 * (step - 1), opts)}})
                 .at("number_density");
    return bins;
  };
  benchmark::DoNotOptimize(history()); // the first calls of a graph are slow
  for (auto _ : state)
    benchmark::DoNotOptimize(history());
  state.SetItemsProcessed(state.iterations() * batch * 100);
}

void binned_history(benchmark::State& state, Runtime runtime) {
  if (runtime == Runtime::peer) {
    auto model = neml2::aoti::load_model(binned_stub, "model",
                                         std::make_shared<neml2::aoti::SimpleScheduler>(
                                             neml2::aoti::SimpleScheduler::Config{"cpu", 0}));
    run_history(state, model);
    return;
  }
  auto model = neml2::load_model(binned_stub, "model", neml2::SyncChunking{.device = "cpu"});
  auto config = model.solver_config();
  config.row_pass = runtime == Runtime::rows;
  model.set_solver_config(config);
  run_history(state, model);
}

// The machine's limits for the roofline line, on the intra-op threads: a copy of 512 MiB
// (bytes read and written per second) and a double matrix product of 2048 (flops per second).
void machine_copy(benchmark::State& state) {
  const auto from = at::rand({std::int64_t{1} << 26}, at::kDouble);
  auto to = at::empty_like(from);
  for (auto _ : state)
    to.copy_(from);
  state.SetBytesProcessed(state.iterations() * 2 * from.numel() * 8);
}
void machine_matmul(benchmark::State& state) {
  const auto a = at::rand({2048, 2048}, at::kDouble), b = at::rand({2048, 2048}, at::kDouble);
  for (auto _ : state)
    benchmark::DoNotOptimize(at::mm(a, b));
  state.counters["flops"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * 2 * 2048.0 * 2048 * 2048,
                         benchmark::Counter::kIsRate);
}

// On a GPU (artifact j2_radial_return_gpu, -DNEML2_DISPATCH_GPU_TESTS=ON): cpu inputs, cuda
// compute, results on the cpu for NEML2's runtime and ours alike; the results of the last
// call are checked against the CPU's (scripts/gpu-check.sh fails on the error).
const auto gpu_stub =
    std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) / "j2_radial_return_gpu" / "model_aoti.i";

template <class Model>
void measure_checked(benchmark::State& state, Model& model) {
  measure(state, model);
  const auto x = inputs(state.range(0), state.range(1));
  const auto cpu = neml2::load_model(stub, "model").forward(x);
  for (const auto& [name, value] : model.forward(x)) {
    const std::string output = name;
    const at::Tensor expected = cpu.at(output), actual = value.to(at::kCPU);
    const auto scale = std::max(expected.abs().max().item<double>(), 1e-300);
    if ((actual - expected).abs().max().item<double>() > 1e-10 * scale)
      state.SkipWithError(("'" + output + "' differs from the CPU's").c_str());
  }
}

void neml2_runtime_cuda(benchmark::State& state) {
  auto model = neml2::aoti::load_model(gpu_stub, "model",
                                       std::make_shared<neml2::aoti::SimpleScheduler>(
                                           neml2::aoti::SimpleScheduler::Config{"cuda:0", 0}));
  measure_checked(state, model);
}

void dispatched_cuda(benchmark::State& state) {
  auto model = neml2::load_model(gpu_stub, "model", neml2::SyncChunking{.device = "cuda:0"});
  measure_checked(state, model);
}

void run_dispatched(benchmark::State& state, double compact_below) {
  auto model = neml2::load_model(stub, "model", neml2::SyncChunking{.device = "cpu"});
  auto config = model.solver_config();
  config.row_pass = false; // the row pass always compacts
  if (compact_below >= 0)
    config.compact_below = compact_below;
  model.set_solver_config(config);
  measure(state, model);
}

void dispatched(benchmark::State& state) {
  run_dispatched(state, -1);
}
void compact_never(benchmark::State& state) {
  run_dispatched(state, 0);
}
void compact_always(benchmark::State& state) {
  run_dispatched(state, 1);
}

// x + dt x^2 = x~1 + dt a over dt = 0.1: a in [1, 2) converges in one step; a = -60 has
// no root in one step and takes spans of 1/2, 1/4, 1/4 (the first `percent` of the rows).
std::map<std::string, at::Tensor> scalar_inputs(std::int64_t batch, std::int64_t percent) {
  const auto opts = at::TensorOptions(at::kDouble);
  const auto hard = at::arange(batch, opts) < batch * percent / 100.0;
  return {{"a", at::where(hard, at::full({batch}, -60.0, opts), 1 + at::rand({batch}, opts))},
          {"x", at::full({batch}, 0.5, opts)},
          {"x~1", at::full({batch}, 0.5, opts)},
          {"t", at::full({batch}, 0.1, opts)},
          {"t~1", at::zeros({batch}, opts)}};
}

void run_scalar(benchmark::State& state, const char* artifact) {
  const auto path =
      std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) / artifact / "model_aoti.i";
  auto model = neml2::load_model(path, "model", neml2::SyncChunking{.device = "cpu"});
  const auto x = scalar_inputs(state.range(0), state.range(1));
  const auto call = [&] {
    try {
      benchmark::DoNotOptimize(model.forward(x));
    } catch (const neml2::ConvergenceError&) { // the hard rows without substepping
    }
  };
  for (int i = 0; i < 5; ++i)
    call();
  for (auto _ : state)
    call();
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void scalar_plain(benchmark::State& state) {
  run_scalar(state, "scalar_backward_euler");
}
void scalar_substepping(benchmark::State& state) {
  run_scalar(state, "scalar_substepping");
}

void substep_cases(benchmark::internal::Benchmark* b) {
  for (std::int64_t batch : {64, 1 << 14})
    for (std::int64_t percent : {0, 10})
      b->Args({batch, percent});
}

void versus(benchmark::internal::Benchmark* b) {
  for (std::int64_t batch : {1, 64, 1 << 14, 1 << 18})
    for (std::int64_t percent : {100, 10})
      b->Args({batch, percent});
}

void on_gpu(benchmark::internal::Benchmark* b) {
  b->Args({1 << 14, 100})->Args({1 << 18, 100})->Args({1 << 18, 10})->UseRealTime();
}

void thresholds(benchmark::internal::Benchmark* b) {
  for (std::int64_t percent : {100, 95, 90, 75, 50, 10})
    b->Args({1 << 14, percent});
}

} // namespace

void pool_sync(benchmark::State& state) {
  auto model = neml2::load_model(
      stub, "model", neml2::SyncChunking{.device = "cpu", .batch_size = state.range(1)});
  measure(state, model, 100);
}
void pool_greedy(benchmark::State& state) {
  auto model = neml2::load_model(
      stub, "model",
      neml2::GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {state.range(1)}});
  measure(state, model, 100);
}
void pool_chunks(benchmark::internal::Benchmark* b) {
  for (const std::int64_t chunk : {1 << 12, 1 << 14, 1 << 16})
    b->Args({1 << 17, chunk});
}

BENCHMARK(dispatched)->Apply(thresholds)->UseRealTime();
BENCHMARK(compact_never)->Apply(thresholds)->UseRealTime();
BENCHMARK(compact_always)->Apply(thresholds)->UseRealTime();
BENCHMARK(scalar_plain)->Apply(substep_cases)->UseRealTime();
BENCHMARK(scalar_substepping)->Apply(substep_cases)->UseRealTime();
BENCHMARK(machine_copy)->UseRealTime();
BENCHMARK(machine_matmul)->UseRealTime();
BENCHMARK(pool_sync)->Apply(pool_chunks)->UseRealTime();
BENCHMARK(pool_greedy)->Apply(pool_chunks)->UseRealTime();
// `lanes_<model>_<call>/BATCH/LANES`: ours on 1 or 2 CPU lanes (SyncChunking.cpu_lanes),
// whole batch, every row plastic; model `elasticity` (forward only), `j2` or `chaboche`.
// One process for both lane counts, so that what the process holds (its threads, glibc's
// arenas) is the same for both.
const auto elasticity_stub = std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) /
                             "elasticity_forward" / "elasticity_aoti.i";

void on_lanes(benchmark::State& state, const char* model, bool jacobian) {
  const std::string name = model;
  const auto batch = state.range(0);
  const auto policy = neml2::SyncChunking{.device = "cpu", .cpu_lanes = state.range(1)};
  if (name == "elasticity") {
    const auto m = neml2::load_model(elasticity_stub, "elasticity", policy);
    measure(state, m, {{"strain", 1e-3 * at::rand({batch, 6}, at::kDouble)}}, false);
    return;
  }
  const bool chaboche = name == "chaboche";
  const auto m = neml2::load_model(chaboche ? chaboche_stub : stub, "model", policy);
  measure(state, m, chaboche ? chaboche_inputs(batch, 100) : inputs(batch, 100), jacobian);
}

void lane_cases(benchmark::internal::Benchmark* b) {
  for (std::int64_t batch : {1, 64, 1024, 1 << 14, 1 << 16, 1 << 18, 1 << 20})
    for (std::int64_t lanes : {1, 2})
      b->Args({batch, lanes});
}
void lane_cases_chaboche(benchmark::internal::Benchmark* b) {
  for (std::int64_t batch : {1, 64, 1024, 1 << 14})
    for (std::int64_t lanes : {1, 2})
      b->Args({batch, lanes});
}

const bool lane_benchmarks = [] {
  benchmark::RegisterBenchmark("lanes_elasticity_forward", on_lanes, "elasticity", false)
      ->Apply(lane_cases)
      ->UseRealTime();
  for (const bool jacobian : {false, true}) {
    const std::string call = jacobian ? "_jacobian" : "_forward";
    benchmark::RegisterBenchmark(("lanes_j2" + call).c_str(), on_lanes, "j2", jacobian)
        ->Apply(lane_cases)
        ->UseRealTime();
    benchmark::RegisterBenchmark(("lanes_chaboche" + call).c_str(), on_lanes, "chaboche", jacobian)
        ->Apply(lane_cases_chaboche)
        ->UseRealTime();
  }
  return true;
}();

const bool versus_peer_benchmarks = [] {
  for (const auto& [runtime, runtime_name] :
       {std::pair{Runtime::peer, "peer"}, {Runtime::rows, "rows"}, {Runtime::tensor, "tensor"}}) {
    for (const bool chaboche : {false, true})
      for (const bool jacobian : {false, true}) {
        const auto name = std::string(runtime_name) + (chaboche ? "_chaboche" : "_j2") +
                          (jacobian ? "_jacobian" : "_forward");
        benchmark::RegisterBenchmark(name.c_str(), versus_peer, runtime, chaboche, jacobian)
            ->Apply(versus)
            ->UseRealTime();
      }
    benchmark::RegisterBenchmark((std::string(runtime_name) + "_binned_history").c_str(),
                                 binned_history, runtime)
        ->Arg(64)
        ->Arg(4096)
        ->UseRealTime();
  }
  return true;
}();
// J2 on cuda:0 against NEML2's runtime where a GPU and the artifact's cuda graphs exist
// (scripts/gpu-check.sh compiles them); registered at start-up, as BENCHMARK does.
const bool gpu_benchmarks = [] {
  if (neml2::device_count(neml2::DeviceFamily::cuda) > 0 &&
      std::filesystem::is_directory(gpu_stub.parent_path() / "model" / "cuda")) {
    benchmark::RegisterBenchmark("neml2_runtime_cuda", neml2_runtime_cuda)->Apply(on_gpu);
    benchmark::RegisterBenchmark("dispatched_cuda", dispatched_cuda)->Apply(on_gpu);
  }
  return true;
}();

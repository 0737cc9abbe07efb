// SyncChunking and GreedyPriorityCapacity on a CUDA device, against eager NEML2 and the CPU;
// the ordering of the caller's stream against the workers' (a slow kernel queued by the
// caller before a call, a reader queued before a call writes into its tensors), results
// kept while other calls run, implicit models and parameter derivatives on the GPU. Skips
// (exit code 77) where no CUDA device is visible; needs the artifacts of
// -DNEML2_DISPATCH_GPU_TESTS=ON.

#define DOCTEST_CONFIG_IMPLEMENT
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#ifdef NEML2_DISPATCH_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#endif

#include <neml2/detail/testing.hpp> // before_chunk

#include "model_checks.hpp"
#include "scratch.hpp"

using namespace neml2;
using test::contains;
namespace fs = std::filesystem;

namespace {
const auto stub = test::artifacts() / "elasticity_gpu" / "elasticity_aoti.i";
const auto params_stub = test::artifacts() / "elasticity_params_gpu" / "elasticity_aoti.i";
const auto j2_stub = test::artifacts() / "j2_radial_return_gpu" / "model_aoti.i";
const c10::Device gpu("cuda:0");

// Queues a kernel that spins for about 0.1 s (2e8 cycles at 2 GHz, longer at lower clocks)
// on this thread's current stream of cuda:0: a caller's slow kernel.
void delay_this_stream() {
#ifdef NEML2_DISPATCH_WITH_CUDA
  at::cuda::sleep(200'000'000);
#else
  FAIL("built without the CUDA runtime");
#endif
}

// A stream of cuda:0 that is not the default one (non-blocking, as the workers' are).
c10::Stream side_stream() {
  return c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStreamFromGlobalPool(gpu);
}

void synchronize_this_stream() {
  c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(gpu).synchronize();
}

neml2::TensorMap on_gpu(const neml2::TensorMap& values) {
  neml2::TensorMap out;
  for (const auto& [name, t] : values)
    out.emplace(name, t.to(gpu));
  return out;
}

// `values` on cuda:0 as a producer kernel of the caller writes them: zeros until a slow
// kernel on this thread's current stream has run, then the values (nothing waits here).
neml2::TensorMap produced_late(const neml2::TensorMap& values) {
  neml2::TensorMap ready = on_gpu(values), late;
  for (const auto& [name, t] : ready)
    late.emplace(name, at::zeros_like(t));
  delay_this_stream();
  for (auto& [name, t] : late)
    t.copy_(ready.at(name)); // device to device: queued behind the delay
  return late;
}

// Chunks of 8 rows on cuda:0, two in flight on the workers' streams: any batch above 8
// rows goes through the pool, not the direct path.
GreedyPriorityCapacity gpu_pool() {
  return {.devices = {"cuda:0"}, .batch_sizes = {8}, .capacities = {16}};
}
GreedyPriorityCapacity hybrid_pool() {
  return {.devices = {"cpu", "cuda:0"}, .batch_sizes = {4, 8}, .capacities = {4, 16}};
}

// `f(policy)` for a pool on cuda:0 and one over the CPU and cuda:0, each called from the
// default stream of cuda:0 and from a stream of the caller's own.
template <class F>
void for_each_caller_stream(F&& f) {
  for (const bool own_stream : {false, true}) {
    CAPTURE(own_stream);
    std::optional<c10::StreamGuard> caller;
    if (own_stream)
      caller.emplace(side_stream());
    for (const auto& policy : {gpu_pool(), hybrid_pool()}) {
      CAPTURE(policy.devices.size());
      f(policy);
    }
  }
}
} // namespace

TEST_CASE("chunks on cuda:0; inputs and results on the cpu") {
  const test::Reference ref("elasticity");
  for (std::int64_t rows : {3, 0}) {
    CAPTURE(rows);
    const auto m =
        load_model(stub, "elasticity", SyncChunking{.device = "cuda:0", .batch_size = rows});
    test::check_all_batches(m, ref, true, false);
    CHECK(m.forward(ref.group("b7/in")).at("stress").device().is_cpu());
  }
}

TEST_CASE("inputs already on the device: one direct call, results stay there") {
  const test::Reference ref("elasticity");
  const auto m = load_model(stub, "elasticity", SyncChunking{.device = "cuda"});
  CHECK(m.device() == Device("cuda:0")); // a bare family is pinned to the current device
  const auto out = m.forward({{"strain", ref["b33/in/strain"].to(at::Device("cuda:0"))}});
  CHECK(out.at("stress").device() == at::Device("cuda:0"));
  test::check_close(out.at("stress"), ref["b33/out/stress"], "stress on cuda:0");
}

TEST_CASE("a session refuses inputs on another device") {
  const auto artifact =
      std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(stub, "elasticity")));
  const Session s(artifact, "cuda:0");
  const auto message = test::fatal_message([&] {
    return s.forward({{"strain", at::zeros({2, 6}, at::kDouble)}});
  });
  CHECK(contains(message, "input 'strain' is on cpu, but this session runs on cuda:0"));
}

TEST_CASE("a pool over the CPU and cuda:0 gives the CPU's results; capacity keeps chunks in "
          "flight on their own streams") {
  const test::Reference ref("elasticity");
  const auto cpu = load_model(stub, "elasticity", SyncChunking{.batch_size = 5});
  for (std::int64_t capacity : {1, 2, 4}) {
    CAPTURE(capacity);
    auto m = load_model(stub, "elasticity",
                        GreedyPriorityCapacity{.devices = {"cpu", "cuda:0"},
                                               .batch_sizes = {2, 3},
                                               .capacities = {2, 3 * capacity},
                                               .priorities = {1, 2}});
    std::mutex mutex;
    std::set<std::string> used;
    m.set_observer([&](const ChunkEvent& e) {
      std::lock_guard lock(mutex);
      used.insert(e.device.str());
    });
    test::check_all_batches(m, ref, true, false);
    CHECK(used.count("cuda:0") == 1);
    for (const auto* c : {"b7", "b33"}) {
      const auto in = ref.group(std::string(c) + "/in");
      test::check_close(m.forward(in), cpu.forward(in), "pool against cpu", 1e-10);
      const auto [out, J] = m.jacobian(in);
      test::check_close(J.at("stress").at("strain"),
                        cpu.jacobian(in).second.at("stress").at("strain"), "dstress/dstrain",
                        1e-10);
    }
  }
  // Inputs on the GPU, whole batch on it: the pool is skipped, results stay on the GPU.
  const auto gpu_only = load_model(
      stub, "elasticity", GreedyPriorityCapacity{.devices = {"cuda:0"}, .batch_sizes = {64}});
  const auto out = gpu_only.forward({{"strain", ref["b33/in/strain"].to(at::Device("cuda:0"))}});
  CHECK(out.at("stress").device() == at::Device("cuda:0"));
  test::check_close(out.at("stress"), ref["b33/out/stress"], "stress on cuda:0");
}

TEST_CASE("a large batch over cuda:0 with 4 chunks in flight matches the CPU") {
  const auto x = 1e-3 * at::rand({1 << 18, 6}, at::kDouble);
  const auto cpu = load_model(stub, "elasticity").forward({{"strain", x}}).at("stress");
  const auto m =
      load_model(stub, "elasticity",
                 GreedyPriorityCapacity{
                     .devices = {"cuda:0"}, .batch_sizes = {1 << 14}, .capacities = {1 << 16}});
  for (int i = 0; i < 3; ++i) // staging buffers reused across calls
    test::check_close(m.forward({{"strain", x}}).at("stress"), cpu, "stress", 1e-10);
}

TEST_CASE("inputs of one call on two devices are refused") {
  const auto m = load_model(test::stub("rates", "eq"), "eq");
  auto inputs = test::Reference("rates").group("b7/in");
  inputs.at("b") = inputs.at("b").to(at::Device("cuda:0"));
  CHECK(contains(test::fatal_message([&] { return m.forward(inputs); }),
                 "input 'b' is on cuda:0 but 'a' is on cpu: all inputs of a call must be on "
                 "one device"));
}

TEST_CASE("CUDA graphs in the cpu folder are refused at load, naming the file") {
  const test::Scratch s;
  const auto root = s.copy_root("elasticity_gpu", "elasticity");
  fs::remove_all(root / "cpu" / "float64");
  fs::create_directories(root / "cpu");
  fs::copy(root / "cuda" / "float64", root / "cpu" / "float64", fs::copy_options::recursive);
  const auto message = test::fatal_message(
      [&] { return Session(std::make_shared<const Artifact>(read_artifact(root)), "cpu"); });
  CHECK(contains(message, "elasticity.pt2' was compiled for cuda, but it sits in the folder of "
                          "graphs for cpu"));
}

TEST_CASE("a pool call waits for the caller's kernels that produce its inputs") {
  // Workers run on streams of their own: without waiting for the caller's stream they read
  // the zeros the inputs hold before the caller's slow kernel has written them.
  const test::Reference ref("elasticity");
  const auto in = ref.group("b33/in");
  for_each_caller_stream([&](const GreedyPriorityCapacity& policy) {
    const auto m = load_model(stub, "elasticity", policy);
    test::check_close(m.forward(produced_late(in)), ref.group("b33/out"), "forward");
    const auto [out, J] = m.jacobian(produced_late(in));
    test::check_close(J.at("stress").at("strain"), ref["b33/jac/stress/strain"], "dstress/dstrain",
                      1e-10, true);
  });
}

TEST_CASE("a pool call writes into the caller's tensors after the caller's queued readers") {
  // The caller queues a slow kernel, then a copy of its output tensor (the old values),
  // then forward_into the same tensor: the copy must see the old values.
  const test::Reference ref("elasticity");
  const auto in = on_gpu(ref.group("b33/in"));
  for_each_caller_stream([&](const GreedyPriorityCapacity& policy) {
    const auto m = load_model(stub, "elasticity", policy);
    auto stress = at::full({33, 6}, 7.0, at::TensorOptions().dtype(at::kDouble).device(gpu));
    auto seen = at::empty_like(stress);
    delay_this_stream();
    seen.copy_(stress);
    m.forward_into(in, {{"stress", stress}});
    CHECK(at::all(seen.cpu() == 7.0).item<bool>());
    test::check_close(stress, ref["b33/out/stress"], "stress");
  });
}

TEST_CASE("a parameter set on the GPU is in place before the next pool call") {
  // set_parameter copies on the caller's stream; queued behind a slow kernel, a worker that
  // did not wait would still read the old value.
  const test::Reference ref("elasticity_params");
  const auto in = on_gpu(ref.group("b7/in"));
  auto cpu = load_model(test::stub("elasticity_params", "elasticity"), "elasticity");
  auto m = load_model(params_stub, "elasticity",
                      GreedyPriorityCapacity{.devices = {"cuda:0"}, .batch_sizes = {2}});
  const auto E = at::full({}, 2e5, at::kDouble);
  cpu.set_parameter("elasticity.E", E);
  const auto E_gpu = E.to(gpu);
  delay_this_stream();
  m.set_parameter("elasticity.E", E_gpu * 1); // made and copied behind the delay
  test::check_close(m.forward(in), cpu.forward(ref.group("b7/in")), "forward with the new E");
}

TEST_CASE("param_vjp over the CPU and cuda:0 sums the chunks of both, as on the CPU") {
  const test::Reference ref("elasticity_params");
  const auto m = load_model(params_stub, "elasticity", hybrid_pool());
  for (const auto* c : {"b7", "b33"}) {
    CAPTURE(c);
    test::check_param_vjp(m, ref, c);
    test::check_param_jacobian(m, ref, c);
    const auto gpu_in = on_gpu(ref.group(std::string(c) + "/in"));
    const auto gpu_cot = on_gpu(ref.group(std::string(c) + "/cot"));
    test::check_close(m.param_vjp(gpu_in, gpu_cot), ref.group(std::string(c) + "/pvjp"),
                      "param_vjp of inputs on cuda:0");
  }
}

TEST_CASE("parameter derivatives on cuda:0 match the CPU at 1e-10") {
  const test::Reference ref("elasticity_params");
  const auto cpu = load_model(test::stub("elasticity_params", "elasticity"), "elasticity");
  for (const auto* c : {"b7", "b33"}) {
    CAPTURE(c);
    const auto in = ref.group(std::string(c) + "/in");
    const auto cot = ref.group(std::string(c) + "/cot");
    const auto direct = load_model(params_stub, "elasticity", SyncChunking{.device = "cuda:0"});
    const auto chunked =
        load_model(params_stub, "elasticity", SyncChunking{.device = "cuda:0", .batch_size = 4});
    for (const auto* m : {&direct, &chunked}) {
      const auto [out, P] = m->param_jacobian(on_gpu(in));
      const auto [cpu_out, cpu_P] = cpu.param_jacobian(in);
      for (const auto& p : {"elasticity.E", "elasticity.nu"})
        test::check_close(P.at("stress").at(p), cpu_P.at("stress").at(p), std::string("d/d") + p);
      test::check_close(m->param_vjp(on_gpu(in), on_gpu(cot)), cpu.param_vjp(in, cot), "param_vjp");
    }
  }
}

TEST_CASE("results stay the caller's while 8 threads call one GPU model") {
  // Each thread, on a stream of its own, calls through the pool, queues a slow kernel and
  // then a copy of its results, and lets the results go: their memory must not go to the
  // kernels of other calls before that copy has run. Shared Jacobian blocks and parameter
  // sums are made on the workers' streams; outputs on the caller's.
  const test::Reference ref("elasticity_params");
  const auto m = load_model(params_stub, "elasticity", gpu_pool());
  const auto in = on_gpu(ref.group("b33/in"));
  const auto cot = on_gpu(ref.group("b33/cot"));
  std::atomic<int> wrong{0}, failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&] {
      try {
        const c10::StreamGuard own(side_stream());
        for (int i = 0; i < 4; ++i) {
          at::Tensor stress, J, dE;
          {
            auto [out, jac] = m.jacobian(in);
            auto grad = m.param_vjp(in, cot);
            delay_this_stream();
            stress = out.at("stress").clone();
            J = jac.at("stress").at("strain").clone();
            dE = grad.at("elasticity.E").clone();
          } // the results go; the clones are still queued behind the delay
          static_cast<void>(m.param_vjp(in, cot));
          const auto close = [](const at::Tensor& a, const at::Tensor& b) {
            return (a.cpu() - b).abs().max().item<double>() <= 1e-10 * b.abs().max().item<double>();
          };
          if (!close(stress, ref["b33/out/stress"]) || !close(dE, ref["b33/pvjp/elasticity.E"]) ||
              !close(J.expand_as(ref["b33/jac/stress/strain"]), ref["b33/jac/stress/strain"]))
            ++wrong;
        }
      } catch (...) {
        ++failed;
      }
    });
  for (auto& t : threads)
    t.join();
  CHECK(failed == 0);
  CHECK(wrong == 0);
}

TEST_CASE("a GPU chunk's seconds end when its results are ready") {
  // A slow kernel queued as the chunk starts: the seconds the observer and the policy see
  // include it (at least 0.05 s), not only the time to launch the graph.
  const test::Reference ref("elasticity");
  const auto in = on_gpu(ref.group("b33/in"));
  const auto check = [&](auto m) {
    neml2::detail::ModelAccess::before_chunk(m, [](const ChunkEvent&) { delay_this_stream(); });
    std::vector<double> seconds;
    std::mutex mutex;
    m.set_observer([&](const ChunkEvent& e) {
      std::lock_guard lock(mutex);
      seconds.push_back(e.seconds);
    });
    static_cast<void>(m.forward(in));
    REQUIRE(seconds.size() == 1);
    CHECK(seconds.front() >= 0.05);
  };
  check(load_model(stub, "elasticity", SyncChunking{.device = "cuda:0"}));
  check(load_model(stub, "elasticity",
                   GreedyPriorityCapacity{.devices = {"cuda:0"}, .batch_sizes = {64}}));
}

TEST_CASE("J2 radial return on cuda:0 matches the CPU at 1e-10") {
  const test::Reference ref("j2_radial_return");
  const auto cpu = load_model(test::stub("j2_radial_return", "model"), "model");
  for (const auto* c : {"s1", "s4"}) {
    CAPTURE(c);
    const auto in = ref.group(std::string(c) + "/in");
    const auto [cpu_out, cpu_J] = cpu.jacobian(in);
    test::check_close(cpu_out, ref.group(std::string(c) + "/out"), "cpu against NEML2", 1e-8);
    const auto check = [&](const auto& m, const neml2::TensorMap& inputs, const char* how) {
      CAPTURE(how);
      const auto [out, J] = m.jacobian(inputs);
      test::check_close(out, cpu_out, "outputs");
      for (const auto& [o, row] : cpu_J)
        for (const auto& [i, block] : row)
          test::check_close(J.at(o).at(i), block, "d" + o + "/d" + i, 1e-10,
                            J.at(o).at(i).dim() < block.dim());
    };
    check(load_model(j2_stub, "model", SyncChunking{.device = "cuda:0"}), on_gpu(in), "direct");
    check(load_model(j2_stub, "model", SyncChunking{.device = "cuda:0", .batch_size = 3}), in,
          "chunks from the cpu");
    check(load_model(j2_stub, "model", gpu_pool()), produced_late(in), "pool, inputs late");
  }
}

TEST_CASE("J2 rows that fail to converge on cuda:0: the same rows and results as the CPU") {
  // miters = 1 allows no update: only the elastic rows converge.
  const test::Reference ref("j2_radial_return");
  const auto in = ref.group("s4/in");
  auto cpu = load_model(test::stub("j2_radial_return", "model"), "model");
  auto config = cpu.solver_config();
  config.miters = 1;
  cpu.set_solver_config(config);
  const auto expected = test::convergence_error([&] { static_cast<void>(cpu.forward(in)); });
  const auto elastic = expected.converged_mask();
  REQUIRE(elastic.any().item<bool>());
  REQUIRE_FALSE(elastic.all().item<bool>());
  auto direct = load_model(j2_stub, "model", SyncChunking{.device = "cuda:0"});
  auto pool = load_model(j2_stub, "model", gpu_pool());
  direct.set_solver_config(config);
  pool.set_solver_config(config);
  for (const auto& e :
       {test::convergence_error([&] { static_cast<void>(direct.forward(on_gpu(in))); }),
        test::convergence_error([&] { static_cast<void>(pool.forward(on_gpu(in))); })}) {
    CHECK(at::equal(e.converged_mask().cpu(), elastic));
    for (const auto& [name, value] : expected.outputs())
      test::check_close(e.outputs().at(name).cpu().index({elastic}), value.index({elastic}),
                        "converged rows " + name);
  }
}

TEST_CASE("float32 inputs on cuda:0 are refused, naming the dtype to convert to") {
  // neml2-compile 3.1 writes float64 graphs even for --dtype float32 (a float32 leaf is
  // refused at load: test_artifact_info), so float32 reaches the GPU only as a wrong input.
  const auto m = load_model(stub, "elasticity", gpu_pool());
  const auto message = test::fatal_message([&] {
    return m.forward(
        {{"strain", at::zeros({9, 6}, at::TensorOptions().dtype(at::kFloat).device(gpu))}});
  });
  CHECK(contains(message, "has dtype Float, but the artifact"));
  CHECK(contains(message, "convert it with .to(Double)"));
}

int main(int argc, char** argv) {
  if (!at::hasCUDA()) {
    // scripts/gpu-check.sh sets NEML2_DISPATCH_REQUIRE_GPU: there a missing GPU fails.
    if (std::getenv("NEML2_DISPATCH_REQUIRE_GPU")) {
      std::puts("FAILED: no CUDA device is visible, and NEML2_DISPATCH_REQUIRE_GPU is set");
      return 1;
    }
    std::puts("SKIPPED: no CUDA device is visible; the CUDA tests need one");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}

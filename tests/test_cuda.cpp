// SyncChunking and GreedyPriorityCapacity on a CUDA device, against eager NEML2 and the CPU. Skips
// (exit code 77) where no CUDA device is visible; needs the artifacts of
// -DNEML2_DISPATCH_GPU_TESTS=ON.

#define DOCTEST_CONFIG_IMPLEMENT
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>

#include "model_checks.hpp"
#include "scratch.hpp"

using namespace neml2;
using test::contains;
namespace fs = std::filesystem;

namespace {
const auto stub = test::artifacts() / "elasticity_gpu" / "elasticity_aoti.i";
}

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

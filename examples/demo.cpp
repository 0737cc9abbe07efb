// The demo: a million material points through DispatchedModel with each built-in policy,
// timed, and checked against what eager NEML2 computes for the same points.
//
//   demo <artifacts-folder>     (the build's artifacts/ folder; scripts/demo.sh passes it)

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include <neml2/dispatch.hpp>

#include "reference_file.hpp"

int main(int argc, char** argv) try {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <artifacts-folder>\n", argv[0]);
    return 2;
  }
  const std::filesystem::path artifacts = argv[1];
  const auto reference = test::read_reference(artifacts / "elasticity_forward.ref");
  const auto& strain = reference.at("b1048576/in/strain");
  const auto& expected = reference.at("b1048576/out/stress");
  const auto batch = strain.size(0);

  const auto stub = artifacts / "elasticity_forward" / "elasticity_aoti.i";
  std::printf("model: %s [elasticity], linear isotropic elasticity, float64\n", stub.c_str());
  std::printf("batch: %lld material points\n\n", static_cast<long long>(batch));
  std::printf("%-44s %14s %12s\n", "policy", "points/s", "ms/batch");

  const auto difference = [&](const at::Tensor& stress) {
    return ((stress - expected).abs().max() / expected.abs().max()).item<double>();
  };
  double worst = 0;
  const neml2::TensorMap inputs = {{"strain", strain}};
  const auto run = [&](const std::string& label, auto policy) {
    const auto model = neml2::load_model(stub, "elasticity", policy);
    auto stress = model.forward(inputs).at("stress"); // warm-up
    constexpr int repeats = 10;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < repeats; ++i)
      stress = model.forward(inputs).at("stress");
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    const auto seconds = elapsed.count() / repeats;
    std::printf("%-44s %14.3e %12.2f\n", label.c_str(), static_cast<double>(batch) / seconds,
                1e3 * seconds);
    worst = std::max(worst, difference(stress));
  };
  run("SyncChunking{cpu, whole batch}", neml2::SyncChunking{.device = "cpu"});
  for (const std::int64_t rows : {1 << 14, 1 << 12})
    run("SyncChunking{cpu, " + std::to_string(rows) + "}",
        neml2::SyncChunking{.device = "cpu", .batch_size = rows});
  run("GreedyPriorityCapacity{{cpu}, {16384}}",
      neml2::GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {1 << 14}});
  if (!(worst <= 1e-12)) {
    std::printf("\nFAILED: stress differs from eager NEML2 by %.3e (relative)\n", worst);
    return 1;
  }
  std::printf("\nstress matches eager NEML2 on all %lld points for every policy (max relative "
              "difference %.1e)\n",
              static_cast<long long>(batch), worst);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "demo failed: %s\n", e.what());
  return 1;
}

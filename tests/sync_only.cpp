// A host that uses synchronous policies only, built as its own program: tests/CMakeLists.txt
// checks that it links no worker pool, asynchronous engine or stream helper (nm), and it
// checks here that loading and calling a model on one lane starts no thread, that its
// numbers are right (linear elasticity: stress = J strain, J from the model's own
// jacobian()), and that two lanes add torch's OpenMP team (one thread) and nothing else.

#include <cstdio>
#include <filesystem>

#include <ATen/Parallel.h> // at::set_num_threads, for the count below

#include <neml2/dispatch.hpp>

namespace {
std::size_t threads() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/task"))
    ++n;
  return n;
}
} // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: test_sync_only ELASTICITY_STUB\n");
    return 2;
  }
  at::set_num_threads(1); // torch's own team stays out of the count
  const auto before = threads();
  try {
    const auto model =
        neml2::load_model(argv[1], "elasticity", neml2::SyncChunking{.batch_size = 1000});
    const auto strain = 1e-3 * at::randn({4321, 6}, at::kDouble);
    const auto stress = model.forward({{"strain", strain}}).at("stress");
    const auto [outputs, J] = model.jacobian({{"strain", strain}});
    const auto C = J.at("stress").at("strain").reshape({-1, 6, 6}).select(0, 0);
    const auto expected = at::matmul(strain, C.transpose(0, 1));
    const auto error =
        (stress - expected).abs().max().item<double>() / expected.abs().max().item<double>();
    if (!(error < 1e-12) || !at::equal(outputs.at("stress"), stress)) {
      std::fprintf(stderr, "sync_only: wrong results (relative error %g)\n", error);
      return 1;
    }
  } catch (const neml2::Exception& e) {
    std::fprintf(stderr, "sync_only: %s\n", e.what());
    return 1;
  }
  const auto after = threads();
  if (after != before) {
    std::fprintf(stderr, "sync_only: %zu threads before loading and calling, %zu after\n", before,
                 after);
    return 1;
  }
  // On two lanes: the same bits, and no thread but torch's own OpenMP team (one more).
  try {
    const auto model = neml2::load_model(argv[1], "elasticity",
                                         neml2::SyncChunking{.batch_size = 1000, .cpu_lanes = 2});
    const auto one = neml2::load_model(argv[1], "elasticity",
                                       neml2::SyncChunking{.batch_size = 1000, .cpu_lanes = 1});
    const auto strain = 1e-3 * at::randn({4321, 6}, at::kDouble);
    if (!at::equal(model.forward({{"strain", strain}}).at("stress"),
                   one.forward({{"strain", strain}}).at("stress"))) {
      std::fprintf(stderr, "sync_only: two lanes give other bits than one\n");
      return 1;
    }
  } catch (const neml2::Exception& e) {
    std::fprintf(stderr, "sync_only: %s\n", e.what());
    return 1;
  }
  const auto laned = threads();
  if (laned > after + 1) {
    std::fprintf(stderr, "sync_only: %zu threads after a call on two lanes, %zu before\n", laned,
                 after);
    return 1;
  }
  std::printf("sync_only: %zu thread(s) before and after; results exact; %zu on two lanes\n", after,
              laned);
  return 0;
}

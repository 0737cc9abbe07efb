// SyncChunking on a CUDA device, against eager NEML2. Skips (exit code 77) where no CUDA
// device is visible; needs the artifacts of -DNEML2_DISPATCH_GPU_TESTS=ON.

#define DOCTEST_CONFIG_IMPLEMENT
#include <cstdio>

#include "model_checks.hpp"

using namespace neml2;
using test::contains;

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

int main(int argc, char** argv) {
  if (!at::hasCUDA()) {
    std::puts("SKIPPED: no CUDA device is visible; the CUDA tests need one");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}

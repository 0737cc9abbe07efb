// The custom-policy example: ThroughputBalancing (examples/throughput_balancing.hpp) next
// to GreedyPriorityCapacity on the same batch, over the CPU and, where one is visible and
// the artifact has its graphs, the first CUDA device. Prints each policy's throughput and
// where the rows went; exits non-zero unless both match SyncChunking exactly.
//
//   throughput_balancing <stub> <model> [batch]

#include "throughput_balancing.hpp"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>

namespace {

std::vector<neml2::Device> available_devices(const std::filesystem::path& root) {
  std::vector<neml2::Device> devices = {"cpu"};
  if (neml2::device_count(neml2::DeviceFamily::cuda) > 0 && std::filesystem::exists(root / "cuda"))
    devices.emplace_back("cuda:0");
  return devices;
}

template <class Policy>
at::Tensor run(const char* label, const std::filesystem::path& stub, const std::string& model,
               Policy policy, const neml2::TensorMap& inputs, const std::string& output) {
  auto m = neml2::load_model(stub, model, std::move(policy));
  std::map<std::string, std::int64_t> rows_per_device;
  std::size_t chunks = 0;
  auto result = m.forward(inputs).at(output); // warm-up (and a first measurement)
  m.set_observer([&](const neml2::ChunkEvent& e) {
    rows_per_device[e.device.str()] += e.rows;
    ++chunks;
  });
  constexpr int repeats = 5;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < repeats; ++i)
    result = m.forward(inputs).at(output);
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  const auto batch = inputs.begin()->second.size(0);
  std::printf("%-24s %12.3e rows/s %6zu chunks/call ", label,
              static_cast<double>(batch) * repeats / elapsed.count(), chunks / repeats);
  for (const auto& [device, rows] : rows_per_device)
    std::printf(" %s %.0f%%", device.c_str(),
                100.0 * static_cast<double>(rows) / (batch * repeats));
  std::printf("\n");
  return result;
}

} // namespace

int main(int argc, char** argv) try {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s <stub> <model> [batch]\n", argv[0]);
    return 2;
  }
  const std::filesystem::path stub = argv[1];
  const std::string model = argv[2];
  const std::int64_t batch = argc > 3 ? std::stoll(argv[3]) : 1 << 20;
  const auto root = neml2::resolve_artifact_root(stub, model);
  const auto devices = available_devices(root);

  const auto reference = neml2::load_model(stub, model);
  neml2::TensorMap inputs;
  for (std::size_t i = 0; i < reference.input_names().size(); ++i) {
    auto shape = reference.input_base_shapes()[i];
    shape.insert(shape.begin(), batch);
    inputs[reference.input_names()[i]] = 1e-3 * at::rand(shape, at::kDouble);
  }
  const auto output = reference.output_names().front();
  const auto expected = reference.forward(inputs).at(output);

  const auto greedy = run("GreedyPriorityCapacity", stub, model,
                          neml2::GreedyPriorityCapacity{.devices = devices, .batch_sizes = {16384}},
                          inputs, output);
  const auto balanced = run("ThroughputBalancing", stub, model,
                            ThroughputBalancing{.devices = devices}, inputs, output);
  if (!at::allclose(greedy, expected, 1e-13, 0) || !at::allclose(balanced, expected, 1e-13, 0)) {
    std::printf("FAILED: a policy's results differ from SyncChunking's\n");
    return 1;
  }
  std::printf("both policies match SyncChunking on all %lld rows\n", static_cast<long long>(batch));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "throughput_balancing failed: %s\n", e.what());
  return 1;
}

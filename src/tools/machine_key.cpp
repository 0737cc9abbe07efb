// The machine key a tune file is checked against: torch, threads, the CPU's lanes, the
// host CPU, each device's name and usability, and a hash of the artifact's files for a
// device.

#include <algorithm>
#include <fstream>
#include <sstream>

#include <ATen/Parallel.h>
#include <c10/util/hash.h>
#include <fmt/format.h>
#include <torch/headeronly/version.h>

#include <neml2/tune.hpp>

#include "core/cpu_lanes.hpp"
#include "tools/cuda_driver.hpp"

namespace neml2 {

static std::string host_cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.starts_with("model name")) {
      const auto colon = line.find(':');
      auto name = line.substr(colon == std::string::npos ? line.size() : colon + 1);
      name.erase(0, name.find_first_not_of(" \t"));
      return name;
    }
  return "unknown CPU";
}

// The lanes a model's CPU call runs on when its policy asks for `requested`, as the engine
// resolves them (src/engine/chunk_runner.cpp, bind): on this thread, against the
// runners its CPU session makes for them (a count out of range needs none: it is refused).
static int resolved_cpu_lanes(std::int64_t requested) {
  const auto runners =
      detail::cpu_runners(static_cast<std::size_t>(std::max<std::int64_t>(requested, 0)));
  return static_cast<int>(detail::resolve_cpu_lanes(requested, detail::lane_limits_here(runners),
                                                    detail::LanesAskedBy::current_machine));
}

MachineKey current_machine(c10::ScalarType dtype, std::int64_t cpu_lanes) {
  return {.torch_version = TORCH_VERSION,
          .intra_op_threads = at::get_num_threads(),
          .host_cpu = host_cpu_name(),
          .dtype = dtype_folder(dtype),
          .cpu_lanes = resolved_cpu_lanes(cpu_lanes)};
}

// A device this process can run on (index within the count), or a FatalError naming it.
static void require_usable(const Device& device) {
  const auto count = device_count(device.family());
  if (count == 0)
    throw FatalError(fmt::format("device {} cannot be used here: this process sees no {} device "
                                 "(torch built without it, or no driver); tune only the devices "
                                 "this machine has, e.g. --device cpu",
                                 device.str(), device.folder()));
  if (device.has_index() && static_cast<std::size_t>(device.index()) >= count)
    throw FatalError(fmt::format("device {} cannot be used here: this process sees {} {} "
                                 "device(s), {}:0 to {}:{}",
                                 device.str(), count, device.folder(), device.folder(),
                                 device.folder(), count - 1));
}

std::string device_name(const Device& device) {
  require_usable(device);
  if (device.family() == DeviceFamily::cpu)
    return host_cpu_name();
  if (device.family() == DeviceFamily::cuda)
    if (auto q = detail::cuda_query(device.has_index() ? device.index() : 0); !q.name.empty())
      return q.name;
  return std::string(device.folder());
}

std::string artifact_hash(const Artifact& artifact, const Device& device, c10::ScalarType dtype) {
  const auto read = [](const std::filesystem::path& file) {
    std::ifstream in(file, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  std::string content = read(artifact.root / "metadata.json");
  const auto leaf = artifact.leaf(device, dtype);
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(leaf))
    if (entry.is_regular_file())
      files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  for (const auto& f : files)
    content += "\n" + std::filesystem::relative(f, leaf).string() + "\n" + read(f);
  return c10::sha1(content).str();
}
} // namespace neml2

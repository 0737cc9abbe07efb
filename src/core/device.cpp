// Device counts and the rules for devices that run side by side.

#include <algorithm>
#include <vector>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <neml2/device.hpp>

namespace neml2 {

std::size_t device_count(DeviceFamily family) {
  const auto type = Device(family).torch().type();
  if (type == c10::DeviceType::CPU)
    return 1;
  if (!c10::impl::hasDeviceGuardImpl(type))
    return 0;
  try {
    return static_cast<std::size_t>(c10::impl::getDeviceGuardImpl(type)->deviceCount());
  } catch (...) { // no driver: none usable
    return 0;
  }
}

void validate_device_pool(std::span<const Device> devices, std::string_view who) {
  const auto listed = [&] {
    std::vector<std::string> names;
    for (const auto& d : devices)
      names.push_back(d.str());
    return fmt::format("{{{}}}", fmt::join(names, ", "));
  };
  if (devices.empty())
    throw FatalError(fmt::format("{} is empty; list at least one device, e.g. {{\"cpu\"}} or "
                                 "{{\"cpu\", \"cuda:0\"}}",
                                 who));
  const auto cpus = std::count_if(devices.begin(), devices.end(),
                                  [](const Device& d) { return d.family() == DeviceFamily::cpu; });
  if (cpus > 1)
    throw FatalError(fmt::format("{} {} lists the CPU {} times (cpu and cpu:0 are the same "
                                 "device); a pool takes at most one CPU, whose chunks already run "
                                 "on all of its lanes (cpu_lanes; by default one per intra-op "
                                 "thread): keep one",
                                 who, listed(), cpus));
  for (auto family : known_device_families) {
    if (!is_accelerator(family))
      continue;
    std::vector<int> indices;
    int bare = 0;
    for (const auto& d : devices)
      if (d.family() == family)
        d.has_index() ? indices.push_back(d.index()) : void(++bare);
    const auto f = std::string(name(family));
    if (bare > 1)
      throw FatalError(fmt::format("{} {} lists '{}' {} times; list each device once (pin them "
                                   "as '{}:0', '{}:1', ... to use several)",
                                   who, listed(), f, bare, f, f));
    if (bare == 1 && !indices.empty()) {
      if (device_count(family) == 1 && indices == std::vector<int>{0})
        throw FatalError(fmt::format("{} {} lists '{}' and '{}:0', which are the same device "
                                     "here (one {} device): list it once",
                                     who, listed(), f, f, f));
      throw FatalError(fmt::format("{} {} mixes a bare '{}' with pinned '{}:N' devices; the bare "
                                   "one could be any of them: pin it too, or list only '{}'",
                                   who, listed(), f, f, f));
    }
    std::sort(indices.begin(), indices.end());
    if (const auto dup = std::adjacent_find(indices.begin(), indices.end()); dup != indices.end())
      throw FatalError(
          fmt::format("{} {} lists '{}:{}' twice; list each device once", who, listed(), f, *dup));
  }
}

} // namespace neml2

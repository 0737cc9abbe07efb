#pragma once

/// @file device.hpp
/// @brief Device families (cpu, cuda, xpu, hip, mps), their indexed forms (cuda:1), and
/// the lowercase folder names under an artifact root.

#include <array>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <ostream>
#include <span>
#include <string>
#include <string_view>

#include <c10/core/Device.h>

#include <neml2/errors.hpp>

namespace neml2 {

/// The device families a compiled artifact can target.
enum class DeviceFamily : std::uint8_t { cpu, cuda, xpu, hip, mps };

/// Every DeviceFamily, in declaration order.
inline constexpr std::array<DeviceFamily, 5> known_device_families = {
    DeviceFamily::cpu, DeviceFamily::cuda, DeviceFamily::xpu, DeviceFamily::hip, DeviceFamily::mps};

/// The family's name: what `--device` takes and the artifact's folder name.
constexpr std::string_view name(DeviceFamily family) noexcept {
  constexpr std::array<std::string_view, 5> names = {"cpu", "cuda", "xpu", "hip", "mps"};
  return names[static_cast<std::size_t>(family)];
}

/// Everything but the host CPU.
constexpr bool is_accelerator(DeviceFamily family) noexcept {
  return family != DeviceFamily::cpu;
}

/// @brief A device: a family and an optional index (`cuda` is the current CUDA device,
/// `cuda:1` a pinned one). Built from a string such as "cuda:1" or from an at::Device.
/// @code
/// neml2::Device gpu = "cuda:1";   // throws FatalError for "gpu", "cuda:x", ...
/// at::Tensor x = at::ones({3}, gpu.torch());
/// @endcode
///
/// Thread safety: a small value (a family and an index); const use from any number of
/// threads is safe, as for any value type.
class Device {
public:
  /// A family and an index (-1: the bare family).
  /* implicit */ Device(DeviceFamily family = DeviceFamily::cpu, int index = -1)
      : _family(family)
      , _index(index) {}
  /// From "cpu", "cuda", "cuda:1", ...; a FatalError for an unknown family or a bad index.
  /* implicit */ Device(std::string_view text) { parse(text); }
  /// @copydoc Device(std::string_view)
  /* implicit */ Device(const char* text) { parse(text); }
  /// @copydoc Device(std::string_view)
  /* implicit */ Device(const std::string& text) { parse(text); }
  /// From a torch device; a FatalError for a type this library does not know (meta, ...).
  /* implicit */ Device(const c10::Device& device);

  /// The family: cpu, cuda, ...
  [[nodiscard]] DeviceFamily family() const noexcept { return _family; }
  /// The pinned index, or -1 for a bare family.
  [[nodiscard]] int index() const noexcept { return _index; }
  /// True for a pinned device (`cuda:1`), false for a bare family (`cuda`).
  [[nodiscard]] bool has_index() const noexcept { return _index >= 0; }
  /// Everything but the host CPU.
  [[nodiscard]] bool is_accelerator() const noexcept { return neml2::is_accelerator(_family); }
  /// The folder under an artifact root that holds this family's graphs.
  [[nodiscard]] std::string_view folder() const noexcept { return name(_family); }
  /// "cpu", "cuda:1": what the constructor takes.
  [[nodiscard]] std::string str() const {
    return has_index() ? std::string(name(_family)) + ':' + std::to_string(_index)
                       : std::string(name(_family));
  }
  /// The torch device, for at::Tensor::to and at::TensorOptions.
  [[nodiscard]] c10::Device torch() const;

  /// Same family and index (`cuda` and `cuda:0` differ here).
  friend bool operator==(const Device&, const Device&) = default;

private:
  void parse(std::string_view text);
  void check_index() const;

  DeviceFamily _family = DeviceFamily::cpu;
  int _index = -1;
};

/// Writes str().
inline std::ostream& operator<<(std::ostream& os, const Device& device) {
  return os << device.str();
}

/// "{cpu, cuda:0}": a list of devices for error messages.
inline std::string devices_text(std::span<const Device> devices) {
  std::string text;
  for (const auto& d : devices)
    text += (text.empty() ? "{" : ", ") + d.str();
  return text.empty() ? "{}" : text + "}";
}

/// "cpu, cuda, xpu, hip, mps": for error messages.
inline std::string known_device_families_text() {
  std::string text;
  for (auto f : known_device_families)
    text += (text.empty() ? "" : ", ") + std::string(name(f));
  return text;
}

/// How many devices of `family` this process can use (0 where torch has no backend or
/// driver for it; 1 for the CPU).
[[nodiscard]] std::size_t device_count(DeviceFamily family);

/// Checks devices meant to run side by side (a pool); `who` names the list in errors, as
/// in "GreedyPriorityCapacity.devices". Refused: an empty list, a device twice (`cpu` and
/// `cpu:0` are one; so are `cuda` and `cuda:0` where one CUDA device exists), a bare
/// family next to pinned devices of that family, and more than one CPU.
void validate_device_pool(std::span<const Device> devices, std::string_view who);

inline void Device::parse(std::string_view text) {
  const auto colon = text.find(':');
  const auto family = text.substr(0, colon);
  bool known = false;
  for (auto f : known_device_families)
    if (name(f) == family) {
      _family = f;
      known = true;
    }
  if (!known)
    throw FatalError("unknown device family '" + std::string(family) + "' in device '" +
                     std::string(text) + "'; known families (lowercase): " +
                     known_device_families_text() + ", optionally indexed as in 'cuda:1'");
  if (colon == std::string_view::npos)
    return;
  const auto digits = text.substr(colon + 1);
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), _index);
  if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size() || _index < 0)
    throw FatalError("bad device index in '" + std::string(text) +
                     "': expected a non-negative integer after the colon, as in '" +
                     std::string(family) + ":0'");
  check_index(); // an index torch cannot address fails here, not on another device later
}

inline Device::Device(const c10::Device& device)
    : _index(device.has_index() ? device.index() : -1) {
  switch (device.type()) {
  case c10::DeviceType::CPU:
    _family = DeviceFamily::cpu;
    break;
  case c10::DeviceType::CUDA:
    _family = DeviceFamily::cuda;
    break;
  case c10::DeviceType::XPU:
    _family = DeviceFamily::xpu;
    break;
  case c10::DeviceType::HIP:
    _family = DeviceFamily::hip;
    break;
  case c10::DeviceType::MPS:
    _family = DeviceFamily::mps;
    break;
  default:
    throw FatalError("device '" + device.str() +
                     "' is of no known family; known families: " + known_device_families_text());
  }
}

inline void Device::check_index() const {
  if (_index > std::numeric_limits<c10::DeviceIndex>::max())
    throw FatalError("device index " + std::to_string(_index) + " of '" + str() +
                     "' is out of range: torch addresses devices 0 to " +
                     std::to_string(std::numeric_limits<c10::DeviceIndex>::max()) +
                     " of a family; use one this process has (device_count())");
}

inline c10::Device Device::torch() const {
  check_index();
  constexpr std::array<c10::DeviceType, 5> types = {c10::DeviceType::CPU, c10::DeviceType::CUDA,
                                                    c10::DeviceType::XPU, c10::DeviceType::HIP,
                                                    c10::DeviceType::MPS};
  return {types[static_cast<std::size_t>(_family)],
          static_cast<c10::DeviceIndex>(has_index() ? _index : -1)};
}

/// The most lanes the CPU's chunks of a call may run on: what a policy's `cpu_lanes` (a data
/// member or a member function; 0 or none: torch's intra-op thread count,
/// at::get_num_threads(), at each call) may ask for (<neml2/policy.hpp>).
inline constexpr std::int64_t max_cpu_lanes = 1024;

} // namespace neml2

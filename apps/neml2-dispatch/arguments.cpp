// What the commands share: the checks of their arguments, and the device validator.

#include "arguments.hpp"

#include <fmt/format.h>
#include <unistd.h>

namespace program {

void check_writable(const fs::path& file, const char* flag) {
  const auto folder = file.has_parent_path() ? file.parent_path() : fs::path(".");
  if (!fs::is_directory(folder) || ::access(folder.c_str(), W_OK) != 0)
    throw UsageError(fmt::format("{} {}: the folder {} does not exist or is not writable; "
                                 "give a file in a writable folder",
                                 flag, file.string(), folder.string()));
}

const CLI::Validator device_check(
    [](std::string& text) {
      try {
        (void)neml2::Device(text);
        return std::string();
      } catch (const neml2::FatalError& e) {
        return std::string(e.what());
      }
    },
    "DEVICE", "device");

std::pair<std::string, std::pair<double, double>> parse_range(const std::string& text) {
  const auto eq = text.find('=');
  const auto colon = text.find(':', eq == std::string::npos ? 0 : eq);
  try {
    if (eq == std::string::npos || colon == std::string::npos || eq == 0)
      throw std::invalid_argument("");
    std::size_t end = 0;
    const auto low = std::stod(text.substr(eq + 1, colon - eq - 1), &end);
    const auto high = std::stod(text.substr(colon + 1));
    if (!(low <= high))
      throw std::invalid_argument("");
    return {text.substr(0, eq), {low, high}};
  } catch (const std::exception&) {
    throw UsageError("--range '" + text +
                     "' is not NAME=LOW:HIGH with LOW <= HIGH (e.g. strain=-1e-3:1e-3)");
  }
}

std::vector<neml2::Device> as_devices(const std::vector<std::string>& names) {
  return {names.begin(), names.end()};
}

} // namespace program

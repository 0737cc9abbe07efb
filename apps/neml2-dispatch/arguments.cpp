// What the commands share: the checks of their arguments, and the device validator.

#include "arguments.hpp"

#include <charconv>
#include <cmath>

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

std::optional<double> parse_finite(std::string_view text) {
  double value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size() ||
      !std::isfinite(value))
    return std::nullopt;
  return value;
}

std::optional<std::int64_t> parse_integer(std::string_view text) {
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size())
    return std::nullopt;
  return value;
}

const CLI::Validator finite_positive(
    [](const std::string& text) {
      const auto value = parse_finite(text);
      return value && *value > 0 ? std::string()
                                 : "'" + text + "' is not a finite number > 0 (e.g. 2.5)";
    },
    "POSITIVE", "finite_positive");

CLI::Validator whole_number(std::int64_t minimum) {
  return {[minimum](const std::string& text) {
            const auto value = parse_integer(text);
            return value && *value >= minimum
                       ? std::string()
                       : fmt::format("'{}' is not a whole number >= {} (e.g. 1024)", text, minimum);
          },
          "WHOLE", "whole_number"};
}

std::pair<std::string, std::pair<double, double>> parse_range(const std::string& text) {
  const auto eq = text.find('=');
  const auto colon = text.find(':', eq == std::string::npos ? 0 : eq);
  if (eq != std::string::npos && colon != std::string::npos && eq > 0) {
    const std::string_view whole(text);
    const auto low = parse_finite(whole.substr(eq + 1, colon - eq - 1));
    const auto high = parse_finite(whole.substr(colon + 1));
    if (low && high && *low <= *high)
      return {text.substr(0, eq), {*low, *high}};
  }
  throw UsageError("--range '" + text +
                   "' is not NAME=LOW:HIGH with finite LOW <= HIGH (e.g. strain=-1e-3:1e-3)");
}

std::vector<neml2::Device> as_devices(const std::vector<std::string>& names) {
  return {names.begin(), names.end()};
}

} // namespace program

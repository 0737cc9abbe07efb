// The <device>/<dtype>/ folders of graphs: dtype folder names, the folder a model loads.

#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <neml2/artifact.hpp>

#include "core/bounded_files.hpp"

namespace fs = std::filesystem;

namespace neml2 {
namespace {

// "cpu/float64, cuda/float32": the leaf folders under an artifact root, or "none".
std::string list_leaves(const fs::path& root) {
  std::vector<std::string> leaves;
  std::error_code ec;
  for (const auto& dev : fs::directory_iterator(root, ec))
    if (dev.is_directory(ec))
      for (const auto& dt : fs::directory_iterator(dev.path(), ec))
        if (dt.is_directory(ec))
          leaves.push_back(dev.path().filename().string() + "/" + dt.path().filename().string());
  std::sort(leaves.begin(), leaves.end());
  return leaves.empty() ? "none" : fmt::format("{}", fmt::join(leaves, ", "));
}

} // namespace

std::string dtype_folder(c10::ScalarType dtype) {
  switch (dtype) {
  case c10::kDouble:
    return "float64";
  case c10::kFloat:
    return "float32";
  default:
    throw FatalError(fmt::format("dtype {} has no compiled artifacts: neml2-compile --dtype "
                                 "takes float64 or float32",
                                 c10::toString(dtype)));
  }
}

c10::ScalarType dtype_from_name(const std::string& name) {
  static const std::map<std::string, c10::ScalarType> known = {
      {"float64", c10::kDouble},    {"float32", c10::kFloat}, {"float16", c10::kHalf},
      {"bfloat16", c10::kBFloat16}, {"int64", c10::kLong},    {"int32", c10::kInt},
      {"bool", c10::kBool}};
  const auto it = known.find(name.starts_with("torch.") ? name.substr(6) : name);
  if (it == known.end())
    throw FatalError(fmt::format("unknown dtype '{}'", name));
  return it->second;
}

fs::path Artifact::leaf(const Device& device, c10::ScalarType dtype) const {
  auto dir = root / std::string(device.folder()) / dtype_folder(dtype);
  if (fs::is_directory(detail::status_of(dir, "the graphs folder")))
    return dir;
  throw FatalError(fmt::format(
      "artifact '{}' has no graphs for device {} and dtype {} (no folder {}/{}); it has: {}. "
      "Compile them with: neml2-compile <input.i> --model {} --device {} --dtype {} (plus the "
      "-p/-d options used before)",
      root.string(), device.str(), dtype_folder(dtype), device.folder(), dtype_folder(dtype),
      list_leaves(root), root.filename().string(), device.folder(), dtype_folder(dtype)));
}

} // namespace neml2

#pragma once

// Reads the reference values tools/make_reference.py writes: reference.json (name ->
// offset, shape, dtype) over the raw float64 values in reference.bin.

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

namespace test {

inline std::map<std::string, at::Tensor> read_reference(const std::filesystem::path& dir) {
  std::ifstream index_file(dir / "reference.json");
  std::ifstream bin(dir / "reference.bin", std::ios::binary);
  if (!index_file || !bin)
    throw std::runtime_error("no reference values in " + dir.string() +
                             " (built by the neml2_dispatch_artifacts target)");
  const auto index = nlohmann::json::parse(index_file);
  const std::string bytes{std::istreambuf_iterator<char>(bin), {}};
  std::map<std::string, at::Tensor> tensors;
  for (const auto& [key, entry] : index.items()) {
    auto t = at::empty(entry["shape"].get<std::vector<std::int64_t>>(), at::kDouble);
    const auto offset = entry["offset"].get<std::size_t>();
    if (offset + t.nbytes() > bytes.size())
      throw std::runtime_error(dir.string() + "/reference.bin is truncated at '" + key + "'");
    std::memcpy(t.data_ptr(), bytes.data() + offset, t.nbytes());
    tensors.emplace(key, std::move(t));
  }
  return tensors;
}

} // namespace test

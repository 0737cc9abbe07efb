#pragma once

// A compiled graph's signature as its package states it (src/graph/package.cpp): every
// check the loader makes of the archive, before PyTorch's reader sees it.

#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace neml2::detail {

/// What a graph's generated wrapper checks of one input.
struct GraphInput {
  std::string dtype;               ///< "float64", ...; empty when unchecked
  std::vector<std::int64_t> sizes; ///< per dimension: the size, or -1 where it varies
  std::int64_t min_rows = 0;       ///< bounds of a varying leading (batch) dimension
  std::int64_t max_rows = std::numeric_limits<std::int64_t>::max();
  [[nodiscard]] bool batched() const { return !sizes.empty() && sizes.front() < 0; }
};

/// A package's signature, as read from the package itself.
struct GraphSignature {
  std::string archive_name; ///< the folder every record sits in: the file stem it was written as
  std::string device_type;  ///< what it was compiled for ("cpu", "cuda"); empty when unsaid
  std::size_t num_inputs = 0, num_outputs = 0;
  std::vector<GraphInput> inputs;
};

/// Reads the signature of `file`; a FatalError naming the file when it is not a readable
/// AOTInductor package with a generated wrapper, or is far larger than any real one.
[[nodiscard]] GraphSignature read_graph_signature(const std::filesystem::path& file);
/// The same from the package's bytes in memory (`file` names it in errors): every check
/// the file version makes, before PyTorch's reader sees the bytes (fuzz/fuzz_package.cpp).
[[nodiscard]] GraphSignature read_graph_signature(std::string_view bytes,
                                                  const std::filesystem::path& file);

/// A signature's sizes as text: `(B, 6)`, with B where the size varies.
[[nodiscard]] std::string shape_of(const std::vector<std::int64_t>& sizes);

} // namespace neml2::detail

#pragma once

// Scratch copies of compiled artifacts, for tests that damage them.

#include <atomic>
#include <fstream>
#include <string>

#include <unistd.h>

#include "reference.hpp"

namespace test {

// A scratch folder, removed at the end of the test.
struct Scratch {
  fs::path dir;
  Scratch() {
    static std::atomic<int> counter = 0;
    dir = fs::temp_directory_path() /
          ("neml2_dispatch_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(dir);
  }
  ~Scratch() { fs::remove_all(dir); }

  fs::path write(const std::string& name, const std::string& text) const {
    const auto file = dir / name;
    fs::create_directories(file.parent_path());
    std::ofstream(file) << text;
    return file;
  }

  // A copy of a compiled artifact root.
  fs::path copy_root(const std::string& artifact, const std::string& model) const {
    const auto to = dir / model;
    fs::copy(artifacts() / artifact / model, to, fs::copy_options::recursive);
    return to;
  }
};

inline std::string read(const fs::path& file) {
  std::ifstream in(file);
  return {std::istreambuf_iterator<char>(in), {}};
}

// Replaces `file` (a file or a folder) with a file of `bytes`.
inline void write_bytes(const fs::path& file, const std::string& bytes) {
  fs::remove_all(file);
  std::ofstream(file, std::ios::binary) << bytes;
}

// Rewrites a copied root's metadata.json: one replacement at a time, from the original.
inline auto metadata_rewriter(const fs::path& root) {
  const auto meta = root / "metadata.json";
  return [meta, original = read(meta)](const std::string& from, const std::string& to) {
    auto text = original;
    const auto at = text.find(from);
    REQUIRE(at != std::string::npos);
    text.replace(at, from.size(), to);
    std::ofstream(meta) << text;
  };
}

} // namespace test

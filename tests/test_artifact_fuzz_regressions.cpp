// What the fuzz targets (fuzz/) found, kept as inputs that must give a FatalError naming
// the field, and every seed of their corpora replayed: each parses or is a FatalError.

#include <fstream>
#include <sstream>

#include <doctest/doctest.h>

#include <neml2/artifact.hpp>
#include <neml2/errors.hpp>

namespace fs = std::filesystem;
using neml2::FatalError;

namespace {

const fs::path corpus = fs::path(NEML2_DISPATCH_TEST_SOURCES) / ".." / "fuzz" / "corpus";

std::string read(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return std::move(text).str();
}

// The FatalError's message, or a failed check when parsing succeeds or throws another type.
std::string metadata_error(const std::string& seed) {
  try {
    (void)neml2::detail::parse_metadata(read(corpus / "metadata" / seed), "fuzz");
    FAIL_CHECK(seed << " parsed without an error");
  } catch (const FatalError& e) {
    return e.what();
  }
  return {};
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

} // namespace

TEST_CASE("a float where metadata.json needs an integer is a FatalError naming the field") {
  // Was undefined behaviour: nlohmann casts 1e300 to std::int64_t (UBSan: float-cast-overflow).
  const auto shape = metadata_error("float_shape.json");
  CHECK(has(shape, "field 'inputs[0].base_shape': 1e+300 is not an integer"));
  // Was silently read as schema 14.
  CHECK(has(metadata_error("float_schema_version.json"), "14.5 is not an integer"));
}

TEST_CASE("an integer out of range in metadata.json is a FatalError naming the field") {
  // Was read as -1 (2^64 - 1 cast to std::int64_t).
  CHECK(has(metadata_error("unsigned_shape.json"),
            "field 'inputs[0].base_shape': 18446744073709551615 is out of range"));
  // Was signed overflow (undefined behaviour) while counting the parameter's elements.
  CHECK(has(metadata_error("overflowing_shape.json"),
            "field 'parameters[0].shape': size 9223372036854775807 in [9223372036854775807, "
            "9223372036854775807] is not a size between 0 and"));
}

TEST_CASE("a stub nested deeper than any stub is a FatalError, not a stack overflow") {
  // 300,000 nested blocks overflowed the stack when the block tree was destroyed (ASan).
  std::string deep;
  for (int i = 0; i < 300000; ++i)
    deep += "[a]\n";
  CHECK_THROWS_WITH_AS((void)neml2::detail::artifact_root_from_stub(deep, "deep_aoti.i", "model"),
                       doctest::Contains("deep_aoti.i:65: section [a] is nested more than 64"),
                       FatalError);
}

TEST_CASE("every seed of the fuzz corpora parses or is a FatalError") {
  int replayed = 0;
  for (const auto& entry : fs::directory_iterator(corpus / "metadata")) {
    CAPTURE(entry.path());
    try {
      (void)neml2::detail::parse_metadata(read(entry.path()), "fuzz");
    } catch (const FatalError&) {
    }
    ++replayed;
  }
  for (const auto& entry : fs::directory_iterator(corpus / "stub")) {
    CAPTURE(entry.path());
    for (const char* model : {"model", "elasticity", "eq"})
      try {
        (void)neml2::detail::artifact_root_from_stub(read(entry.path()), entry.path(), model);
      } catch (const FatalError&) {
      }
    ++replayed;
  }
  CHECK(replayed >= 10);
}

// libFuzzer target: the metadata.json reader (neml2::detail::parse_metadata).
// A FatalError is the correct answer to a malformed file; anything else that leaves the
// parser (another exception, a crash, a hang, a sanitizer report) is a bug.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include <neml2/artifact.hpp>
#include <neml2/errors.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const auto artifact = neml2::detail::parse_metadata(text, "fuzz/artifact");
    (void)artifact.single_forward();
  } catch (const neml2::FatalError&) {
  }
  return 0;
}

// libFuzzer target: the tune file reader (neml2::parse_tune_file).
// A FatalError is the correct answer to a malformed file; anything else that leaves the
// parser (another exception, a crash, a hang, a sanitizer report) is a bug.

#include <cstddef>
#include <cstdint>
#include <string>

#include <neml2/errors.hpp>
#include <neml2/tune.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    (void)neml2::parse_tune_file(text, "fuzz.tune.json");
  } catch (const neml2::FatalError&) {
  }
  return 0;
}

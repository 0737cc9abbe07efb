// libFuzzer target: the HIT stub parser (neml2::detail::artifact_root_from_stub).
// A FatalError is the correct answer to a malformed stub; anything else that leaves the
// parser (another exception, a crash, a hang, a sanitizer report) is a bug.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include <neml2/artifact.hpp>
#include <neml2/errors.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  // The model names of the seed stubs, so that the fuzzer reaches the block checks.
  for (const char* model : {"model", "elasticity", "eq"}) {
    try {
      (void)neml2::detail::artifact_root_from_stub(text, "fuzz/model_aoti.i", model);
    } catch (const neml2::FatalError&) {
    }
  }
  return 0;
}

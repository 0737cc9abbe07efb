// libFuzzer target: the HIT stub parser (neml2::detail::artifact_root_from_stub), with a
// model name and without one (a stub of one model loads by itself), and stub_models().
// A FatalError is the correct answer to a malformed stub; anything else that leaves the
// parser (another exception, a crash, a hang, a sanitizer report) is a bug.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <neml2/artifact.hpp>
#include <neml2/errors.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> names;
  try {
    names = neml2::detail::stub_models(text, "fuzz/model_aoti.i");
  } catch (const neml2::FatalError&) {
    return 0; // the same parse fails below too: no need to repeat it
  }
  // No name (one model loads by itself), an empty one, and the stub's own first and last
  // model names, so that the fuzzer reaches the block checks.
  std::vector<std::optional<std::string>> models = {std::nullopt, ""};
  if (!names.empty())
    models.insert(models.end(), {names.front(), names.back()});
  for (const auto& model : models) {
    try {
      (void)neml2::detail::artifact_root_from_stub(text, "fuzz/model_aoti.i", model);
    } catch (const neml2::FatalError&) {
    }
  }
  return 0;
}

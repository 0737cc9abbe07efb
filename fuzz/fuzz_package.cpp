// libFuzzer target: the .pt2 package reader (neml2::detail::read_graph_signature on bytes
// in memory: the zip checks, PyTorch's archive reader, the generated wrapper's regular
// expressions). An input that starts as a zip does is read as the package; any other is
// read as the text of the wrapper inside a valid archive (written by PyTorch's own
// archive writer, CRC-32s included), so that its mutations reach the regular expressions
// instead of stopping at the CRC check. Seeds: fuzz/corpus/package/ (strip_package.py).
// A FatalError is the correct answer to a malformed package; anything else that leaves
// the reader (another exception, a crash, a hang, a sanitizer report) is a bug.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <caffe2/serialize/inline_container.h>

#include <neml2/errors.hpp>

#include "graph/graph.hpp"

namespace {

// An archive named `fuzz` holding `wrapper` as the generated wrapper's source.
std::string archive_with(std::string_view wrapper) {
  std::string bytes;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, std::size_t n) {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  const std::string_view device = R"({"AOTI_DEVICE_KEY": "cpu"})";
  writer.writeRecord("data/aotinductor/model/fuzz.wrapper.cpp", wrapper.data(), wrapper.size());
  writer.writeRecord("data/aotinductor/model/fuzz.wrapper_metadata.json", device.data(),
                     device.size());
  writer.writeEndOfFile();
  return bytes;
}

void read(std::string_view bytes) {
  try {
    (void)neml2::detail::read_graph_signature(bytes, "fuzz/cpu/float64/fuzz.pt2");
  } catch (const neml2::FatalError&) {
  }
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  if (bytes.starts_with("PK\x03\x04"))
    read(bytes);
  else
    read(archive_with(bytes));
  return 0;
}

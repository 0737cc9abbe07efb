// A compiled graph's package read before PyTorch's reader sees it: the zip archive and
// its records' sizes and CRC-32s, then the signature its generated wrapper checks.

#include "graph/package.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cstring>
#include <optional>
#include <regex>

#include <caffe2/serialize/inline_container.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <neml2/errors.hpp>

#include "core/bounded_files.hpp"

namespace fs = std::filesystem;

namespace neml2::detail {
namespace {

constexpr std::string_view recompile = "recompile the artifact with neml2-compile";

[[noreturn]] void not_a_package(const fs::path& file, const std::string& why) {
  throw FatalError(fmt::format("graph file '{}' is not a compiled graph neml2-dispatch can use "
                               "({}); the artifact is damaged or incomplete: recompile it with "
                               "neml2-compile",
                               file.string(), why));
}

// The text records read here (the generated wrapper and its metadata): at most 16 MiB, a
// margin of 160 over the largest real wrapper (99 KiB, of the models in models/). A run of
// one character class longer than 4 KiB (the longest real one: 156 characters) is refused
// too: std::regex matches \d+, \w+ and \s* by recursion, one frame per character, and
// 100,000 of them overflow the stack.
constexpr std::size_t max_wrapper_bytes = std::size_t(16) << 20;
constexpr std::size_t max_run = 4096;
// What a signature may declare: far more than any real graph (a few dozen arguments of at
// most 6 dimensions), little enough that nothing sized by it runs out of memory.
constexpr std::size_t max_arguments = 1 << 16;
constexpr std::size_t max_dims = 64;

// The records read here: the generated wrapper's source and its metadata.
bool read_as_text(const std::string& record) {
  return record.ends_with("wrapper.cpp") || record.ends_with("wrapper_metadata.json");
}

// The folder every record of a PyTorch archive sits in, from the name of the zip's first
// local file header (the same record PyTorch takes the archive's name from).
std::string archive_name(std::string_view bytes, const fs::path& file) {
  if (bytes.size() < 30)
    not_a_package(file, "shorter than a zip header");
  const auto* header = reinterpret_cast<const unsigned char*>(bytes.data());
  if (header[0] != 'P' || header[1] != 'K' || header[2] != 3 || header[3] != 4)
    not_a_package(file, "not a zip archive");
  const auto name_length = std::size_t(header[26]) | std::size_t(header[27]) << 8;
  if (bytes.size() < 30 + name_length)
    not_a_package(file, "truncated zip header");
  const auto name = bytes.substr(30, name_length);
  const auto slash = name.find('/');
  if (slash == std::string::npos || slash == 0)
    not_a_package(file, "its records are not in one folder");
  return std::string(name.substr(0, slash));
}

std::uint32_t crc32(const unsigned char* data, std::size_t size) {
  static const auto table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      auto c = i;
      for (int k = 0; k < 8; ++k)
        c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  std::uint32_t c = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < size; ++i)
    c = table[(c ^ data[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

// Every record of the package against the CRC-32 its zip directory stores: the loader
// does not check them, and a damaged shared library inside would run (SIGILL, SIGSEGV).
// And every record's size: PyTorch's reader allocates what the directory says before it
// reads a record. And what PyTorch's reader checks when it opens the archive (the folder
// of the directory's first entry, a version record it can parse and supports): when its
// constructor throws, torch 2.12 leaks the zip reader it opened.
void check_records(std::string_view bytes, const std::string& folder, const fs::path& file) {
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  const auto size = bytes.size();
  const auto u16 = [&](std::size_t at) {
    return at + 2 <= size ? std::uint32_t(data[at]) | std::uint32_t(data[at + 1]) << 8 : 0u;
  };
  const auto u32 = [&](std::size_t at) { return u16(at) | u16(at + 2) << 16; };
  const auto damaged = [&](const std::string& why) { not_a_package(file, why); };
  // The end-of-central-directory record: 22 bytes plus a comment of at most 64 KiB.
  std::size_t end = std::string::npos;
  for (std::size_t at = size >= 22 ? size - 22 : 0; size >= 22; --at) {
    if (u32(at) == 0x06054b50u) {
      end = at;
      break;
    }
    if (at == 0 || size - at > 22 + 0xFFFF)
      break;
  }
  if (end == std::string::npos)
    damaged("no zip directory at its end: truncated");
  const auto entries = u16(end + 10);
  std::size_t at = u32(end + 16);
  if (at == 0xFFFFFFFFu || entries == 0xFFFFu)
    damaged("a zip64 archive, which neml2-compile writes only for graphs larger than 4 GiB");
  // `.data/version` and `version`: the text of a stored record, nullopt in a compressed one.
  std::optional<std::optional<std::string>> version, old_version;
  // Records lie apart in the file, each unpacking to at most max_package_bytes together:
  // the checks below read each byte once, whatever the directory claims (tens of thousands
  // of entries naming one large record would otherwise cost its CRC-32 each time).
  std::size_t all_stored = 0, all_unpacked = 0;
  for (std::uint32_t e = 0; e < entries; ++e) {
    if (u32(at) != 0x02014b50u)
      damaged(fmt::format("zip directory entry {} is damaged", e));
    const auto method = u16(at + 10);
    const auto crc = u32(at + 16);
    const std::size_t stored = u32(at + 20);
    const std::size_t unpacked = u32(at + 24);
    const std::size_t local = u32(at + 42);
    const auto name_length = u16(at + 28);
    const std::string name(bytes.substr(std::min(at + 46, size), name_length));
    const auto next = at + 46 + name_length + u16(at + 30) + u16(at + 32);
    if (u32(local) != 0x04034b50u)
      damaged(fmt::format("record '{}' is damaged", name));
    const auto begin = local + 30 + u16(local + 26) + u16(local + 28);
    if (begin + stored > size)
      damaged(fmt::format("record '{}' is cut short", name));
    if ((method == 0 && unpacked != stored) || unpacked > max_package_bytes ||
        (unpacked > max_wrapper_bytes && read_as_text(name)))
      damaged(fmt::format("record '{}' says it unpacks to {} bytes", name, unpacked));
    all_stored += stored;
    all_unpacked += unpacked;
    if (all_stored > size)
      damaged(fmt::format("its zip directory's first {} records hold {} bytes, more than the "
                          "file's {}: records that overlap",
                          e + 1, all_stored, size));
    if (all_unpacked > max_package_bytes)
      damaged(fmt::format("its records unpack to more than {} bytes together", max_package_bytes));
    if (method == 0 && crc32(data + begin, stored) != crc)
      damaged(fmt::format("record '{}' fails its CRC-32 check", name));
    if (e == 0 && !name.starts_with(folder + "/"))
      damaged(
          fmt::format("its zip directory's first record '{}' is not in folder '{}'", name, folder));
    if (name == folder + "/.data/version" || name == folder + "/version")
      (name.ends_with(".data/version") ? version : old_version) =
          method == 0 ? std::optional(std::string(bytes.substr(begin, stored))) : std::nullopt;
    at = next;
  }
  if (!version && !old_version)
    damaged(fmt::format("it holds no version record ('{}/version')", folder));
  const auto stored_text = version ? *version : *old_version;
  if (!stored_text) // compressed (neml2-compile stores every record): PyTorch's reader reads it
    return;
  const auto& text = *stored_text;
  std::uint64_t number = 0;
  try {
    number = std::stoull(text); // as PyTorch's reader reads it
  } catch (const std::exception&) {
    damaged(fmt::format("its version record holds '{}', not a number",
                        first_lines(std::string_view(text).substr(0, 40), 1)));
  }
  if (number < caffe2::serialize::kMinSupportedFileFormatVersion ||
      number > caffe2::serialize::kMaxSupportedFileFormatVersion)
    damaged(fmt::format("its archive format version {} is not one PyTorch reads ({} to {})", number,
                        caffe2::serialize::kMinSupportedFileFormatVersion,
                        caffe2::serialize::kMaxSupportedFileFormatVersion));
}

// A decimal number the wrapper's regular expressions matched, at most `most`.
template <class T>
T number(const std::ssub_match& digits, T most, const fs::path& file, const char* what) {
  T value{};
  const auto* first = &*digits.first;
  const auto [end, error] = std::from_chars(first, first + digits.length(), value);
  if (error != std::errc() || value > most)
    not_a_package(file,
                  fmt::format("its wrapper holds {} {}, more than {}", what, digits.str(), most));
  return value;
}

// The generated wrapper's input checks, one `check_input_<i>` function per argument.
std::vector<GraphInput> wrapper_inputs(const std::string& source, const fs::path& file) {
  static const std::regex function(R"(static void check_input_(\d+)\()");
  static const std::regex dtype(R"(_expected_dtype = aoti_torch_dtype_(\w+)\(\))");
  static const std::regex below(R"(_size\[(\d+)\] < (\d+)\))");
  static const std::regex above(R"(_size\[(\d+)\] > (\d+)\))");
  static const std::regex fixed(R"(if \((\d+) != \w+_size\[(\d+)\]\))");
  static const std::regex stride(R"(_stride\[(\d+)\])");
  constexpr auto most_rows = std::numeric_limits<std::int64_t>::max();
  std::vector<std::pair<std::size_t, std::size_t>> bodies; // (start, index)
  for (std::sregex_iterator it(source.begin(), source.end(), function), end; it != end; ++it)
    bodies.emplace_back(it->position(),
                        number<std::size_t>((*it)[1], max_arguments, file, "input number"));
  std::vector<GraphInput> inputs(bodies.size());
  for (std::size_t k = 0; k < bodies.size(); ++k) {
    const auto start = source.begin() + static_cast<std::ptrdiff_t>(bodies[k].first);
    const auto stop = k + 1 < bodies.size()
                          ? source.begin() + static_cast<std::ptrdiff_t>(bodies[k + 1].first)
                          : source.end();
    if (bodies[k].second >= inputs.size())
      continue;
    auto& in = inputs[bodies[k].second];
    std::size_t rank = 0;
    const auto dim = [&](const std::ssub_match& m) {
      const auto d = number<std::size_t>(m, max_dims - 1, file, "dimension");
      rank = std::max<std::size_t>(rank, d + 1);
      return d;
    };
    const auto size = [&](const std::ssub_match& m) {
      return number<std::int64_t>(m, most_rows, file, "size");
    };
    std::smatch m;
    if (std::regex_search(start, stop, m, dtype))
      in.dtype = m[1].str();
    std::vector<std::pair<std::size_t, std::int64_t>> sizes;
    for (std::sregex_iterator it(start, stop, fixed), end; it != end; ++it)
      sizes.emplace_back(dim((*it)[2]), size((*it)[1]));
    for (std::sregex_iterator it(start, stop, stride), end; it != end; ++it)
      dim((*it)[1]);
    for (std::sregex_iterator it(start, stop, below), end; it != end; ++it)
      if (dim((*it)[1]) == 0)
        in.min_rows = size((*it)[2]);
    for (std::sregex_iterator it(start, stop, above), end; it != end; ++it)
      if (dim((*it)[1]) == 0)
        in.max_rows = size((*it)[2]);
    in.sizes.assign(rank, -1);
    for (const auto& [d, s] : sizes)
      in.sizes[d] = s;
  }
  return inputs;
}

// A text record the regular expressions will read: no run longer than they can match.
void check_runs(std::string_view text, const fs::path& file, const std::string& record) {
  const auto kind = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' ? 1
           : std::isspace(static_cast<unsigned char>(c))           ? 2
                                                                   : 0;
  };
  std::size_t run = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    run = i > 0 && kind(text[i]) != 0 && kind(text[i]) == kind(text[i - 1]) ? run + 1 : 1;
    if (run > max_run)
      not_a_package(file, fmt::format("its record '{}' holds a word or a blank of more than {} "
                                      "characters",
                                      record, max_run));
  }
}

// Bytes of a package in memory, for PyTorch's reader.
class BytesReader final : public caffe2::serialize::ReadAdapterInterface {
public:
  explicit BytesReader(std::string_view bytes)
      : _bytes(bytes) {}
  std::size_t size() const override { return _bytes.size(); }
  std::size_t read(std::uint64_t pos, void* buf, std::size_t n, const char*) const override {
    if (pos >= _bytes.size())
      return 0;
    n = std::min<std::size_t>(n, _bytes.size() - pos);
    std::memcpy(buf, _bytes.data() + pos, n);
    return n;
  }

private:
  std::string_view _bytes;
};

} // namespace

GraphSignature read_graph_signature(std::string_view bytes, const fs::path& file) {
  check_size(bytes.size(), max_package_bytes, "graph file", file.string(), recompile);
  GraphSignature s;
  s.archive_name = archive_name(bytes, file);
  check_records(bytes, s.archive_name, file);
  std::string source;
  try {
    caffe2::serialize::PyTorchStreamReader reader(std::make_shared<BytesReader>(bytes));
    for (const auto& record : reader.getAllRecords()) {
      if (!read_as_text(record))
        continue;
      const auto [data, size] = reader.getRecord(record);
      std::string text(static_cast<const char*>(data.get()), size);
      check_runs(text, file, record);
      if (record.ends_with("wrapper.cpp"))
        source = std::move(text);
      else {
        static const std::regex key(R"re("AOTI_DEVICE_KEY":\s*"(\w+)")re");
        std::smatch m;
        if (std::regex_search(text, m, key))
          s.device_type = m[1].str();
      }
    }
  } catch (const FatalError&) {
    throw;
  } catch (const std::exception& e) {
    not_a_package(file, first_lines(e.what()));
  }
  static const std::regex counts(R"(AOTInductorModelBase\(\s*(\d+),\s*(\d+),)");
  std::smatch m;
  if (source.empty() || !std::regex_search(source, m, counts))
    not_a_package(file, "it holds no generated wrapper source to check its signature against");
  s.num_inputs = number<std::size_t>(m[1], max_arguments, file, "an input count");
  s.num_outputs = number<std::size_t>(m[2], max_arguments, file, "an output count");
  s.inputs = wrapper_inputs(source, file);
  if (s.inputs.size() != s.num_inputs)
    not_a_package(file, fmt::format("its wrapper declares {} inputs but checks {}", s.num_inputs,
                                    s.inputs.size()));
  return s;
}

GraphSignature read_graph_signature(const fs::path& file) {
  return read_graph_signature(read_text(file, "graph file", max_package_bytes, recompile), file);
}

std::string shape_of(const std::vector<std::int64_t>& sizes) {
  std::vector<std::string> dims;
  for (auto s : sizes)
    dims.push_back(s < 0 ? "B" : std::to_string(s));
  return fmt::format("({})", fmt::join(dims, ", "));
}

} // namespace neml2::detail

// Files read whole within a bound; too large, not a file or unreadable: a FatalError.

#include "core/bounded_files.hpp"

#include <array>
#include <fstream>

#include <fmt/format.h>

#include <neml2/errors.hpp>

namespace fs = std::filesystem;

namespace neml2::detail {
namespace {

[[noreturn]] void unreadable(const char* what, const fs::path& path, const std::string& why) {
  throw FatalError(fmt::format("cannot read {} '{}' ({}): check that it exists, that every link "
                               "on the way resolves, and that you may read it",
                               what, path.string(), why));
}

const char* kind_of(fs::file_type type) {
  switch (type) {
  case fs::file_type::directory:
    return "folder";
  case fs::file_type::fifo:
    return "FIFO";
  case fs::file_type::socket:
    return "socket";
  case fs::file_type::character:
    return "character device";
  case fs::file_type::block:
    return "block device";
  default:
    return "special file";
  }
}

} // namespace

void check_size(std::uintmax_t size, std::size_t max_bytes, std::string_view what,
                const std::string& path, std::string_view fix) {
  if (size > max_bytes)
    throw FatalError(fmt::format("{} '{}' is {} bytes, more than the {} bytes read at most (a "
                                 "real one is far smaller); {}",
                                 what, path, size, max_bytes, fix));
}

std::string read_text(const fs::path& file, const char* what, std::size_t max_bytes,
                      std::string_view fix) {
  const auto status = status_of(file, what);
  if (fs::exists(status) && !fs::is_regular_file(status))
    throw FatalError(fmt::format("{} '{}' is not a regular file but a {}; {}", what, file.string(),
                                 kind_of(status.type()), fix));
  std::error_code ec;
  if (const auto size = fs::file_size(file, ec); !ec)
    check_size(size, max_bytes, what, file.string(), fix);
  // Read no further than the bound: a file can grow, and /proc's files say size 0.
  std::ifstream in(file, std::ios::binary);
  std::string text;
  try {
    std::array<char, 1 << 16> block{};
    while (in && text.size() <= max_bytes) {
      const auto n = in.rdbuf()->sgetn(block.data(), block.size());
      if (n <= 0)
        break;
      text.append(block.data(), static_cast<std::size_t>(n));
    }
  } catch (const std::exception& e) { // a read error, e.g. reading /proc/self/mem
    unreadable(what, file, e.what());
  }
  check_size(text.size(), max_bytes, what, file.string(), fix);
  if (!in || in.bad())
    unreadable(what, file, "the read failed");
  return text;
}

void check_json_bounds(std::string_view text, const std::string& where, std::string_view fix) {
  std::size_t depth = 0, values = 0, line = 1;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\n') {
      ++line;
    } else if (c == '"') { // a string, its escapes skipped
      while (++i < text.size() && text[i] != '"')
        if (text[i] == '\\')
          ++i;
      ++values;
    } else if (c == '[' || c == '{') {
      if (++depth > max_json_depth)
        throw FatalError(fmt::format("{}: JSON nested more than {} deep (line {}); {}", where,
                                     max_json_depth, line, fix));
      ++values;
    } else if (c == ']' || c == '}') {
      depth -= depth > 0;
    } else if (c == ',') {
      ++values;
    }
    if (values > max_json_values)
      throw FatalError(fmt::format("{}: more than {} JSON values (line {}); {}", where,
                                   max_json_values, line, fix));
  }
}

// fs::status without exceptions: a loop of links or an overlong name is the caller's
// FatalError, not a std::filesystem::filesystem_error.
fs::file_status status_of(const fs::path& path, const char* what) {
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory)
    unreadable(what, path, ec.message());
  return status;
}

} // namespace neml2::detail

#pragma once

// Files read whole within a bound, with errors of our own family, and the bounds every
// reader (the stub, metadata.json, a graph package, a tune file) checks before a
// third-party parser sees the text.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace neml2::detail {

/// The most a file of each kind may be, far above any real one: the largest of the 19
/// compiled models of models/ is a stub of 637 bytes, a metadata.json of 22 KB, a graph
/// package of 1.25 MiB; a tune file is about 5 KB. Margins: 1,600, 3,000, 400 and 3,000.
/// A larger file is refused before it is read (and read no further than the bound).
inline constexpr std::size_t max_stub_bytes = std::size_t(1) << 20;
inline constexpr std::size_t max_metadata_bytes = std::size_t(64) << 20;
inline constexpr std::size_t max_tune_bytes = std::size_t(16) << 20;
inline constexpr std::size_t max_package_bytes = std::size_t(512) << 20;

/// JSON (metadata.json, a tune file) nests at most 8 deep and holds at most 834 values in
/// those models; nlohmann's parser and the copies made of its values are bounded by these.
inline constexpr std::size_t max_json_depth = 64;
inline constexpr std::size_t max_json_values = std::size_t(1) << 22;

/// The whole file; a FatalError naming `what` and the path when it cannot be read, is not
/// a regular file (a FIFO or a device would block or never end), or holds more than
/// `max_bytes` (read no further); `fix` ends the last two messages.
[[nodiscard]] std::string read_text(const std::filesystem::path& file, const char* what,
                                    std::size_t max_bytes, std::string_view fix);

/// A FatalError when `size` (bytes of `what` at `path`) is above `max_bytes`.
void check_size(std::uintmax_t size, std::size_t max_bytes, std::string_view what,
                const std::string& path, std::string_view fix);

/// JSON nesting and the number of values, counted outside strings: a FatalError starting
/// with `where` and ending with `fix` when either is above its bound.
void check_json_bounds(std::string_view text, const std::string& where, std::string_view fix);

/// fs::status without exceptions: a loop of links or an overlong name is a FatalError
/// naming `what`; a missing file is a status, for the caller's own message.
[[nodiscard]] std::filesystem::file_status status_of(const std::filesystem::path& path,
                                                     const char* what);

} // namespace neml2::detail

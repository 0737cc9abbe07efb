#pragma once

// Reading what neml2-compile wrote, with errors of our own family (src/artifact.cpp).

#include <filesystem>
#include <string>

namespace neml2::detail {

/// The whole file; a FatalError naming `what` and the path when it cannot be read.
[[nodiscard]] std::string read_text(const std::filesystem::path& file, const char* what);

/// fs::status without exceptions: a loop of links or an overlong name is a FatalError
/// naming `what`; a missing file is a status, for the caller's own message.
[[nodiscard]] std::filesystem::file_status status_of(const std::filesystem::path& path,
                                                     const char* what);

} // namespace neml2::detail

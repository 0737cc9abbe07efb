#pragma once

// The recommended policies as JSON: what to_json(Recommendations) prints, and what a tune
// file holds for people beside its table.

#include <nlohmann/json.hpp>

namespace neml2 {
struct Recommendations;
}

namespace neml2::detail {

/// `{"sync": [...], "pool": {...}, "mpi": {...}}`.
[[nodiscard]] nlohmann::json recommendations_json(const Recommendations& recommendations);

} // namespace neml2::detail

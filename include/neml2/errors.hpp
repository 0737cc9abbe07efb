#pragma once

/// @file errors.hpp
/// @brief The library's one error family: everything that leaves a public call is a
/// neml2::Exception, and recoverable() tells a time-stepping host whether to retry.

#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace at {
class Tensor; // declared only: ConvergenceError's tensors are read with ATen's operators
}

namespace neml2 {

/// @brief Base of every error the library throws.
/// @code
/// try { auto out = model.forward(inputs); }
/// catch (const neml2::Exception & e) { if (!e.recoverable()) throw; /* cut the step */ }
/// @endcode
///
/// Thread safety: every error is an immutable value once thrown; it may be caught,
/// copied and read on any thread (an AggregateError's parts are exception_ptrs, which
/// rethrow safely anywhere).
class Exception : public std::runtime_error {
public:
  /// `message` for what(); `details` the full text of a foreign error it translates.
  Exception(const std::string& message, bool recoverable, std::string details = {})
      : std::runtime_error(message)
      , _recoverable(recoverable)
      , _details(std::move(details)) {}

  /// True when retrying with different inputs (a smaller step) can succeed.
  [[nodiscard]] bool recoverable() const noexcept { return _recoverable; }
  /// The full text of the foreign error this one translates (torch's, with its
  /// backtrace); empty when there was none. what() keeps only its first lines.
  [[nodiscard]] const std::string& details() const noexcept { return _details; }

private:
  bool _recoverable;
  std::string _details;
};

/// @brief A retry would fail the same way: bad input, malformed artifact, foreign error.
class FatalError : public Exception {
public:
  /// What failed, where, and how to fix it.
  explicit FatalError(const std::string& message, std::string details = {})
      : Exception(message, false, std::move(details)) {}
};

/// @brief Why one row of a per-row ConvergenceError failed (ConvergenceError::reasons()).
enum class RowFailure : std::int8_t {
  none = 0, ///< the row converged
  not_converged =
      1,          ///< its residual stayed finite but was above the tolerance at the iteration cap
  non_finite = 2, ///< its inputs, or its residual at a finite iterate, were NaN or inf
  singular = 3,   ///< its Jacobian gave no finite Newton step (a zero pivot, a solve that was not
                  ///< finite), or its derivatives are not finite where it converged
};

/// The name of a RowFailure as the enumerator is spelled ("not_converged"); "unknown" for a
/// value that is none of them.
[[nodiscard]] constexpr std::string_view to_string(RowFailure reason) noexcept {
  switch (reason) {
  case RowFailure::none:
    return "none";
  case RowFailure::not_converged:
    return "not_converged";
  case RowFailure::non_finite:
    return "non_finite";
  case RowFailure::singular:
    return "singular";
  }
  return "unknown";
}

/// @brief A nonlinear solve diverged or hit its iteration cap: cut the step and retry.
///
/// When the failure is per row (an implicit model), it says which rows converged, why each
/// other row failed and its last residual norm, and carries the converged rows' results,
/// so a host can cut the step only where needed:
/// @code
/// catch (const neml2::ConvergenceError & e) {
///   auto failed = e.converged_mask().logical_not();   // (B,) on the input device
///   auto stress = e.outputs().at("stress");           // converged rows valid, failed rows NaN
///   auto nan_rows = e.reasons() == static_cast<int>(neml2::RowFailure::non_finite);
/// }
/// @endcode
class ConvergenceError : public Exception {
public:
  /// The whole-call form: which rows failed is not known.
  explicit ConvergenceError(const std::string& message);

  /// Per-row form: `converged` is a `(B,)` bool mask over the call's rows, `results` the
  /// operation's positional results (in the order the library gathers them) with the
  /// converged rows filled, `outputs` the same as the public map of outputs (empty inside
  /// the library, where only positional results are known).
  ConvergenceError(const std::string& message, at::Tensor converged, double worst_residual,
                   std::vector<at::Tensor> results);
  /// The same, with the outputs by name.
  ConvergenceError(const std::string& message, at::Tensor converged, double worst_residual,
                   std::vector<at::Tensor> results, std::map<std::string, at::Tensor> outputs);
  /// The same, with why each row failed: `reasons` `(B,)` RowFailure values (int8),
  /// `residual_norms` `(B,)` each row's last residual norm (double). Either may be undefined:
  /// the forms without them report RowFailure::not_converged and a NaN norm for each failed
  /// row (and none and 0 for the others).
  ConvergenceError(const std::string& message, at::Tensor converged, double worst_residual,
                   std::vector<at::Tensor> results, std::map<std::string, at::Tensor> outputs,
                   at::Tensor reasons, at::Tensor residual_norms);

  /// True when the error says which rows failed (see converged_mask()).
  [[nodiscard]] bool per_row() const noexcept;
  /// `(B,)` bool: true where the row converged. Undefined when not per_row().
  [[nodiscard]] const at::Tensor& converged_mask() const noexcept;
  /// How many rows did not converge (0 when not per_row()).
  [[nodiscard]] std::int64_t failed_rows() const;
  /// The largest residual norm among the failed rows (NaN when one was not finite, or
  /// when not per_row()).
  [[nodiscard]] double worst_residual() const noexcept;
  /// `(B,)` int8, on the device of converged_mask(): why each row failed, a RowFailure
  /// (RowFailure::none where it converged). Undefined when not per_row().
  [[nodiscard]] const at::Tensor& reasons() const noexcept;
  /// Why row `row` failed (RowFailure::none where it converged, or when not per_row()).
  [[nodiscard]] RowFailure reason(std::int64_t row) const;
  /// `(B,)` double, on the device of converged_mask(): each failed row's last residual norm,
  /// the one Newton tested against its tolerance (NaN where it was not finite); 0 where the
  /// row converged. Undefined when not per_row().
  [[nodiscard]] const at::Tensor& residual_norms() const noexcept;
  /// The outputs by name: converged rows hold their results, failed rows NaN.
  [[nodiscard]] const std::map<std::string, at::Tensor>& outputs() const noexcept;
  /// The operation's results in positional order (for dispatchers that merge chunks).
  [[nodiscard]] const std::vector<at::Tensor>& results() const noexcept;

private:
  struct Rows; // what a per-row error carries (src/errors.cpp); shared by copies
  [[nodiscard]] const Rows& rows() const noexcept;
  std::shared_ptr<const Rows> _rows;
};

/// @brief Several errors at once (concurrent chunks); recoverable only if all are.
class AggregateError : public Exception {
public:
  /// The errors, in chunk order; what() summarizes them.
  explicit AggregateError(std::vector<std::exception_ptr> errors)
      : Exception(summarize(errors), all_recoverable(errors))
      , _errors(std::move(errors)) {}

  /// The errors, in chunk order: rethrow one to inspect it.
  [[nodiscard]] const std::vector<std::exception_ptr>& errors() const noexcept { return _errors; }

private:
  static std::string summarize(const std::vector<std::exception_ptr>& errors) {
    std::string text = std::to_string(errors.size()) + " errors:";
    for (const auto& e : errors)
      text += "\n  - " + describe(e);
    return text;
  }

  static std::string describe(const std::exception_ptr& e) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      return x.what();
    } catch (...) {
      return "unknown error";
    }
  }

  static bool all_recoverable(const std::vector<std::exception_ptr>& errors) {
    for (const auto& e : errors) {
      try {
        std::rethrow_exception(e);
      } catch (const Exception& x) {
        if (!x.recoverable())
          return false;
      } catch (...) {
        return false;
      }
    }
    return !errors.empty();
  }

  std::vector<std::exception_ptr> _errors;
};

namespace detail {
/// The first meaningful lines of a foreign error's text: torch appends a C++ backtrace
/// ("Exception raised from ...", "frame #0: ...") that tells a user nothing.
inline std::string first_lines(std::string_view text, std::size_t max_lines = 4) {
  std::string kept;
  std::size_t lines = 0;
  while (!text.empty() && lines < max_lines) {
    const auto end = text.find('\n');
    const auto line = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view{} : text.substr(end + 1);
    if (line.starts_with("Exception raised from") || line.starts_with("frame #"))
      break;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos)
      continue;
    kept += (lines++ ? " | " : "") + std::string(line.substr(0, 400));
  }
  return kept.empty() ? "(no message)" : kept;
}

/// A foreign error as a FatalError: what was being done, the error's first lines; the
/// full text in details().
inline FatalError foreign(const std::string& doing, const std::exception& e) {
  return FatalError(doing + ": " + first_lines(e.what()), e.what());
}

/// `error` as one of ours: a foreign one becomes a FatalError (see foreign()).
inline std::exception_ptr as_library_error(std::exception_ptr error, const std::string& doing) {
  try {
    std::rethrow_exception(error);
  } catch (const Exception&) {
    return error;
  } catch (const std::exception& e) {
    return std::make_exception_ptr(foreign(doing, e));
  } catch (...) {
    return std::make_exception_ptr(FatalError(doing + ": unknown non-standard exception"));
  }
}

/// Runs f; anything foreign (torch's c10::Error, std::bad_alloc, ...) leaves as a
/// FatalError (see foreign()).
template <class F>
decltype(auto) translate_foreign_errors(const char* doing, F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (const Exception&) {
    throw;
  } catch (const std::exception& e) {
    throw foreign(doing, e);
  } catch (...) {
    throw FatalError(std::string(doing) + ": unknown non-standard exception");
  }
}
} // namespace detail

} // namespace neml2

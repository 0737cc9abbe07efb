#pragma once

/// @file errors.hpp
/// @brief The library's one error family: everything that leaves a public call is a
/// neml2::Exception, and recoverable() tells a time-stepping host whether to retry.

#include <exception>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace neml2 {

/// @brief Base of every error the library throws.
/// @code
/// try { auto out = model.forward(inputs); }
/// catch (const neml2::Exception & e) { if (!e.recoverable()) throw; /* cut the step */ }
/// @endcode
class Exception : public std::runtime_error {
public:
  Exception(const std::string& message, bool recoverable)
      : std::runtime_error(message)
      , _recoverable(recoverable) {}

  /// True when retrying with different inputs (a smaller step) can succeed.
  [[nodiscard]] bool recoverable() const noexcept { return _recoverable; }

private:
  bool _recoverable;
};

/// @brief A retry would fail the same way: bad input, malformed artifact, foreign error.
class FatalError : public Exception {
public:
  explicit FatalError(const std::string& message)
      : Exception(message, false) {}
};

/// @brief A nonlinear solve diverged or hit its iteration cap: cut the step and retry.
class ConvergenceError : public Exception {
public:
  explicit ConvergenceError(const std::string& message)
      : Exception(message, true) {}
};

/// @brief Several errors at once (concurrent chunks); recoverable only if all are.
class AggregateError : public Exception {
public:
  explicit AggregateError(std::vector<std::exception_ptr> errors)
      : Exception(summarize(errors), all_recoverable(errors))
      , _errors(std::move(errors)) {}

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
/// Runs f; anything foreign (torch's c10::Error, std::bad_alloc, ...) leaves as a
/// FatalError that keeps the original message, prefixed by what was being done.
template <class F>
decltype(auto) translate_foreign_errors(const char* doing, F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (const Exception&) {
    throw;
  } catch (const std::exception& e) {
    throw FatalError(std::string(doing) + ": " + e.what());
  } catch (...) {
    throw FatalError(std::string(doing) + ": unknown non-standard exception");
  }
}
} // namespace detail

} // namespace neml2

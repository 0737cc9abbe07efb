// The error family: recoverability, aggregation, and foreign errors made FatalError.

#include <string>

#include <c10/util/Exception.h>

#include <neml2/errors.hpp>

#include "doctest_torch.hpp"

using namespace neml2;

TEST_CASE("each error says whether a retry can help") {
  CHECK_FALSE(FatalError("x").recoverable());
  CHECK(ConvergenceError("x").recoverable());
  CHECK(std::string(FatalError("bad input 'strain'").what()) == "bad input 'strain'");
  const Exception& base = ConvergenceError("diverged");
  CHECK(base.recoverable());
  const std::runtime_error& std_base = FatalError("x");
  CHECK(std::string(std_base.what()) == "x");
}

TEST_CASE("an AggregateError is recoverable only when all its errors are") {
  const auto convergence = std::make_exception_ptr(ConvergenceError("chunk 1 diverged"));
  const auto fatal = std::make_exception_ptr(FatalError("chunk 2 ran out of memory"));
  const auto foreign = std::make_exception_ptr(std::runtime_error("foreign"));

  const AggregateError all_recoverable({convergence, convergence});
  CHECK(all_recoverable.recoverable());
  CHECK(all_recoverable.errors().size() == 2);

  const AggregateError mixed({convergence, fatal});
  CHECK_FALSE(mixed.recoverable());
  const std::string text = mixed.what();
  CHECK(text.find("2 errors") != std::string::npos);
  CHECK(text.find("chunk 1 diverged") != std::string::npos);
  CHECK(text.find("chunk 2 ran out of memory") != std::string::npos);

  CHECK_FALSE(AggregateError({convergence, foreign}).recoverable());
}

TEST_CASE("foreign exceptions become FatalError with their message kept") {
  const auto message_of = [](auto&& f) -> std::string {
    try {
      neml2::detail::translate_foreign_errors("running the model", f);
    } catch (const FatalError& e) {
      return e.what();
    }
    return "(nothing thrown)";
  };
  const auto torch_error = message_of([] { TORCH_CHECK(false, "size mismatch 3 vs 5"); });
  CHECK(torch_error.find("running the model: ") == 0);
  CHECK(torch_error.find("size mismatch 3 vs 5") != std::string::npos);
  CHECK(message_of([] { throw std::bad_alloc(); }).find("bad_alloc") != std::string::npos);
  CHECK(message_of([] { throw 42; }).find("unknown") != std::string::npos);

  // Our own errors pass through with their dynamic type.
  CHECK_THROWS_AS(neml2::detail::translate_foreign_errors(
                      "x", []() -> int { throw ConvergenceError("diverged"); }),
                  ConvergenceError);
  CHECK(neml2::detail::translate_foreign_errors("x", [] { return 7; }) == 7);
}

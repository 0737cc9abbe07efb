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

static_assert(to_string(RowFailure::singular) == "singular"); // usable at compile time

TEST_CASE("a per-row ConvergenceError says why each row failed and its residual norm") {
  const auto converged = at::tensor({1, 0, 0}, at::kInt).to(at::kBool);
  SUBCASE("told: as given, on the mask's device and in its own types") {
    const ConvergenceError e("2 rows failed", converged, 3.5, {}, {},
                             at::tensor({0, 1, 3}, at::kLong), at::tensor({0.0f, 3.5f, 1.0f}));
    CHECK((e.reasons().scalar_type() == at::kChar));
    CHECK((e.residual_norms().scalar_type() == at::kDouble));
    CHECK(e.reason(0) == RowFailure::none);
    CHECK(e.reason(1) == RowFailure::not_converged);
    CHECK(e.reason(2) == RowFailure::singular);
    CHECK(at::equal(e.residual_norms(), at::tensor({0.0, 3.5, 1.0}, at::kDouble)));
    // copies share what they carry
    const ConvergenceError copy = e;
    CHECK(copy.reasons().is_same(e.reasons()));
  }
  SUBCASE("not told: not_converged and a NaN norm where a row failed, none and 0 elsewhere") {
    const ConvergenceError e("2 rows failed", converged, 3.5, {});
    CHECK(at::equal(e.reasons(), at::tensor({0, 1, 1}, at::kChar)));
    CHECK(e.residual_norms()[0].item<double>() == 0);
    CHECK(at::isnan(e.residual_norms().narrow(0, 1, 2)).all().item<bool>());
  }
  SUBCASE("a row out of range is a FatalError naming the range") {
    const ConvergenceError e("2 rows failed", converged, 3.5, {});
    CHECK_THROWS_WITH_AS(static_cast<void>(e.reason(3)),
                         "ConvergenceError::reason(3): the error has 3 rows; ask for a row in "
                         "[0, 3)",
                         FatalError);
  }
  SUBCASE("the whole-call form has none") {
    const ConvergenceError e("diverged");
    CHECK_FALSE(e.reasons().defined());
    CHECK_FALSE(e.residual_norms().defined());
    CHECK(e.reason(0) == RowFailure::none);
  }
  CHECK(to_string(RowFailure::non_finite) == "non_finite");
  CHECK(to_string(RowFailure::none) == "none");
  CHECK(to_string(RowFailure::not_converged) == "not_converged");
  CHECK(to_string(RowFailure::singular) == "singular");
  CHECK(to_string(static_cast<RowFailure>(9)) == "unknown");
}

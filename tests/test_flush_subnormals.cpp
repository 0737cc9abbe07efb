// FlushSubnormals (src/core/flush_subnormals.hpp): subnormal doubles read and written as
// zero on the calling thread while a guard lives, the thread's control word restored after
// it, on an exception's unwinding too, and under a guard already in place.

#include <stdexcept>

#include "core/flush_subnormals.hpp"

using neml2::detail::FlushSubnormals;

namespace {

// Half of a subnormal, computed at run time: 2.5e-310 unflushed, 0 flushed.
double halved_subnormal() {
  volatile double tiny = 5e-310, half = 0.5;
  return tiny * half;
}

bool flushing() {
  return (FlushSubnormals::control() & FlushSubnormals::flush_bits) != 0;
}

} // namespace

TEST_CASE("FlushSubnormals: subnormals are zero while it lives, the control word restored") {
  if (!FlushSubnormals::supported)
    return; // the guard does nothing here
  const auto before = FlushSubnormals::control();
  REQUIRE_FALSE(flushing()); // the test thread starts unflushed
  CHECK(halved_subnormal() == 2.5e-310);
  {
    const FlushSubnormals flushed;
    CHECK(flushing());
    CHECK(halved_subnormal() == 0.0);
  }
  CHECK(FlushSubnormals::control() == before);
  CHECK(halved_subnormal() == 2.5e-310);
}

TEST_CASE("FlushSubnormals: an exception through it restores the control word") {
  if (!FlushSubnormals::supported)
    return;
  const auto before = FlushSubnormals::control();
  CHECK_THROWS_AS(
      [] {
        const FlushSubnormals flushed;
        throw std::runtime_error("inside");
      }(),
      std::runtime_error);
  CHECK(FlushSubnormals::control() == before);
  CHECK(halved_subnormal() == 2.5e-310);
}

TEST_CASE("FlushSubnormals: nested in a guard, it leaves the outer one flushing") {
  if (!FlushSubnormals::supported)
    return;
  const auto before = FlushSubnormals::control();
  {
    const FlushSubnormals outer;
    const auto flushed_word = FlushSubnormals::control();
    { const FlushSubnormals inner; }
    CHECK(FlushSubnormals::control() == flushed_word);
    CHECK(halved_subnormal() == 0.0);
  }
  CHECK(FlushSubnormals::control() == before);
}

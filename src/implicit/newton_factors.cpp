// Where the chord's slots are in a NewtonFactors row (newton_factors.hpp).

#include "implicit/newton_factors.hpp"

#include <variant>

#include <ATen/ATen.h>

#include "implicit/newton_plan.hpp"

namespace neml2::detail {

FactorColumns factor_columns(const Artifact& artifact) {
  FactorColumns columns;
  for (const auto& segment : artifact.segments)
    if (const auto* s = std::get_if<ImplicitSegment>(&segment)) {
      const auto shape = newton_shape(*s);
      const bool slot = has_factor_slot(shape);
      columns.first.push_back(slot ? columns.width : -1);
      if (slot)
        columns.width += chord_slot_width(shape.unknowns);
    }
  return columns;
}

at::Tensor& NewtonFactorsAccess::held(NewtonFactors& factors) {
  if (!factors._slots)
    factors._slots = std::make_shared<at::Tensor>();
  return *factors._slots;
}

at::Tensor NewtonFactorsAccess::slots(NewtonFactors& factors, const Artifact& artifact,
                                      std::int64_t points) {
  const auto width = factor_columns(artifact).width;
  if (width == 0)
    return {};
  auto& slots = held(factors);
  if (!slots.defined() || slots.size(0) != points || slots.size(1) != width)
    slots = at::zeros({points, width}, at::kDouble);
  return slots;
}

} // namespace neml2::detail

namespace neml2 {

std::int64_t NewtonFactors::points() const noexcept {
  return _slots && _slots->defined() ? _slots->size(0) : 0;
}

std::int64_t NewtonFactors::bytes() const noexcept {
  return _slots && _slots->defined() ? static_cast<std::int64_t>(_slots->nbytes()) : 0;
}

} // namespace neml2

#pragma once

/// @file dispatch_fwd.hpp
/// @brief The models declared, for a file that only holds or passes them: AnyDispatchedModel
/// (<neml2/any_dispatched_model.hpp>, to call one without ATen), PreparedCall
/// (<neml2/prepared_call.hpp>) and DispatchedModel (<neml2/dispatched_model.hpp>), with the
/// vocabulary of a call (TensorMap; at::Tensor only declared).
/// @code
/// #include <neml2/dispatch_fwd.hpp>
/// struct Element { const neml2::AnyDispatchedModel* model; };
/// @endcode

#include <neml2/tensor_map.hpp>

namespace neml2 {

class AnyDispatchedModel;
class PreparedCall;
template <class Policy>
class DispatchedModel;

} // namespace neml2

#pragma once

// How tune() measures a real model, for the tuner, the neml2-dispatch program (its `run`
// command times what tune() times) and their tests: the inputs, the call, the timing.

#include <functional>
#include <map>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <neml2/artifact.hpp>
#include <neml2/device.hpp>
#include <neml2/errors.hpp>
#include <neml2/tune.hpp>

namespace neml2::detail {

/// Times `call`: `warmup` calls, then `repeats` timed ones, each waiting for the device's
/// queued work. A failure that says the device ran out of memory gives
/// Timing::out_of_memory; others propagate.
[[nodiscard]] Timing measure_calls(const std::function<void()>& call, const Device& device,
                                   int warmup, int repeats);

/// Calls `operation` (forward, jacobian or param_jacobian) of a model on `inputs`, the
/// results dropped: what tune() and `neml2-dispatch run` time.
template <class Model>
void call_operation(const Model& model, const std::string& operation,
                    const std::map<std::string, at::Tensor>& inputs) {
  if (operation == "forward")
    (void)model.forward(inputs);
  else if (operation == "jacobian")
    (void)model.jacobian(inputs);
  else if (operation == "param_jacobian")
    (void)model.param_jacobian(inputs);
  else
    throw FatalError("operation '" + operation +
                     "' is not one tune() measures; use forward, jacobian or param_jacobian");
}

/// The inputs tune() would measure `rows` rows with, on `device`.
[[nodiscard]] std::map<std::string, at::Tensor> tune_inputs(const Artifact& artifact,
                                                            const TuneInputs& inputs,
                                                            std::int64_t rows, const Device& device,
                                                            c10::ScalarType dtype);

} // namespace neml2::detail

// A call's positional results as the public maps: outputs, tangents, Jacobian blocks by
// [output][input or parameter], gradients by parameter.

#include <ATen/Tensor.h>

#include <neml2/detail/call_names.hpp>

#include "session/session_impl.hpp"

namespace neml2 {

TensorMap detail::CallNames::forward(std::vector<at::Tensor>&& results) const {
  const auto& m = *_session->_impl;
  TensorMap out;
  for (std::size_t o = 0; o < m.output_names.size(); ++o)
    out.emplace(m.output_names[o], std::move(results[o]));
  return out;
}

void detail::CallNames::rethrow_with_outputs(const ConvergenceError& error,
                                             std::vector<at::Tensor> results) const {
  auto outputs = forward(std::vector<at::Tensor>(
      results.begin(),
      results.begin() + static_cast<std::ptrdiff_t>(_session->_impl->output_names.size())));
  throw ConvergenceError(error.what(), error.converged_mask(), error.worst_residual(),
                         std::move(results), std::move(outputs), error.reasons(),
                         error.residual_norms());
}

std::pair<TensorMap, TensorMap> detail::CallNames::jvp(std::vector<at::Tensor>&& results) const {
  const auto& m = *_session->_impl;
  const auto n_out = m.output_names.size();
  TensorMap tangents;
  for (std::size_t o = 0; o < n_out; ++o)
    tangents.emplace(m.output_names[o], std::move(results[n_out + o]));
  return {forward(std::move(results)), std::move(tangents)};
}

std::pair<TensorMap, VariablePairJacobian>
detail::CallNames::jacobian(std::vector<at::Tensor>&& results) const {
  const auto& m = *_session->_impl;
  const auto n_out = m.output_names.size();
  VariablePairJacobian J;
  for (std::size_t k = 0; k < m.jacobian_blocks.size(); ++k)
    J[m.output_names[m.jacobian_blocks[k].out]][m.input_names[m.jacobian_blocks[k].in]] =
        std::move(results[n_out + k]);
  return {forward(std::move(results)), std::move(J)};
}

std::pair<TensorMap, VariablePairJacobian>
detail::CallNames::param_jacobian(std::vector<at::Tensor>&& results) const {
  const auto& m = *_session->_impl;
  const auto n_out = m.output_names.size();
  std::map<std::string, std::string> public_param;
  for (const auto& p : m.artifact->parameters)
    public_param[p.name] = p.public_name;
  VariablePairJacobian P;
  if (m.chain) {
    const auto& blocks = m.chain->param_jacobian_blocks();
    for (std::size_t k = 0; k < blocks.size(); ++k)
      P[m.output_names[blocks[k].first]][m.artifact->parameters[blocks[k].second].public_name] =
          std::move(results[n_out + k]);
    return {forward(std::move(results)), std::move(P)};
  }
  const auto& pairs = m.segment->param_jacobian_pairs;
  for (std::size_t k = 0; k < pairs.size(); ++k)
    P[m.output_names[m.output_index.at(pairs[k].out)]][public_param.at(pairs[k].param)] =
        std::move(results[n_out + k]);
  return {forward(std::move(results)), std::move(P)};
}

TensorMap detail::CallNames::param_vjp(std::vector<at::Tensor>&& results) const {
  const auto& m = *_session->_impl;
  TensorMap grads;
  for (std::size_t k = 0; k < m.vjp_params.size(); ++k)
    grads.emplace(m.artifact->parameters[m.vjp_params[k]].public_name, std::move(results[k]));
  return grads;
}

} // namespace neml2

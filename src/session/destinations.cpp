// The inverse of the result maps: the caller's tensors for a call's results (the `_into`
// calls), in slot order, each named for errors.

#include <algorithm>

#include <ATen/Tensor.h>
#include <fmt/format.h>

#include <neml2/detail/call_names.hpp>

#include "session/session_impl.hpp"

namespace neml2 {

namespace {
// Takes the tensors of `given` in `names` order, refusing a missing or an unknown name.
void take_named(const TensorMap& given, const std::vector<std::string>& names, const char* what,
                const std::string& label_format, detail::Destinations& into) {
  for (const auto& [name, t] : given)
    if (std::find(names.begin(), names.end(), name) == names.end())
      throw FatalError(fmt::format("{} '{}' is not a result of this call; it has: {}", what, name,
                                   detail::names_text(names)));
  for (const auto& name : names) {
    const auto it = given.find(name);
    if (it == given.end())
      throw FatalError(fmt::format("no tensor given for {} '{}': pass one for every result ({})",
                                   what, name, detail::names_text(names)));
    into.tensors.push_back(it->second);
    into.labels.push_back(fmt::format(fmt::runtime(label_format), name));
  }
}
} // namespace

detail::Destinations detail::CallNames::destinations(Operation op, const TensorMap& values,
                                                     const TensorMap& tangents,
                                                     const VariablePairJacobian& blocks) const {
  const auto& m = *_session->_impl;
  m.require_operation(op);
  detail::Destinations into;
  if (op == Operation::param_vjp) {
    std::vector<std::string> grads;
    for (auto p : m.vjp_params)
      grads.push_back(m.artifact->parameters[p].public_name);
    take_named(values, grads, "gradient", "gradient '{}'", into);
    return into;
  }
  take_named(values, m.output_names, "output", "output '{}'", into);
  if (op == Operation::jvp)
    take_named(tangents, m.output_names, "output tangent", "tangent of output '{}'", into);
  // Blocks keyed [output][input or parameter], in the graph's pair order.
  std::vector<std::pair<std::string, std::string>> pairs;
  if (op == Operation::jacobian)
    pairs = _session->jacobian_pairs();
  if (op == Operation::param_jacobian && m.chain)
    for (const auto& [o, p] : m.chain->param_jacobian_blocks())
      pairs.emplace_back(m.output_names[o], m.artifact->parameters[p].public_name);
  else if (op == Operation::param_jacobian) {
    std::map<std::string, std::string> public_param;
    for (const auto& p : m.artifact->parameters)
      public_param[p.name] = p.public_name;
    for (const auto& p : m.segment->param_jacobian_pairs)
      pairs.emplace_back(m.output_names[m.output_index.at(p.out)], public_param.at(p.param));
  }
  std::size_t given = 0;
  for (const auto& [out, row] : blocks)
    given += row.size();
  for (const auto& [out, in] : pairs) {
    const auto row = blocks.find(out);
    if (row == blocks.end() || !row->second.count(in))
      throw FatalError(fmt::format("no tensor given for the block ['{}']['{}']: pass one for "
                                   "every block the artifact has",
                                   out, in));
    into.tensors.push_back(row->second.at(in));
    into.labels.push_back(fmt::format("block ['{}']['{}']", out, in));
  }
  if (given != pairs.size())
    throw FatalError(fmt::format("{} blocks given, but this call has {}: pass exactly the blocks "
                                 "the artifact has (see jacobian() / param_jacobian())",
                                 given, pairs.size()));
  return into;
}

} // namespace neml2

// Block-structured groups: Newton's `(B, width)` <-> the graphs' `(B, *sub_batch, per_entry)`.

#include "implicit/block_groups.hpp"

#include <algorithm>
#include <numeric>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <neml2/errors.hpp>

#include "core/row_shape.hpp"

namespace neml2::detail {

std::int64_t GroupLayout::entry_width(std::int64_t width) const {
  return block() ? std::accumulate(widths.begin(), widths.end(), std::int64_t{0}) : width;
}

Shape GroupLayout::graph_shape(std::int64_t width) const {
  const Shape entry{entry_width(width)};
  return with_rows(-1, {&sub_batch, &entry});
}

std::optional<Shape> jacobian_block_shape(const GroupLayout& row, std::int64_t row_width,
                                          const GroupLayout& column, std::int64_t column_width) {
  if (row.block() && column.block() && row.sub_batch != column.sub_batch)
    return std::nullopt;
  const Shape entry{row.entry_width(row_width), column.entry_width(column_width)};
  return with_rows(-1, {row.block() ? &row.sub_batch : &column.sub_batch, &entry});
}

std::vector<GroupLayout> group_layouts(const std::vector<VariableGroup>& groups,
                                       const std::vector<ImplicitVariable>& vars,
                                       const std::string& field) {
  std::vector<GroupLayout> layouts;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    GroupLayout layout;
    if (groups[g].block) {
      layout.sub_batch = groups[g].sub_batch_shape;
      for (const auto& name : groups[g].names) {
        const auto v = std::find_if(vars.begin(), vars.end(),
                                    [&](const ImplicitVariable& x) { return x.name == name; });
        if (v == vars.end() || v->sub_batch_shape != layout.sub_batch || layout.sub_batch.empty())
          throw FatalError(fmt::format(
              "{}[{}]: block group of sub-batch axes [{}] holds '{}' with sub-batch axes [{}]; "
              "every variable of a block group has the group's axes: the artifact is not what "
              "neml2-compile 3.1 writes, recompile it",
              field, g, fmt::join(layout.sub_batch, ", "), name,
              v == vars.end() ? std::string("unknown")
                              : fmt::format("{}", fmt::join(v->sub_batch_shape, ", "))));
        layout.widths.push_back(numel(v->base_shape));
      }
    }
    layouts.push_back(std::move(layout));
  }
  return layouts;
}

at::Tensor to_graph(const at::Tensor& group, const GroupLayout& layout) {
  if (!layout.block())
    return group;
  const auto rows = group.size(0), entries = numel(layout.sub_batch);
  std::vector<at::Tensor> parts;
  std::int64_t offset = 0;
  for (auto w : layout.widths) {
    parts.push_back(group.narrow(1, offset, entries * w).reshape({rows, entries, w}));
    offset += entries * w;
  }
  auto packed = parts.size() == 1 ? parts.front() : at::cat(parts, 2);
  const Shape entry{packed.size(2)};
  return packed.reshape(with_rows(rows, {&layout.sub_batch, &entry}));
}

at::Tensor from_graph(const at::Tensor& group, const GroupLayout& layout) {
  if (!layout.block())
    return group;
  const auto rows = group.size(0), entries = numel(layout.sub_batch);
  const auto per_entry = group.reshape({rows, entries, -1});
  std::vector<at::Tensor> parts;
  std::int64_t offset = 0;
  for (auto w : layout.widths) {
    parts.push_back(per_entry.narrow(2, offset, w).reshape({rows, entries * w}));
    offset += w;
  }
  return parts.size() == 1 ? parts.front() : at::cat(parts, 1);
}

GraphFn in_newton_layout(GraphFn graph, std::size_t first_argument,
                         std::vector<GroupLayout> arguments, std::size_t first_result,
                         std::vector<GroupLayout> results) {
  const auto any_block = [](const std::vector<GroupLayout>& l) {
    return std::any_of(l.begin(), l.end(), [](const GroupLayout& g) { return g.block(); });
  };
  if (!graph || (!any_block(arguments) && !any_block(results)))
    return graph;
  return [graph = std::move(graph), first_argument, arguments = std::move(arguments), first_result,
          results = std::move(results)](const std::vector<at::Tensor>& args) {
    auto converted = args;
    for (std::size_t k = 0; k < arguments.size(); ++k)
      converted[first_argument + k] = to_graph(args[first_argument + k], arguments[k]);
    auto out = graph(converted);
    for (std::size_t k = 0; k < results.size() && first_result + k < out.size(); ++k)
      out[first_result + k] = from_graph(out[first_result + k], results[k]);
    return out;
  };
}

} // namespace neml2::detail

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

namespace {
thread_local std::uint64_t conversions = 0;
} // namespace

std::uint64_t block_group_conversions() noexcept {
  return conversions;
}

at::Tensor to_graph(const at::Tensor& group, const GroupLayout& layout) {
  if (!layout.block())
    return group;
  ++conversions;
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
  ++conversions;
  const auto rows = group.size(0), entries = numel(layout.sub_batch);
  const auto per_entry = group.reshape({rows, entries, group.size(-1)});
  std::vector<at::Tensor> parts;
  std::int64_t offset = 0;
  for (auto w : layout.widths) {
    parts.push_back(per_entry.narrow(2, offset, w).reshape({rows, entries * w}));
    offset += w;
  }
  return parts.size() == 1 ? parts.front() : at::cat(parts, 1);
}

namespace {
// Where each of a group's values, taken entry by entry (the graphs' order), sits in
// Newton's `(B, width)`; none for a dense group (the same order).
std::optional<at::Tensor> newton_positions(const GroupLayout& layout, std::int64_t width) {
  if (!layout.block())
    return std::nullopt;
  const auto entries = numel(layout.sub_batch), per_entry = layout.entry_width(width);
  std::vector<std::int64_t> at(static_cast<std::size_t>(entries * per_entry));
  std::int64_t first = 0, offset = 0; // the variable's first value in Newton, in an entry
  for (auto w : layout.widths) {
    for (std::int64_t e = 0; e < entries; ++e)
      for (std::int64_t k = 0; k < w; ++k)
        at[static_cast<std::size_t>(e * per_entry + offset + k)] = first + e * w + k;
    first += entries * w;
    offset += w;
  }
  return at::tensor(at, at::kLong);
}

// A block between a block group's entries and anything: `(B, E, r, c)` with E the entries.
at::Tensor by_entries(const at::Tensor& block, std::int64_t entries) {
  return block.reshape({block.size(0), entries, block.size(-2), block.size(-1)});
}
} // namespace

at::Tensor dense_jacobian(const std::vector<at::Tensor>& blocks,
                          const std::vector<GroupLayout>& rows,
                          const std::vector<std::int64_t>& row_widths,
                          const std::vector<GroupLayout>& columns,
                          const std::vector<std::int64_t>& column_widths, GroupOrder order) {
  std::int64_t batch = 1, n_r = 0, n_u = 0;
  for (const auto& b : blocks)
    batch = std::max<std::int64_t>(batch, b.size(0));
  for (auto w : row_widths)
    n_r += w;
  for (auto w : column_widths)
    n_u += w;
  const auto& like = blocks.front();
  auto a = at::zeros({batch, n_r, n_u}, like.options());
  std::int64_t row_at = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    std::int64_t column_at = 0;
    for (std::size_t j = 0; j < columns.size(); ++j) {
      const auto& block = blocks[i * columns.size() + j];
      const auto &lr = rows[i], &lc = columns[j];
      const auto r = row_widths[i], c = column_widths[j];
      at::Tensor dense;               // (B or 1, r, c), each side in its graph order
      if (lr.block() && lc.block()) { // entry by entry: block diagonal
        const auto entries = numel(lr.sub_batch);
        const auto per_entry = by_entries(block, entries);
        auto full =
            at::zeros({per_entry.size(0), entries, per_entry.size(2), entries, per_entry.size(3)},
                      like.options());
        full.diagonal(0, 1, 3).copy_(per_entry.permute({0, 2, 3, 1}));
        dense = full.reshape({per_entry.size(0), r, c});
      } else if (lr.block())
        dense = block.reshape({block.size(0), r, c});
      else if (lc.block())
        dense = by_entries(block, numel(lc.sub_batch))
                    .permute({0, 2, 1, 3})
                    .reshape({block.size(0), r, c});
      else
        dense = block.reshape({block.size(0), r, c});
      auto target = a.narrow(1, row_at, r).narrow(2, column_at, c);
      const auto row_positions = newton_positions(lr, r);
      const auto column_positions = newton_positions(lc, c);
      if (order == GroupOrder::newton && (row_positions || column_positions)) {
        // graph order -> Newton's, by index_put
        const auto all_rows = at::arange(r, at::kLong), all_columns = at::arange(c, at::kLong);
        const auto ri = (row_positions ? *row_positions : all_rows).view({r, 1});
        const auto ci = (column_positions ? *column_positions : all_columns).view({1, c});
        target.index_put_({at::indexing::Slice(), ri, ci}, dense.expand({batch, r, c}));
      } else
        target.copy_(dense);
      column_at += c;
    }
    row_at += row_widths[i];
  }
  return a;
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

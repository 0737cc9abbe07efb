#pragma once

// Block-structured variable groups (`structure = 'block ...'` on NEML2's equation system):
// Newton holds every group as `(B, width)`, its variables one after another, each over its
// sub-batch axes then its base shape; the graphs take a block group as
// `(B, *sub_batch, per_entry)`, its variables side by side within each sub-batch entry
// (NEML2's per-grain blocks). The graphs are wrapped to convert at each call; a solve by
// the solve graph runs in the graphs' layout instead, converted once at either end
// (InGraphLayout). Private.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/Tensor.h>

#include <neml2/artifact.hpp>

#include "implicit/newton_graphs.hpp"

namespace neml2::detail {

/// How one group is laid out in the graphs' arguments.
struct GroupLayout {
  Shape sub_batch;                  ///< a block group's sub-batch axes
  std::vector<std::int64_t> widths; ///< a block group's variables' widths per entry; empty: dense

  [[nodiscard]] bool block() const noexcept { return !widths.empty(); }
  [[nodiscard]] bool operator==(const GroupLayout&) const = default;
  /// The group's shape in the graphs, -1 for the batch axis.
  [[nodiscard]] Shape graph_shape(std::int64_t width) const;
  /// Values per sub-batch entry (a dense group: `width`, all of them).
  [[nodiscard]] std::int64_t entry_width(std::int64_t width) const;
};

/// A segment's Newton graphs as compiled, taking and giving block groups in their own
/// layout, and the layouts of the unknown and given groups (the residual groups are laid
/// out as the unknown groups, pairwise: Newton's per-row products pair them).
struct InGraphLayout {
  NewtonGraphs graphs;
  std::vector<GroupLayout> unknowns, givens;
};

/// Each group's layout. A block group's variables must all have the group's sub-batch
/// axes (as neml2-compile writes them); anything else is refused naming `field`.
[[nodiscard]] std::vector<GroupLayout> group_layouts(const std::vector<VariableGroup>& groups,
                                                     const std::vector<ImplicitVariable>& vars,
                                                     const std::string& field);

/// The shape of A's block (residual group `row`, unknown group `column`) in the graphs, -1
/// for the batch axis: `(B, r, u)` between dense groups; a block group's axes come first,
/// and it gives its width per entry (per-entry blocks: `(B, *sub, r_entry, u_entry)` between
/// two block groups, block diagonal); nullopt for two block groups of different axes.
[[nodiscard]] std::optional<Shape> jacobian_block_shape(const GroupLayout& row,
                                                        std::int64_t row_width,
                                                        const GroupLayout& column,
                                                        std::int64_t column_width);

/// The order of a group's values: Newton's (`(B, width)`, the variables one after another)
/// or the graphs' (entry by entry, flattened).
enum class GroupOrder { newton, graph };

/// A as one `(B, n_r, n_u)` matrix per row, its rows and columns in `order`, from the
/// jacobian graph's blocks (residual groups outer, unknown groups inner, each `(B or 1,
/// ...)` as jacobian_block_shape says); `rows` and `columns`: the residual and unknown
/// groups' layouts and Newton widths.
[[nodiscard]] at::Tensor dense_jacobian(const std::vector<at::Tensor>& blocks,
                                        const std::vector<GroupLayout>& rows,
                                        const std::vector<std::int64_t>& row_widths,
                                        const std::vector<GroupLayout>& columns,
                                        const std::vector<std::int64_t>& column_widths,
                                        GroupOrder order = GroupOrder::newton);

/// `(B, width)` -> the graph's layout, and back.
[[nodiscard]] at::Tensor to_graph(const at::Tensor& group, const GroupLayout& layout);
[[nodiscard]] at::Tensor from_graph(const at::Tensor& group, const GroupLayout& layout);
/// How many block groups to_graph and from_graph converted on this thread (for tests: a
/// solve converts its groups once, not at every graph call).
[[nodiscard]] std::uint64_t block_group_conversions() noexcept;

/// A solve in the graphs' layout: `solve(layout.graphs, u0, givens)` on the groups
/// converted to it, its solution converted back.
template <class Solve>
[[nodiscard]] NewtonResult solve_in_graph_layout(const InGraphLayout& layout,
                                                 const std::vector<at::Tensor>& u0,
                                                 const std::vector<at::Tensor>& givens,
                                                 const Solve& solve) {
  const auto converted = [](const std::vector<at::Tensor>& groups,
                            const std::vector<GroupLayout>& layouts, auto convert) {
    std::vector<at::Tensor> out;
    for (std::size_t k = 0; k < groups.size(); ++k)
      out.push_back(convert(groups[k], layouts[k]));
    return out;
  };
  auto result = solve(layout.graphs, converted(u0, layout.unknowns, to_graph),
                      converted(givens, layout.givens, to_graph));
  result.u = converted(result.u, layout.unknowns, from_graph);
  return result;
}

/// `graph` with the arguments from `first_argument` on and the results from `first_result`
/// on converted (those `layouts` name; the rest pass as they are: A's blocks, parameters).
/// `graph` itself when no layout is a block.
[[nodiscard]] GraphFn in_newton_layout(GraphFn graph, std::size_t first_argument,
                                       std::vector<GroupLayout> arguments, std::size_t first_result,
                                       std::vector<GroupLayout> results);

} // namespace neml2::detail

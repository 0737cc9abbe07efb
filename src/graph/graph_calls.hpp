#pragma once

// An observer of every compiled-graph call, with the rows it was asked for: what lets a
// test prove that converged Newton rows are not evaluated again, or that a lane runs only
// the chunks it was given. Off by default; then a graph call pays one atomic load for it.

#include <cstdint>
#include <functional>
#include <string>

namespace neml2::detail {

/// `file` is the graph's `.pt2` path, `rows` the rows of the call as asked (before
/// padding to the graph's exported minimum; each piece of a split call on its own).
/// Called on the thread that calls the graph.
using GraphCallObserver = std::function<void(const std::string& file, std::int64_t rows)>;

/// Sets the process-wide observer of graph calls; an empty one turns it off. Set it while
/// no call is running.
void observe_graph_calls(GraphCallObserver observer);

} // namespace neml2::detail

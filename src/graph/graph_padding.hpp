#pragma once

// A graph's padded arguments: made when it loads (graph.cpp), filled by a call of fewer
// rows than it was exported for (graph_run.cpp).

#include <mutex>
#include <vector>

#include <ATen/Tensor.h>

#include "graph/graph.hpp"

namespace neml2::detail {

// Arguments padded to the exported minimum, made once at load (a graph keeps none of its
// arguments): a call of fewer rows copies into them and allocates nothing. One call at
// a time uses them; a concurrent one allocates its own.
struct Graph::Padding {
  std::mutex mutex;
  std::vector<at::Tensor> args; // the padded call's arguments: buffers where batched
};

} // namespace neml2::detail

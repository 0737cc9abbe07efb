#pragma once

// Drawing a tune file's curves or a simulated timeline with tools/plot_tune.py, in a
// Python that has matplotlib.

#include <string>
#include <vector>

namespace program {

// The Python that runs tools/plot_tune.py: --python, $NEML2_DISPATCH_PYTHON, or the one
// this program was configured with.
std::string python_for_plots(const std::string& flag);

// Runs plot_tune.py with `arguments` in `python`; a FatalError when it cannot start or fails.
void plot(const std::string& python, const std::vector<std::string>& arguments);

} // namespace program

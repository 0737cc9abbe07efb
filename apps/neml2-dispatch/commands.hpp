#pragma once

// The commands of neml2-dispatch, each added to the program with its options; each runs
// when the command line names it. A command's options are bound to an object that its
// callback holds, so they live as long as the CLI::App.

#include <CLI/CLI.hpp>

namespace program {

/// info: what an artifact offers (info_command.cpp).
void add_info_command(CLI::App& app);
/// run: a generated batch evaluated with a policy (run_command.cpp).
void add_run_command(CLI::App& app);
/// tune: batch sizes measured per device, a tune file (tune_command.cpp).
void add_tune_command(CLI::App& app);
/// simulate: a node simulated from throughput curves (simulate_command.cpp).
void add_simulate_command(CLI::App& app);

} // namespace program

// neml2-dispatch: what an artifact offers (info), a batch evaluated with a policy (run),
// batch sizes measured per device (tune), and a node simulated from the measurements
// (simulate). Usage errors exit 2, run-time failures 1, each with one line on stderr.

#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include <neml2/errors.hpp>

#include "arguments.hpp"
#include "commands.hpp"

namespace {
// A message on one line: stderr gets one line per failure.
std::string one_line(std::string text) {
  for (auto& c : text)
    if (c == '\n')
      c = ' ';
  return text;
}
} // namespace

int main(int argc, char** argv) {
  CLI::App app{"neml2-dispatch: inspect, run, tune and simulate compiled NEML2 models"};
  app.require_subcommand(1);
  program::add_info_command(app);
  program::add_run_command(app);
  program::add_tune_command(app);
  program::add_simulate_command(app);
  const auto known = [&](const std::string& name) {
    for (const auto* c : app.get_subcommands({}))
      if (c->get_name() == name)
        return true;
    return false;
  };
  if (argc > 1 && argv[1][0] != '-' && !known(argv[1])) {
    std::fprintf(stderr,
                 "neml2-dispatch: unknown command '%s'; the commands are info, run, tune "
                 "and simulate (see neml2-dispatch --help)\n",
                 argv[1]);
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e); // --help
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "neml2-dispatch: %s (see neml2-dispatch --help)\n",
                 one_line(e.what()).c_str());
    return 2;
  } catch (const program::UsageError& e) {
    std::fprintf(stderr, "neml2-dispatch: %s\n", one_line(e.what()).c_str());
    return 2;
  } catch (const std::exception& e) { // torch's own errors carry a backtrace: first lines only
    std::fprintf(stderr, "neml2-dispatch: error: %s\n",
                 one_line(neml2::detail::first_lines(e.what())).c_str());
    return 1;
  }
  return 0;
}

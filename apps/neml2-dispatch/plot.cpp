// Drawing with tools/plot_tune.py: which Python and which script, and running it.

#include "plot.hpp"

#include <cstdlib>
#include <filesystem>

#include <spawn.h>
#include <sys/wait.h>

#include <neml2/errors.hpp>

extern char** environ;

namespace program {

namespace fs = std::filesystem;

std::string python_for_plots(const std::string& flag) {
  if (!flag.empty())
    return flag;
  if (const char* env = std::getenv("NEML2_DISPATCH_PYTHON"))
    return env;
  return NEML2_DISPATCH_PROGRAM_PYTHON;
}

namespace {
// The script: $NEML2_DISPATCH_PLOT_SCRIPT, the installed copy beside this program, or the
// source tree's.
fs::path plot_script() {
  if (const char* env = std::getenv("NEML2_DISPATCH_PLOT_SCRIPT"))
    return env;
  std::error_code ec;
  const auto self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const auto installed =
        self.parent_path().parent_path() / "share" / "neml2-dispatch" / "plot_tune.py";
    if (fs::exists(installed))
      return installed;
  }
  return NEML2_DISPATCH_PROGRAM_PLOT_SCRIPT;
}
} // namespace

void plot(const std::string& python, const std::vector<std::string>& arguments) {
  std::vector<std::string> all = {python, plot_script().string()};
  all.insert(all.end(), arguments.begin(), arguments.end());
  std::vector<char*> argv;
  for (auto& a : all)
    argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0)
    throw neml2::FatalError("cannot start '" + python +
                            "' to plot; give a Python with matplotlib (--python PATH or "
                            "NEML2_DISPATCH_PYTHON)");
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw neml2::FatalError("plotting failed (" + python + " " + plot_script().string() +
                            "); see its message above");
}

} // namespace program

// neml2-dispatch tune: throughput against batch size per device, with a progress bar;
// the table, the recommended policies, the tune file, and optionally a plot.

#include <algorithm>
#include <cstdio>
#include <memory>

#include <fmt/format.h>
#include <unistd.h>

#include <neml2/tune.hpp>

#include "arguments.hpp"
#include "commands.hpp"
#include "plot.hpp"

namespace program {
namespace {

// A bar on a terminal, one line per point otherwise (stderr).
struct Progress {
  std::vector<neml2::Device> devices;
  bool bar = ::isatty(STDERR_FILENO) != 0;

  void operator()(std::size_t d, const neml2::TunePoint& p,
                  const neml2::SweepProgress& sweep) const {
    const auto left = sweep.seconds_left();
    const auto name = devices[d].str();
    if (!bar) {
      if (p.out_of_memory)
        fmt::print(stderr, "tune {}: {} rows: out of memory\n", name, p.rows);
      else
        fmt::print(stderr, "tune {}: {} rows: {:.4g} rows/s ({:.4g} to {:.4g}), {:.1f} s left\n",
                   name, p.rows, p.median, p.low, p.high, left);
      return;
    }
    constexpr int width = 30;
    const auto done =
        static_cast<int>(width * std::min(1.0, sweep.spent_seconds / sweep.budget_seconds));
    fmt::print(stderr, "\r{} [{}{}] {:>9} rows  {:>6.1f} s left at most  ", name,
               std::string(static_cast<std::size_t>(done), '#'),
               std::string(static_cast<std::size_t>(width - done), '.'), p.rows, left);
  }
  void device_done() const {
    if (bar)
      fmt::print(stderr, "\n");
  }
};

struct TuneCommand {
  EvaluationArguments evaluation;
  std::vector<std::string> devices;
  double budget = 30;
  std::int64_t batch = std::int64_t{1} << 16;
  std::int64_t min_rows = 1, max_rows = std::int64_t{1} << 22;
  std::int64_t cpu_lanes = 0;
  std::string out, plot_file, python;

  CLI::App* add(CLI::App& app) {
    auto* c = app.add_subcommand("tune", "measure throughput against batch size per device, "
                                         "recommend policies, save a tune file");
    evaluation.add(c);
    c->add_option("--device", devices, "a device to tune (repeat for several)")
        ->required()
        ->check(device_check);
    c->add_option("--budget", budget, "seconds of measurement per device")->check(finite_positive);
    c->add_option("--batch", batch,
                  "rows per call of your host: each size is timed as the chunk size of such a "
                  "call (sizes start at batch / 1024)")
        ->check(whole_number());
    c->add_option("--min-rows", min_rows, "the smallest chunk size")->check(whole_number());
    c->add_option("--max-rows", max_rows, "the largest chunk size (also capped to what fits)")
        ->check(whole_number());
    c->add_option("--cpu-lanes", cpu_lanes,
                  "the lanes the CPU's chunks run on, as the policies you will run ask "
                  "(default 0: torch's intra-op thread count); the file states the number")
        ->check(whole_number(0));
    c->add_option("--out", out, "the tune file to write (default: <model>.tune.json)");
    c->add_option("--plot", plot_file, "also draw the curves into this PNG");
    c->add_option("--python", python, "the Python with matplotlib that draws the plot");
    return c;
  }

  void run() const {
    if (min_rows > max_rows)
      throw UsageError(fmt::format("--min-rows {} is above --max-rows {}", min_rows, max_rows));
    const auto file = out.empty() ? evaluation.model.model_name() + ".tune.json" : out;
    check_writable(file, "--out");
    if (!plot_file.empty())
      check_writable(plot_file, "--plot");
    const auto artifact = evaluation.model.artifact();
    const Progress progress{as_devices(devices)};
    neml2::TuneOptions options{
        .sweep = {.min_rows = min_rows, .max_rows = max_rows, .budget_seconds = budget},
        .operation = evaluation.measured.operation,
        .dtype = evaluation.model.scalar_type(),
        .warmup = evaluation.measured.warmup,
        .repeats = evaluation.measured.repeats,
        .batch_rows = batch,
        .inputs = evaluation.inputs.inputs(),
        .cpu_lanes = cpu_lanes,
        .on_point = {}};
    std::size_t last = 0;
    options.on_point = [&](std::size_t d, const neml2::TunePoint& p,
                           const neml2::SweepProgress& s) {
      if (d != last)
        progress.device_done();
      last = d;
      progress(d, p, s);
    };
    const auto result =
        neml2::tune(artifact, as_devices(devices), options, evaluation.model.model_name());
    progress.device_done();
    const auto recommended = neml2::recommend(result);
    fmt::print("{}\nrecommended policies (C++):\n{}\nas JSON:\n{}\n", neml2::format_table(result),
               neml2::to_cpp(recommended), neml2::to_json(recommended));
    std::fflush(stdout); // the table stays printed if the file cannot be written
    neml2::write_tune_file(file, result);
    fmt::print("tune file written: {}\n", file);
    if (!plot_file.empty()) {
      plot(python_for_plots(python), {"tune", file, "--out", plot_file});
      fmt::print("plot written: {}\n", plot_file);
    }
  }
};

} // namespace

void add_tune_command(CLI::App& app) {
  auto command = std::make_shared<TuneCommand>();
  command->add(app)->callback([command] { command->run(); });
}

} // namespace program

// neml2-dispatch: what an artifact offers (info), a batch evaluated with a policy (run),
// batch sizes measured per device (tune), and a node simulated from the measurements
// (simulate). Usage errors exit 2, run-time failures 1, each with one line on stderr.

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <neml2/artifact_info.hpp>
#include <neml2/dispatch.hpp>
#include <neml2/simulate.hpp>
#include <neml2/tune.hpp>

extern char** environ;

namespace fs = std::filesystem;

namespace {

// An argument found wrong after parsing: a usage error (exit 2).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A file the program will write, checked before any long work: its folder must exist and
// be writable.
void check_writable(const fs::path& file, const char* flag) {
  const auto folder = file.has_parent_path() ? file.parent_path() : fs::path(".");
  if (!fs::is_directory(folder) || ::access(folder.c_str(), W_OK) != 0)
    throw UsageError(fmt::format("{} {}: the folder {} does not exist or is not writable; "
                                 "give a file in a writable folder",
                                 flag, file.string(), folder.string()));
}

// Writes `text` into `file`, or throws naming it.
void write_text(const fs::path& file, const std::string& text) {
  std::ofstream out(file);
  out << text;
  out.close();
  if (!out)
    throw neml2::FatalError(
        fmt::format("could not write {}: {}", file.string(), std::strerror(errno)));
}

// A new file in the temporary folder, made with a name nobody can predict (mkstemps).
fs::path temporary_file(const std::string& prefix, const std::string& suffix) {
  auto path = (fs::temp_directory_path() / (prefix + "XXXXXX" + suffix)).string();
  const int fd = ::mkstemps(path.data(), static_cast<int>(suffix.size()));
  if (fd < 0)
    throw neml2::FatalError(fmt::format("could not make a temporary file in {}: {}",
                                        fs::temp_directory_path().string(), std::strerror(errno)));
  ::close(fd);
  return path;
}

std::string one_line(std::string text) {
  for (auto& c : text)
    if (c == '\n')
      c = ' ';
  return text;
}

// --------------------------------------------------------------- shared arguments

struct ModelArguments {
  fs::path stub;
  std::string model;
  std::string dtype = "float64";

  void add(CLI::App* app) {
    app->add_option("stub", stub, "the model's HIT stub (<model>_aoti.i) or its artifact root")
        ->required()
        ->check(CLI::ExistingPath);
    app->add_option("--model", model,
                    "the model's name in the stub (default: the stub's file name without "
                    "_aoti.i)");
  }
  void add_dtype(CLI::App* app) {
    app->add_option("--dtype", dtype, "float64 or float32 (the artifact's dtype folder)")
        ->check(CLI::IsMember({"float64", "float32"}));
  }

  [[nodiscard]] std::string model_name() const {
    if (!model.empty())
      return model;
    const auto name = stub.filename().string();
    const std::string suffix = "_aoti.i";
    if (name.size() > suffix.size() && name.ends_with(suffix))
      return name.substr(0, name.size() - suffix.size());
    if (fs::is_directory(stub))
      return name;
    throw UsageError("cannot tell the model's name from '" + stub.string() +
                     "'; give it with --model NAME");
  }
  [[nodiscard]] neml2::Artifact artifact() const {
    return neml2::read_artifact(neml2::resolve_artifact_root(stub, model_name()));
  }
  [[nodiscard]] c10::ScalarType scalar_type() const { return neml2::dtype_from_name(dtype); }
};

// "cuda:1" is a device; "gpu" is a usage error that lists the families.
const CLI::Validator device_check(
    [](std::string& text) {
      try {
        (void)neml2::Device(text);
        return std::string();
      } catch (const neml2::FatalError& e) {
        return std::string(e.what());
      }
    },
    "DEVICE", "device");

// NAME=LOW:HIGH
std::pair<std::string, std::pair<double, double>> parse_range(const std::string& text) {
  const auto eq = text.find('=');
  const auto colon = text.find(':', eq == std::string::npos ? 0 : eq);
  try {
    if (eq == std::string::npos || colon == std::string::npos || eq == 0)
      throw std::invalid_argument("");
    std::size_t end = 0;
    const auto low = std::stod(text.substr(eq + 1, colon - eq - 1), &end);
    const auto high = std::stod(text.substr(colon + 1));
    if (!(low <= high))
      throw std::invalid_argument("");
    return {text.substr(0, eq), {low, high}};
  } catch (const std::exception&) {
    throw UsageError("--range '" + text +
                     "' is not NAME=LOW:HIGH with LOW <= HIGH (e.g. strain=-1e-3:1e-3)");
  }
}

struct InputArguments {
  std::vector<std::string> ranges;
  void add(CLI::App* app) {
    app->add_option("--range", ranges,
                    "generated values of input NAME uniform in [LOW, HIGH] (NAME=LOW:HIGH; "
                    "default: old state 0, the rest in [1e-4, 1e-3])");
  }
  [[nodiscard]] neml2::TuneInputs inputs() const {
    neml2::TuneInputs in;
    for (const auto& r : ranges)
      in.ranges.insert(parse_range(r));
    return in;
  }
};

// What is timed and how often (tune: per size; run: the batch).
struct MeasureArguments {
  std::string operation = "forward";
  int repeats = 5, warmup = 1;
  void add(CLI::App* app) {
    app->add_option("--operation", operation, "what to time")
        ->check(CLI::IsMember({"forward", "jacobian", "param_jacobian"}));
    app->add_option("--repeats", repeats, "timed calls")->check(CLI::Range(1, 1000));
    app->add_option("--warmup", warmup, "untimed calls first")->check(CLI::Range(0, 1000));
  }
};

// What tune and run share: the model, its inputs, what is timed.
struct EvaluationArguments {
  ModelArguments model;
  InputArguments inputs;
  MeasureArguments measured;
  void add(CLI::App* app) {
    model.add(app);
    model.add_dtype(app);
    inputs.add(app);
    measured.add(app);
  }
};

std::vector<neml2::Device> as_devices(const std::vector<std::string>& names) {
  return {names.begin(), names.end()};
}

// ------------------------------------------------------------------------ plotting

// The Python that runs tools/plot_tune.py: --python, $NEML2_DISPATCH_PYTHON, or the one
// this program was configured with.
std::string python_for_plots(const std::string& flag) {
  if (!flag.empty())
    return flag;
  if (const char* env = std::getenv("NEML2_DISPATCH_PYTHON"))
    return env;
  return NEML2_DISPATCH_PROGRAM_PYTHON;
}

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

// ---------------------------------------------------------------------------- info

struct InfoCommand {
  ModelArguments model;
  bool json = false;
  void add(CLI::App& app) {
    auto* c = app.add_subcommand("info", "what an artifact offers: inputs, outputs, parameters, "
                                         "operations, segments, devices and dtypes");
    model.add(c);
    c->add_flag("--json", json, "print JSON instead of text");
    c->callback([this] {
      const auto info = neml2::artifact_info(model.artifact());
      std::fputs(
          (json ? neml2::artifact_info_json(info) : neml2::format_artifact_info(info)).c_str(),
          stdout);
    });
  }
};

// ---------------------------------------------------------------------------- tune

// A bar on a terminal, one line per point otherwise (stderr).
struct Progress {
  std::vector<neml2::Device> devices;
  bool bar = ::isatty(STDERR_FILENO) != 0;

  void operator()(std::size_t d, const neml2::TunePoint& p, const neml2::Sweep& sweep) const {
    const auto budget = sweep.options().budget_seconds;
    const auto left = std::max(0.0, budget - sweep.spent());
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
    const auto done = static_cast<int>(width * std::min(1.0, sweep.spent() / budget));
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
  std::string out, plot_file, python;

  void add(CLI::App& app) {
    auto* c = app.add_subcommand("tune", "measure throughput against batch size per device, "
                                         "recommend policies, save a tune file");
    evaluation.add(c);
    c->add_option("--device", devices, "a device to tune (repeat for several)")
        ->required()
        ->check(device_check);
    c->add_option("--budget", budget, "seconds of measurement per device")
        ->check(CLI::PositiveNumber);
    c->add_option("--batch", batch,
                  "rows per call of your host: each size is timed as the chunk size of such a "
                  "call (sizes start at batch / 1024)")
        ->check(CLI::PositiveNumber);
    c->add_option("--min-rows", min_rows, "the smallest chunk size")->check(CLI::PositiveNumber);
    c->add_option("--max-rows", max_rows, "the largest chunk size (also capped to what fits)")
        ->check(CLI::PositiveNumber);
    c->add_option("--out", out, "the tune file to write (default: <model>.tune.json)");
    c->add_option("--plot", plot_file, "also draw the curves into this PNG");
    c->add_option("--python", python, "the Python with matplotlib that draws the plot");
    c->callback([this] { run(); });
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
        .on_point = {}};
    std::size_t last = 0;
    options.on_point = [&](std::size_t d, const neml2::TunePoint& p, const neml2::Sweep& s) {
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

// ----------------------------------------------------------------------------- run

struct RunCommand {
  EvaluationArguments evaluation;
  std::string policy = "sync";
  std::vector<std::string> devices = {"cpu"};
  std::vector<std::int64_t> batch_sizes, capacities;
  std::string tune_file;
  std::int64_t batch = 0;

  void add(CLI::App& app) {
    auto* c = app.add_subcommand("run", "evaluate a generated batch with a policy and print its "
                                        "throughput");
    evaluation.add(c);
    c->add_option("--policy", policy,
                  "sync (SyncChunking), greedy (GreedyPriorityCapacity) or "
                  "tuned (from --tune-file)")
        ->check(CLI::IsMember({"sync", "greedy", "tuned"}));
    c->add_option("--device", devices, "the devices (sync: one)")->check(device_check);
    c->add_option("--batch", batch, "rows per call")->required()->check(CLI::PositiveNumber);
    c->add_option("--batch-size", batch_sizes, "rows per chunk: one, or one per device")
        ->check(CLI::NonNegativeNumber);
    c->add_option("--capacity", capacities, "greedy: rows in flight per device")
        ->check(CLI::PositiveNumber);
    c->add_option("--tune-file", tune_file, "tuned: the tune file")->check(CLI::ExistingFile);
    c->callback([this] { run(); });
  }

  template <class Policy>
  void measure(const neml2::Artifact& artifact, Policy policy_value,
               const std::string& label) const {
    const auto dtype = evaluation.model.scalar_type();
    const neml2::DispatchedModel<Policy> m(std::make_shared<const neml2::Artifact>(artifact),
                                           std::move(policy_value), dtype);
    std::map<std::string, at::Tensor> in;
    try {
      in = neml2::tune_inputs(artifact, evaluation.inputs.inputs(), batch, "cpu", dtype);
    } catch (const neml2::Exception&) {
      throw;
    } catch (const std::exception& e) {
      throw neml2::FatalError(fmt::format("cannot make the inputs of {} rows ({}); use a smaller "
                                          "--batch",
                                          batch, neml2::detail::first_lines(e.what(), 1)));
    }
    const auto timing =
        neml2::measure_calls([&] { neml2::call_operation(m, evaluation.measured.operation, in); },
                             m.device(), evaluation.measured.warmup, evaluation.measured.repeats);
    if (timing.out_of_memory)
      throw neml2::FatalError(fmt::format("ran out of memory with {} rows; use a smaller --batch "
                                          "or --batch-size",
                                          batch));
    const auto p = neml2::summarize(batch, timing);
    fmt::print("{}\n{} {} rows, {}: {:.4g} rows/s median ({:.4g} to {:.4g}), {:.3f} ms per "
               "call\n",
               label, evaluation.measured.operation, batch, evaluation.model.dtype, p.median, p.low,
               p.high, 1e3 * static_cast<double>(batch) / p.median);
  }

  void run() const {
    const auto artifact = evaluation.model.artifact();
    if (policy == "tuned") {
      if (tune_file.empty())
        throw UsageError("--policy tuned needs --tune-file FILE (written by neml2-dispatch tune)");
      const auto p = neml2::tuned_policy<neml2::GreedyPriorityCapacity>(
          tune_file, artifact, evaluation.model.scalar_type());
      measure(artifact, p, neml2::to_cpp(p));
    } else if (policy == "sync") {
      if (devices.size() != 1 || batch_sizes.size() > 1)
        throw UsageError("--policy sync takes one --device and at most one --batch-size");
      const neml2::SyncChunking p{.device = devices.front(),
                                  .batch_size = batch_sizes.empty() ? 0 : batch_sizes.front()};
      measure(artifact, p, neml2::to_cpp(p));
    } else {
      if (batch_sizes.empty())
        throw UsageError("--policy greedy needs --batch-size (one, or one per device)");
      const neml2::GreedyPriorityCapacity p{
          .devices = as_devices(devices), .batch_sizes = batch_sizes, .capacities = capacities};
      measure(artifact, p, neml2::to_cpp(p));
    }
  }
};

// ------------------------------------------------------------------------ simulate

// "cpu,8xcuda" or "cpu, 8 x cuda": the pool's entries, counts expanded to cuda:0..cuda:7.
std::vector<std::pair<neml2::Device, neml2::DeviceFamily>> parse_pool(const std::string& text) {
  std::vector<std::pair<neml2::Device, neml2::DeviceFamily>> pool;
  std::string entry;
  std::stringstream list(text);
  while (std::getline(list, entry, ',')) {
    std::erase_if(entry, [](char c) { return c == ' '; });
    std::int64_t count = 1;
    if (const auto x = entry.find('x');
        x != std::string::npos && x > 0 && std::isdigit(static_cast<unsigned char>(entry[0]))) {
      try {
        count = std::stoll(entry.substr(0, x));
      } catch (const std::exception&) {
        count = 0;
      }
      entry = entry.substr(x + 1);
    }
    neml2::Device device;
    try {
      device = neml2::Device(entry);
    } catch (const neml2::FatalError& e) {
      throw UsageError(std::string("--pool: ") + e.what());
    }
    if (count < 1 || count > 4096 || (count > 1 && device.has_index()) ||
        (count > 1 && !device.is_accelerator()))
      throw UsageError("--pool entry '" + entry +
                       "' is not DEVICE or N x FAMILY (N from 1 to 4096, an accelerator family "
                       "without an index, e.g. 8xcuda)");
    if (count == 1)
      pool.emplace_back(device, device.family());
    else
      for (std::int64_t i = 0; i < count; ++i)
        pool.emplace_back(neml2::Device(device.family(), static_cast<int>(i)), device.family());
  }
  if (pool.empty())
    throw UsageError("--pool is empty; give devices such as cpu,8xcuda");
  return pool;
}

// FAMILY=ROWS:RATE,ROWS:RATE,...
std::pair<neml2::DeviceFamily, neml2::DeviceCurve> parse_curve(const std::string& text) {
  const auto eq = text.find('=');
  const auto bad = [&](const std::string& why) {
    return UsageError("--curve '" + text + "': " + why +
                      "; give FAMILY=ROWS:RATE,ROWS:RATE,... (e.g. cuda=1024:2e6,65536:6e7)");
  };
  if (eq == std::string::npos)
    throw bad("no '='");
  neml2::Device device;
  try {
    device = neml2::Device(text.substr(0, eq));
  } catch (const neml2::FatalError& e) {
    throw bad(e.what());
  }
  neml2::DeviceCurve curve{.device = device.family(), .device_name = "by hand"};
  std::stringstream points(text.substr(eq + 1));
  std::string point;
  while (std::getline(points, point, ',')) {
    const auto colon = point.find(':');
    try {
      if (colon == std::string::npos)
        throw std::invalid_argument("");
      const auto rows = std::stoll(point.substr(0, colon));
      const auto rate = std::stod(point.substr(colon + 1));
      if (rows < 1 || !(rate > 0) || (!curve.points.empty() && rows <= curve.points.back().rows))
        throw std::invalid_argument("");
      curve.points.push_back({rows, rate, rate, rate, 1});
    } catch (const std::exception&) {
      throw bad("point '" + point + "' is not ROWS:RATE with ROWS >= 1 increasing, RATE > 0");
    }
  }
  if (curve.points.empty())
    throw bad("no points");
  return {device.family(), curve};
}

// "2e-5" for every device, or "cuda=2e-5" for one family.
void parse_per_family(const std::vector<std::string>& given, const char* flag,
                      std::map<neml2::DeviceFamily, double>& out, bool accelerators_only) {
  for (const auto& text : given) {
    const auto eq = text.find('=');
    double value = -1;
    try {
      value = std::stod(text.substr(eq == std::string::npos ? 0 : eq + 1));
    } catch (const std::exception&) {
    }
    if (!(value >= 0))
      throw UsageError(std::string(flag) + " '" + text +
                       "' is not SECONDS or FAMILY=SECONDS with SECONDS >= 0");
    if (eq == std::string::npos) {
      for (const auto f : neml2::known_device_families)
        if (!accelerators_only || neml2::is_accelerator(f))
          out[f] = value;
      continue;
    }
    try {
      out[neml2::Device(text.substr(0, eq)).family()] = value;
    } catch (const neml2::FatalError& e) {
      throw UsageError(std::string(flag) + ": " + e.what());
    }
  }
}

struct SimulateCommand {
  std::string tune_file, pool_text, json_file, plot_file, python;
  std::vector<std::string> curves, overheads, transfers;
  std::int64_t batch = 0;
  int calls = 1;

  void add(CLI::App& app) {
    auto* c = app.add_subcommand("simulate", "replay throughput curves through "
                                             "GreedyPriorityCapacity on a virtual node");
    c->add_option("tune_file", tune_file, "a tune file (its curves and recommendations)")
        ->check(CLI::ExistingFile);
    c->add_option("--pool", pool_text, "the node's devices, e.g. cpu,8xcuda")->required();
    c->add_option("--batch", batch, "rows per call")->required()->check(CLI::PositiveNumber);
    c->add_option("--calls", calls, "calls in a row (the policy's state lives across them)")
        ->check(CLI::Range(1, 1000));
    c->add_option("--curve", curves, "a curve by hand: FAMILY=ROWS:RATE,ROWS:RATE,...");
    c->add_option("--overhead", overheads,
                  "seconds per chunk: SECONDS or FAMILY=SECONDS (default: the tune file's lane "
                  "test; 0 for a curve by hand)");
    c->add_option("--transfer", transfers,
                  "seconds per row copied (accelerators): SECONDS or FAMILY=SECONDS");
    c->add_option("--json", json_file, "write the report and timeline as JSON");
    c->add_option("--plot", plot_file, "draw the timeline into this PNG");
    c->add_option("--python", python, "the Python with matplotlib that draws the plot");
    c->callback([this] { run(); });
  }

  void run() const {
    if (!json_file.empty())
      check_writable(json_file, "--json");
    if (!plot_file.empty())
      check_writable(plot_file, "--plot");
    const auto pool = parse_pool(pool_text);
    // One curve per family: the tune file's first device of it, or one by hand.
    std::map<neml2::DeviceFamily, neml2::DeviceCurve> by_family;
    if (!tune_file.empty())
      for (const auto& curve : neml2::read_tune_file(tune_file).devices)
        by_family.try_emplace(curve.device.family(), curve);
    for (const auto& text : curves) {
      auto [family, curve] = parse_curve(text);
      by_family[family] = curve;
    }
    std::map<neml2::DeviceFamily, double> overhead, transfer;
    parse_per_family(overheads, "--overhead", overhead, false);
    parse_per_family(transfers, "--transfer", transfer, true);
    // The pool policy recommended for one device of each family, given to each of its devices.
    neml2::TuneResult families;
    for (const auto& [device, family] : pool)
      if (!by_family.contains(family))
        throw UsageError(fmt::format("--pool lists {}, but no curve for {} was given: tune it, or "
                                     "give --curve {}=ROWS:RATE,...",
                                     device.str(), neml2::name(family), neml2::name(family)));
    for (const auto& [family, curve] : by_family) {
      auto c = curve;
      c.device = family;
      families.devices.push_back(c);
    }
    const auto recommended = neml2::recommend(families).pool;
    neml2::GreedyPriorityCapacity policy;
    std::vector<neml2::SimulatedDevice> node;
    std::vector<std::string> names;
    for (const auto& [device, family] : pool) {
      std::size_t k = 0;
      while (recommended.devices[k].family() != family)
        ++k;
      policy.devices.push_back(device);
      policy.batch_sizes.push_back(recommended.batch_sizes[k]);
      policy.capacities.push_back(recommended.capacities[k]);
      policy.priorities.push_back(recommended.priorities[k]);
      node.push_back(
          {neml2::ThroughputCurve::from(by_family.at(family)),
           overhead.contains(family) ? overhead.at(family) : by_family.at(family).chunk_overhead,
           transfer.contains(family) ? transfer.at(family) : 0.0});
      names.push_back(device.str());
    }
    const auto sim = neml2::simulate(policy, node, batch, static_cast<std::size_t>(calls));
    fmt::print("{}\n{}", neml2::to_cpp(policy), neml2::format_simulation(sim, names));
    std::fflush(stdout);
    fs::path json = json_file;
    if (json.empty() && !plot_file.empty())
      json = temporary_file("neml2-dispatch-simulate-", ".json");
    if (!json.empty()) {
      write_text(json, neml2::simulation_json(sim, names));
      if (!json_file.empty())
        fmt::print("timeline written: {}\n", json.string());
    }
    if (!plot_file.empty()) {
      plot(python_for_plots(python), {"timeline", json.string(), "--out", plot_file});
      if (json_file.empty())
        fs::remove(json);
      fmt::print("plot written: {}\n", plot_file);
    }
  }
};

} // namespace

int main(int argc, char** argv) {
  CLI::App app{"neml2-dispatch: inspect, run, tune and simulate compiled NEML2 models"};
  app.require_subcommand(1);
  InfoCommand info;
  TuneCommand tune;
  RunCommand run;
  SimulateCommand simulate;
  info.add(app);
  run.add(app);
  tune.add(app);
  simulate.add(app);
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
  } catch (const UsageError& e) {
    std::fprintf(stderr, "neml2-dispatch: %s\n", one_line(e.what()).c_str());
    return 2;
  } catch (const std::exception& e) { // torch's own errors carry a backtrace: first lines only
    std::fprintf(stderr, "neml2-dispatch: error: %s\n",
                 one_line(neml2::detail::first_lines(e.what())).c_str());
    return 1;
  }
  return 0;
}

// neml2-dispatch simulate: throughput curves (a tune file's, or given by hand) replayed
// through GreedyPriorityCapacity on a virtual node, the CPU on its lanes; the report, its
// timeline as JSON, and optionally a plot.

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <unistd.h>

#include <neml2/simulate.hpp>
#include <neml2/tune.hpp>

#include "arguments.hpp"
#include "commands.hpp"
#include "plot.hpp"

namespace program {
namespace {

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
      count = parse_integer(std::string_view(entry).substr(0, x)).value_or(0);
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
    const std::string_view whole(point);
    const auto rows =
        colon == std::string::npos ? std::nullopt : parse_integer(whole.substr(0, colon));
    const auto rate =
        colon == std::string::npos ? std::nullopt : parse_finite(whole.substr(colon + 1));
    if (!rows || !rate || *rows < 1 || !(*rate > 0) ||
        (!curve.points.empty() && *rows <= curve.points.back().rows))
      throw bad("point '" + point +
                "' is not ROWS:RATE with whole ROWS >= 1 increasing, finite RATE > 0");
    curve.points.push_back({*rows, *rate, *rate, *rate, 1});
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
    const auto parsed =
        parse_finite(std::string_view(text).substr(eq == std::string::npos ? 0 : eq + 1));
    if (!parsed || !(*parsed >= 0))
      throw UsageError(std::string(flag) + " '" + text +
                       "' is not SECONDS or FAMILY=SECONDS with finite SECONDS >= 0");
    const auto value = *parsed;
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

// `curve` with every rate times `factor`.
neml2::DeviceCurve scaled(neml2::DeviceCurve curve, double factor) {
  for (auto& p : curve.points) {
    p.median *= factor;
    p.low *= factor;
    p.high *= factor;
  }
  return curve;
}

struct SimulateCommand {
  std::string tune_file, pool_text, json_file, plot_file, python;
  std::vector<std::string> curves, overheads, transfers;
  std::int64_t batch = 0;
  int calls = 1;
  std::optional<std::int64_t> cpu_lanes; // default: the tune file's, else 1

  CLI::App* add(CLI::App& app) {
    auto* c = app.add_subcommand("simulate", "replay throughput curves through "
                                             "GreedyPriorityCapacity on a virtual node");
    c->add_option("tune_file", tune_file, "a tune file (its curves and recommendations)")
        ->check(CLI::ExistingFile);
    c->add_option("--pool", pool_text, "the node's devices, e.g. cpu,8xcuda")->required();
    c->add_option("--batch", batch, "rows per call")->required()->check(whole_number());
    c->add_option("--calls", calls, "calls in a row (the policy's state lives across them)")
        ->check(CLI::Range(1, 1000));
    c->add_option("--curve", curves, "a curve by hand: FAMILY=ROWS:RATE,ROWS:RATE,...");
    c->add_option("--overhead", overheads,
                  "seconds per chunk: SECONDS or FAMILY=SECONDS (default: the tune file's lane "
                  "test; 0 for a curve by hand)");
    c->add_option("--transfer", transfers,
                  "seconds per row copied (accelerators): SECONDS or FAMILY=SECONDS");
    c->add_option("--cpu-lanes", cpu_lanes,
                  "the simulated CPU's lanes (default: those the tune file was measured on, or "
                  "1; its curve, or one by hand, is taken as one lane's rate)")
        ->check(whole_number());
    c->add_option("--json", json_file, "write the report and timeline as JSON");
    c->add_option("--plot", plot_file, "draw the timeline into this PNG");
    c->add_option("--python", python, "the Python with matplotlib that draws the plot");
    return c;
  }

  void run() const {
    if (!json_file.empty())
      check_writable(json_file, "--json");
    if (!plot_file.empty())
      check_writable(plot_file, "--plot");
    const auto pool = parse_pool(pool_text);
    // One curve per family, of one lane on the CPU: the tune file's first device of it (its
    // CPU rates over the lanes it was measured on), or one by hand.
    std::map<neml2::DeviceFamily, neml2::DeviceCurve> by_family;
    int file_lanes = 1;
    if (!tune_file.empty()) {
      const auto file = neml2::read_tune_file(tune_file);
      file_lanes = file.machine.cpu_lanes;
      for (const auto& curve : file.devices)
        by_family.try_emplace(curve.device.family(),
                              scaled(curve, curve.device.family() == neml2::DeviceFamily::cpu
                                                ? 1.0 / file_lanes
                                                : 1.0));
    }
    for (const auto& text : curves) {
      auto [family, curve] = parse_curve(text);
      by_family[family] = curve;
    }
    const auto lanes = cpu_lanes.value_or(file_lanes);
    if (lanes > neml2::max_cpu_lanes)
      throw UsageError(fmt::format("--cpu-lanes {} is more than {}, the most a policy asks for",
                                   lanes, neml2::max_cpu_lanes));
    std::map<neml2::DeviceFamily, double> overhead, transfer;
    parse_per_family(overheads, "--overhead", overhead, false);
    parse_per_family(transfers, "--transfer", transfer, true);
    // The pool policy recommended for one device of each family, given to each of its
    // devices: from the CPU's rates on all its lanes (one lane's times the lanes).
    neml2::TuneResult families{.machine = {.cpu_lanes = static_cast<int>(lanes)}};
    for (const auto& [device, family] : pool)
      if (!by_family.contains(family))
        throw UsageError(fmt::format("--pool lists {}, but no curve for {} was given: tune it, or "
                                     "give --curve {}=ROWS:RATE,...",
                                     device.str(), neml2::name(family), neml2::name(family)));
    for (const auto& [family, curve] : by_family) {
      auto c = scaled(curve, family == neml2::DeviceFamily::cpu ? static_cast<double>(lanes) : 1.0);
      c.device = family;
      families.devices.push_back(c);
    }
    const auto recommended = neml2::recommend(families).pool;
    neml2::GreedyPriorityCapacity policy{.cpu_lanes = recommended.cpu_lanes};
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

void add_simulate_command(CLI::App& app) {
  auto command = std::make_shared<SimulateCommand>();
  command->add(app)->callback([command] { command->run(); });
}

} // namespace program

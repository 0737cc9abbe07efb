// The tune file: the table written as JSON, read back with every field checked, and
// checked against the artifact and machine it is loaded for.

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <neml2/tune.hpp>

#include "core/bounded_files.hpp"
#include "core/json_fields.hpp"
#include "tools/recommendations_json.hpp"

namespace neml2 {

using json = nlohmann::json;

// The stop a tune file names, back.
static std::optional<SweepStop> sweep_stop_from(const std::string& text) {
  for (auto s :
       {SweepStop::finished, SweepStop::budget, SweepStop::out_of_memory_wall, SweepStop::cap})
    if (to_string(s) == text)
      return s;
  return std::nullopt;
}

static constexpr const char* tune_format = "neml2-dispatch tune file";
static constexpr int tune_format_version = 3; // 2: chunk_overhead; 3: cpu_lanes

std::string tune_file_text(const TuneResult& result) {
  json devices = json::array();
  for (const auto& curve : result.devices) {
    json points = json::array();
    for (const auto& p : curve.points)
      points.push_back({{"rows", p.rows},
                        {"median", p.median},
                        {"low", p.low},
                        {"high", p.high},
                        {"repeats", p.repeats},
                        {"out_of_memory", p.out_of_memory}});
    devices.push_back({{"device", curve.device.str()},
                       {"device_name", curve.device_name},
                       {"artifact_hash", curve.artifact_hash},
                       {"stop", to_string(curve.stop)},
                       {"overlap_chunks", curve.overlap_chunks},
                       {"chunk_overhead", curve.chunk_overhead},
                       {"points", points}});
  }
  json file = {{"format", tune_format},
               {"version", tune_format_version},
               {"model", result.model},
               {"operation", result.operation},
               {"dtype", result.machine.dtype},
               {"torch_version", result.machine.torch_version},
               {"intra_op_threads", result.machine.intra_op_threads},
               {"cpu_lanes", result.machine.cpu_lanes},
               {"host_cpu", result.machine.host_cpu},
               {"devices", devices}};
  try { // for people reading the file; not read back (recomputed from the table)
    file["recommendations"] = detail::recommendations_json(recommend(result));
  } catch (const FatalError&) {
  }
  return file.dump(2) + "\n";
}

namespace {
constexpr std::string_view retune =
    "re-tune to write a new file (neml2-dispatch tune STUB --device ... --out FILE)";

// A tune file's fields, with errors that name the field:
// "tune file <where>: field 'devices[0].stop' is missing; re-tune ...".
class TuneFileFields final : public detail::JsonFields {
public:
  explicit TuneFileFields(std::string where)
      : _where(std::move(where)) {}

  // A rate or seconds: a finite number >= 0.
  double non_negative(const json& object, const std::string& key, const std::string& field) const {
    const auto& v = at(object, key, field);
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0)
      fail(detail::field_path(field, key), "must be a non-negative number");
    return v.get<double>();
  }

private:
  std::string message(const std::string& field, const std::string& problem) const override {
    return fmt::format("tune file {}: field '{}' {}; re-tune to write a new file "
                       "(neml2-dispatch tune STUB --device ... --out FILE)",
                       _where, field, problem);
  }
  std::string words(const detail::FieldProblem& problem) const override {
    if (problem.kind == detail::FieldProblem::Kind::missing)
      return "is missing";
    // A wrong type by its name ("must be an integer, not string"), a number by its value.
    return fmt::format("must be {}, not {}", problem.expected,
                       problem.kind == detail::FieldProblem::Kind::wrong_type
                           ? std::string(problem.value->type_name())
                           : problem.value->dump());
  }

  std::string _where;
};
} // namespace

TuneResult parse_tune_file(const std::string& text, const std::string& where) {
  // Bounded before nlohmann sees it (a real tune file is a few KB, 5 deep).
  detail::check_size(text.size(), detail::max_tune_bytes, "tune file", where, retune);
  detail::check_json_bounds(text, "tune file " + where, retune);
  json file;
  try {
    file = json::parse(text);
  } catch (const json::exception& e) { // parse_error, or out_of_range for 1e400 (fuzz_tune)
    throw FatalError(fmt::format("tune file {} is not valid JSON ({}); re-tune to write a new "
                                 "file (neml2-dispatch tune STUB --device ... --out FILE)",
                                 where, e.what()));
  }
  const TuneFileFields r{where};
  if (!file.is_object())
    r.fail("(top level)", "must be an object");
  if (r.get<std::string>(file, "format", "") != tune_format)
    r.fail("format", fmt::format("is not '{}'", tune_format));
  if (const auto v = r.get<std::int64_t>(file, "version", ""); v != tune_format_version)
    r.fail("version", fmt::format("is {}; this library reads version {}", v, tune_format_version));
  TuneResult result;
  result.model = r.get<std::string>(file, "model", "");
  result.operation = r.get<std::string>(file, "operation", "");
  result.machine.dtype = r.get<std::string>(file, "dtype", "");
  result.machine.torch_version = r.get<std::string>(file, "torch_version", "");
  result.machine.intra_op_threads = r.get<int>(file, "intra_op_threads", "");
  result.machine.cpu_lanes = r.get<int>(file, "cpu_lanes", "");
  if (result.machine.cpu_lanes < 1 || result.machine.cpu_lanes > max_cpu_lanes)
    r.fail("cpu_lanes",
           fmt::format("must be from 1 to {} (the lanes the CPU was measured on)", max_cpu_lanes));
  result.machine.host_cpu = r.get<std::string>(file, "host_cpu", "");
  const auto& devices = r.array(file, "devices", "");
  for (std::size_t d = 0; d < devices.size(); ++d) {
    const auto f = fmt::format("devices[{}]", d);
    const auto& entry = devices[d];
    DeviceCurve curve;
    try {
      curve.device = Device(r.get<std::string>(entry, "device", f));
    } catch (const FatalError& e) {
      if (std::string(e.what()).starts_with("tune file"))
        throw;
      r.fail(f + ".device", std::string("is not a device: ") + e.what());
    }
    curve.device_name = r.get<std::string>(entry, "device_name", f);
    curve.artifact_hash = r.get<std::string>(entry, "artifact_hash", f);
    const auto stop = r.get<std::string>(entry, "stop", f);
    if (const auto known = sweep_stop_from(stop))
      curve.stop = *known;
    else
      r.fail(f + ".stop",
             "is '" + stop + "'; expected finished, budget, out_of_memory_wall or cap");
    curve.overlap_chunks = r.get<int>(entry, "overlap_chunks", f);
    if (curve.overlap_chunks < 1)
      r.fail(f + ".overlap_chunks", "must be >= 1");
    curve.chunk_overhead = r.non_negative(entry, "chunk_overhead", f);
    const auto& points = r.array(entry, "points", f);
    for (std::size_t i = 0; i < points.size(); ++i) {
      const auto g = fmt::format("{}.points[{}]", f, i);
      TunePoint p;
      p.rows = r.get<std::int64_t>(points[i], "rows", g);
      if (p.rows < 1)
        r.fail(g + ".rows", "must be >= 1");
      p.median = r.non_negative(points[i], "median", g);
      p.low = r.non_negative(points[i], "low", g);
      p.high = r.non_negative(points[i], "high", g);
      p.repeats = r.get<int>(points[i], "repeats", g);
      p.out_of_memory = r.get<bool>(points[i], "out_of_memory", g);
      if (!p.out_of_memory)
        for (const auto& [value, key] :
             {std::pair{p.median, "median"}, {p.low, "low"}, {p.high, "high"}})
          if (!(std::isfinite(value) && value > 0))
            r.fail(g + "." + key, "must be a finite number > 0 (rows per second); re-tune");
      if (!p.out_of_memory && (p.repeats < 1 || !(p.low <= p.median && p.median <= p.high)))
        r.fail(g, "must have repeats >= 1 and low <= median <= high");
      if (!curve.points.empty() && p.rows <= curve.points.back().rows)
        r.fail(g + ".rows", "must be larger than the previous point's (points by size)");
      curve.points.push_back(p);
    }
    result.devices.push_back(std::move(curve));
  }
  if (result.devices.empty())
    r.fail("devices", "is empty");
  return result;
}

void write_tune_file(const std::filesystem::path& file, const TuneResult& result) {
  std::ofstream out(file);
  out << tune_file_text(result);
  out.close();
  if (!out)
    throw FatalError(fmt::format("cannot write the tune file {}; check that its folder exists and "
                                 "is writable",
                                 file.string()));
}

TuneResult read_tune_file(const std::filesystem::path& file) {
  // Never opened when it is a FIFO or a device (it would block, or not end).
  const auto status = detail::status_of(file, "tune file");
  if (std::filesystem::is_regular_file(status) ? !std::ifstream(file)
                                               : !std::filesystem::exists(status))
    throw FatalError(fmt::format("cannot read the tune file {}; tune first (neml2-dispatch tune "
                                 "STUB --device ... --out {})",
                                 file.string(), file.string()));
  return parse_tune_file(detail::read_text(file, "tune file", detail::max_tune_bytes, retune),
                         file.string());
}

void check_tune_matches(const TuneResult& result, const Artifact& artifact, c10::ScalarType dtype,
                        const std::filesystem::path& file, std::optional<std::int64_t> cpu_lanes) {
  std::vector<std::string> devices;
  for (const auto& c : result.devices)
    devices.push_back("--device " + c.device.str());
  const auto retune = fmt::format(
      "re-tune on this machine: neml2-dispatch tune {} {} --dtype {}{} --out {}",
      artifact.root.string(), fmt::join(devices, " "), dtype_folder(dtype),
      cpu_lanes.value_or(0) > 0 ? fmt::format(" --cpu-lanes {}", *cpu_lanes) : std::string(),
      file.empty() ? std::string("FILE") : file.string());
  const auto differ = [&](const std::string& key, const std::string& theirs,
                          const std::string& ours) {
    if (theirs != ours)
      throw FatalError(fmt::format("tune file {} does not match: its {} is '{}', but here it is "
                                   "'{}'; {}",
                                   file.empty() ? std::string("(in memory)") : file.string(), key,
                                   theirs, ours, retune));
  };
  const auto here = current_machine(dtype, cpu_lanes.value_or(0));
  differ("dtype", result.machine.dtype, here.dtype);
  differ("torch_version", result.machine.torch_version, here.torch_version);
  differ("intra_op_threads", std::to_string(result.machine.intra_op_threads),
         std::to_string(here.intra_op_threads));
  // The CPU's sizes hold for the lanes they were measured on: a SyncChunking chunk is one
  // lane's work, a pool's CPU chunk is shared by the lanes.
  const bool has_cpu =
      std::any_of(result.devices.begin(), result.devices.end(),
                  [](const DeviceCurve& c) { return c.device.family() == DeviceFamily::cpu; });
  if (cpu_lanes && has_cpu)
    differ("cpu_lanes (the lanes its CPU sizes were measured on)",
           std::to_string(result.machine.cpu_lanes), std::to_string(here.cpu_lanes));
  differ("host_cpu", result.machine.host_cpu, here.host_cpu);
  for (std::size_t d = 0; d < result.devices.size(); ++d) {
    const auto& curve = result.devices[d];
    const auto where = fmt::format("devices[{}] ({})", d, curve.device.str());
    differ(where + " device_name", curve.device_name, device_name(curve.device));
    differ(where + " artifact_hash (the artifact's metadata.json or graphs changed)",
           curve.artifact_hash, artifact_hash(artifact, curve.device, dtype));
  }
}

TuneResult load_tuning(const std::filesystem::path& file, const Artifact& artifact,
                       c10::ScalarType dtype, std::optional<std::int64_t> cpu_lanes) {
  auto result = read_tune_file(file);
  check_tune_matches(result, artifact, dtype, file, cpu_lanes);
  return result;
}

} // namespace neml2

// The tools from Python: policies from tune files, artifact info, the tuner's sweep
// (neml2::tune) and the node simulator (neml2::simulate). Results cross as the JSON texts
// the program writes (the tune file, simulation_json), which neml2_dispatch loads as dicts.

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/stl/filesystem.h>

#include <neml2/artifact_info.hpp>
#include <neml2/dispatch.hpp>
#include <neml2/simulate.hpp>
#include <neml2/tune.hpp>

#include "bindings.hpp"

namespace neml2::python {
namespace {

using namespace pybind11::literals;

// on_point(device index, point as a dict), with the GIL taken; a Python exception stops
// the sweep as a FatalError that names the callback.
std::function<void(std::size_t, const TunePoint&, const neml2::SweepProgress&)>
as_on_point(py::object callable) {
  if (callable.is_none())
    return {};
  if (!PyCallable_Check(callable.ptr()))
    throw FatalError("tune(): on_point is a " + type_name(callable) +
                     "; it must be callable as on_point(device_index, point) or None");
  return [held = hold(std::move(callable))](std::size_t device, const TunePoint& p,
                                            const neml2::SweepProgress&) {
    run_callback("tune(): the on_point callback", [&] {
      (*held)(device,
              py::dict("rows"_a = p.rows, "median"_a = p.median, "low"_a = p.low, "high"_a = p.high,
                       "repeats"_a = p.repeats, "out_of_memory"_a = p.out_of_memory));
    });
  };
}

std::string tune_text(const std::filesystem::path& path, std::optional<std::string> name,
                      const std::vector<Device>& devices, const std::string& operation,
                      c10::ScalarType dtype, std::int64_t batch_rows, std::int64_t min_rows,
                      std::int64_t max_rows, double budget_seconds, int warmup, int repeats,
                      py::object sample,
                      const std::map<std::string, std::pair<double, double>>& ranges, double low,
                      double high, std::uint64_t seed, bool overlap_test, bool lane_test,
                      py::object on_point, std::optional<std::filesystem::path> out) {
  if (devices.empty())
    throw FatalError("tune(): devices is empty; give the devices to measure, e.g. ['cpu']");
  if (out && !out->parent_path().empty() && !std::filesystem::is_directory(out->parent_path()))
    throw FatalError("tune(): cannot write the tune file " + out->string() + ": its folder " +
                     out->parent_path().string() + " does not exist; create it first");
  TuneOptions options;
  options.sweep.min_rows = min_rows;
  options.sweep.max_rows = max_rows;
  options.sweep.budget_seconds = budget_seconds;
  options.operation = operation;
  options.dtype = dtype;
  options.warmup = warmup;
  options.repeats = repeats;
  options.batch_rows = batch_rows;
  options.inputs = {.sample = to_map(sample, "tune(): sample"),
                    .ranges = ranges,
                    .low = low,
                    .high = high,
                    .seed = seed};
  options.overlap_test = overlap_test;
  options.lane_test = lane_test;
  options.on_point = as_on_point(std::move(on_point));
  const auto artifact = load_artifact(path, name);
  py::gil_scoped_release nogil;
  const auto result = tune(*artifact, devices, options, name.value_or(""));
  if (out)
    write_tune_file(*out, result);
  return tune_file_text(result);
}

// A float (a flat curve) or (rows, rows per second) pairs by increasing rows.
ThroughputCurve curve_of(py::handle value, const std::string& where) {
  if (PyFloat_Check(value.ptr()) || PyLong_Check(value.ptr()))
    return ThroughputCurve::constant(value.cast<double>());
  std::vector<std::pair<std::int64_t, double>> points;
  try {
    for (const auto& point : py::reinterpret_borrow<py::iterable>(value))
      points.push_back(point.cast<std::pair<std::int64_t, double>>());
  } catch (const std::exception&) { // not iterable, or an item that is not a pair
    throw FatalError(where + " is " + py::repr(value).cast<std::string>() +
                     "; give rows per second (a number) or (rows, rows per second) pairs");
  }
  try {
    return ThroughputCurve(std::move(points));
  } catch (const FatalError& e) {
    throw FatalError(where + ": " + e.what());
  }
}

double seconds_of(const py::dict& entry, const char* key, double fallback,
                  const std::string& where) {
  if (!entry.contains(key))
    return fallback;
  const auto value = entry[key];
  if (!PyFloat_Check(value.ptr()) && !PyLong_Check(value.ptr()))
    throw FatalError(where + "['" + key + "'] is a " + type_name(value) + "; it must be seconds");
  const auto seconds = value.cast<double>();
  if (!(seconds >= 0) || !std::isfinite(seconds))
    throw FatalError(where + "['" + key + "'] is " + std::to_string(seconds) +
                     "; it must be finite seconds >= 0");
  return seconds;
}

// A simulated device: {"curve": ..., "chunk_overhead": s, "transfer_seconds_per_row": s},
// or a device of a tune result (its measured points' medians; its chunk_overhead).
SimulatedDevice simulated_device(py::handle value, std::size_t index) {
  const auto where = "simulate(): devices[" + std::to_string(index) + "]";
  if (!PyDict_Check(value.ptr()))
    throw FatalError(where + " is a " + type_name(value) +
                     "; give a dict with 'curve' (rows/s, or (rows, rows/s) pairs) and optional "
                     "'chunk_overhead' and 'transfer_seconds_per_row', or a device of a tune "
                     "result (tune(...)['devices'][k])");
  const auto entry = py::reinterpret_borrow<py::dict>(value);
  const bool tuned = entry.contains("points"); // a device of a tune result, with its own keys
  for (const auto& [key, _] : entry)
    if (const auto k = py::str(key).cast<std::string>();
        !tuned && k != "curve" && k != "chunk_overhead" && k != "transfer_seconds_per_row")
      throw FatalError(where + " has the key '" + k +
                       "'; the keys are curve, chunk_overhead, transfer_seconds_per_row");
  ThroughputCurve curve;
  if (entry.contains("curve"))
    curve = curve_of(entry["curve"], where + "['curve']");
  else if (tuned) {
    // A CPU's medians are all its lanes' rows per second; the simulator wants one lane's.
    double lanes = 1;
    if (entry.contains("device") && py::str(entry["device"]).cast<std::string>() == "cpu") {
      if (!entry.contains("cpu_lanes"))
        throw FatalError(where + " is the CPU of a tune result, measured on its lanes: add the "
                                 "result's cpu_lanes, dict(device, cpu_lanes=result['cpu_lanes'])");
      lanes = entry["cpu_lanes"].cast<double>();
      if (!(lanes >= 1))
        throw FatalError(where + "['cpu_lanes'] is " + std::to_string(lanes) + "; it must be >= 1");
    }
    py::list pairs;
    try {
      for (const auto& p : entry["points"])
        if (!p["out_of_memory"].cast<bool>() && p["repeats"].cast<int>() > 0)
          pairs.append(py::make_tuple(p["rows"], p["median"].cast<double>() / lanes));
    } catch (const std::exception&) {
      throw FatalError(where + "['points'] is not a tune result's points (dicts with rows, "
                               "median, repeats, out_of_memory)");
    }
    curve = curve_of(pairs, where + "['points']");
  } else
    throw FatalError(where + " has no 'curve'; give rows per second or (rows, rows/s) pairs");
  return {std::move(curve), seconds_of(entry, "chunk_overhead", 0, where),
          seconds_of(entry, "transfer_seconds_per_row", 0, where)};
}

std::string simulate_text(const py::object& policy, const py::object& given, std::int64_t batch,
                          std::size_t calls) {
  if (!PyList_Check(given.ptr()) && !PyTuple_Check(given.ptr()))
    throw FatalError("simulate(): devices is a " + type_name(given) +
                     "; give a list with one simulated device per device of the policy");
  std::vector<SimulatedDevice> devices;
  std::size_t k = 0;
  for (const auto& d : py::reinterpret_borrow<py::sequence>(given))
    devices.push_back(simulated_device(d, k++));
  if (py::isinstance<SyncChunking>(policy) || py::isinstance<GreedyPriorityCapacity>(policy)) {
    const auto run = [&](const auto& p) {
      py::gil_scoped_release nogil;
      return simulation_json(simulate(p, devices, batch, calls), device_strings(listed_devices(p)));
    };
    return py::isinstance<SyncChunking>(policy) ? run(policy.cast<SyncChunking>())
                                                : run(policy.cast<GreedyPriorityCapacity>());
  }
  if (is_python_policy(policy))
    return simulate_python_policy(policy, devices, batch, calls);
  throw FatalError("simulate(): policy is a " + type_name(policy) +
                   "; give a SyncChunking, a GreedyPriorityCapacity or a policy written in "
                   "Python");
}

} // namespace

void bind_tools(py::module_& m) {
  m.def(
      "tuned_policy",
      [](py::object kind, const std::filesystem::path& tune_file, const std::filesystem::path& path,
         std::optional<std::string> name, c10::ScalarType dtype) -> py::object {
        const auto artifact = load_artifact(path, name);
        if (kind.is(py::type::of<SyncChunking>())) {
          auto p = [&] {
            py::gil_scoped_release nogil;
            return tuned_policy<SyncChunking>(tune_file, *artifact, dtype);
          }();
          return py::cast(p);
        }
        if (kind.is(py::type::of<GreedyPriorityCapacity>())) {
          auto p = [&] {
            py::gil_scoped_release nogil;
            return tuned_policy<GreedyPriorityCapacity>(tune_file, *artifact, dtype);
          }();
          return py::cast(p);
        }
        throw FatalError("tuned_policy(): kind must be neml2_dispatch.SyncChunking or "
                         "GreedyPriorityCapacity (the class)");
      },
      "kind"_a, "tune_file"_a, "path"_a, "name"_a = py::none(), "dtype"_a = c10::kDouble,
      "A policy of class `kind` from a tune file (neml2-dispatch tune), checked against the "
      "artifact, this machine and `dtype`.");
  m.def("_tune", &tune_text, "path"_a, "name"_a, "devices"_a, py::kw_only(),
        "operation"_a = "forward", "dtype"_a = c10::kDouble, "batch_rows"_a = std::int64_t{1} << 16,
        "min_rows"_a = 1, "max_rows"_a = std::int64_t{1} << 22, "budget_seconds"_a = 30.0,
        "warmup"_a = 1, "repeats"_a = 5, "sample"_a = py::none(),
        "ranges"_a = std::map<std::string, std::pair<double, double>>{}, "low"_a = 1e-4,
        "high"_a = 1e-3, "seed"_a = 0, "overlap_test"_a = true, "lane_test"_a = true,
        "on_point"_a = py::none(), "out"_a = py::none());
  m.def("_simulate", &simulate_text, "policy"_a, "devices"_a, "batch"_a, "calls"_a = 1);
  m.def(
      "_artifact_info_json",
      [](const std::filesystem::path& path, std::optional<std::string> name) {
        return artifact_info_json(artifact_info(*load_artifact(path, name)));
      },
      "path"_a, "name"_a = py::none());
  m.def(
      "_artifact_info_text",
      [](const std::filesystem::path& path, std::optional<std::string> name) {
        return format_artifact_info(artifact_info(*load_artifact(path, name)));
      },
      "path"_a, "name"_a = py::none());
}

} // namespace neml2::python

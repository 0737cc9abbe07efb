#pragma once

// What the commands share: usage errors, the options that name a model, its inputs and
// what is timed, devices, and the checks made on arguments before any long work.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include <neml2/artifact.hpp>
#include <neml2/device.hpp>
#include <neml2/tune.hpp>

namespace program {

namespace fs = std::filesystem;

// An argument found wrong after parsing: a usage error (exit 2).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A file the program will write, checked before any long work: its folder must exist and
// be writable.
void check_writable(const fs::path& file, const char* flag);

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

// `text` whole as a finite number ("1e-4"; not "inf", "nan", "2e-5s" or " 1"), else nothing.
[[nodiscard]] std::optional<double> parse_finite(std::string_view text);
// `text` whole as a 64-bit integer ("1024"; not "1024abc", "1e3" or out of range), else nothing.
[[nodiscard]] std::optional<std::int64_t> parse_integer(std::string_view text);

// A number option's value is finite and > 0 (CLI11's PositiveNumber lets "inf" through).
extern const CLI::Validator finite_positive;
// A count option's value is a whole number >= 1 (`minimum` 0: >= 0) that fits 64 bits.
CLI::Validator whole_number(std::int64_t minimum = 1);

// "cuda:1" is a device; "gpu" is a usage error that lists the families.
extern const CLI::Validator device_check;

// NAME=LOW:HIGH
std::pair<std::string, std::pair<double, double>> parse_range(const std::string& text);

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

std::vector<neml2::Device> as_devices(const std::vector<std::string>& names);

} // namespace program

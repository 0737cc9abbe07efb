// neml2-dispatch run: a generated batch evaluated with a policy (given, or from a tune
// file), and its throughput.

#include <map>
#include <memory>
#include <optional>

#include <fmt/format.h>

#include <neml2/detail/tune_decisions.hpp>
#include <neml2/detail/tune_measure.hpp>
#include <neml2/dispatch.hpp>
#include <neml2/tune.hpp>

#include "arguments.hpp"
#include "commands.hpp"

namespace program {
namespace {

struct RunCommand {
  EvaluationArguments evaluation;
  std::string policy = "sync";
  std::vector<std::string> devices = {"cpu"};
  std::vector<std::int64_t> batch_sizes, capacities;
  std::string tune_file;
  std::int64_t batch = 0;
  std::optional<std::int64_t> cpu_lanes; // tuned: the file's unless given

  CLI::App* add(CLI::App& app) {
    auto* c = app.add_subcommand("run", "evaluate a generated batch with a policy and print its "
                                        "throughput");
    evaluation.add(c);
    c->add_option("--policy", policy,
                  "sync (SyncChunking), greedy (GreedyPriorityCapacity) or "
                  "tuned (from --tune-file)")
        ->check(CLI::IsMember({"sync", "greedy", "tuned"}));
    c->add_option("--device", devices, "the devices (sync: one)")->check(device_check);
    c->add_option("--batch", batch, "rows per call")->required()->check(whole_number());
    c->add_option("--batch-size", batch_sizes, "rows per chunk: one, or one per device")
        ->check(whole_number(0));
    c->add_option("--capacity", capacities, "greedy: rows in flight per device")
        ->check(whole_number());
    c->add_option("--tune-file", tune_file, "tuned: the tune file")->check(CLI::ExistingFile);
    c->add_option("--cpu-lanes", cpu_lanes,
                  "the lanes the CPU's chunks run on (0: torch's intra-op thread count; default "
                  "0, or with --policy tuned the lanes the tune file was measured on, and a file "
                  "measured on others is refused)")
        ->check(whole_number(0));
    return c;
  }

  template <class Policy>
  void measure(const neml2::Artifact& artifact, Policy policy_value,
               const std::string& label) const {
    const auto dtype = evaluation.model.scalar_type();
    const neml2::DispatchedModel<Policy> m(std::make_shared<const neml2::Artifact>(artifact),
                                           std::move(policy_value), dtype);
    std::map<std::string, at::Tensor> in;
    try {
      in = neml2::detail::tune_inputs(artifact, evaluation.inputs.inputs(), batch, "cpu", dtype);
    } catch (const neml2::Exception&) {
      throw;
    } catch (const std::exception& e) {
      throw neml2::FatalError(fmt::format("cannot make the inputs of {} rows ({}); use a smaller "
                                          "--batch",
                                          batch, neml2::detail::first_lines(e.what(), 1)));
    }
    const auto timing = neml2::detail::measure_calls(
        [&] { neml2::detail::call_operation(m, evaluation.measured.operation, in); }, m.device(),
        evaluation.measured.warmup, evaluation.measured.repeats);
    if (timing.out_of_memory)
      throw neml2::FatalError(fmt::format("ran out of memory with {} rows; use a smaller --batch "
                                          "or --batch-size",
                                          batch));
    const auto p = neml2::detail::summarize(batch, timing);
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
          tune_file, artifact, evaluation.model.scalar_type(), cpu_lanes);
      measure(artifact, p, neml2::to_cpp(p));
    } else if (policy == "sync") {
      if (devices.size() != 1 || batch_sizes.size() > 1)
        throw UsageError("--policy sync takes one --device and at most one --batch-size");
      const neml2::SyncChunking p{.device = devices.front(),
                                  .batch_size = batch_sizes.empty() ? 0 : batch_sizes.front(),
                                  .cpu_lanes = cpu_lanes.value_or(0)};
      measure(artifact, p, neml2::to_cpp(p));
    } else {
      if (batch_sizes.empty())
        throw UsageError("--policy greedy needs --batch-size (one, or one per device)");
      const neml2::GreedyPriorityCapacity p{.devices = as_devices(devices),
                                            .batch_sizes = batch_sizes,
                                            .capacities = capacities,
                                            .cpu_lanes = cpu_lanes.value_or(0)};
      measure(artifact, p, neml2::to_cpp(p));
    }
  }
};

} // namespace

void add_run_command(CLI::App& app) {
  auto command = std::make_shared<RunCommand>();
  command->add(app)->callback([command] { command->run(); });
}

} // namespace program

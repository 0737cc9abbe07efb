#pragma once

/// @file tune.hpp
/// @brief Batch sizes chosen by measurement: a sweep per device, the table it makes,
/// policies recommended from it, and a tune file the library loads back (like FFTW's
/// wisdom) so that later runs pay nothing.
///
/// Opt-in (not in dispatch.hpp). A host tunes once, saves, and builds its policy from the
/// file at start-up; a file made for another artifact or machine is refused by name:
/// @code
/// const auto artifact = neml2::read_artifact(neml2::resolve_artifact_root(stub, "model"));
/// if (!std::filesystem::exists("model.tune.json"))
///   neml2::write_tune_file("model.tune.json",
///                          neml2::tune(artifact, {"cpu", "cuda:0"}, neml2::TuneOptions{}));
/// auto model = neml2::DispatchedModel<neml2::GreedyPriorityCapacity>(
///     std::make_shared<const neml2::Artifact>(artifact),
///     neml2::tuned_policy<neml2::GreedyPriorityCapacity>("model.tune.json", artifact));
/// @endcode
/// The sweep's decisions are plain code over measurements (knee, recommend, and the sweep
/// itself in neml2/detail/tune_decisions.hpp), so they are tested on synthetic timings;
/// tune() feeds them real ones (neml2/detail/tune_measure.hpp: how it measures).
/// @see docs/tuning.md

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <neml2/artifact.hpp>
#include <neml2/device.hpp>
#include <neml2/policies/greedy_priority_capacity.hpp>
#include <neml2/policies/mpi_rank_assign_settings.hpp>
#include <neml2/policies/sync_chunking.hpp>

namespace neml2 {

// ---------------------------------------------------------------------------- the sweep

/// What one measurement of a size gave (what a sweep's record() takes).
struct Timing {
  std::vector<double> seconds = {}; ///< wall seconds of each timed repeat, after warm-up
  double elapsed = 0;               ///< seconds in all, warm-up included (0: the repeats' sum)
  bool out_of_memory = false;       ///< the size did not fit in the device's memory
  std::int64_t rows_per_call = 0;   ///< rows each repeat evaluated (0: the size itself)
};

/// One size of the table: rows per second over the repeats (median, lowest, highest).
struct TunePoint {
  std::int64_t rows = 0; ///< the size measured (in tune(): rows per chunk)
  /// @var median
  /// The median of the repeats' rates, in rows per second.
  /// @var low
  /// The lowest of the repeats' rates, in rows per second.
  /// @var high
  /// The highest of the repeats' rates, in rows per second.
  double median = 0, low = 0, high = 0;
  int repeats = 0;            ///< timed repeats the rates are over (0 when out of memory)
  bool out_of_memory = false; ///< the size did not fit in the device's memory
  /// True when it holds rates: the size fit and was timed at least once.
  [[nodiscard]] bool measured() const noexcept { return !out_of_memory && repeats > 0; }
};

/// How a sweep grows, refines and stops.
struct SweepOptions {
  std::int64_t min_rows = 1;                     ///< the first size: doubling starts there
  std::int64_t max_rows = std::int64_t{1} << 22; ///< the cap (also lowered to what fits)
  /// A size counts as better when its median beats the best so far by this fraction.
  double improvement = 0.03;
  /// Doubling stops after this many sizes in a row that were not better (a dip of up to
  /// patience - 1 sizes does not stop it: J2 radial return on this machine's CPU has a
  /// plateau from 4096 to 16384 rows and its best chunks near 46341).
  int patience = 4;
  /// Rounds of refinement: the geometric midpoints between the best size and its measured
  /// neighbours, then again around the new best.
  int refine_rounds = 2;
  /// The sweep measures nothing more once its measurements took this long in all.
  double budget_seconds = 30;
  /// Sizes measured once doubling stops, whether or not it reached them (tune() adds its
  /// batch_rows: the whole call unchunked, which a curve with a far second rise can win).
  std::vector<std::int64_t> also = {};
};

/// Why a sweep ended: `finished` (doubling stopped for lack of improvement, refinement
/// done), `budget` (spent with sizes still to measure), `out_of_memory_wall` (a doubled
/// size did not fit) or `cap` (doubling reached max_rows).
enum class SweepStop { finished, budget, out_of_memory_wall, cap };

/// The stop's name, as the tune file writes it: "finished", "budget", ...
[[nodiscard]] std::string to_string(SweepStop stop);

/// Where a device's sweep stands when TuneOptions::on_point sees one of its points: the
/// seconds its measurements took so far against its budget (a progress bar's).
struct SweepProgress {
  double spent_seconds = 0;  ///< seconds the device's measurements took so far, warm-up included
  double budget_seconds = 0; ///< SweepOptions::budget_seconds: nothing is measured past it
  /// Seconds of budget left (0 once it is spent).
  [[nodiscard]] double seconds_left() const noexcept {
    return spent_seconds < budget_seconds ? budget_seconds - spent_seconds : 0.0;
  }
};

// ---------------------------------------------------------------------------- the table

/// One device's curve: its points by size, and what the machine key holds for it.
struct DeviceCurve {
  Device device = {};                   ///< the device the sizes were measured on
  std::string device_name = {};         ///< the CPU's model name or the GPU's name
  std::string artifact_hash = {};       ///< of metadata.json and the graphs of this device's leaf
  std::vector<TunePoint> points = {};   ///< by increasing rows, sizes that did not fit included
  SweepStop stop = SweepStop::finished; ///< why the device's sweep ended
  /// Chunks in flight that the overlap test found best (1 where the device cannot overlap).
  int overlap_chunks = 1;
  /// Seconds a chunk costs on a pool's lane beyond what the curve says (the lane test:
  /// GreedyPriorityCapacity against the calling thread at the knee, per chunk, >= 0). The
  /// simulator adds it to each chunk of this device.
  double chunk_overhead = 0;

  /// The measured point of highest median throughput (a FatalError when none was measured).
  [[nodiscard]] const TunePoint& best() const;
  /// The smallest measured size whose median reaches `fraction` of the best median: past
  /// it, larger chunks buy little, and smaller chunks balance a pool better.
  [[nodiscard]] const TunePoint& knee(double fraction = 0.9) const;
};

/// What a tuning result depends on, beside each device's own key (DeviceCurve).
struct MachineKey {
  std::string torch_version = {}; ///< the torch the library was built against
  int intra_op_threads = 0;       ///< at::get_num_threads() when tuned
  std::string host_cpu = {};      ///< the host CPU's model name, from /proc/cpuinfo
  std::string dtype = {};         ///< "float64", as the artifact folders are named
  /// The lanes the CPU's sizes were measured on (TuneOptions::cpu_lanes as a model resolves
  /// it: 0 became the intra-op count). A CPU point's rows are one lane's chunk; its rates
  /// are all lanes' together.
  int cpu_lanes = 1;
};

/// A whole tuning result: what a tune file holds.
struct TuneResult {
  std::string model = {};                ///< for people: the model it was tuned on
  std::string operation = "forward";     ///< forward, jacobian or param_jacobian
  MachineKey machine = {};               ///< the key of the process that tuned
  std::vector<DeviceCurve> devices = {}; ///< one curve per device, in the order tuned
};

// --------------------------------------------------------------------- recommendations

/// Policies recommended from a table: SyncChunking per device at its best size (the
/// smallest within `sync_fraction` of the best median: sizes closer than that are within
/// the noise of one run, and the smaller holds less memory); one GreedyPriorityCapacity
/// over all devices at their knees, priorities from their best throughput, capacities from
/// their overlap tests; MPIRankAssign at the same sizes as SyncChunking.
///
/// On the CPU both policies get the lanes the table was measured on (`cpu_lanes`), and
/// sizes as each policy counts them: SyncChunking's batch_size is one lane's chunk (the
/// table's rows), GreedyPriorityCapacity's CPU batch size is the chunk all lanes share
/// (the knee times the lanes).
struct Recommendations {
  std::vector<SyncChunking> sync = {}; ///< in the table's device order
  std::size_t fastest = 0;             ///< the device of highest best throughput
  GreedyPriorityCapacity pool = {};    ///< every device at once, chunks at their knees
  MPIRankAssignSettings mpi = {};      ///< one device per MPI rank, at its best size
};

/// The policies `result` recommends, knees at `knee_fraction` of each best median and
/// SyncChunking's sizes at `sync_fraction` (DeviceCurve::knee). A FatalError when it lists
/// no device or one has no measured size.
[[nodiscard]] Recommendations recommend(const TuneResult& result, double knee_fraction = 0.9,
                                        double sync_fraction = 0.97);

/// `policy` as a C++ expression to paste: `neml2::SyncChunking{.device = ..., ...}`.
[[nodiscard]] std::string to_cpp(const SyncChunking& policy);
/// `policy` as a C++ expression to paste, one field per line.
[[nodiscard]] std::string to_cpp(const GreedyPriorityCapacity& policy);
/// `settings` as a C++ expression to paste: `neml2::MPIRankAssign({.devices = ..., ...})`.
[[nodiscard]] std::string to_cpp(const MPIRankAssignSettings& settings);
/// Every recommended policy as C++, each under a `//` line that says what it is for.
[[nodiscard]] std::string to_cpp(const Recommendations& recommendations);
/// `policy` as one line of JSON: `{"policy": "SyncChunking", "device": ..., ...}`.
[[nodiscard]] std::string to_json(const SyncChunking& policy);
/// `policy` as one line of JSON: `{"policy": "GreedyPriorityCapacity", ...}`.
[[nodiscard]] std::string to_json(const GreedyPriorityCapacity& policy);
/// `settings` as one line of JSON: `{"policy": "MPIRankAssign", ...}`.
[[nodiscard]] std::string to_json(const MPIRankAssignSettings& settings);
/// All of them as indented JSON: `{"sync": [...], "pool": {...}, "mpi": {...}}`.
[[nodiscard]] std::string to_json(const Recommendations& recommendations);

/// The table as aligned text: one row per size and device.
[[nodiscard]] std::string format_table(const TuneResult& result);

// ---------------------------------------------------------------------------- the file

/// The tune file's JSON text (with the recommendations, for people: they are not read back).
[[nodiscard]] std::string tune_file_text(const TuneResult& result);
/// A tune file's text back; `where` names it in errors. A malformed file is a FatalError
/// naming the field and the command that re-tunes.
[[nodiscard]] TuneResult parse_tune_file(const std::string& text, const std::string& where);
/// Writes tune_file_text() to `file` (a FatalError when it cannot be written).
void write_tune_file(const std::filesystem::path& file, const TuneResult& result);
/// Reads and parses `file`, without checking what it was made for (see load_tuning()).
[[nodiscard]] TuneResult read_tune_file(const std::filesystem::path& file);

/// This process's key: torch version, intra-op threads, host CPU, `dtype`, and the lanes a
/// model's CPU calls run on when its policy asks for `cpu_lanes` (0: torch's intra-op count).
[[nodiscard]] MachineKey current_machine(c10::ScalarType dtype, std::int64_t cpu_lanes = 0);
/// The CPU's model name, or the accelerator's name (a FatalError for a device that this
/// process cannot use).
[[nodiscard]] std::string device_name(const Device& device);
/// A hash of metadata.json and the graph files of the artifact's leaf for device/dtype.
[[nodiscard]] std::string artifact_hash(const Artifact& artifact, const Device& device,
                                        c10::ScalarType dtype);

/// Checks that `result` was made for `artifact`, this machine and `dtype`: a FatalError
/// names the first key that differs, both values, and the command that re-tunes. With
/// `cpu_lanes` (the lanes the policy built from it asks for, as a policy's cpu_lanes: 0 for
/// torch's intra-op count here), a table with a CPU must have been measured on as many
/// lanes; without, the policy is taken to use the table's own (as recommend() sets them).
void check_tune_matches(const TuneResult& result, const Artifact& artifact, c10::ScalarType dtype,
                        const std::filesystem::path& file = {},
                        std::optional<std::int64_t> cpu_lanes = std::nullopt);

/// read_tune_file + check_tune_matches.
[[nodiscard]] TuneResult load_tuning(const std::filesystem::path& file, const Artifact& artifact,
                                     c10::ScalarType dtype = c10::kDouble,
                                     std::optional<std::int64_t> cpu_lanes = std::nullopt);

/// @brief A policy built from a checked tune file: SyncChunking (the fastest device at its
/// best size), GreedyPriorityCapacity (every device tuned), or any type constructible from
/// MPIRankAssignSettings' fields as `P::Config{.devices, .batch_sizes}` (MPIRankAssign).
/// SyncChunking and GreedyPriorityCapacity run the CPU on the lanes the file was measured on;
/// with `cpu_lanes`, on those, and a file measured on others is refused (check_tune_matches).
template <class P>
P tuned_policy(const std::filesystem::path& file, const Artifact& artifact,
               c10::ScalarType dtype = c10::kDouble,
               std::optional<std::int64_t> cpu_lanes = std::nullopt) {
  auto recommended = recommend(load_tuning(file, artifact, dtype, cpu_lanes));
  if constexpr (std::is_same_v<P, GreedyPriorityCapacity>) {
    if (cpu_lanes)
      recommended.pool.cpu_lanes = *cpu_lanes;
    return recommended.pool;
  } else if constexpr (std::is_same_v<P, SyncChunking>) {
    auto& sync = recommended.sync.at(recommended.fastest);
    if (cpu_lanes)
      sync.cpu_lanes = *cpu_lanes;
    return sync;
  } else {
    typename P::Config config;
    config.devices = recommended.mpi.devices;
    config.batch_sizes = recommended.mpi.batch_sizes;
    return P(config);
  }
}

// ------------------------------------------------------------- measuring a real model

/// Inputs for measurement: the caller's sample (tiled to each size), or generated values,
/// uniform in a range per input. Defaults keep the repository's implicit models
/// convergent: old-state inputs (`name~1`) are 0, the rest uniform in [low, high].
struct TuneInputs {
  std::map<std::string, at::Tensor> sample = {}; ///< (n, *base) per input; empty: generated
  std::map<std::string, std::pair<double, double>> ranges = {}; ///< per input (public name)
  /// @var low
  /// The lower end of generated values, for inputs without a range of their own.
  /// @var high
  /// The upper end of generated values, for inputs without a range of their own.
  double low = 1e-4, high = 1e-3;
  std::uint64_t seed = 0; ///< of the CPU generator that draws the values
};

/// What tune() measures and how.
struct TuneOptions {
  SweepOptions sweep = {};              ///< each device's sweep (min_rows raised: see max_chunks)
  std::string operation = "forward";    ///< forward, jacobian or param_jacobian
  c10::ScalarType dtype = c10::kDouble; ///< of the graphs measured and their inputs
  int warmup = 1;                       ///< untimed calls before each size's timed ones
  int repeats = 5;                      ///< timed calls per size (their median is kept)
  /// The rows of the calls your host makes: each size is timed as the chunk size of one
  /// call of max(batch_rows, size) rows, so that what a chunk costs beside its graphs
  /// (slicing, gathering results, fresh memory) counts as in the run. One hot call of a
  /// size alone overstates it: elasticity at 4096 rows measured 2.8e8 rows/s alone, 1.3e7
  /// as chunks of a 2^20-row call (docs/tuning.md).
  std::int64_t batch_rows = std::int64_t{1} << 16;
  /// Sizes start at batch_rows / max_chunks (or sweep.min_rows, if larger): smaller chunks
  /// would make each measurement many calls long.
  std::int64_t max_chunks = 1024;
  TuneInputs inputs = {}; ///< the values each size is measured on
  /// Test chunks in flight 1, 2, 4 on accelerators (capacities of the pool).
  bool overlap_test = true;
  /// Time a pool's lane against the calling thread at the knee (DeviceCurve::chunk_overhead).
  bool lane_test = true;
  /// The lanes the CPU's sizes are measured on, as a policy's cpu_lanes (0 to 1024; 0:
  /// torch's intra-op count): those of the policies you will run. The table states the
  /// number (MachineKey::cpu_lanes); its CPU rows are one lane's chunk.
  std::int64_t cpu_lanes = 0;
  /// Called after each point (device index, point, where the device's sweep stands).
  std::function<void(std::size_t, const TunePoint&, const SweepProgress&)> on_point = {};
  /// Called after each device's lane test (device index, the calls through the calling
  /// thread, the same calls through the pool, chunks per call): what chunk_overhead was
  /// made from.
  std::function<void(std::size_t, const Timing&, const Timing&, std::int64_t)> on_lane_test = {};
};

/// Sweeps each device through `DispatchedModel<SyncChunking>` (one call per batch; on the
/// CPU its chunks run `cpu_lanes` at once), then runs the overlap and lane tests the
/// options ask for.
[[nodiscard]] TuneResult tune(const Artifact& artifact, const std::vector<Device>& devices,
                              const TuneOptions& options = {}, const std::string& model = {});

} // namespace neml2

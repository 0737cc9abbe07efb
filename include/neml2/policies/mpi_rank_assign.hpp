#pragma once

/// @file policies/mpi_rank_assign.hpp
/// @brief One device per MPI rank: the ranks of a node share its devices round robin,
/// then each rank chunks its own batch on its device like SyncChunking.
///
/// Opt-in: MPI stays out of the core library. A target that uses MPIRankAssign links
/// `neml2::dispatch_mpi` (which exists where neml2-dispatch was configured with MPI,
/// `-DNEML2_DISPATCH_MPI=ON`, the default when CMake finds MPI). Elsewhere, naming
/// MPIRankAssign is a compile-time error that says MPI support was not built. Its devices
/// and chunk sizes as the tuner recommends them, MPIRankAssignSettings, need no MPI.

#include <neml2/policies/mpi_rank_assign_settings.hpp>
#include <neml2/policy.hpp>

#if defined(NEML2_DISPATCH_MPI)

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include <mpi.h>

#if defined(__linux__)
#include <sched.h>
#endif

#include <ATen/Parallel.h>

#include <neml2/errors.hpp>

namespace neml2 {

namespace detail {

/// The entry of a node's device list that the node's `local_rank`-th rank (of
/// `local_size`) takes: one rank per device, several per device round robin, and an
/// error when a device would get no rank. `node` names the node in that error.
inline std::size_t mpi_rank_device(int local_rank, int local_size,
                                   const std::vector<Device>& devices, const std::string& node) {
  const auto n = static_cast<int>(devices.size());
  if (local_size < n)
    throw FatalError("MPIRankAssign: node '" + node + "' runs " + std::to_string(local_size) +
                     (local_size == 1 ? " rank" : " ranks") +
                     " of the communicator, but MPIRankAssign.devices " + devices_text(devices) +
                     " lists " + std::to_string(n) +
                     " devices, so a device would sit idle: launch at least " + std::to_string(n) +
                     " ranks per node (OpenMPI: mpiexec --map-by ppr:" + std::to_string(n) +
                     ":node), or list at most " + std::to_string(local_size) + " devices");
  return static_cast<std::size_t>(local_rank % n);
}

/// Intra-op threads of the `index`-th of `cpu_ranks` ranks that compute on the CPU of a
/// node with `cores` usable cores, where `accelerator_ranks` other ranks drive a device
/// each (one core apiece): the rest divided evenly, the remainder to the first ranks,
/// at least one each.
inline int mpi_cpu_share(int cores, int cpu_ranks, int accelerator_ranks, int index) {
  const int spare = std::max(cores - accelerator_ranks, cpu_ranks);
  return std::max(1, spare / cpu_ranks + (index < spare % cpu_ranks ? 1 : 0));
}

} // namespace detail

/// @brief Each MPI rank computes on one device of its node. The ranks of a node (those
/// that share memory: `MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED)`) take
/// `devices[local_rank % devices.size()]`: with m ranks and n devices on a node, one
/// each when m == n, round robin when m > n, and an error when m < n. Each rank then
/// runs its batch on its device in chunks of that device's batch size.
///
/// Constructing it is collective over `comm` (every rank of it must construct one, with
/// the same device list on each node) and needs MPI initialized. `comm` is read only
/// while constructing. An error on any rank (a bad field, m < n) is thrown on every rank,
/// naming the rank it came from, so no rank is left waiting.
///
/// Ranks computing on the CPU set torch's intra-op threads (`cpu_threads`), and as many
/// CPU lanes (a rank's chunks side by side): by default the node's cores (the union of its
/// ranks' CPU affinity, less one core per rank that drives an accelerator) are shared
/// evenly among them, never more than a rank's own affinity allows: ranks times lanes is
/// the node's cores.
/// @code
/// MPI_Init(&argc, &argv);
/// auto model = neml2::load_model("aoti/model_aoti.i", "model",
///     neml2::MPIRankAssign({.devices = {"cuda:0", "cuda:1"}, .batch_sizes = {65536}}));
/// auto out = model.forward({{"strain", my_rows}});   // on this rank's device
/// @endcode
///
/// Thread safety: constructing one is collective over `comm` (every rank, one thread
/// each, as MPI requires); after that it is a plain value, never changed, and
/// DispatchedModel<MPIRankAssign> is as thread-safe as with SyncChunking: it makes no
/// MPI call of its own.
/// @see SyncChunking, DispatchedModel
class MPIRankAssign {
public:
  using dispatch_mode = synchronous; ///< runs on the calling thread

  /// What the ranks share: the node's devices, chunk sizes, communicators, CPU threads.
  struct Config {
    /// The devices of each node, shared by its ranks (at most one CPU, one bare entry per
    /// accelerator family, no bare entry beside pinned ones, each index once).
    std::vector<Device> devices;
    /// Rows per chunk: one per device, one for all, or none (whole batch). 0 = whole batch.
    std::vector<std::int64_t> batch_sizes = {};
    /// The ranks that take part; read only while constructing.
    MPI_Comm comm = MPI_COMM_WORLD;
    /// The ranks of `comm` that share this rank's devices. MPI_COMM_NULL (default): one
    /// group per node, split from `comm` by shared memory. Give a sub-communicator of
    /// `comm` to group otherwise (per socket; simulated nodes in a test).
    MPI_Comm node_comm = MPI_COMM_NULL;
    /// Intra-op threads of a rank on the CPU: 0 shares the node's cores (see above), n > 0
    /// sets n, -1 leaves torch's setting. Ranks on accelerators are never changed.
    int cpu_threads = 0;
  };

  /// Assigns this rank its device; collective over `config.comm`.
  /* implicit */ MPIRankAssign(const Config& config);

  /// The policy interface: this rank's one device.
  [[nodiscard]] std::array<Device, 1> devices() const { return {_device}; }
  /// Where this rank's chunks run.
  [[nodiscard]] Device compute_device() const { return _device; }
  /// Rows per chunk on this rank's device (0: its whole batch).
  [[nodiscard]] std::int64_t chunk_rows(std::int64_t /*batch*/) const { return _batch_size; }

  /// This rank's device, its position in the node's list, and its chunk size.
  [[nodiscard]] const Device& device() const noexcept { return _device; }
  /// This rank's device's position in device_pool().
  [[nodiscard]] std::size_t device_index() const noexcept { return _device_index; }
  /// This rank's rows per chunk.
  [[nodiscard]] std::int64_t batch_size() const noexcept { return _batch_size; }
  /// The node's device list this rank chose from.
  [[nodiscard]] const std::vector<Device>& device_pool() const noexcept { return _pool; }
  /// This rank in `comm`, and in its node group.
  [[nodiscard]] int rank() const noexcept { return _rank; }
  /// The number of ranks in `comm`.
  [[nodiscard]] int size() const noexcept { return _size; }
  /// This rank in its node group.
  [[nodiscard]] int local_rank() const noexcept { return _local_rank; }
  /// The number of ranks in its node group.
  [[nodiscard]] int local_size() const noexcept { return _local_size; }
  /// The intra-op threads this rank set, 0 when it left them alone.
  [[nodiscard]] int cpu_threads() const noexcept { return _cpu_threads; }
  /// The lanes this rank's CPU chunks run on: its cpu_threads (0: torch's intra-op count).
  [[nodiscard]] std::int64_t cpu_lanes() const noexcept { return _cpu_threads; }

private:
  std::vector<Device> _pool;
  Device _device;
  std::size_t _device_index = 0;
  std::int64_t _batch_size = 0;
  int _rank = 0, _size = 1, _local_rank = 0, _local_size = 1, _cpu_threads = 0;
};

static_assert(DispatchPolicy<MPIRankAssign>);
static_assert(SynchronousPolicy<MPIRankAssign>);

namespace detail {

/// The checks that need no other rank: an empty string when the fields are good.
inline std::string mpi_field_errors(const MPIRankAssign::Config& config) {
  try {
    validate_device_pool(config.devices, "MPIRankAssign.devices");
    const auto n = config.devices.size();
    const auto sizes = config.batch_sizes.size();
    if (sizes > 1 && sizes != n)
      return "MPIRankAssign.batch_sizes has " + std::to_string(sizes) + " entries for " +
             std::to_string(n) +
             " devices; give one per device, one for all, or none (whole "
             "batch)";
    for (const auto rows : config.batch_sizes)
      if (rows < 0)
        return "MPIRankAssign.batch_sizes holds " + std::to_string(rows) +
               "; each must be >= 0 (rows per chunk; 0 runs the whole batch in one call)";
    if (config.cpu_threads < -1)
      return "MPIRankAssign.cpu_threads is " + std::to_string(config.cpu_threads) +
             "; use 0 (share the node's cores among its CPU ranks), a thread count, or -1 "
             "(leave torch's setting)";
  } catch (const FatalError& e) {
    return e.what();
  }
  return {};
}

/// The communicator of this rank's node group, freed on scope exit when made here.
class MPINodeGroup {
public:
  MPINodeGroup(MPI_Comm comm, MPI_Comm given, int rank, std::string& error) {
    if (given == MPI_COMM_NULL) {
      MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &_comm);
      _owned = true;
    } else {
      _comm = given;
      if (error.empty() && !within(given, comm))
        error = "MPIRankAssign.node_comm has ranks that are not in MPIRankAssign.comm; pass a "
                "sub-communicator of comm (e.g. from MPI_Comm_split(comm, ...)), or "
                "MPI_COMM_NULL to group ranks by node";
    }
  }
  MPINodeGroup(const MPINodeGroup&) = delete;
  MPINodeGroup& operator=(const MPINodeGroup&) = delete;
  ~MPINodeGroup() {
    if (_owned)
      MPI_Comm_free(&_comm);
  }
  [[nodiscard]] MPI_Comm comm() const noexcept { return _comm; }

private:
  static bool within(MPI_Comm part, MPI_Comm whole) {
    MPI_Group part_group, whole_group;
    MPI_Comm_group(part, &part_group);
    MPI_Comm_group(whole, &whole_group);
    int n = 0;
    MPI_Group_size(part_group, &n);
    std::vector<int> ranks(static_cast<std::size_t>(n)), in_whole(ranks.size());
    for (int i = 0; i < n; ++i)
      ranks[static_cast<std::size_t>(i)] = i;
    MPI_Group_translate_ranks(part_group, n, ranks.data(), whole_group, in_whole.data());
    MPI_Group_free(&part_group);
    MPI_Group_free(&whole_group);
    return std::none_of(in_whole.begin(), in_whole.end(), [](int r) { return r == MPI_UNDEFINED; });
  }

  MPI_Comm _comm = MPI_COMM_NULL;
  bool _owned = false;
};

/// FNV-1a over the device list's text: equal lists, equal hashes.
inline std::uint64_t mpi_device_list_hash(const std::vector<Device>& devices) {
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& d : devices)
    for (const char c : d.str() + ",") {
      h ^= static_cast<unsigned char>(c);
      h *= 1099511628211ull;
    }
  return h;
}

/// Every rank of `comm` learns the first error, if any: its own if it has one, the
/// lowest failing rank's otherwise. Collective.
inline void mpi_agree_or_throw(MPI_Comm comm, int rank, int size, const std::string& error) {
  const int mine = error.empty() ? size : rank;
  int first = size;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == size)
    return;
  int length = rank == first ? static_cast<int>(error.size()) : 0;
  MPI_Bcast(&length, 1, MPI_INT, first, comm);
  std::string message = rank == first ? error : std::string(static_cast<std::size_t>(length), ' ');
  MPI_Bcast(message.data(), length, MPI_CHAR, first, comm);
  if (!error.empty())
    throw FatalError(error);
  throw FatalError("MPIRankAssign failed on rank " + std::to_string(first) +
                   " of the communicator: " + message);
}

/// The CPUs this process may run on, as a bit set of a fixed size (the same on every
/// rank, for a bitwise OR over a node), or the first hardware_concurrency() CPUs where
/// the affinity cannot be read.
struct CpuAffinity {
  static constexpr int max_cpus = 1024;
  std::vector<unsigned char> bits = std::vector<unsigned char>(max_cpus / 8, 0);

  static CpuAffinity of_this_process() {
    CpuAffinity a;
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
      for (int c = 0; c < std::min(max_cpus, static_cast<int>(CPU_SETSIZE)); ++c)
        if (CPU_ISSET(c, &set))
          a.set(c);
      return a;
    }
#endif
    const int n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    for (int c = 0; c < std::min(n, max_cpus); ++c)
      a.set(c);
    return a;
  }

  [[nodiscard]] static int count(const std::vector<unsigned char>& bits) {
    int n = 0;
    for (const auto b : bits)
      n += __builtin_popcount(b);
    return n;
  }
  [[nodiscard]] int count() const {
    return count(bits);
  }

private:
  void set(int cpu) {
    bits[static_cast<std::size_t>(cpu / 8)] |= static_cast<unsigned char>(1u << (cpu % 8));
  }
};

} // namespace detail

inline MPIRankAssign::MPIRankAssign(const Config& config)
    : _pool(config.devices) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized)
    throw FatalError(std::string("MPIRankAssign: MPI ") +
                     (finalized ? "has already been finalized" : "is not initialized") +
                     "; call MPI_Init (or MPI_Init_thread) before constructing it, and "
                     "MPI_Finalize only after the last model using it is gone");
  if (config.comm == MPI_COMM_NULL)
    throw FatalError("MPIRankAssign.comm is MPI_COMM_NULL; pass the communicator of the ranks "
                     "that take part (the default is MPI_COMM_WORLD)");
  int inter = 0;
  MPI_Comm_test_inter(config.comm, &inter);
  if (inter)
    throw FatalError("MPIRankAssign.comm is an inter-communicator; pass an intra-communicator "
                     "(e.g. the one MPI_Intercomm_merge makes of it, or MPI_COMM_WORLD)");

  // From here on every rank makes the same collective calls whatever fails, and errors
  // are thrown only after all ranks know of them: nobody waits for a rank that threw.
  std::string error = detail::mpi_field_errors(config);
  MPI_Comm_rank(config.comm, &_rank);
  MPI_Comm_size(config.comm, &_size);
  const detail::MPINodeGroup node(config.comm, config.node_comm, _rank, error);
  MPI_Comm_rank(node.comm(), &_local_rank);
  MPI_Comm_size(node.comm(), &_local_size);

  std::array<char, MPI_MAX_PROCESSOR_NAME> host{};
  int host_length = 0;
  MPI_Get_processor_name(host.data(), &host_length);
  const std::string node_name(host.data(), static_cast<std::size_t>(host_length));

  // The node's ranks must choose from one list, or two could take the same device.
  const auto hash = detail::mpi_device_list_hash(_pool);
  std::uint64_t low = 0, high = 0;
  MPI_Allreduce(&hash, &low, 1, MPI_UINT64_T, MPI_MIN, node.comm());
  MPI_Allreduce(&hash, &high, 1, MPI_UINT64_T, MPI_MAX, node.comm());
  if (error.empty() && low != high)
    error = "MPIRankAssign.devices differs between the ranks of node '" + node_name +
            "' (this rank lists " + devices_text(_pool) +
            "); every rank of a node must list the same devices in the same order";

  if (error.empty()) {
    try {
      _device_index = detail::mpi_rank_device(_local_rank, _local_size, _pool, node_name);
      _device = _pool[_device_index];
      const auto& sizes = config.batch_sizes;
      _batch_size = sizes.empty() ? 0 : sizes.size() == 1 ? sizes.front() : sizes[_device_index];
    } catch (const FatalError& e) {
      error = e.what();
    }
  }
  detail::mpi_agree_or_throw(config.comm, _rank, _size, error);

  // Share the node's cores among the ranks computing on its CPU.
  const int on_cpu = _device.family() == DeviceFamily::cpu ? 1 : 0;
  int cpu_ranks = 0, cpu_index = 0;
  MPI_Allreduce(&on_cpu, &cpu_ranks, 1, MPI_INT, MPI_SUM, node.comm());
  MPI_Exscan(&on_cpu, &cpu_index, 1, MPI_INT, MPI_SUM, node.comm());
  if (_local_rank == 0)
    cpu_index = 0; // MPI_Exscan leaves the first rank's result undefined
  const auto affinity = detail::CpuAffinity::of_this_process();
  std::vector<unsigned char> node_cpus(affinity.bits.size());
  MPI_Allreduce(affinity.bits.data(), node_cpus.data(), static_cast<int>(node_cpus.size()),
                MPI_BYTE, MPI_BOR, node.comm());
  if (!on_cpu || config.cpu_threads == -1)
    return;
  _cpu_threads =
      config.cpu_threads > 0
          ? config.cpu_threads
          : std::min(affinity.count(),
                     detail::mpi_cpu_share(detail::CpuAffinity::count(node_cpus), cpu_ranks,
                                           _local_size - cpu_ranks, cpu_index));
  at::set_num_threads(_cpu_threads);
}

} // namespace neml2

#else // no MPI support

#include <type_traits>

namespace neml2 {
namespace detail {
template <class T = void>
struct mpi_support_not_built {
  static_assert(!std::is_same_v<T, T>,
                "MPI support was not built: neml2::MPIRankAssign needs neml2-dispatch configured "
                "with MPI (-DNEML2_DISPATCH_MPI=ON, the default where CMake finds MPI, e.g. "
                "Debian's libopenmpi-dev) and this target linked to neml2::dispatch_mpi");
};
} // namespace detail

/// Unavailable: this build has no MPI support (see the message when it is used).
using MPIRankAssign = detail::mpi_support_not_built<>;
} // namespace neml2

#endif

// MPIRankAssign with real ranks (ctest runs this under mpiexec -n 1, 2, 3 and 4): which
// rank takes which device, on one node and on two simulated ones, over sub-communicators;
// every error, thrown on every rank; results identical to one process; CPU threads.
//
// Lists with cuda entries test the assignment only: constructing the policy loads
// nothing, and only cpu-only lists are used to load models.

#include <algorithm>
#include <numeric>

#if defined(__linux__)
#include <sched.h>
#endif

#include <neml2/policies/mpi_rank_assign.hpp>

#include "model_checks.hpp"

using namespace neml2;
using test::contains;

namespace {

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

/// cuda:0 ... cuda:n-1, after `first` if given.
std::vector<Device> gpus(int n, std::vector<Device> first = {}) {
  for (int i = 0; i < n; ++i)
    first.emplace_back("cuda:" + std::to_string(i));
  return first;
}

/// Every rank's device index in `comm`, by rank.
std::vector<int> gather_indices(const MPIRankAssign& policy, MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  const int mine = static_cast<int>(policy.device_index());
  std::vector<int> all(static_cast<std::size_t>(size));
  MPI_Allgather(&mine, 1, MPI_INT, all.data(), 1, MPI_INT, comm);
  return all;
}

/// Rows [lo, hi) of this rank's share of `batch` rows, cut at multiples of `chunk` so that
/// its chunks are one process's chunks (compiled kernels treat a chunk's last rows in
/// their own way, so other cuts differ in the last bits).
std::pair<std::int64_t, std::int64_t> my_rows(std::int64_t batch, std::int64_t chunk, int rank,
                                              int size) {
  const auto cut = [&](int r) { return r == size ? batch : batch * r / size / chunk * chunk; };
  return {cut(rank), cut(rank + 1)};
}

TensorMap rows_of(const TensorMap& all, std::int64_t lo, std::int64_t hi) {
  TensorMap part;
  for (const auto& [name, t] : all)
    part.emplace(name, t.slice(0, lo, hi));
  return part;
}

/// A MPI communicator freed on scope exit.
struct Comm {
  MPI_Comm comm = MPI_COMM_NULL;
  Comm() = default;
  Comm(Comm&& other) noexcept
      : comm(std::exchange(other.comm, MPI_COMM_NULL)) {}
  Comm& operator=(Comm&&) = delete;
  ~Comm() {
    if (comm != MPI_COMM_NULL)
      MPI_Comm_free(&comm);
  }
  static Comm split(int color, int key) {
    Comm c;
    MPI_Comm_split(MPI_COMM_WORLD, color, key, &c.comm);
    return c;
  }
};

int own_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof(set), &set) == 0);
  return CPU_COUNT(&set);
#else
  return static_cast<int>(std::thread::hardware_concurrency());
#endif
}

} // namespace

TEST_CASE("pure rules: local_rank % n, an idle device is an error, the CPU share") {
  const auto three = gpus(3);
  for (int r = 0; r < 7; ++r)
    CHECK(neml2::detail::mpi_rank_device(r, 7, three, "n") == static_cast<std::size_t>(r % 3));
  CHECK(neml2::detail::mpi_rank_device(2, 3, three, "n") == 2u);
  const auto message =
      test::fatal_message([&] { neml2::detail::mpi_rank_device(0, 2, three, "hostA"); });
  CHECK(contains(message, "node 'hostA' runs 2 ranks"));
  CHECK(contains(message, "lists 3 devices"));
  CHECK(contains(message, "launch at least 3 ranks per node"));
  CHECK(contains(message, "list at most 2 devices"));

  // 8 cores, 3 CPU ranks: 3 + 3 + 2; two more ranks on GPUs keep a core each.
  CHECK(neml2::detail::mpi_cpu_share(8, 3, 0, 0) == 3);
  CHECK(neml2::detail::mpi_cpu_share(8, 3, 0, 1) == 3);
  CHECK(neml2::detail::mpi_cpu_share(8, 3, 0, 2) == 2);
  CHECK(neml2::detail::mpi_cpu_share(8, 2, 2, 0) == 3);
  CHECK(neml2::detail::mpi_cpu_share(8, 2, 2, 1) == 3);
  CHECK(neml2::detail::mpi_cpu_share(16, 1, 0, 0) == 16);
  for (int i = 0; i < 4; ++i) // more ranks than cores: one each, never zero
    CHECK(neml2::detail::mpi_cpu_share(2, 4, 0, i) == 1);
  CHECK(neml2::detail::mpi_cpu_share(2, 1, 3, 0) == 1);
}

TEST_CASE("one node: rank r takes devices[r % n] for every list that has a rank per device") {
  const int rank = world_rank(), size = world_size();
  const std::vector<std::vector<Device>> lists = {
      {"cpu"}, {"cuda"},         {"cuda:3"}, {"cpu", "cuda:0"},  {"cuda:1", "cuda:0"},
      gpus(3), gpus(3, {"cpu"}), gpus(4),    {"cuda:0", "hip:0"}};
  int checked = 0;
  for (const auto& list : lists) {
    const int n = static_cast<int>(list.size());
    if (n > size)
      continue;
    ++checked;
    CAPTURE(neml2::devices_text(list));
    const MPIRankAssign policy({.devices = list});
    CHECK(policy.rank() == rank);
    CHECK(policy.size() == size);
    CHECK(policy.local_rank() == rank); // one machine, one node
    CHECK(policy.local_size() == size);
    CHECK(policy.device_index() == static_cast<std::size_t>(rank % n));
    CHECK(policy.device() == list[static_cast<std::size_t>(rank % n)]);
    CHECK(policy.devices() == std::array<Device, 1>{list[static_cast<std::size_t>(rank % n)]});
    CHECK(policy.compute_device() == policy.device());
    CHECK(policy.device_pool() == list);
    CHECK(policy.chunk_rows(1000) == 0);

    // Every device serves ranks, and no device serves two more than another.
    std::vector<int> served(list.size(), 0);
    for (const int d : gather_indices(policy, MPI_COMM_WORLD))
      ++served[static_cast<std::size_t>(d)];
    const auto [least, most] = std::minmax_element(served.begin(), served.end());
    CHECK(*least >= 1);
    CHECK(*most - *least <= 1);
  }
  CHECK(checked >= 3);
}

TEST_CASE("each rank chunks with its own device's batch size") {
  const int rank = world_rank(), size = world_size();
  const auto list = gpus(size);
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(size));
  std::iota(sizes.begin(), sizes.end(), 10);
  const MPIRankAssign per_device({.devices = list, .batch_sizes = sizes});
  CHECK(per_device.batch_size() == 10 + rank);
  CHECK(per_device.chunk_rows(1 << 20) == 10 + rank);
  const MPIRankAssign one_for_all({.devices = list, .batch_sizes = {7}});
  CHECK(one_for_all.chunk_rows(100) == 7);
  const MPIRankAssign whole({.devices = list, .batch_sizes = {0}});
  CHECK(whole.chunk_rows(100) == 0);
}

TEST_CASE("fewer ranks than devices on a node fails on every rank, naming both counts") {
  const int size = world_size();
  const auto message = test::fatal_message(
      [&] { return MPIRankAssign({.devices = gpus(size, {"cpu"}), .batch_sizes = {4}}); });
  CHECK(contains(message, "runs " + std::to_string(size) + (size == 1 ? " rank " : " ranks ")));
  CHECK(contains(message, "lists " + std::to_string(size + 1) + " devices"));
  CHECK(contains(message, "launch at least " + std::to_string(size + 1) + " ranks per node"));
  CHECK(contains(message, "list at most " + std::to_string(size) + " devices"));
}

TEST_CASE("bad fields fail on every rank with the field and the fix") {
  const auto fails = [](const MPIRankAssign::Config& config, const std::string& part) {
    const auto message = test::fatal_message([&] { return MPIRankAssign(config); });
    CHECK_MESSAGE(contains(message, part), message);
  };
  fails({.devices = {}}, "MPIRankAssign.devices is empty");
  fails({.devices = {"cpu", "cpu:0"}}, "lists the CPU 2 times");
  fails({.devices = {"cuda", "cuda:1"}}, "mixes a bare 'cuda'");
  fails({.devices = {"cuda:1", "cuda:1"}}, "lists 'cuda:1' twice");
  fails({.devices = {"cuda", "cuda"}}, "lists 'cuda' 2 times");
  fails({.devices = {"cpu"}, .batch_sizes = {1, 2}},
        "MPIRankAssign.batch_sizes has 2 entries for 1 devices");
  fails({.devices = {"cpu"}, .batch_sizes = {-4}}, "MPIRankAssign.batch_sizes holds -4");
  fails({.devices = {"cpu"}, .cpu_threads = -2}, "MPIRankAssign.cpu_threads is -2");
  fails({.devices = {"cpu"}, .comm = MPI_COMM_NULL}, "MPIRankAssign.comm is MPI_COMM_NULL");

  // An inter-communicator between the even and the odd ranks.
  if (world_size() > 1) {
    const auto half = Comm::split(world_rank() % 2, world_rank());
    Comm inter;
    MPI_Intercomm_create(half.comm, 0, MPI_COMM_WORLD, world_rank() % 2 == 0 ? 1 : 0, 7,
                         &inter.comm);
    fails({.devices = {"cpu"}, .comm = inter.comm}, "MPIRankAssign.comm is an inter-communicator");
  }

  // A node group that is not part of comm: each rank alone in comm, all in node_comm.
  if (world_size() > 1) {
    const auto alone = Comm::split(world_rank(), 0);
    fails({.devices = {"cpu"}, .comm = alone.comm, .node_comm = MPI_COMM_WORLD},
          "MPIRankAssign.node_comm has ranks that are not in MPIRankAssign.comm");
  }
}

TEST_CASE("an error on one rank is thrown on every rank, naming that rank") {
  const int rank = world_rank(), size = world_size();
  const int bad = size - 1;
  const auto message = test::fatal_message([&] {
    return MPIRankAssign(
        {.devices = {"cpu"}, .batch_sizes = {rank == bad ? std::int64_t{-1} : std::int64_t{8}}});
  });
  CHECK(contains(message, "MPIRankAssign.batch_sizes holds -1"));
  if (rank != bad)
    CHECK(contains(message, "failed on rank " + std::to_string(bad)));

  // Two ranks of a node with different lists could take the same device.
  if (size > 1) {
    const auto differs = test::fatal_message([&] {
      return MPIRankAssign({.devices = rank == 0 ? std::vector<Device>{"cuda:0", "cuda:1"}
                                                 : std::vector<Device>{"cuda:1", "cuda:0"}});
    });
    CHECK(contains(differs, "MPIRankAssign.devices differs between the ranks of node"));
  }

  // Nothing is left pending: the next construction works.
  const MPIRankAssign after({.devices = {"cpu"}});
  CHECK(after.device() == Device("cpu"));
}

TEST_CASE("a sub-communicator: ranks 1.. assign among themselves, rank 0 alone; comm may go") {
  const int rank = world_rank(), size = world_size();
  std::optional<MPIRankAssign> policy;
  {
    const auto sub = Comm::split(rank == 0 ? 0 : 1, rank);
    // Ranks 1..size-1 list one GPU each; rank 0 alone lists cuda:7.
    const auto list = rank == 0 ? std::vector<Device>{"cuda:7"} : gpus(size - 1);
    policy.emplace(MPIRankAssign({.devices = list, .comm = sub.comm}));
  } // the communicator is freed: the policy no longer needs it
  const MPIRankAssign copy = *policy;
  CHECK(copy.size() == (rank == 0 ? 1 : size - 1));
  CHECK(copy.rank() == (rank == 0 ? 0 : rank - 1));
  CHECK(copy.local_rank() == copy.rank());
  CHECK(copy.device() ==
        (rank == 0 ? Device("cuda:7") : Device("cuda:" + std::to_string(rank - 1))));
}

TEST_CASE("two simulated nodes: even and odd ranks, each node with its own list") {
  const int rank = world_rank(), size = world_size();
  if (size < 2)
    return;
  const int node = rank % 2, local = rank / 2;
  const int node_ranks = node == 0 ? (size + 1) / 2 : size / 2;
  const auto node_comm = Comm::split(node, rank);
  // Node 0: up to two GPUs, as many as it has ranks; node 1: one GPU, cuda:5.
  const auto list = node == 0 ? gpus(std::min(node_ranks, 2)) : std::vector<Device>{"cuda:5"};
  const MPIRankAssign policy({.devices = list, .node_comm = node_comm.comm});
  CHECK(policy.size() == size);
  CHECK(policy.rank() == rank);
  CHECK(policy.local_rank() == local);
  CHECK(policy.local_size() == node_ranks);
  const auto expected = list[static_cast<std::size_t>(local) % list.size()];
  CHECK(policy.device() == expected);

  // Node 0 lists one device too many: its ranks fail, and node 1's ranks learn of it.
  const auto too_many = node == 0 ? gpus(node_ranks + 1) : std::vector<Device>{"cuda:0"};
  const auto message = test::fatal_message(
      [&] { return MPIRankAssign({.devices = too_many, .node_comm = node_comm.comm}); });
  CHECK(contains(message, "lists " + std::to_string(((size + 1) / 2) + 1) + " devices"));
  if (node == 1)
    CHECK(contains(message, "failed on rank 0"));
}

TEST_CASE("each rank's rows give exactly what one process gives, in chunks of its size") {
  const int rank = world_rank(), size = world_size();
  constexpr std::int64_t chunk = 4;
  for (const auto& [artifact, model] :
       {std::pair{"elasticity", "elasticity"}, std::pair{"perzyna", "perzyna"}}) {
    CAPTURE(std::string(artifact));
    const test::Reference ref(artifact);
    const auto all = ref.group("b33/in");
    const std::int64_t batch = all.begin()->second.size(0);
    const auto [lo, hi] = my_rows(batch, chunk, rank, size);
    const auto mine = rows_of(all, lo, hi);

    auto dispatched = load_model(test::stub(artifact, model), model,
                                 MPIRankAssign({.devices = {"cpu"}, .batch_sizes = {chunk}}));
    std::vector<ChunkEvent> chunks;
    dispatched.set_observer([&](const ChunkEvent& e) { chunks.push_back(e); });
    const auto one_process =
        load_model(test::stub(artifact, model), model, SyncChunking{.batch_size = chunk});
    const auto whole = one_process.forward(all);

    const auto out = dispatched.forward(mine);
    CHECK(test::identical(out, rows_of(whole, lo, hi)));
    test::check_close(out, rows_of(ref.group("b33/out"), lo, hi), "forward vs eager");
    REQUIRE(!chunks.empty());
    // (Reported as they complete: on several CPU lanes, not in row order.)
    std::sort(chunks.begin(), chunks.end(),
              [](const ChunkEvent& a, const ChunkEvent& b) { return a.first < b.first; });
    std::int64_t covered = 0;
    for (const auto& c : chunks) {
      CHECK(c.device == Device("cpu"));
      CHECK(c.first == covered);
      CHECK(c.rows == std::min(chunk, hi - lo - covered));
      covered += c.rows;
    }
    CHECK(covered == hi - lo);

    const auto [values, J] = dispatched.jacobian(mine);
    const auto [values1, J1] = one_process.jacobian(all);
    CHECK(test::identical(values, rows_of(values1, lo, hi)));
    for (const auto& [o, blocks] : J1)
      for (const auto& [i, block] : blocks) {
        const auto& got = J.at(o).at(i);
        // A batch-independent block comes back unbatched from both: whole, not sliced.
        const bool per_row = block.dim() > 0 && block.size(0) == batch && got.size(0) == hi - lo;
        CHECK(test::identical(got, per_row ? block.slice(0, lo, hi) : block));
      }

    // Gathered on rank 0, the ranks' outputs are one process's, row for row.
    for (const auto& name : dispatched.output_names()) {
      const auto part = out.at(name).contiguous();
      const int count = static_cast<int>(part.numel());
      std::vector<int> counts(static_cast<std::size_t>(size)), offsets(counts.size());
      MPI_Gather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
      std::exclusive_scan(counts.begin(), counts.end(), offsets.begin(), 0);
      auto gathered = at::empty_like(whole.at(name));
      MPI_Gatherv(part.data_ptr<double>(), count, MPI_DOUBLE, gathered.data_ptr<double>(),
                  counts.data(), offsets.data(), MPI_DOUBLE, 0, MPI_COMM_WORLD);
      if (rank == 0) {
        CHECK(test::identical(gathered, whole.at(name)));
        test::check_close(gathered, ref["b33/out/" + name], "gathered vs eager");
      }
    }
  }
}

TEST_CASE("a sub-batched unknown across ranks: each rank's points, their bins whole") {
  // binned_precipitation: 8 bins per point; a chunk and a rank's share split points only.
  const int rank = world_rank(), size = world_size();
  constexpr std::int64_t chunk = 3;
  const test::Reference ref("binned_precipitation");
  const auto all = ref.group("s5/in");
  const std::int64_t batch = all.at("T").size(0);
  const auto [lo, hi] = my_rows(batch, chunk, rank, size);
  const auto stub = test::stub("binned_precipitation", "model");
  const auto dispatched =
      load_model(stub, "model", MPIRankAssign({.devices = {"cpu"}, .batch_sizes = {chunk}}));
  const auto whole = load_model(stub, "model", SyncChunking{}).forward(all);
  const auto out = dispatched.forward(rows_of(all, lo, hi));
  CHECK(out.at("number_density").sizes() == at::IntArrayRef{hi - lo, 8});
  CHECK(test::identical(out, rows_of(whole, lo, hi)));
  test::check_close(out, rows_of(ref.group("s5/out"), lo, hi), "forward vs eager", 1e-8);
}

TEST_CASE("ranks on the CPU share the node's cores; cpu_threads overrides; -1 leaves them") {
  const int rank = world_rank(), size = world_size();
  // ctest launches without binding, so every rank may use every core the job has.
  const int cores = own_cpus();
  const MPIRankAssign shared({.devices = {"cpu"}});
  const int expected = std::max(1, cores / size + (rank < cores % size ? 1 : 0));
  CHECK(shared.cpu_threads() == expected);
  CHECK(at::get_num_threads() == expected);

  const MPIRankAssign three({.devices = {"cpu"}, .cpu_threads = 3});
  CHECK(three.cpu_threads() == 3);
  CHECK(at::get_num_threads() == 3);

  at::set_num_threads(5);
  const MPIRankAssign untouched({.devices = {"cpu"}, .cpu_threads = -1});
  CHECK(untouched.cpu_threads() == 0);
  CHECK(at::get_num_threads() == 5);

  // With a GPU on the node, its rank keeps a core and its threads are not changed.
  if (size >= 2) {
    at::set_num_threads(5);
    const MPIRankAssign hybrid({.devices = {"cpu", "cuda:0"}});
    const int cpu_ranks = (size + 1) / 2, gpu_ranks = size / 2;
    if (hybrid.device() == Device("cpu")) {
      const int spare = std::max(cores - gpu_ranks, cpu_ranks);
      const int index = rank / 2;
      CHECK(hybrid.cpu_threads() ==
            std::max(1, spare / cpu_ranks + (index < spare % cpu_ranks ? 1 : 0)));
    } else {
      CHECK(hybrid.cpu_threads() == 0);
      CHECK(at::get_num_threads() == 5);
    }
  }
}

TEST_CASE("a rank that dies leaves the run failing, not waiting" * doctest::skip()) {
  // Run by the mpi_rank_dies test (expected to fail): the last rank exits while the
  // others wait in a barrier that will never complete.
  if (world_rank() == world_size() - 1) {
    std::printf("rank %d exits now\n", world_rank());
    std::fflush(stdout);
    std::_Exit(3);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

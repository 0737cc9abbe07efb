// A large batch scattered over MPI ranks: each rank evaluates its rows on its own device
// with DispatchedModel<MPIRankAssign>, rank 0 gathers the results and checks them against
// one process evaluating the whole batch. Prints each rank's time.
//
//   mpiexec -n 4 mpi_batch <stub> <model> [batch=1048576] [devices=cpu] [chunk=16384]
//
// `devices` is the comma-separated list each node shares, as in "cuda:0,cuda:1". Ranks
// get rows in multiples of `chunk`, so their chunks are the one process's chunks and the
// results must agree to the last bit on the same device family.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include <mpi.h>

#include <neml2/dispatch.hpp>

namespace {

std::vector<neml2::Device> parse_devices(const std::string& text) {
  std::vector<neml2::Device> devices;
  std::stringstream list(text);
  for (std::string item; std::getline(list, item, ',');)
    devices.emplace_back(item);
  return devices;
}

/// Rows per rank: the batch cut at multiples of `chunk`, as evenly as that allows.
std::vector<std::int64_t> rows_per_rank(std::int64_t batch, std::int64_t chunk, int ranks) {
  std::vector<std::int64_t> rows;
  std::int64_t previous = 0;
  for (int r = 1; r <= ranks; ++r) {
    const auto cut = r == ranks ? batch : batch * r / ranks / chunk * chunk;
    rows.push_back(cut - previous);
    previous = cut;
  }
  return rows;
}

/// MPI counts and displacements, in doubles, for rows of `width` doubles each.
std::pair<std::vector<int>, std::vector<int>> layout(const std::vector<std::int64_t>& rows,
                                                     std::int64_t width) {
  std::vector<int> counts, offsets(rows.size());
  for (const auto r : rows)
    counts.push_back(static_cast<int>(r * width));
  std::exclusive_scan(counts.begin(), counts.end(), offsets.begin(), 0);
  return {counts, offsets};
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int run(int argc, char** argv) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc < 3) {
    if (rank == 0)
      std::fprintf(stderr, "usage: %s <stub> <model> [batch] [devices] [chunk]\n", argv[0]);
    return 2;
  }
  const std::string stub = argv[1], name = argv[2];
  const std::int64_t batch = argc > 3 ? std::stoll(argv[3]) : 1 << 20;
  const auto devices = parse_devices(argc > 4 ? argv[4] : "cpu");
  const std::int64_t chunk = argc > 5 ? std::stoll(argv[5]) : 16384;

  // Collective: every rank learns its device (and, on the CPU, its share of the cores).
  const auto model = neml2::load_model(
      stub, name, neml2::MPIRankAssign({.devices = devices, .batch_sizes = {chunk}}));
  const auto& policy = model.policy();

  // Rank 0 makes the batch and scatters each input's rows.
  const auto rows = rows_per_rank(batch, chunk, size);
  neml2::TensorMap all, mine;
  for (std::size_t i = 0; i < model.input_names().size(); ++i) {
    auto shape = model.input_base_shapes()[i];
    const auto width =
        std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
    shape.insert(shape.begin(), batch);
    const auto& input = model.input_names()[i];
    if (rank == 0) {
      at::manual_seed(static_cast<std::uint64_t>(i));
      all[input] = 1e-3 * at::rand(shape, at::kDouble);
    }
    shape[0] = rows[static_cast<std::size_t>(rank)];
    mine[input] = at::empty(shape, at::kDouble);
    const auto [counts, offsets] = layout(rows, width);
    MPI_Scatterv(rank == 0 ? all[input].data_ptr<double>() : nullptr, counts.data(), offsets.data(),
                 MPI_DOUBLE, mine[input].data_ptr<double>(), counts[static_cast<std::size_t>(rank)],
                 MPI_DOUBLE, 0, MPI_COMM_WORLD);
  }

  // Each rank evaluates its rows (once untimed: compiled kernels load lazily).
  (void)model.forward(mine);
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  const auto out = model.forward(mine);
  const double mine_seconds = seconds_since(start);

  std::vector<double> seconds(static_cast<std::size_t>(size));
  MPI_Gather(&mine_seconds, 1, MPI_DOUBLE, seconds.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  const int info[3] = {static_cast<int>(policy.device_index()), policy.local_rank(),
                       policy.cpu_threads()};
  std::vector<int> infos(3 * static_cast<std::size_t>(size));
  MPI_Gather(info, 3, MPI_INT, infos.data(), 3, MPI_INT, 0, MPI_COMM_WORLD);

  // Rank 0 gathers every output.
  neml2::TensorMap gathered;
  for (std::size_t o = 0; o < model.output_names().size(); ++o) {
    const auto& output = model.output_names()[o];
    auto shape = model.output_base_shapes()[o];
    const auto width =
        std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
    shape.insert(shape.begin(), batch);
    if (rank == 0)
      gathered[output] = at::empty(shape, at::kDouble);
    const auto part = out.at(output).to(at::kCPU).contiguous();
    const auto [counts, offsets] = layout(rows, width);
    MPI_Gatherv(part.data_ptr<double>(), static_cast<int>(part.numel()), MPI_DOUBLE,
                rank == 0 ? gathered[output].data_ptr<double>() : nullptr, counts.data(),
                offsets.data(), MPI_DOUBLE, 0, MPI_COMM_WORLD);
  }

  int ok = 1;
  if (rank == 0) {
    std::printf("%s [%s]: %lld rows over %d ranks, devices per node {%s}, chunks of %lld\n",
                stub.c_str(), name.c_str(), static_cast<long long>(batch), size,
                argc > 4 ? argv[4] : "cpu", static_cast<long long>(chunk));
    for (int r = 0; r < size; ++r) {
      const auto* i = &infos[3 * static_cast<std::size_t>(r)];
      const auto s = seconds[static_cast<std::size_t>(r)];
      const auto n = rows[static_cast<std::size_t>(r)];
      std::printf("  rank %d: %-7s (local rank %d, %s threads) %8lld rows in %8.2f ms, "
                  "%.3e rows/s\n",
                  r, devices[static_cast<std::size_t>(i[0])].str().c_str(), i[1],
                  i[2] ? std::to_string(i[2]).c_str() : "torch's", static_cast<long long>(n),
                  1e3 * s, static_cast<double>(n) / s);
    }

    // One process, the whole batch, the same chunks on rank 0's device.
    const auto one = neml2::load_model(
        stub, name, neml2::SyncChunking{.device = policy.device(), .batch_size = chunk});
    (void)one.forward(all);
    const auto one_start = std::chrono::steady_clock::now();
    const auto expected = one.forward(all);
    const double one_seconds = seconds_since(one_start);
    const auto slowest = *std::max_element(seconds.begin(), seconds.end());
    std::printf("  one process (rank 0, its threads): %.2f ms; slowest rank %.2f ms\n",
                1e3 * one_seconds, 1e3 * slowest);

    const bool one_family =
        std::all_of(devices.begin(), devices.end(),
                    [&](const neml2::Device& d) { return d.family() == devices[0].family(); });
    double worst = 0;
    for (const auto& [output, value] : expected) {
      const auto e = value.to(at::kCPU);
      const auto& g = gathered.at(output);
      if (one_family && !at::equal(g, e))
        ok = 0;
      const auto scale = std::max(e.abs().max().item<double>(), 1e-300);
      worst = std::max(worst, (g - e).abs().max().item<double>() / scale);
    }
    if (!one_family && worst > 1e-12)
      ok = 0;
    if (ok)
      std::printf("all %lld rows match one process (%s, max relative difference %.1e)\n",
                  static_cast<long long>(batch), one_family ? "bit for bit" : "to 1e-12", worst);
    else
      std::printf("FAILED: the gathered rows differ from one process (max relative "
                  "difference %.3e)\n",
                  worst);
  }
  MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return ok ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int code = 1;
  try {
    code = run(argc, argv);
  } catch (const std::exception& e) {
    // An error on one rank would leave the others in a collective: end them all.
    std::fprintf(stderr, "error: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return code;
}

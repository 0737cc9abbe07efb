// Throughput of one batch split over MPI ranks (MPIRankAssign on the CPU) against one
// process with several threads (SyncChunking). scripts/bench-mpi.sh runs both, interleaved,
// and prints the ratios (docs/performance.md).
//
//   bench_mpi <stub> <model> <batch> <chunk> <repeats> --threads N   one process, N threads
//   mpiexec -n R bench_mpi <stub> <model> <batch> <chunk> <repeats>  R ranks, batch/R rows each
//
// Prints one line: "result <mode> batch <B> median_ms <t> rows_per_s <B/t>", where t is
// the median over repeats of the wall time of one whole batch (for ranks: from a barrier
// to the barrier after the slowest rank).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <mpi.h>

#include <neml2/dispatch.hpp>

namespace {

template <class Model>
neml2::TensorMap random_inputs(const Model& model, std::int64_t rows) {
  neml2::TensorMap inputs;
  for (std::size_t i = 0; i < model.input_names().size(); ++i) {
    auto shape = model.input_base_shapes()[i];
    shape.insert(shape.begin(), rows);
    inputs[model.input_names()[i]] = 1e-3 * at::rand(shape, at::kDouble);
  }
  return inputs;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void report(const std::string& mode, std::int64_t batch, double seconds) {
  std::printf("result %s batch %lld median_ms %.3f rows_per_s %.4e\n", mode.c_str(),
              static_cast<long long>(batch), 1e3 * seconds, static_cast<double>(batch) / seconds);
}

} // namespace

int main(int argc, char** argv) try {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s <stub> <model> <batch> <chunk> <repeats> [--threads N]\n",
                 argv[0]);
    return 2;
  }
  const std::string stub = argv[1], name = argv[2];
  const std::int64_t batch = std::stoll(argv[3]), chunk = std::stoll(argv[4]);
  const int repeats = std::stoi(argv[5]);
  using clock = std::chrono::steady_clock;

  if (argc > 7 && std::strcmp(argv[6], "--threads") == 0) { // the baseline: no MPI at all
    const int threads = std::stoi(argv[7]);
    at::set_num_threads(threads);
    const auto model =
        neml2::load_model(stub, name, neml2::SyncChunking{.device = "cpu", .batch_size = chunk});
    const auto inputs = random_inputs(model, batch);
    (void)model.forward(inputs);
    std::vector<double> times;
    for (int r = 0; r < repeats; ++r) {
      const auto start = clock::now();
      (void)model.forward(inputs);
      times.push_back(std::chrono::duration<double>(clock::now() - start).count());
    }
    report("process_" + std::to_string(threads) + "_threads", batch, median(times));
    return 0;
  }

  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const auto model = neml2::load_model(
      stub, name, neml2::MPIRankAssign({.devices = {"cpu"}, .batch_sizes = {chunk}}));
  const auto cut = [&](int r) { return r == size ? batch : batch * r / size / chunk * chunk; };
  const auto inputs = random_inputs(model, cut(rank + 1) - cut(rank));
  (void)model.forward(inputs);
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto start = clock::now();
    (void)model.forward(inputs);
    MPI_Barrier(MPI_COMM_WORLD);
    times.push_back(std::chrono::duration<double>(clock::now() - start).count());
  }
  if (rank == 0)
    report("mpi_" + std::to_string(size) + "_ranks_" +
               std::to_string(model.policy().cpu_threads()) + "_threads",
           batch, median(times));
  MPI_Finalize();
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}

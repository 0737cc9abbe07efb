// The installed package's MPI target: each rank takes the CPU through MPIRankAssign and
// checks one stress value against the analytic answer (E = 100, nu = 0.3).
#include <cmath>
#include <cstdio>

#include <ATen/ATen.h>
#include <mpi.h>

#include <neml2/dispatch.hpp>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int ok = 0;
  if (argc == 2) {
    const auto model =
        neml2::load_model(argv[1], "elasticity", neml2::MPIRankAssign({.devices = {"cpu"}}));
    auto strain = at::zeros({3, 6}, at::kDouble);
    strain.select(1, 0).fill_(1e-3); // uniaxial strain
    const double got = model.forward({{"strain", strain}}).at("stress")[2][0].item<double>();
    const double expected = 100 * (1 - 0.3) / ((1 + 0.3) * (1 - 2 * 0.3)) * 1e-3;
    ok = std::abs(got - expected) <= 1e-12 * expected;
  }
  int all = 0, ranks = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0)
    std::printf("%d ranks: %s\n", ranks, all ? "every rank matches" : "MISMATCH");
  MPI_Finalize();
  return all ? 0 : 1;
}

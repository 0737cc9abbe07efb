// MPIRankAssign before MPI_Init and after MPI_Finalize: a FatalError that says what to call,
// never a crash inside MPI. Runs as one plain process (no launcher).

#include <neml2/policies/mpi_rank_assign.hpp>

#include "reference.hpp"

using neml2::MPIRankAssign;
using test::contains;

TEST_CASE("without MPI_Init, and after MPI_Finalize, constructing is a clear error") {
  const auto before = test::fatal_message([] { return MPIRankAssign({.devices = {"cpu"}}); });
  CHECK(contains(before, "MPIRankAssign: MPI is not initialized"));
  CHECK(contains(before, "call MPI_Init"));

  int argc = 0;
  char** argv = nullptr;
  REQUIRE(MPI_Init(&argc, &argv) == MPI_SUCCESS);
  const MPIRankAssign during({.devices = {"cpu"}});
  CHECK(during.device() == neml2::Device("cpu"));
  MPI_Finalize();

  const auto after = test::fatal_message([] { return MPIRankAssign({.devices = {"cpu"}}); });
  CHECK(contains(after, "MPIRankAssign: MPI has already been finalized"));
}

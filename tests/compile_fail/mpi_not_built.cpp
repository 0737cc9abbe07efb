// Naming MPIRankAssign without MPI support (here: a target that does not link
// neml2::dispatch_mpi) must fail to compile, saying MPI support was not built.
#include <neml2/dispatch.hpp>

int main() {
  [[maybe_unused]] neml2::MPIRankAssign* policy = nullptr;
  return sizeof(neml2::MPIRankAssign) > 0 ? 0 : 1;
}

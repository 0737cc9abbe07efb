// doctest under MPI: every rank runs every test case; the job fails when any rank fails.
// A watchdog ends a rank that runs too long (a collective some rank never joined), and
// a rank that exits without MPI_Finalize makes the launcher end the others: a broken
// test fails, it never hangs.

#define DOCTEST_CONFIG_IMPLEMENT
#include <csignal>
#include <cstdlib>

#include <doctest/doctest.h>
#include <mpi.h>
#include <unistd.h>

namespace {
extern "C" void watchdog(int) {
  constexpr char message[] = "\nMPI test watchdog: this rank ran past its time limit "
                             "(NEML2_DISPATCH_MPI_TEST_SECONDS); a collective is likely "
                             "waiting for a rank that left it; failing\n";
  [[maybe_unused]] auto written = write(2, message, sizeof(message) - 1);
  _exit(124);
}
} // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const char* limit = std::getenv("NEML2_DISPATCH_MPI_TEST_SECONDS");
  std::signal(SIGALRM, watchdog);
  alarm(limit ? static_cast<unsigned>(std::atoi(limit)) : 150u);

  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context context(argc, argv);
  if (rank != 0) // one summary is enough; failures still print on every rank
    context.setOption("no-version", true);
  const int mine = context.run();
  int worst = mine;
  MPI_Allreduce(&mine, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  alarm(0);
  MPI_Finalize();
  return worst;
}

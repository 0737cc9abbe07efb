// Large dense systems on the CPU, one row at a time by LAPACK held to the calling thread
// (lapack_rows.hpp says why not torch's batched LU).

#include "implicit/lapack_rows.hpp"

#include <cmath>
#include <limits>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <neml2/errors.hpp>

#include "core/cpu_lanes.hpp"
#include "core/flush_subnormals.hpp"
#include "implicit/row_lu.hpp"
#include "implicit/row_system.hpp"
#include "implicit/tensor_newton.hpp"

// What torch links: LAPACK's LU (declared as torch declares them). Weak: a torch that
// exports no LAPACK keeps the solve graphs.
extern "C" {
void dgetrf_(int* m, int* n, double* a, int* lda, int* ipiv, int* info) __attribute__((weak));
void dgetrs_(char* trans, int* n, int* nrhs, double* a, int* lda, int* ipiv, double* b, int* ldb,
             int* info) __attribute__((weak));
}

namespace neml2::detail {
namespace {

// While it lives, MKL's LAPACK runs on this thread alone: each row's LU the same
// operations at any intra-op thread count, and no team of its own.
class LapackOnThisThread {
public:
  LapackOnThisThread() {
    // torch sets a thread's MKL threads at its first parallel call there (at::set_num_threads
    // again): let that be now, not inside a solve.
    (void)at::get_num_threads();
    _mkl.emplace();
  }

private:
  std::optional<MklOnThisThread> _mkl;
};

} // namespace

bool lapack_rows_available() noexcept {
  return dgetrf_ && dgetrs_;
}

at::Tensor minus_solve_lapack_rows(const std::vector<at::Tensor>& a_blocks,
                                   const std::vector<at::Tensor>& c_blocks,
                                   std::size_t residual_groups) {
  const BlockSystems systems(a_blocks, c_blocks, residual_groups);
  const auto &a = systems.a, &c = systems.c;
  const auto rows = systems.rows, n = a.height, m = c.width;
  auto out = at::empty({rows, n, m}, at::kDouble);
  // A row-major is A^T column-major: getrf factors A^T, getrs solves (A^T)^T X = C, with C
  // and X column-major.
  std::vector<double> lu(n * n), x(n * m), c_row(n * m);
  std::vector<int> pivots(n);
  int order = static_cast<int>(n), columns = static_cast<int>(m), info = 0;
  char transpose = 'T';
  const LapackOnThisThread one_thread;
  // Subnormals flushed: NEML2's KWN example's A holds rows of them (bins whose densities
  // have underflowed), and its LU took 2.0 ms through the CPU's microcode assists, 0.5 ms
  // flushed. Read as zero, no entry moves by more than 2.2e-308, below one rounding of any
  // A whose largest entry is above 1e-292; a KWN history's bins change only below 1e-294.
  const FlushSubnormals flushed;
  for (std::int64_t i = 0; i < rows; ++i) {
    a.fill(i, lu.data());
    c.fill(i, c_row.data());
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t k = 0; k < m; ++k)
        x[r + k * n] = c_row[r * m + k];
    dgetrf_(&order, &order, lu.data(), &order, pivots.data(), &info);
    if (info < 0)
      throw FatalError(fmt::format("LAPACK's dgetrf refused argument {} of a {} x {} system (row "
                                   "{}): a bug in neml2-dispatch's row solve, please report it",
                                   -info, n, n, i));
    const bool regular = info == 0; // else a zero pivot: no solution
    if (regular)
      dgetrs_(&transpose, &order, &columns, lu.data(), &order, pivots.data(), x.data(), &order,
              &info);
    double* solved = out.data_ptr<double>() + i * n * m;
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t k = 0; k < m; ++k)
        solved[r * m + k] = regular ? -x[r + k * n] : std::numeric_limits<double>::quiet_NaN();
  }
  return out;
}

bool lapack_lu_factor(double* a, std::int64_t n, std::int64_t* pivot,
                      std::vector<double>& scratch) {
  if (!lapack_rows_available())
    return lu_factor(a, n, pivot);
  // getrf is column-major: A goes in transposed, and its LU comes back row-major.
  scratch.resize(static_cast<std::size_t>(n * n));
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t c = 0; c < n; ++c)
      scratch[static_cast<std::size_t>(c * n + r)] = a[r * n + c];
  std::vector<int> pivots(static_cast<std::size_t>(n));
  int order = static_cast<int>(n), info = 0;
  {
    const LapackOnThisThread one_thread;
    const FlushSubnormals flushed;
    dgetrf_(&order, &order, scratch.data(), &order, pivots.data(), &info);
  }
  if (info < 0)
    throw FatalError(fmt::format("LAPACK's dgetrf refused argument {} of a {} x {} system: a bug "
                                 "in neml2-dispatch's chord, please report it",
                                 -info, n, n));
  bool regular = info == 0;
  for (std::int64_t r = 0; r < n; ++r) {
    pivot[r] = pivots[static_cast<std::size_t>(r)] - 1;
    for (std::int64_t c = 0; c < n; ++c)
      a[r * n + c] = scratch[static_cast<std::size_t>(c * n + r)];
    regular = regular && std::isfinite(a[r * n + r]) && a[r * n + r] != 0;
  }
  return regular;
}

std::vector<at::Tensor> lapack_rows_step(const std::vector<at::Tensor>& jacobian,
                                         std::size_t a_blocks,
                                         const std::vector<at::Tensor>& like) {
  const auto b_first = jacobian.begin() + static_cast<std::ptrdiff_t>(a_blocks);
  const std::vector<at::Tensor> a(jacobian.begin(), b_first);
  std::vector<at::Tensor> b; // (rows, n_r, 1): one right-hand side
  for (auto it = b_first; it != jacobian.end(); ++it)
    b.push_back(it->unsqueeze(2));
  return split_groups(minus_solve_lapack_rows(a, b, b.size()).squeeze(2).neg(), like);
}

} // namespace neml2::detail

// Large dense systems on the CPU, one row at a time by LAPACK held to the calling thread
// (lapack_rows.hpp says why not torch's batched LU).

#include "implicit/lapack_rows.hpp"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "implicit/newton_rows.hpp"
#include "implicit/row_system.hpp"

// What torch links: LAPACK's LU (as torch declares them) and MKL's threads for the calling
// thread alone (it returns the setting it replaces; 0 is MKL's global one). Weak: a torch
// that exports none of them takes torch's operators instead, or has no MKL to hold.
extern "C" {
void dgetrf_(int* m, int* n, double* a, int* lda, int* ipiv, int* info) __attribute__((weak));
void dgetrs_(char* trans, int* n, int* nrhs, double* a, int* lda, int* ipiv, double* b, int* ldb,
             int* info) __attribute__((weak));
int MKL_Set_Num_Threads_Local(int threads) __attribute__((weak));
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
    if (MKL_Set_Num_Threads_Local)
      _before = MKL_Set_Num_Threads_Local(1);
  }
  ~LapackOnThisThread() {
    if (MKL_Set_Num_Threads_Local)
      MKL_Set_Num_Threads_Local(_before);
  }
  LapackOnThisThread(const LapackOnThisThread&) = delete;
  LapackOnThisThread& operator=(const LapackOnThisThread&) = delete;

private:
  int _before = 0;
};

// Row i's A^{-1} C by torch's operator on that row alone (a batch of one is not split), for
// a torch that exports no LAPACK: `x` its n x m solution, row-major.
bool solve_row_by_torch(const Blocks& a, const Blocks& c, std::int64_t i, double* x) {
  auto ai = at::empty({a.height, a.width}, at::kDouble);
  auto ci = at::empty({c.height, c.width}, at::kDouble);
  a.fill(i, ai.data_ptr<double>());
  c.fill(i, ci.data_ptr<double>());
  const auto [solution, lu, pivots, info] = at::_linalg_solve_ex(ai, ci);
  std::copy_n(solution.contiguous().data_ptr<double>(), c.height * c.width, x);
  return info.item<int>() == 0;
}

} // namespace

bool solves_by_lapack_rows(std::span<const at::Tensor> u) {
  const auto& like = u.front();
  return like.is_cpu() && like.scalar_type() == at::kDouble &&
         unknowns_per_row(u) > row_pass_max_unknowns;
}

at::Tensor minus_solve_lapack_rows(const std::vector<at::Tensor>& a_blocks,
                                   const std::vector<at::Tensor>& c_blocks,
                                   std::size_t residual_groups) {
  std::int64_t rows = 0;
  for (const auto* list : {&a_blocks, &c_blocks})
    for (const auto& t : *list)
      rows = std::max(rows, t.size(0));
  const Blocks a(a_blocks, 0, a_blocks.size(), residual_groups),
      c(c_blocks, 0, c_blocks.size(), residual_groups);
  auto n = static_cast<int>(a.height), m = static_cast<int>(c.width);
  auto out = at::empty({rows, n, m}, at::kDouble);
  // A row-major is A^T column-major: getrf factors A^T, getrs solves (A^T)^T X = C.
  std::vector<double> lu(static_cast<std::size_t>(n) * n), x(static_cast<std::size_t>(n) * m),
      row_major(x.size());
  std::vector<int> pivots(static_cast<std::size_t>(n));
  char transpose = 'T';
  const LapackOnThisThread one_thread;
  for (std::int64_t i = 0; i < rows; ++i) {
    double* solved = out.data_ptr<double>() + i * n * m;
    bool regular = true;
    if (dgetrf_ && dgetrs_) {
      a.fill(i, lu.data());
      c.fill(i, row_major.data());
      for (int r = 0; r < n; ++r) // C column-major
        for (int k = 0; k < m; ++k)
          x[r + static_cast<std::size_t>(k) * n] = row_major[static_cast<std::size_t>(r) * m + k];
      int info = 0;
      dgetrf_(&n, &n, lu.data(), &n, pivots.data(), &info);
      regular = info == 0;
      if (info < 0)
        throw std::logic_error("LAPACK's dgetrf was given a wrong argument");
      if (regular)
        dgetrs_(&transpose, &n, &m, lu.data(), &n, pivots.data(), x.data(), &n, &info);
      for (int r = 0; r < n; ++r)
        for (int k = 0; k < m; ++k)
          solved[r * m + k] = -x[r + static_cast<std::size_t>(k) * n];
    } else {
      regular = solve_row_by_torch(a, c, i, solved);
      std::transform(solved, solved + n * m, solved, [](double v) { return -v; });
    }
    if (!regular) // a zero pivot: LAPACK's x is no solution
      std::fill(solved, solved + n * m, std::numeric_limits<double>::quiet_NaN());
  }
  return out;
}

} // namespace neml2::detail

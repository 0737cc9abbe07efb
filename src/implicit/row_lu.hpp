#pragma once

// One row's small dense system A x = b, solved by LU with partial pivoting as LAPACK's
// getrf / getrs do it (the first largest pivot of each column), in plain loops; and the
// same for several rows at once in SIMD lanes (row_lu.cpp). The row pass of Newton on the
// CPU (implicit/newton_rows.cpp) solves every row's system. Private to src/implicit/.

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace neml2::detail {

/// Factors the `n` x `n` row-major `a` in place: L (unit diagonal) below, U on and above;
/// row k was swapped with `pivot[k]`. False when a pivot is zero or not finite (A singular,
/// or not finite): that row's solve fails.
template <class T>
bool lu_factor(T* a, std::int64_t n, std::int64_t* pivot) {
  for (std::int64_t k = 0; k < n; ++k) {
    std::int64_t p = k;
    T largest = std::abs(a[k * n + k]);
    for (std::int64_t i = k + 1; i < n; ++i)
      if (std::abs(a[i * n + k]) > largest) {
        largest = std::abs(a[i * n + k]);
        p = i;
      }
    if (!(largest > 0) || !std::isfinite(largest))
      return false;
    pivot[k] = p;
    if (p != k)
      for (std::int64_t j = 0; j < n; ++j)
        std::swap(a[k * n + j], a[p * n + j]);
    const T inverse = 1 / a[k * n + k];
    const T* __restrict pivot_row = a + k * n;
    for (std::int64_t i = k + 1; i < n; ++i) {
      T* __restrict row = a + i * n; // another row than the pivot's: no aliasing
      const T l = row[k] *= inverse;
      for (std::int64_t j = k + 1; j < n; ++j)
        row[j] -= l * pivot_row[j];
    }
  }
  return true;
}

/// Overwrites the `n` x `columns` row-major `x` with U^{-1} x, U the upper triangle of the
/// `n` x `n` row-major `lu` (lu_factor's). `T` is a double, or a vector of them (one row's
/// system a lane: row_lu.cpp), the same operations in the same order either way.
template <class T>
[[gnu::always_inline]] inline void lu_back_substitute(const T* lu, std::int64_t n, T* x,
                                                      std::int64_t columns) {
  for (std::int64_t i = n - 1; i >= 0; --i) {
    for (std::int64_t k = i + 1; k < n; ++k)
      for (std::int64_t c = 0; c < columns; ++c)
        x[i * columns + c] -= lu[i * n + k] * x[k * columns + c];
    for (std::int64_t c = 0; c < columns; ++c)
      x[i * columns + c] /= lu[i * n + i];
  }
}

/// Overwrites the `n` x `columns` row-major `x` (right-hand sides) with A^{-1} x, from
/// lu_factor's `lu` and `pivot`.
template <class T>
void lu_solve(const T* lu, const std::int64_t* pivot, std::int64_t n, T* x, std::int64_t columns) {
  for (std::int64_t k = 0; k < n; ++k)
    if (pivot[k] != k)
      for (std::int64_t c = 0; c < columns; ++c)
        std::swap(x[k * columns + c], x[pivot[k] * columns + c]);
  for (std::int64_t i = 1; i < n; ++i)
    for (std::int64_t k = 0; k < i; ++k)
      for (std::int64_t c = 0; c < columns; ++c)
        x[i * columns + c] -= lu[i * n + k] * x[k * columns + c];
  lu_back_substitute(lu, n, x, columns);
}

/// lu_solve for one right-hand side, skipping the zeros of `lu`: a block-structured A
/// (NEML2's per-grain blocks, in the graphs' order) keeps most of them through its LU, and
/// each skipped entry is a step off a serial chain of n^2 / 2. The same x as lu_solve's
/// wherever x is finite, but for the sign of a zero.
template <class T>
void lu_solve_skipping_zeros(const T* lu, const std::int64_t* pivot, std::int64_t n, T* x) {
  for (std::int64_t k = 0; k < n; ++k)
    if (pivot[k] != k)
      std::swap(x[k], x[pivot[k]]);
  for (std::int64_t i = 1; i < n; ++i)
    for (std::int64_t k = 0; k < i; ++k)
      if (const T l = lu[i * n + k]; l != 0)
        x[i] -= l * x[k];
  for (std::int64_t i = n - 1; i >= 0; --i) {
    for (std::int64_t k = i + 1; k < n; ++k)
      if (const T u = lu[i * n + k]; u != 0)
        x[i] -= u * x[k];
    x[i] /= lu[i * n + i];
  }
}

/// How many rows lu_solve_lanes solves at once on this machine: 8 with AVX-512, 4 with
/// AVX2, else 1.
[[nodiscard]] int lu_lanes();

/// Room for `count` doubles, aligned for lu_solve_lanes: storage this thread used before
/// and let go, when there is some. A pass takes its buffers anew each time, and a fresh
/// kilobyte from glibc there makes it merge the small blocks the graph calls between
/// passes free, sending each of their ~1,000 allocations a call down its slow path.
class LaneBuffer {
public:
  explicit LaneBuffer(std::int64_t count);
  ~LaneBuffer();
  LaneBuffer(const LaneBuffer&) = delete;
  LaneBuffer& operator=(const LaneBuffer&) = delete;
  double* data() { return _blocks.front().values; }

  struct alignas(64) Block {
    double values[8];
  };

private:
  std::vector<Block> _blocks;
};

/// Solves `lanes` (lu_lanes(), or 1) systems A X = B at once, interleaved: entry (r, c) of
/// lane l's A (n x n) at `a[(r * n + c) * lanes + l]`, of its B (n x `columns`) at
/// `x[(r * columns + c) * lanes + l]`; a and x aligned to 8 * lanes bytes (a LaneBuffer, or
/// a tensor's data). Overwrites x with each lane's X, exactly as lu_factor and lu_solve
/// give it, and a with its LU. Returns a bit per lane (1 << l) whose A has a zero or
/// non-finite pivot; such a lane's X is not a solution, and the other lanes' are unaffected.
[[nodiscard]] unsigned lu_solve_lanes(double* a, double* x, std::int64_t n, std::int64_t columns,
                                      int lanes);

} // namespace neml2::detail

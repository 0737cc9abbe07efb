#pragma once

// Dense systems larger than the row pass solves, on the CPU: LAPACK's LU (getrf, getrs:
// what NEML2's solve graphs reach through torch's _linalg_solve_ex) one row at a time on
// the calling thread, LAPACK held to that thread. Not the solve graphs: torch's batched LU
// splits its matrices over the intra-op OpenMP team, and once at::set_num_threads has run
// (it turns MKL's dynamic threading off), MKL's getrf of a matrix over 150 unknowns opens
// threads of its own inside that team; concurrent factorizations then corrupt each other's
// pivots ("Intel oneMKL ERROR: Parameter 6 was incorrect on entry to DLASWP", lu_solve's
// pivot check) or never return. Private to src/implicit/.

#include <cstddef>
#include <cstdint>
#include <vector>

#include <ATen/Tensor.h>

namespace neml2::detail {

/// Whether torch exports LAPACK's getrf and getrs (what minus_solve_lapack_rows calls):
/// NewtonPlan gives dense systems above row_pass_max_unknowns on the CPU in double to
/// LAPACK's rows where it does (smaller ones are the row pass's, or safe in a graph: MKL
/// factors them on one thread).
[[nodiscard]] bool lapack_rows_available() noexcept;

/// A Newton step du per unknown group (like `(B, n)` each), A du = b, from the jacobian
/// graph's results (A's `a_blocks` blocks, then b per residual group): LAPACK's rows.
[[nodiscard]] std::vector<at::Tensor> lapack_rows_step(const std::vector<at::Tensor>& jacobian,
                                                       std::size_t a_blocks,
                                                       const std::vector<at::Tensor>& like);

/// -A^{-1} C per row, `(rows, n, m)`: A from its blocks `(rows or 1, n_r, n_u)` (residual
/// groups outer, unknown groups inner), C from its `(rows or 1, n_r, n_c)` blocks,
/// `residual_groups` of them. A row whose A is singular gets NaN. The same values at any
/// intra-op thread count. Subnormals are zero in it (core/flush_subnormals.hpp): read from
/// A and C as zero, and written as zero.
[[nodiscard]] at::Tensor minus_solve_lapack_rows(const std::vector<at::Tensor>& a_blocks,
                                                 const std::vector<at::Tensor>& c_blocks,
                                                 std::size_t residual_groups);

/// Factors the `n` x `n` row-major `a` in place as lu_factor does (row_lu.hpp: L with a
/// unit diagonal below, U on and above, row k swapped with `pivot[k]`), by LAPACK's getrf
/// on the calling thread alone, subnormals flushed; by lu_factor where torch exports no
/// LAPACK. False at a zero or non-finite pivot. `scratch`: n * n doubles of room.
[[nodiscard]] bool lapack_lu_factor(double* a, std::int64_t n, std::int64_t* pivot,
                                    std::vector<double>& scratch);

} // namespace neml2::detail

// Rows' systems side by side in SIMD lanes (row_lu.hpp): each step of lu_factor and
// lu_solve done for `lanes` rows at once, in GCC's vector types, compiled for AVX-512 and
// AVX2 and chosen at run time. Built with -ffp-contract=off: a lane computes exactly what
// lu_factor and lu_solve compute for its row.

#include "implicit/row_lu.hpp"

#include <cfloat>
#include <new>
#include <vector>

namespace neml2::detail {
namespace {

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define NEML2_DISPATCH_ROW_LU_LANES 1

// W lanes: doubles, and masks (-1 or 0 per lane).
template <int W>
struct Lanes {
  typedef double real __attribute__((vector_size(8 * W)));
  typedef std::int64_t mask __attribute__((vector_size(8 * W)));
};

// Swaps `top` and `other` in the lanes of `m` (references: no vector crosses a call
// compiled for another target).
template <int W>
[[gnu::always_inline]] inline void swap_lanes(const typename Lanes<W>::mask& m,
                                              typename Lanes<W>::real& top,
                                              typename Lanes<W>::real& other) {
  using mask = typename Lanes<W>::mask;
  const mask t = (mask)top, o = (mask)other;
  top = (typename Lanes<W>::real)((o & m) | (t & ~m));
  other = (typename Lanes<W>::real)((t & m) | (o & ~m));
}

// lu_factor, with the pivots' swaps and the forward substitution applied to x (n x
// columns) as they go
// (the same operations, in the same order per row, as lu_factor then lu_solve), then the
// back substitution. Returns a bit per failed lane.
template <int W>
[[gnu::always_inline]] inline unsigned factor_solve(double* a_data, double* x_data, std::int64_t n,
                                                    std::int64_t columns) {
  using L = Lanes<W>;
  using real = typename L::real;
  using mask = typename L::mask;
  auto* a = reinterpret_cast<real*>(a_data);
  auto* x = reinterpret_cast<real*>(x_data);
  const mask sign = mask{} + INT64_MIN;
  mask failed{};
  for (std::int64_t k = 0; k < n; ++k) {
    real largest = (real)((mask)a[k * n + k] & ~sign);
    mask pivot = mask{} + k;
    for (std::int64_t i = k + 1; i < n; ++i) {
      const real v = (real)((mask)a[i * n + k] & ~sign);
      const mask bigger = v > largest;
      largest = (real)(((mask)v & bigger) | ((mask)largest & ~bigger));
      pivot = (pivot & ~bigger) | ((mask{} + i) & bigger);
    }
    failed |= ~((largest > 0) & (largest <= DBL_MAX)); // zero, or not finite
    for (std::int64_t i = k + 1; i < n; ++i) {
      const mask here = pivot == i;
      bool any = false;
      for (int l = 0; l < W; ++l)
        any = any || here[l] != 0;
      if (!any)
        continue;
      for (std::int64_t j = 0; j < n; ++j)
        swap_lanes<W>(here, a[k * n + j], a[i * n + j]);
      for (std::int64_t c = 0; c < columns; ++c)
        swap_lanes<W>(here, x[k * columns + c], x[i * columns + c]);
    }
    const real inverse = 1 / a[k * n + k];
    const real* __restrict pivot_row = a + k * n;
    for (std::int64_t i = k + 1; i < n; ++i) {
      real* __restrict row = a + i * n;
      const real l = row[k] *= inverse;
      for (std::int64_t j = k + 1; j < n; ++j)
        row[j] -= l * pivot_row[j];
      for (std::int64_t c = 0; c < columns; ++c)
        x[i * columns + c] -= l * x[k * columns + c];
    }
  }
  lu_back_substitute(a, n, x, columns);
  unsigned bits = 0;
  for (int l = 0; l < W; ++l)
    bits |= (failed[l] != 0 ? 1U : 0U) << l;
  return bits;
}

[[gnu::target("avx512f,avx512dq,avx512vl,avx512bw")]] unsigned
factor_solve_8(double* a, double* x, std::int64_t n, std::int64_t columns) {
  return factor_solve<8>(a, x, n, columns);
}

[[gnu::target("avx2")]] unsigned factor_solve_4(double* a, double* x, std::int64_t n,
                                                std::int64_t columns) {
  return factor_solve<4>(a, x, n, columns);
}

int machine_lanes() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))
    return 8;
  return __builtin_cpu_supports("avx2") ? 4 : 1;
}
#endif

} // namespace

namespace {
// Storage LaneBuffers of this thread let go, for the next ones: a few, of at most 1 MiB.
thread_local std::vector<std::vector<LaneBuffer::Block>> spare_lane_storage;
constexpr std::size_t spare_buffers = 4, spare_blocks = (std::size_t{1} << 20) / 64;
} // namespace

LaneBuffer::LaneBuffer(std::int64_t count) {
  auto& spare = spare_lane_storage;
  if (!spare.empty()) {
    _blocks = std::move(spare.back());
    spare.pop_back();
  }
  _blocks.resize(static_cast<std::size_t>((count + 7) / 8));
}

LaneBuffer::~LaneBuffer() {
  auto& spare = spare_lane_storage;
  if (spare.size() < spare_buffers && _blocks.capacity() <= spare_blocks)
    try {
      spare.push_back(std::move(_blocks));
    } catch (const std::bad_alloc&) { // freed instead
    }
}

int lu_lanes() {
#ifdef NEML2_DISPATCH_ROW_LU_LANES
  static const int lanes = machine_lanes();
  return lanes;
#else
  return 1;
#endif
}

unsigned lu_solve_lanes(double* a, double* x, std::int64_t n, std::int64_t columns, int lanes) {
#ifdef NEML2_DISPATCH_ROW_LU_LANES
  if (lanes == 8)
    return factor_solve_8(a, x, n, columns);
  if (lanes == 4)
    return factor_solve_4(a, x, n, columns);
#endif
  // One lane: the row's own LU.
  std::vector<std::int64_t> pivot(static_cast<std::size_t>(n));
  if (!lu_factor(a, n, pivot.data()))
    return 1;
  lu_solve(a, pivot.data(), n, x, columns);
  return 0;
}

} // namespace neml2::detail

#pragma once

// Rows in tasks over the intra-op threads, for the row passes of src/implicit/. Private.

#include <cstdint>

#include <ATen/Parallel.h>

namespace neml2::detail {

#if defined(__SANITIZE_THREAD__)
#define NEML2_DISPATCH_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define NEML2_DISPATCH_TSAN 1
#endif
#endif

/// `f(begin, end)` over [0, rows) in tasks of at least `grain` rows: one OpenMP team
/// (at::parallel_for), or the calling thread alone for fewer rows. Serial under
/// ThreadSanitizer, which cannot see the barriers of torch's uninstrumented libgomp and
/// would report each task's writes as racing with the caller's reads after the team.
template <class F>
void for_row_ranges(std::int64_t rows, std::int64_t grain, const F& f) {
#ifdef NEML2_DISPATCH_TSAN
  (void)grain;
  if (rows > 0)
    f(std::int64_t{0}, rows);
#else
  at::parallel_for(0, rows, grain, f);
#endif
}

} // namespace neml2::detail

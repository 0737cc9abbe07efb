#pragma once

// Subnormal doubles read as zero and results that would be subnormal written as zero, on
// the calling thread, for as long as a FlushSubnormals lives: x86's MXCSR flush-to-zero and
// denormals-are-zero bits (SSE and AVX alike), AArch64's FPCR FZ bit; elsewhere nothing.
// Why: an LU whose matrix holds subnormal entries (NEML2's KWN example: about 1,300 in
// 90,000, a few bins' rows where the number density has underflowed) takes each operation
// on them through the CPU's microcode assists: 4 times the LU's flushed time (lapack_rows.cpp).

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace neml2::detail {

#if defined(__x86_64__) || defined(_M_X64)
inline constexpr std::uint64_t subnormal_flush_bits = 0x8040; // MXCSR's FTZ (bit 15), DAZ (6)
#elif defined(__aarch64__)
inline constexpr std::uint64_t subnormal_flush_bits = std::uint64_t{1} << 24; // FPCR's FZ
#else
inline constexpr std::uint64_t subnormal_flush_bits = 0;
#endif

/// While it lives, the calling thread flushes subnormal doubles to zero (inputs and
/// results); the thread's previous floating-point control and status word is restored when
/// it ends, an exception's unwinding included. Other threads are untouched.
class FlushSubnormals {
public:
  /// The control word's bits that flush (0 where this platform has none here).
  static constexpr std::uint64_t flush_bits = subnormal_flush_bits;
  /// Whether this platform flushes at all (else the guard does nothing).
  static constexpr bool supported = flush_bits != 0;

  FlushSubnormals()
      : _saved(word()) {
    set_word(_saved | flush_bits);
  }
  ~FlushSubnormals() { set_word(_saved); }
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

  /// The calling thread's floating-point controls (MXCSR without its sticky exception
  /// flags, FPCR; 0 where unsupported).
  static std::uint64_t control() {
#if defined(__x86_64__) || defined(_M_X64)
    return word() & ~std::uint64_t{0x3f};
#else
    return word();
#endif
  }

private:
  static std::uint64_t word() {
#if defined(__x86_64__) || defined(_M_X64)
    return _mm_getcsr();
#elif defined(__aarch64__)
    std::uint64_t fpcr = 0;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    return fpcr;
#else
    return 0;
#endif
  }

  static void set_word([[maybe_unused]] std::uint64_t word) {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_setcsr(static_cast<unsigned int>(word));
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(word));
#endif
  }

  std::uint64_t _saved;
};

} // namespace neml2::detail

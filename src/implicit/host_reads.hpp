#pragma once

// The reads back to the host that the implicit solvers (newton_solve, gmres,
// solve_with_substeps) make, counted per thread for newton_host_reads(). Private to
// src/implicit/.

#include <cstdint>

#include <ATen/Tensor.h>

namespace neml2::detail {

// Every value the solvers read back from their tensors passes through these: on an
// accelerator each read is a host synchronization, which leaves the device idle for the
// launch latency of what follows. Counted per thread for tests (newton_host_reads()).
extern thread_local std::uint64_t host_reads;

template <class T>
T to_host(const at::Tensor& t) {
  ++host_reads;
  return t.item<T>();
}

// The indices where `mask` (rows,) is true.
at::Tensor rows_where(const at::Tensor& mask);

// Whether some row failed and the largest ||r|| of a row that did (NaN when one is not
// finite, 0 when none failed), in one read.
struct FailedRows {
  bool any = false;
  double worst_residual = 0;
};
FailedRows failed_rows(const at::Tensor& converged, const at::Tensor& norm);

} // namespace neml2::detail

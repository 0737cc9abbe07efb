#pragma once

// A CUDA device's name and memory from the driver API (libcuda, loaded where torch found a
// GPU), so that no CUDA header is needed to build: the machine key and the tuner's memory
// estimate read them.

#include <cstddef>
#include <string>

namespace neml2::detail {

/// What the driver says of one CUDA device.
struct CudaDriverQuery {
  std::string name;      ///< cuDeviceGetName
  std::size_t bytes = 0; ///< cuDeviceTotalMem
};

/// The CUDA device `ordinal`; empty where the driver is absent or does not know it.
[[nodiscard]] CudaDriverQuery cuda_query(int ordinal);

} // namespace neml2::detail

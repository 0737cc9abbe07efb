#pragma once

/// @file policies/mpi_rank_assign_settings.hpp
/// @brief MPIRankAssign's devices and chunk sizes without MPI: what the tuner recommends
/// (neml2/tune.hpp), for any build, to pass as `MPIRankAssign::Config` where MPI is.

#include <cstdint>
#include <vector>

#include <neml2/device.hpp>

namespace neml2 {

/// @brief MPIRankAssign's configuration without MPI: pass its fields as
/// `MPIRankAssign::Config{.devices = s.devices, .batch_sizes = s.batch_sizes}`.
/// @see recommend
struct MPIRankAssignSettings {
  std::vector<Device> devices = {};           ///< every device tuned, in the table's order
  std::vector<std::int64_t> batch_sizes = {}; ///< rows per chunk: each device's best size
};

} // namespace neml2

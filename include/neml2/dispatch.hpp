#pragma once

/// @file dispatch.hpp
/// @brief Everything a single-node user needs: ATen (to make and read tensors), devices,
/// artifacts, sessions, policies and DispatchedModel. A file that only holds or passes
/// models can include <neml2/dispatch_fwd.hpp> instead.
/// @code
/// #include <neml2/dispatch.hpp>
/// auto model = neml2::load_model("aoti/model_aoti.i", "model",
///                                neml2::SyncChunking{.device = "cpu", .batch_size = 16384});
/// auto stress = model.forward({{"strain", strain}}).at("stress");
/// @endcode

#include <ATen/ATen.h>

#include <neml2/any_dispatched_model.hpp>
#include <neml2/artifact.hpp>
#include <neml2/device.hpp>
#include <neml2/dispatch_fwd.hpp>
#include <neml2/dispatched_model.hpp>
#include <neml2/errors.hpp>
#include <neml2/material_state.hpp>
#include <neml2/memory.hpp>
#include <neml2/observer.hpp>
#include <neml2/policies/greedy_priority_capacity.hpp>
#include <neml2/policies/mpi_rank_assign.hpp> // MPI only with neml2::dispatch_mpi
#include <neml2/policies/sync_chunking.hpp>
#include <neml2/policy.hpp>
#include <neml2/prepared_call.hpp>
#include <neml2/session.hpp>
#include <neml2/version.hpp>

#pragma once

// Where a call's chunks go: the pieces a large CPU call runs in, the places its results
// land, and the caller's tensors checked as targets (src/engine/placement.cpp).

#include <cstdint>
#include <vector>

#include "graph/call.hpp"
#include "session/result_memory.hpp"

namespace neml2::detail {

/// Up to this many rows, forward() of a dense CPU batch may go straight to the value
/// graph (ModelCore::batch_as_given).
inline constexpr std::int64_t max_direct_rows = 1024;

/// What a call's chunk on the CPU should hold at most: its inputs and results in about
/// this many bytes, so that a chunk's results are still in cache when they are copied.
inline constexpr std::int64_t piece_bytes = std::int64_t(2) << 20;
/// The fewest and most rows of a piece.
inline constexpr std::int64_t min_piece_rows = 1024, max_piece_rows = 65536;

/// The rows of the pieces a whole-batch call on the CPU runs in (a power of two, about
/// piece_bytes of inputs and results), or 0 when it should run as one piece: on another
/// device, or when the batch is no larger than one piece.
[[nodiscard]] std::int64_t piece_rows(const BoundCall& call, c10::ScalarType dtype);

/// Where a chunk's results will be written: rows [first, first + rows) of each of
/// `results` (a call's outputs, slot order) gathered by rows; nowhere for the other
/// slots, and for all of them off the CPU. A chunk run on the CPU may compute them in
/// place (see CallProtocol::run).
[[nodiscard]] Places places(const BoundCall& call, const std::vector<at::Tensor>& results,
                            std::int64_t first, std::int64_t rows);

/// The caller's tensors as a Gatherer writes them: each checked against its result's
/// shape (batch axis as called), the dtype and its layout, and refused when it shares
/// memory with another (share_memory), is a lazy (negated, conjugated or zero) view, or
/// requires grad in grad mode, before anything runs. An input of `call` that shares memory
/// with one is replaced by a copy, so the results are those of the inputs as given. Their
/// autograd versions are bumped: the call writes them.
[[nodiscard]] std::vector<at::Tensor> writable(BoundCall& call, c10::ScalarType dtype,
                                               const Destinations& into);

/// Whether `a` and `b` have a byte of memory in common, whatever storages hold them (two
/// tensors made from one pointer are two storages): by their data pointers, sizes and
/// strides, element by element where strided views interleave.
[[nodiscard]] bool share_memory(const at::Tensor& a, const at::Tensor& b);

/// Writes results (as a whole-batch call returns them) into the caller's tensors.
void copy_into(const std::vector<at::Tensor>& into, const BoundCall& call,
               const std::vector<at::Tensor>& results);

/// `to.copy_(from)`; between dense CPU tensors of one shape and dtype, one memcpy on this
/// thread. Nothing when `from` is `to` already (it landed in place: see Landing).
void copy_rows(const at::Tensor& to, const at::Tensor& from);

} // namespace neml2::detail

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
/// The fewest and most rows of a cache-sized piece.
inline constexpr std::int64_t min_piece_rows = 1024, max_piece_rows = 65536;
/// The fewest rows of a piece when a call is cut so that lanes can share it: below this a
/// graph call of one forward segment costs little more than a lane's start; a row of a
/// segment chain (Newton, several graphs a row) costs far more.
inline constexpr std::int64_t min_lane_rows = 8192, min_lane_rows_chain = 256;
/// At least this many pieces, when the rows allow (so that lanes share a call).
inline constexpr std::int64_t lane_pieces = 8;

/// The rows of the pieces that rows [0, rows) of a call on the CPU run in, or 0 when they
/// run as one piece (on another device, or no more rows than one piece): the rows over
/// lane_pieces (a power of two, at least min_lane_rows, or min_lane_rows_chain for a
/// `chain`), at most a cache-sized piece (about piece_bytes of inputs and results). The
/// same whatever the lanes: a row's bits depend on where it sits in its graph call (a
/// kernel's vector loop or its scalar tail), so the pieces do not depend on the lanes.
[[nodiscard]] std::int64_t piece_rows(const BoundCall& call, c10::ScalarType dtype,
                                      std::int64_t rows, bool chain);

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

/// Refuses (FatalError, naming it `label`) a tensor results cannot be written into as
/// values: a lazy (negated, conjugated or zero) view, one that requires grad in grad mode,
/// or one whose elements share memory (a broadcast view).
void check_destination(const at::Tensor& t, const std::string& label);

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

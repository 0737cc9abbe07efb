#pragma once

// A call in positional form, and how each result gathers across chunks. Shared by
// the session (which produces and consumes them) and the dispatchers (which chunk them).

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/Tensor.h>

#include <neml2/artifact.hpp>
#include <neml2/session.hpp>

namespace neml2::detail {

/// One chunk's arguments: every tensor `(rows, *trailing)`, contiguous, on the compute
/// device (undefined extras stay undefined).
struct ChunkArgs {
  std::int64_t rows = 0;
  std::vector<at::Tensor> inputs, params, extras;
};

/// How a result gathers across chunks.
enum class Gather : std::uint8_t {
  rows,   ///< one row per batch row: chunks fill their rows of `(batch, *shape)`
  shared, ///< batch-independent: the same in every chunk, `(*shape)`; taken once
  sum,    ///< per-row contributions summed over the batch to `(*shape)`
};

struct ResultSlot {
  Gather gather = Gather::rows;
  Shape shape; ///< without the batch axis
};

/// A validated call: tensors in graph-independent positional order (inputs in master
/// order, parameters in Artifact::parameters order, extras = tangents in master input
/// order or cotangents in param_vjp_outputs order). Every tensor has a leading axis: the
/// batch, or 1 to broadcast to every row. An undefined extra stands for zero. No data has
/// been copied or moved.
struct BoundCall {
  std::int64_t batch = 1;
  bool batched = false;           ///< false when nothing carried a batch axis: results drop it
  c10::Device device = c10::kCPU; ///< where the inputs live, and the results go
  std::vector<at::Tensor> inputs, params, extras;

  /// How each result of the operation gathers (shared by all calls, or this call's own).
  [[nodiscard]] const std::vector<ResultSlot>& slots() const {
    return shared_slots ? *shared_slots : own_slots;
  }
  const std::vector<ResultSlot>* shared_slots = nullptr;
  std::vector<ResultSlot> own_slots;
};

/// The caller's tensors for an operation's results, in slot order, each with what it is
/// ("output 'stress'", "J['stress']['strain']") for errors.
struct Destinations {
  std::vector<at::Tensor> tensors;
  std::vector<std::string> labels;
};

} // namespace neml2::detail

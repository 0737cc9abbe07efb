#pragma once

/// @file artifact_info.hpp
/// @brief What an artifact offers, as plain values: its inputs, outputs and parameters
/// with their shapes, which operations its graphs can run, its segments (implicit ones
/// with their solver settings), and the device/dtype folders present. `neml2-dispatch
/// info` prints exactly this.
/// @code
/// const auto info = neml2::artifact_info(neml2::read_artifact(root));
/// if (!info.can("jacobian")) { /* recompile with neml2-compile -d : */ }
/// std::puts(neml2::format_artifact_info(info).c_str());
/// @endcode

#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <neml2/artifact.hpp>

namespace neml2 {

/// One segment, summarized: "forward" (its graphs) or "implicit" (its Newton solve).
struct SegmentInfo {
  std::string kind = {}; ///< "forward" or "implicit"
  /// @var inputs
  /// Forward: the names of its inputs; implicit: of its givens.
  /// @var outputs
  /// Forward: the names of its outputs; implicit: of its unknowns.
  std::vector<std::string> inputs = {}, outputs = {};
  std::vector<std::string> graphs = {};    ///< the graph files it names
  std::vector<std::string> residuals = {}; ///< implicit only
  std::int64_t max_substepping_level = 0;  ///< implicit only
  bool predictor = false;                  ///< implicit only: an initial-guess graph
};

/// One `<device>/<dtype>/` folder present under the root.
struct LeafInfo {
  /// @var device
  /// The device family's folder: "cpu", "cuda", "xpu", "hip" or "mps".
  /// @var dtype
  /// The dtype's folder, e.g. "float64".
  std::string device = {}, dtype = {};
  std::size_t graphs = 0; ///< `.pt2` files in it
};

/// @brief What an artifact offers (see artifact_info()).
struct ArtifactInfo {
  std::filesystem::path root = {}; ///< the folder holding metadata.json
  int schema_version = 0;          ///< metadata.json's `schema_version`
  /// @var inputs
  /// The model's structural inputs, in the graphs' order.
  /// @var outputs
  /// The model's structural outputs, in the graphs' order.
  std::vector<VariableSpec> inputs = {}, outputs = {};
  std::vector<ParameterSpec> parameters = {}; ///< the promoted parameters (`-p`)
  /// forward, jvp, jacobian, param_jacobian, param_vjp: whether its graphs are present.
  std::vector<std::pair<std::string, bool>> operations = {};
  /// @var derivatives
  /// The (output, input) pairs the model's Jacobian has (internal names).
  /// @var parameter_derivatives
  /// The (output, parameter) pairs of the parameter Jacobian.
  std::vector<std::pair<std::string, std::string>> derivatives = {}, parameter_derivatives = {};
  std::vector<SegmentInfo> segments = {};         ///< the model's steps, in order
  std::optional<SolverConfig> solver_config = {}; ///< present with an implicit segment
  std::vector<LeafInfo> leaves = {};              ///< sorted by device, then dtype

  /// True when `operation` (as named in `operations`) can run.
  [[nodiscard]] bool can(const std::string& operation) const;
};

/// The queries, answered from the artifact's metadata and folders.
[[nodiscard]] ArtifactInfo artifact_info(const Artifact& artifact);
/// As text for people (what `neml2-dispatch info` prints).
[[nodiscard]] std::string format_artifact_info(const ArtifactInfo& info);
/// As JSON (`neml2-dispatch info --json`).
[[nodiscard]] std::string artifact_info_json(const ArtifactInfo& info);

} // namespace neml2

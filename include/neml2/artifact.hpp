#pragma once

/// @file artifact.hpp
/// @brief What neml2-compile writes, read into plain values: the HIT stub, the artifact
/// root's metadata.json, and the `<device>/<dtype>/` folders of compiled graphs.
/// @see docs/artifact-contract.md

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include <neml2/device.hpp>

namespace neml2 {

using Shape = std::vector<std::int64_t>;

/// The metadata schema versions this library reads.
inline constexpr int supported_schema_versions[] = {14};

/// A structural input or output. `name` is the model's own name, `public_name` the one
/// callers use (they differ when compiled with --rename-input / --rename-output).
struct VariableSpec {
  std::string name;
  std::string public_name;
  std::string var_type;
  Shape base_shape;
  Shape sub_batch_shape;
};

/// A promoted parameter (`-p`): its stored value and natural base shape.
struct ParameterSpec {
  std::string name;        ///< qualified, e.g. "elasticity.E"
  std::string public_name; ///< after --rename-parameter
  Shape shape;             ///< the stored shape of `values`
  Shape base_shape;        ///< natural: [] Scalar, [6] SR2
  std::vector<double> values;
  std::optional<c10::ScalarType> dtype; ///< only for non-floating parameters
};

/// One block d(out)/d(in) of the jvp graph.
struct JacobianPair {
  std::string out, in;
  Shape out_base_shape, in_base_shape, in_sub_batch_shape;
  bool batch_independent = false;
};

/// One block d(out)/d(param) of the parameter-Jacobian graph.
struct ParameterJacobianPair {
  std::string out, param;
  Shape out_base_shape, param_base_shape;
};

/// A forward segment: its graphs (file names inside a leaf folder) and their calling
/// conventions. Optional graphs have empty package names.
struct ForwardSegment {
  std::string package;
  std::vector<std::string> inputs, outputs, param_inputs;
  std::string jvp_package;
  std::vector<JacobianPair> jacobian_pairs;
  std::string param_jacobian_package;
  std::vector<ParameterJacobianPair> param_jacobian_pairs;
  std::string param_vjp_package;
  std::vector<std::string> param_vjp_params, param_vjp_outputs;
};

/// @brief An artifact root as described by its metadata.json.
struct Artifact {
  std::filesystem::path root;
  int schema_version = 0;
  std::vector<VariableSpec> inputs, outputs;
  std::vector<ParameterSpec> parameters;
  std::vector<ForwardSegment> segments;

  /// The `<device>/<dtype>/` folder of graphs, checked to exist; a FatalError lists the
  /// folders that do exist and the neml2-compile command that would make the missing one.
  [[nodiscard]] std::filesystem::path leaf(const Device& device, c10::ScalarType dtype) const;
};

/// Reads `<root>/metadata.json`. Throws FatalError naming the file and the fix.
[[nodiscard]] Artifact read_artifact(const std::filesystem::path& root);

/// The artifact root a HIT stub names for `[Models]/[<model>]` (type = AOTIModel,
/// artifact_path relative to the stub's folder or absolute).
[[nodiscard]] std::filesystem::path artifact_root_from_stub(const std::filesystem::path& stub,
                                                            const std::string& model);

/// A stub file -> the root it names for `model`; a folder is taken as the root itself.
[[nodiscard]] std::filesystem::path resolve_artifact_root(const std::filesystem::path& path,
                                                          const std::string& model);

/// "float64" <-> at::kDouble, as the artifact folders are named.
[[nodiscard]] std::string dtype_folder(c10::ScalarType dtype);
[[nodiscard]] c10::ScalarType dtype_from_name(const std::string& name);

} // namespace neml2

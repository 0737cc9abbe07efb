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
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <c10/core/ScalarType.h>

#include <neml2/device.hpp>

namespace neml2 {

/// A tensor shape: the sizes of its axes.
using Shape = std::vector<std::int64_t>;

namespace detail {
/// The number of values of a shape (1 for `[]`).
inline std::int64_t numel(const Shape& shape) {
  std::int64_t n = 1;
  for (auto d : shape)
    n *= d;
  return n;
}
} // namespace detail

/// The metadata schema versions this library reads.
inline constexpr int supported_schema_versions[] = {14};

/// A structural input or output. `name` is the model's own name, `public_name` the one
/// callers use (they differ when compiled with --rename-input / --rename-output).
struct VariableSpec {
  std::string name;        ///< the model's own name, e.g. "strain"
  std::string public_name; ///< after --rename-input / --rename-output
  std::string var_type;    ///< NEML2's type: "Scalar", "SR2", ...
  Shape base_shape;        ///< per row, e.g. [6] for an SR2
  Shape sub_batch_shape;   ///< axes that ride along with each row (--example-batch-shape)
};

/// A promoted parameter (`-p`): its stored value and natural base shape.
struct ParameterSpec {
  std::string name;                     ///< qualified, e.g. "elasticity.E"
  std::string public_name;              ///< after --rename-parameter
  Shape shape;                          ///< the stored shape of `values`
  Shape base_shape;                     ///< natural: [] Scalar, [6] SR2
  std::vector<double> values;           ///< the stored value, row-major
  std::optional<c10::ScalarType> dtype; ///< only for non-floating parameters
};

/// One block d(out)/d(in) of the jvp graph.
struct JacobianPair {
  std::string out;                ///< the output (internal name)
  std::string in;                 ///< the input (internal name)
  Shape out_base_shape;           ///< the output's shape per row
  Shape in_base_shape;            ///< the input's shape per row
  Shape in_sub_batch_shape;       ///< the input's sub-batch axes
  bool batch_independent = false; ///< one block for every row (returned unbatched)
};

/// One block d(out)/d(param) of the parameter-Jacobian graph.
struct ParameterJacobianPair {
  std::string out;        ///< the output (internal name)
  std::string param;      ///< the parameter (qualified name)
  Shape out_base_shape;   ///< the output's shape per row
  Shape param_base_shape; ///< the parameter's natural shape
};

/// A forward segment: its graphs (file names inside a leaf folder) and their calling
/// conventions. Optional graphs have empty package names.
struct ForwardSegment {
  std::string package;                                     ///< the forward graph
  std::vector<std::string> inputs;                         ///< its arguments, in order
  std::vector<std::string> outputs;                        ///< its results, in order
  std::vector<std::string> param_inputs;                   ///< promoted parameters it takes
  std::string jvp_package;                                 ///< the Jacobian graph (-d)
  std::vector<JacobianPair> jacobian_pairs;                ///< the blocks it returns
  std::string param_jacobian_package;                      ///< d(out)/d(param) (-d OUT:P)
  std::vector<ParameterJacobianPair> param_jacobian_pairs; ///< the blocks it returns
  std::string param_vjp_package;                           ///< the parameter VJP graph
  std::vector<std::string> param_vjp_params;               ///< the parameters it returns for
  std::vector<std::string> param_vjp_outputs;              ///< the outputs it takes cotangents of
};

/// A variable of an implicit segment: unknown, residual or given (flattened per row to
/// `var_size` values inside its group: its sub-batch axes, then its base shape).
struct ImplicitVariable {
  std::string name;          ///< the variable's name
  std::int64_t var_size = 1; ///< values per row, over its sub-batch axes too
  Shape sub_batch_shape;     ///< axes that ride along with each row (300 bins: [300])
  Shape base_shape;          ///< its shape per sub-batch entry
  /// Givens only: how substepping treats it (static, old_state, cur_force, old_force)
  /// and the variable it pairs with (empty when none).
  std::string role;
  std::string pair; ///< the paired variable, or empty
};

/// One entry of `unknown_group_infos` / `given_group_infos` / `residual_group_infos`:
/// the variables packed side by side into one graph argument: `(B, sum of var_size)`, or for
/// a block group (`structure: "block"`) `(B, *sub_batch_shape, sum of base sizes)`, the
/// variables side by side within each sub-batch entry.
struct VariableGroup {
  std::vector<std::string> names; ///< the variables, side by side
  Shape sub_batch_shape;          ///< the sub-batch axes the compiler gave the group
  bool block = false;             ///< whether the graphs keep the sub-batch axes
};

/// One block du/dg of the solve_ift graph, at its flat offsets in -A^{-1}B.
struct ImplicitJacobianPair {
  std::string unknown;         ///< the unknown (row block)
  std::string given;           ///< the given (column block)
  Shape unknown_base_shape;    ///< the unknown's shape per row
  Shape given_base_shape;      ///< the given's shape per row
  std::int64_t row_offset = 0; ///< first row of the block in -A^{-1}B
  std::int64_t col_offset = 0; ///< first column of the block in -A^{-1}B
};

/// An implicit segment: the graphs of one Newton solve (file names inside a leaf folder).
/// Every graph takes the unknown groups, then the given groups, then `param_inputs`
/// (stored, not per row); residual returns b = -r per residual group; jacobian returns the
/// (residual group x unknown group) blocks of A = dr/du then b; solve takes A, b and
/// returns du (u += du); jacobian_given returns the blocks of B = dr/dg; solve_ift takes
/// A, B and returns du/dg per `jacobian_pairs` entry.
struct ImplicitSegment {
  std::string residual_package, jacobian_package, solve_package;
  std::string jacobian_given_package, solve_ift_package; ///< input derivatives (-d)
  std::string predictor_package;                         ///< optional initial guess
  std::vector<std::string> predictor_inputs, predictor_outputs;
  std::vector<ImplicitVariable> unknowns, residuals, givens;
  std::vector<VariableGroup> unknown_groups, given_groups, residual_groups;
  std::vector<std::string> param_inputs;
  std::int64_t max_substepping_level = 0;
  std::vector<std::string> incremental_variables;
  std::vector<ImplicitJacobianPair> jacobian_pairs;
  /// Parameter derivatives (-p P -d OUT:P): dr_dparam takes the parameters per row and
  /// returns A and dr/dparam; solve_param returns du/dparam per `param_jacobian_pairs` entry.
  std::string dr_dparam_package, solve_param_package;
  std::vector<ParameterJacobianPair> param_jacobian_pairs;
  /// A matrix-free Krylov Newton step (solver_kind "krylov"): instead of solve_package,
  /// matvec takes the unknown groups, the given groups, `param_inputs` (stored), then one
  /// direction v per unknown group, and returns (dr/du) v per residual group. With a
  /// preconditioner, precond_setup takes what residual takes and returns its state;
  /// precond_apply takes that state and a flat residual `(B, n)` and returns M^-1 r.
  std::string matvec_package, precond_setup_package, precond_apply_package;
  /// The derivative solves -A^{-1} B (input_sensitivity / param_sensitivity kind "krylov"):
  /// no solve_ift / solve_param graph; the assembled A is solved here instead.
  bool iterative_input_sensitivity = false, iterative_param_sensitivity = false;
};

/// One step of the model: a forward graph, or a Newton solve.
using Segment = std::variant<ForwardSegment, ImplicitSegment>;

/// The Newton settings of an implicit model (metadata.json `solver_config`), with NEML2's
/// meanings: converged when ||r|| < atol or ||r|| / ||r0|| < rtol (and, while substepping,
/// the last update below `substep_del_tol` (||u|| + atol) for the relative test);
/// `miters = N` allows N - 1 updates; `ls_max_iters = N` tries at most N - 1 steps of the
/// line search (so it searches only from N = 3).
struct SolverConfig {
  double atol = 1e-10;
  double rtol = 1e-8;
  std::int64_t miters = 25;
  double substep_del_tol = 1e-6;
  std::string ls_type = "BACKTRACKING"; ///< or "STRONG_WOLFE"
  std::int64_t ls_max_iters = 1;
  double ls_cutback = 2.0;
  double ls_c = 1e-3;
  std::string solver_kind = "direct"; ///< or "krylov" (then `krylov` applies)
  /// NEML2's GMRES settings (metadata.json `solver_config.krylov`), measured on NEML2 3.1's
  /// own Krylov loop (docs/artifact-contract.md): left-preconditioned restarted GMRES from
  /// du = 0 per Newton step; a row's linear solve stops when ||M^-1 (b - A du)|| <=
  /// max(abs_tol, rel_tol ||b||) (the preconditioned residual, the plain right-hand side), after
  /// `max_its` iterations (counted inside a cycle of `restart`; NEML2 checks only between cycles),
  /// or when its Arnoldi process breaks down (an unconverged solve still takes its step). The
  /// preconditioner is rebuilt every Newton step
  /// (`cache_strategy` none), once per solve (chord), or when the last linear solve took more than
  /// `cache_max_its` iterations (max_its).
  struct Krylov {
    std::string method = "gmres";
    std::int64_t restart = 40;
    std::int64_t max_its = 1000;
    double abs_tol = 0;
    double rel_tol = 1e-4;
    std::string cache_strategy = "none"; ///< none | chord | max_its
    std::int64_t cache_max_its = 10;
  } krylov;
  /// Ours, not NEML2's: the working set of rows is compacted to the rows still iterating
  /// once they are at most this fraction of it (0 never compacts: converged rows are
  /// still evaluated, masked; 1 compacts whenever a row converged). See docs/performance.md.
  double compact_below = 0.5;
  /// Ours: on the CPU (in double, direct steps), everything between two graph calls
  /// is one pass over the rows in plain C++ (each row's LU with partial pivoting in place
  /// of the solve graphs, its update, norms and flags; the rows still iterating always
  /// compacted, so `compact_below` does not apply). False runs those steps as tensor
  /// operations, as on accelerators. The two agree to 1e-12 (tests/test_row_pass.cpp).
  bool row_pass = true;
  /// Ours, off by default (then Newton is NEML2's, bit for bit): the chord, wherever Newton's
  /// steps are direct on the CPU in double (dense or block groups, any size, with or without a
  /// line search; not Krylov steps, accelerators or float). Each point keeps the LU of the last
  /// Newton matrix it took and steps from it, calling the residual graph alone, while its
  /// ||r|| falls by at least `chord_rate` a step (and would reach its tolerance within
  /// miters); where it does not, that point takes A again (the jacobian graph on such points
  /// alone). With a line search, a step from an older factor must pass its sufficient
  /// decrease at alpha = 1. Results meet the same convergence test, so they agree with
  /// Newton's within its tolerance; derivatives are the implicit function theorem's at the
  /// solution, as without. Kept within one call; NewtonFactors (a MaterialState's
  /// StepOptions::chord) keeps them from call to call.
  bool chord = false;
  double chord_rate = 0.1; ///< in (0, 1)
};

/// @brief An artifact root as described by its metadata.json.
///
/// Thread safety: a plain value, read-only once loaded (DispatchedModel and Session share
/// one through a `shared_ptr<const Artifact>`); reading it from any number of threads is
/// safe. The types it is made of (VariableSpec, ForwardSegment, SolverConfig, ...) are
/// plain values too.
struct Artifact {
  std::filesystem::path root;
  int schema_version = 0;
  std::vector<VariableSpec> inputs, outputs;
  std::vector<ParameterSpec> parameters;
  std::vector<Segment> segments;
  /// `derivatives`: the (output, input) pairs the model's Jacobian has (internal names).
  std::vector<std::pair<std::string, std::string>> derivatives;
  /// `parameter_derivatives`: the (output, parameter) pairs of the parameter Jacobian.
  std::vector<std::pair<std::string, std::string>> parameter_derivatives;
  /// Present for models with an implicit segment.
  std::optional<SolverConfig> solver_config;

  /// True for one forward segment (what the session calls directly, without a chain).
  [[nodiscard]] bool single_forward() const {
    return segments.size() == 1 && std::holds_alternative<ForwardSegment>(segments.front());
  }

  /// The `<device>/<dtype>/` folder of graphs, checked to exist; a FatalError lists the
  /// folders that do exist and the neml2-compile command that would make the missing one.
  [[nodiscard]] std::filesystem::path leaf(const Device& device, c10::ScalarType dtype) const;
};

/// Reads `<root>/metadata.json`. Throws FatalError naming the file and the fix.
[[nodiscard]] Artifact read_artifact(const std::filesystem::path& root);

/// @name Stubs
/// A stub is the `<name>_aoti.i` HIT file neml2-compile writes beside the artifact root. It
/// is read with nmhit, NEML2's own HIT parser, and only its `[Models]/[<model>]` block
/// (`type = AOTIModel`, `artifact_path` relative to the stub's folder or absolute) is
/// used; the `[Tensors]` and `[Settings]` sections it may repeat from the input are
/// parsed and ignored, as NEML2's runtime does.
/// @{

/// @brief The artifact root a stub names for `[Models]/[<model>]`.
/// @throws FatalError naming the file and line: a malformed stub, no such model (the
/// message lists the models it has), a type other than AOTIModel, no artifact_path.
[[nodiscard]] std::filesystem::path artifact_root_from_stub(const std::filesystem::path& stub,
                                                            const std::string& model);

/// @brief The artifact root of the one model a stub holds.
/// @throws FatalError as above, and when the stub holds several models (the message lists
/// them: pass one to the overload that takes a model name).
[[nodiscard]] std::filesystem::path artifact_root_from_stub(const std::filesystem::path& stub);

/// @brief The model names under a stub's `[Models]`, in the stub's order.
[[nodiscard]] std::vector<std::string> stub_models(const std::filesystem::path& stub);

/// @brief A stub file -> the root it names for `model`; a folder is taken as the root itself.
[[nodiscard]] std::filesystem::path resolve_artifact_root(const std::filesystem::path& path,
                                                          const std::string& model);

/// @brief A stub file -> the root of its one model; a folder is taken as the root itself.
/// @throws FatalError when the stub holds several models, listing them.
[[nodiscard]] std::filesystem::path resolve_artifact_root(const std::filesystem::path& path);

/// @}

namespace detail {
/// read_artifact's parser over the text of a metadata.json (`root` names it in messages).
[[nodiscard]] Artifact parse_metadata(std::string_view text, const std::filesystem::path& root);
/// artifact_root_from_stub's parser over the text of a stub (`stub` names it in messages);
/// without a model, the stub's one model.
[[nodiscard]] std::filesystem::path
artifact_root_from_stub(std::string_view text, const std::filesystem::path& stub,
                        const std::optional<std::string>& model = std::nullopt);
/// stub_models' parser over the text of a stub.
[[nodiscard]] std::vector<std::string> stub_models(std::string_view text,
                                                   const std::filesystem::path& stub);
/// What is wrong with GMRES settings ("method is 'x'; ..." naming the field and the values
/// supported), or nothing: shared by the metadata reader and set_solver_config.
[[nodiscard]] std::optional<std::string> check_krylov(const SolverConfig::Krylov& krylov);
} // namespace detail

/// @brief at::kDouble -> "float64", as the artifact folders are named (float64, float32).
[[nodiscard]] std::string dtype_folder(c10::ScalarType dtype);
/// @brief "float64" (or "torch.float64") -> at::kDouble; also float32, float16, bfloat16,
/// int64, int32, bool. A FatalError for any other name.
[[nodiscard]] c10::ScalarType dtype_from_name(const std::string& name);

} // namespace neml2

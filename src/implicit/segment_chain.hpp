#pragma once

// The segments of a composed model (forward graphs and Newton solves) run in order over
// one name-to-tensor state, with Jacobians chained across them. Private to the library:
// Session runs a chain for every artifact that is not a single forward segment.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/Tensor.h>

#include <neml2/artifact.hpp>
#include <neml2/tensor_map.hpp>

#include "graph/call.hpp"
#include "implicit/newton.hpp"
#include "implicit/substepping.hpp"

namespace neml2::detail {

/// Loads one graph of the leaf folder by file name, checked to take `arguments` (their
/// shapes with -1 for the batch axis, nullopt where unknown) and return `results`; an
/// empty name gives an empty function. Given `result_shapes`, fills it with each result's
/// shape per row, from one call of the graph on zeros (Graph::result_shapes).
using GraphLoader = std::function<GraphFn(const std::string& package, const char* listed_as,
                                          const std::vector<std::optional<Shape>>& arguments,
                                          std::size_t results, std::vector<Shape>* result_shapes)>;

class SegmentChain {
public:
  /// The segments of `artifact` on `device` in `dtype` (each implicit segment's Newton
  /// planned for them: newton_plan.hpp).
  SegmentChain(const Artifact& artifact, c10::Device device, c10::ScalarType dtype,
               const GraphLoader& load);

  /// forward: the outputs (master order); jacobian: the outputs, then one block
  /// `(rows, *out_base, *in_base)` per jacobian_blocks() entry; jvp: the outputs, then
  /// their tangents; param_vjp: per row, sum over outputs of cotangent . d(out)/d(param),
  /// `(rows, *param_base)` per param_vjp_params() entry (the cotangents in chunk.extras, one
  /// per output, undefined = zero). Throws the per-row ConvergenceError when some rows fail.
  /// `newton_factors`: the chord's slots of the chunk's rows, `(rows, width)` double on the
  /// CPU (a NewtonFactors row's layout: factor_columns), or undefined.
  [[nodiscard]] std::vector<at::Tensor> run(Operation op, ChunkArgs& chunk,
                                            const at::Tensor& newton_factors = {}) const;

  /// Each output's shape per row, `(*sub_batch, *base)`, in master order: an input's or an
  /// unknown's from metadata.json, one a forward segment makes from its graph (metadata.json
  /// does not record an output's sub-batch axes; a forward segment may add or sum them).
  [[nodiscard]] const std::vector<Shape>& output_shapes() const noexcept { return _output_shapes; }

  /// Whether every segment carries its derivative graphs (jvp / jacobian_given + solve_ift).
  [[nodiscard]] bool has_input_derivatives() const noexcept { return _has_input_derivatives; }
  /// (output, input) master positions of the Jacobian's blocks: metadata.json `derivatives`.
  [[nodiscard]] const std::vector<std::pair<std::size_t, std::size_t>>&
  jacobian_blocks() const noexcept {
    return _jacobian_blocks;
  }
  /// Whether every segment that takes a parameter carries its parameter-derivative graphs.
  [[nodiscard]] bool has_param_derivatives() const noexcept { return _has_param_derivatives; }
  /// (output, parameter) positions of the parameter Jacobian's blocks: `parameter_derivatives`.
  [[nodiscard]] const std::vector<std::pair<std::size_t, std::size_t>>&
  param_jacobian_blocks() const noexcept {
    return _param_jacobian_blocks;
  }

  /// The parameters param_vjp returns gradients for (Artifact::parameters positions, in
  /// order): those of param_jacobian_blocks(). Its cotangents are one per output.
  [[nodiscard]] const std::vector<std::size_t>& param_vjp_params() const noexcept {
    return _param_vjp_params;
  }

  /// Whether an implicit segment's graphs take parameter `p` (Artifact::parameters index):
  /// they take one stored value for every row, so it cannot be batched.
  [[nodiscard]] bool solves_with_parameter(std::size_t p) const;

  [[nodiscard]] const SolverConfig& solver_config() const noexcept { return _config; }
  /// Checks `config` and plans each implicit segment's Newton again under it.
  void set_solver_config(const SolverConfig& config);

  /// Each implicit segment's plan, in order.
  [[nodiscard]] std::vector<NewtonPlan> newton_plans() const;

private:
  struct ForwardStep {
    const ForwardSegment* segment;
    GraphFn value, jvp, param_jacobian;
    std::vector<std::size_t> params; // positions in Artifact::parameters
  };
  struct ImplicitStep {
    const ImplicitSegment* segment = nullptr;
    NewtonGraphs newton;
    GraphFn predictor, jacobian_given, solve_ift, dr_dparam, solve_param;
    std::vector<std::size_t> params;
    std::size_t a_blocks = 0;     // residual groups x unknown groups (of the jacobian graph)
    std::size_t given_blocks = 0; // residual groups x given groups
    NewtonShape shape;            // what its plan is decided from
    NewtonPlan plan;              // which Newton it runs (newton_plan.hpp)
    SubstepPlan substeps;
  };
  using Step = std::variant<ForwardStep, ImplicitStep>;
  struct State;

  // Loading, in steps (segment_chain_load.cpp): what the constructor keeps until it ends,
  // each segment's graphs, what an implicit segment's graphs take, the outputs' shapes
  // checked, the derivative blocks' positions.
  struct Loading;
  struct ImplicitArguments;
  [[nodiscard]] std::vector<std::size_t> params_of(const std::vector<std::string>& names) const;
  void load_forward(const ForwardSegment& f, Loading& loading);
  void load_implicit(const ImplicitSegment& s, std::size_t position, Loading& loading);
  [[nodiscard]] ImplicitArguments implicit_arguments(const ImplicitSegment& s,
                                                     const std::vector<std::size_t>& params,
                                                     std::size_t position) const;
  void load_implicit_graphs(const ImplicitSegment& s, const ImplicitArguments& a,
                            ImplicitStep& step, const Loading& loading);
  void check_outputs(const Loading& loading);
  void index_derivatives(const Loading& loading);

  // The steps of run(), in order: the inputs as the state (each its own derivative where
  // derivatives are chained), every segment on it, the operation's results taken from it,
  // the rows that failed.
  [[nodiscard]] State start(Operation op, const ChunkArgs& chunk) const;
  void run_steps(const ChunkArgs& chunk, State& state) const;
  [[nodiscard]] std::vector<at::Tensor> results_of(Operation op, const ChunkArgs& chunk,
                                                   const State& state) const;
  // Marks as failed the rows whose inputs are finite but whose results are not; how many.
  [[nodiscard]] std::int64_t fail_rows_not_finite(const ChunkArgs& chunk,
                                                  const std::vector<at::Tensor>& results,
                                                  State& state) const;
  // The ConvergenceError of a chunk some of whose rows failed (their results NaN).
  [[noreturn]] void throw_unconverged(Operation op, const State& state, std::int64_t n_not_finite,
                                      std::vector<at::Tensor> results) const;

  // results_of() per operation: param_vjp's gradients (in place of the outputs), the
  // Jacobian blocks or the tangents (after them).
  [[nodiscard]] std::vector<at::Tensor>
  param_vjp_gradients(const ChunkArgs& chunk, const State& state,
                      const std::vector<at::Tensor>& outputs) const;
  void append_blocks(Operation op, const State& state, std::vector<at::Tensor>& results) const;
  void append_tangents(const ChunkArgs& chunk, const State& state,
                       std::vector<at::Tensor>& results) const;

  void run_forward(const ForwardStep& step, const ChunkArgs& chunk, State& state) const;
  void run_implicit(const ImplicitStep& step, const ChunkArgs& chunk, State& state) const;

  // Where the columns of a dense d(u)/d(givens, parameters) are (see DerivativeFn): each
  // unknown's first row, each parameter's first column after the givens'.
  struct DenseLayout {
    std::map<std::string, std::int64_t> unknown_row, param_column;
    std::int64_t n_params = 0; // 0 when the parameters are not asked for
  };
  [[nodiscard]] DenseLayout dense_layout(const ImplicitStep& step, bool with_params) const;
  // du/dg = -A^{-1} B per jacobian_pairs entry at solutions `u` of givens `g`; du/dparam =
  // -A^{-1} dr/dparam per param_jacobian_pairs entry (`per_row`: u, g, the parameters per
  // row). On the CPU's row pass the solves are ours, else the solve graphs'.
  [[nodiscard]] std::vector<at::Tensor>
  input_sensitivity(const ImplicitStep& step, const std::vector<at::Tensor>& u,
                    const std::vector<at::Tensor>& g, const std::vector<at::Tensor>& params) const;
  [[nodiscard]] std::vector<at::Tensor> param_sensitivity(const ImplicitStep& step,
                                                          const std::vector<at::Tensor>& per_row,
                                                          const DenseLayout& layout) const;
  // The dense derivative at solutions `u` of spans with givens `g` (the rows of a chunk).
  [[nodiscard]] at::Tensor dense_derivative(const ImplicitStep& step, const ChunkArgs& chunk,
                                            const std::vector<at::Tensor>& params,
                                            const DenseLayout& layout,
                                            const std::vector<at::Tensor>& u,
                                            const std::vector<at::Tensor>& g) const;

  // The derivatives of a segment's outputs (forward) or unknowns (implicit, solved as
  // `solved` from `givens`) with respect to the model's inputs (and parameters), chained
  // from those of what it takes: one vector of columns per output, into `state` for the
  // implicit ones.
  [[nodiscard]] std::vector<std::vector<at::Tensor>>
  forward_derivatives(const ForwardStep& step, const std::vector<at::Tensor>& args,
                      const std::vector<at::Tensor>& results, const State& state) const;
  void chain_implicit(const ImplicitStep& step, const ChunkArgs& chunk, const NewtonResult& solved,
                      const std::vector<at::Tensor>& givens, const std::vector<at::Tensor>& params,
                      const DenseLayout& layout, State& state) const;

  const Artifact& _artifact;
  c10::Device _device;
  c10::ScalarType _dtype;
  std::vector<Step> _steps;
  std::vector<std::pair<std::size_t, std::size_t>> _jacobian_blocks, _param_jacobian_blocks;
  std::vector<std::size_t> _param_vjp_params;
  std::map<std::string, std::size_t> _param_index;
  std::vector<std::int64_t> _input_sizes; // values per row of each input
  std::vector<Shape> _output_shapes;
  bool _has_input_derivatives = true;
  bool _has_param_derivatives = true;
  SolverConfig _config;
};

} // namespace neml2::detail

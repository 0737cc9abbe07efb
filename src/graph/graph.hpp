#pragma once

// One compiled graph (.pt2 package), trusted only as far as it was checked: its signature
// is read from the package (the archive's own name and the input checks of its generated
// wrapper: package.hpp) and checked against what metadata.json says at load (graph.cpp);
// every call's arguments are checked against it, calls below or above the exported batch
// range are padded or split, and the number of results is checked after every call
// (graph_run.cpp).

#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/Tensor.h>

#include <neml2/artifact.hpp>

#include "graph/package.hpp"

namespace torch::inductor {
class AOTIModelPackageLoader;
}

namespace neml2::detail {

/// Graph::expect's result count for a graph metadata.json says nothing about (a
/// preconditioner's state): only the graph's own signature is checked, at every call.
inline constexpr std::size_t unchecked_results = std::numeric_limits<std::size_t>::max();

class Graph {
public:
  Graph(); ///< absent: the artifact was compiled without it
  /// Loads `package` from `leaf` (listed in metadata.json as `listed_as`). Checks that the
  /// file is the graph its name says, that it takes `dtype`, and when given, the number of
  /// arguments and results metadata.json implies.
  Graph(const std::filesystem::path& leaf, const std::string& package, const c10::Device& device,
        c10::ScalarType dtype, std::size_t runners, std::string listed_as);
  ~Graph();
  Graph(Graph&&) noexcept;
  Graph& operator=(Graph&&) noexcept;

  explicit operator bool() const noexcept { return _loader != nullptr; }
  [[nodiscard]] const std::string& file() const noexcept { return _file; }
  [[nodiscard]] const GraphSignature& signature() const noexcept { return _signature; }

  /// Load-time checks against metadata.json: each argument's shape (-1 for the batch axis;
  /// nullopt where metadata.json does not say) and the number of results. A graph exported
  /// for a fixed batch (`[Settings] dynamic_batch = false`) takes its batch axes from them:
  /// see fixed_rows().
  void expect(const std::vector<std::optional<Shape>>& arguments, std::size_t results);

  /// The batch a fixed-batch graph was exported for (0: a dynamic batch). Other batch sizes
  /// are padded and split as below its minimum and above its maximum, unless its rows are
  /// not interchangeable (rows_differ()): then they are refused.
  [[nodiscard]] std::int64_t fixed_rows() const noexcept { return _fixed_rows; }
  /// Whether a fixed-batch graph treats equal rows differently (a per-row tensor baked
  /// in, e.g. a [Tensors] entry bound to a coefficient), found by one probe call at load.
  [[nodiscard]] bool rows_differ() const noexcept { return _rows_differ; }

  /// The same, and what each result must be: `(rows or 1, *trailing)` in `dtype`; with `broadcast`,
  /// trailing sizes of 1 are accepted too (Jacobian blocks that do not vary). Checked
  /// now, on one probe call of zeros, and after every call.
  struct Result {
    Shape trailing;
    bool broadcast = false;
  };
  void expect(const std::vector<std::optional<Shape>>& arguments, std::vector<Result> results,
              c10::ScalarType dtype);

  /// Whether a call of one row runs as it is, unpadded, on a dynamic CPU graph exported for
  /// at least two rows (torch.export's 0/1 specialization: NEML2's runtime passes it one):
  /// where a probe at load, two distinct rows and then the first alone, gives that row the
  /// same bits (NaN where NaN), without an error. Else such calls stay padded.
  void probe_one_row(c10::ScalarType dtype);
  [[nodiscard]] bool runs_one_row() const noexcept { return _runs_one_row; }

  /// Each result's shape per row (its batch axis dropped), from one call on zeros at the
  /// graph's smallest batch: what metadata.json does not record (an output's sub-batch axes).
  [[nodiscard]] std::vector<Shape> result_shapes(c10::ScalarType dtype) const;
  /// Runs the graph on dense row-major `(rows, ...)` arguments (unbatched ones as the
  /// graph takes them). Checked against the signature; a call with fewer rows than the
  /// graph was exported for is padded with copies of its last row, one with more is split.
  [[nodiscard]] std::vector<at::Tensor> run(const std::vector<at::Tensor>& args) const;

private:
  [[nodiscard]] std::vector<at::Tensor> run_checked(const std::vector<at::Tensor>& args) const;
  [[nodiscard]] std::vector<at::Tensor> run_container(const std::vector<at::Tensor>& args) const;
  [[nodiscard]] std::vector<at::Tensor> run_padded(const std::vector<at::Tensor>& args,
                                                   std::int64_t rows) const;
  [[nodiscard]] std::vector<at::Tensor> run_split(const std::vector<at::Tensor>& args,
                                                  std::int64_t rows) const;
  [[nodiscard]] std::vector<at::Tensor> zeros(c10::ScalarType dtype) const;
  [[noreturn]] void fail(const std::string& what) const;
  void pin_fixed_batch(const std::vector<std::optional<Shape>>& arguments);

  struct Padding; // arguments padded to _min_rows, reused (see run_padded)
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> _loader;
  std::unique_ptr<Padding> _padding;
  std::string _file, _listed_as, _device;
  c10::Device _torch_device = c10::kCPU;
  GraphSignature _signature;
  std::vector<Result> _results; // empty: only their number is known
  c10::ScalarType _result_dtype = c10::kDouble;
  std::int64_t _min_rows = 0, _max_rows = std::numeric_limits<std::int64_t>::max();
  std::int64_t _fixed_rows = 0;
  bool _runs_one_row = false; // probe_one_row()
  std::size_t _container_outputs = 0; // what the compiled library returns per call
  bool _rows_differ = false;
};

} // namespace neml2::detail

#pragma once

// A row's linear system, read in place from graph results, for the row passes of
// src/implicit/ (newton_rows.cpp, the IFT solves): the views of the graphs' results, a
// row's matrix and right-hand sides gathered from their blocks, and rows' systems solved
// a vector's width of lanes at a time. Private to src/implicit/.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <ATen/Tensor.h>

#include "implicit/newton_graphs.hpp"
#include "implicit/row_lu.hpp"
#include "implicit/row_ranges.hpp"

namespace neml2::detail {

// thread).
inline constexpr std::int64_t row_grain = 256;

template <class F>
void for_rows(std::int64_t rows, const F& f) {
  for_row_ranges(rows, row_grain, f);
}

// The row pass runs in double (NewtonStrategy::rows); a result in another type is converted.
at::Tensor typed(const at::Tensor& t);

// A graph's result read in place: `(rows, n)` or `(rows, n_r, n_c)`, any strides (results
// can come back column-major), a batch of 1 standing for every row.
struct View {
  at::Tensor tensor; // kept alive
  const double* data;
  std::int64_t row, stride1, stride2 = 0, size1, size2 = 1;

  explicit View(const at::Tensor& t)
      : tensor(typed(t))
      , data(tensor.data_ptr<double>())
      , row(tensor.size(0) == 1 ? 0 : tensor.stride(0))
      , stride1(tensor.stride(1))
      , size1(tensor.size(1)) {
    if (tensor.dim() == 3) {
      stride2 = tensor.stride(2);
      size2 = tensor.size(2);
    }
  }
  double operator()(std::int64_t i, std::int64_t r, std::int64_t c = 0) const {
    return data[i * row + r * stride1 + c * stride2];
  }
};

// Row i's matrix (n x n) and right-hand sides (n x m) from their blocks: residual groups
// outer, unknown (or column) groups inner.
struct Blocks {
  std::vector<View> blocks;
  std::size_t column_groups;
  std::vector<std::int64_t> row_at, column_at; // first row / column of each group
  std::int64_t height = 0, width = 0;

  Blocks(const std::vector<at::Tensor>& tensors, std::size_t first, std::size_t count,
         std::size_t residual_groups)
      : column_groups(count / residual_groups) {
    for (auto k = first; k < first + count; ++k)
      blocks.emplace_back(tensors[k]);
    for (std::size_t r = 0; r < residual_groups; ++r) {
      row_at.push_back(height);
      height += blocks[r * column_groups].size1;
    }
    for (std::size_t c = 0; c < column_groups; ++c) {
      column_at.push_back(width);
      width += blocks[c].size2;
    }
  }
  // Entry (r, c) at out[(r * width + c) * stride].
  void fill(std::int64_t i, double* out, std::int64_t stride = 1) const {
    for (std::size_t r = 0; r < row_at.size(); ++r)
      for (std::size_t c = 0; c < column_groups; ++c) {
        const auto& b = blocks[r * column_groups + c];
        for (std::int64_t x = 0; x < b.size1; ++x)
          for (std::int64_t y = 0; y < b.size2; ++y)
            out[((row_at[r] + x) * width + column_at[c] + y) * stride] = b(i, x, y);
      }
  }
};

// The operands of -A^{-1} C per row (minus_solve_rows, minus_solve_lapack_rows): A's
// blocks and C's, and the rows they cover (a block of one row stands for every row).
struct BlockSystems {
  Blocks a, c;
  std::int64_t rows = 0;

  BlockSystems(const std::vector<at::Tensor>& a_blocks, const std::vector<at::Tensor>& c_blocks,
               std::size_t residual_groups)
      : a(a_blocks, 0, a_blocks.size(), residual_groups)
      , c(c_blocks, 0, c_blocks.size(), residual_groups) {
    for (const auto* list : {&a_blocks, &c_blocks})
      for (const auto& t : *list)
        rows = std::max(rows, t.size(0));
  }
};

// b = -r per residual group: each row's ||b||, and <b, x>.
struct Residual {
  std::vector<View> groups;

  Residual(const std::vector<at::Tensor>& tensors, std::size_t first) {
    for (auto k = first; k < tensors.size(); ++k)
      groups.emplace_back(tensors[k]);
  }
  double norm(std::int64_t i) const {
    double squares = 0;
    for (const auto& g : groups)
      for (std::int64_t x = 0; x < g.size1; ++x)
        squares += g(i, x) * g(i, x);
    return std::sqrt(squares);
  }
  // Entry r at out[r * stride].
  void copy(std::int64_t i, double* out, std::int64_t stride = 1) const {
    for (const auto& g : groups)
      for (std::int64_t x = 0; x < g.size1; ++x, out += stride)
        *out = g(i, x);
  }
};

// ||x|| of n entries.
double norm(const double* x, std::int64_t n);

// Pointers to the rows of `(rows, width)` contiguous tensors.
struct Groups {
  std::vector<double*> data;
  std::vector<std::int64_t> width;

  explicit Groups(const std::vector<at::Tensor>& tensors) {
    for (const auto& t : tensors) {
      data.push_back(t.data_ptr<double>());
      width.push_back(t.size(1));
    }
  }
  // Row i of every group, packed side by side, into `out`.
  void read(std::int64_t i, double* out) const {
    for (std::size_t k = 0; k < data.size(); ++k)
      out = std::copy_n(data[k] + i * width[k], width[k], out);
  }
  void write(std::int64_t i, const double* in) const {
    for (std::size_t k = 0; k < data.size(); ++k) {
      std::copy_n(in, width[k], data[k] + i * width[k]);
      in += width[k];
    }
  }
  void copy_row(std::int64_t to, const Groups& from, std::int64_t i) const {
    for (std::size_t k = 0; k < data.size(); ++k)
      std::copy_n(from.data[k] + i * width[k], width[k], data[k] + to * width[k]);
  }
};

// `(rows, width)` tensors like each of `like`.
std::vector<at::Tensor> empty_like_rows(const std::vector<at::Tensor>& like, std::int64_t rows);

// Rows' systems (n x n, n x `columns` right-hand sides) gathered `lanes` at a time and
// solved together (lu_solve_lanes), unused lanes holding the identity. `done(i, x, stride,
// solved)` gets each row's solution, entry k at x[k * stride].
class LaneBatch {
public:
  LaneBatch(std::int64_t n, std::int64_t columns, std::int64_t lanes)
      : _n(n)
      , _columns(columns)
      , _lanes(lanes)
      , _a(n * n * lanes)
      , _x(n * columns * lanes)
      , _rows(static_cast<std::size_t>(lanes)) {}

  // Where the next row's A and B go, entry k at a()[k * lanes] and x()[k * lanes].
  double* a() { return _a.data() + _count; }
  double* x() { return _x.data() + _count; }

  // Adds row i (its A and B written); solves once every lane is taken.
  template <class F>
  void add(std::int64_t i, const F& done) {
    _rows[static_cast<std::size_t>(_count)] = i;
    if (++_count == _lanes)
      solve(done);
  }

  // Solves the rows added since the last solve.
  template <class F>
  void solve(const F& done) {
    if (_count == 0)
      return;
    for (auto l = _count; l < _lanes; ++l)
      for (std::int64_t r = 0; r < _n; ++r) {
        for (std::int64_t c = 0; c < _n; ++c)
          _a.data()[(r * _n + c) * _lanes + l] = r == c ? 1 : 0;
        for (std::int64_t c = 0; c < _columns; ++c)
          _x.data()[(r * _columns + c) * _lanes + l] = 0;
      }
    const auto failed =
        lu_solve_lanes(_a.data(), _x.data(), _n, _columns, static_cast<int>(_lanes));
    for (std::int64_t l = 0; l < _count; ++l)
      done(_rows[static_cast<std::size_t>(l)], _x.data() + l, _lanes, (failed >> l & 1U) == 0);
    _count = 0;
  }

private:
  std::int64_t _n, _columns, _lanes, _count = 0;
  LaneBuffer _a, _x;
  std::vector<std::int64_t> _rows;
};

// Lanes for a working set of `rows`: a lone row alone (waking the vector unit would cost
// more than it saves).
std::int64_t lanes_for(std::int64_t rows);

/// `graph` on `args`, its results for the row pass alone (read in place, never returned to
/// a caller): made in inference mode, without a version counter for each of the hundreds
/// of tensors an AOTI call makes (a third of its allocations at small batches).
[[nodiscard]] std::vector<at::Tensor> call_for_rows(const GraphFn& graph,
                                                    const std::vector<at::Tensor>& args);

/// -A^{-1} C per row, `(rows, n, m)`: A from its blocks `(rows or 1, n_r, n_u)` (residual
/// groups outer, unknown groups inner), C from its `(rows or 1, n_r, n_c)` blocks (residual
/// groups outer, column groups inner), `residual_groups` of them. A row whose A is
/// singular gets NaN, as the solve graphs give.
[[nodiscard]] at::Tensor minus_solve_rows(const std::vector<at::Tensor>& a_blocks,
                                          const std::vector<at::Tensor>& c_blocks,
                                          std::size_t residual_groups);

} // namespace neml2::detail

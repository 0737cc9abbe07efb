// Where a call's rows go: the pieces of a large CPU call, the places its results land, the
// caller's tensors checked as targets (see placement.hpp).

#include "engine/placement.hpp"

#include <bit>
#include <cstring>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/grad_mode.h>

#include "core/shape_text.hpp"

namespace neml2::detail {

// Torch's copy costs a dispatch, and above 32768 elements an OpenMP team, which on a
// thread other than the one that made the team waits for it (see performance.md).
void copy_rows(const at::Tensor& to, const at::Tensor& from) {
  if (to.is_cpu() && from.is_cpu() && to.scalar_type() == from.scalar_type() &&
      to.sizes() == from.sizes() && to.is_contiguous() && from.is_contiguous()) {
    if (to.data_ptr() != from.const_data_ptr())
      std::memcpy(to.data_ptr(), from.const_data_ptr(), to.nbytes());
  } else
    to.copy_(from);
}

std::int64_t piece_rows(const BoundCall& call, c10::ScalarType dtype, std::int64_t rows,
                        bool chain) {
  if (!call.device.is_cpu())
    return 0;
  std::int64_t values = 0; // per row, read and written
  for (const auto* tensors : {&call.inputs, &call.params, &call.extras})
    for (const auto& t : *tensors)
      if (t.defined() && t.dim() > 0 && t.size(0) == call.batch && t.size(0) > 0)
        values += t.numel() / t.size(0);
  for (const auto& slot : call.slots())
    if (slot.gather == Gather::rows)
      values += numel(slot.shape);
  const auto row_bytes =
      std::max<std::int64_t>(values, 1) * static_cast<std::int64_t>(c10::elementSize(dtype));
  const auto power_of_two = [](std::int64_t n) {
    return static_cast<std::int64_t>(std::bit_floor(static_cast<std::uint64_t>(n)));
  };
  const auto cache =
      power_of_two(std::clamp(piece_bytes / row_bytes, min_piece_rows, max_piece_rows));
  const auto shared = std::max(chain ? min_lane_rows_chain : min_lane_rows,
                               power_of_two(std::max<std::int64_t>(rows / lane_pieces, 1)));
  const auto piece = std::min(cache, shared);
  return rows > piece ? piece : 0;
}

Places places(const BoundCall& call, const std::vector<at::Tensor>& results, std::int64_t first,
              std::int64_t rows) {
  Places at(results.size());
  if (!call.device.is_cpu())
    return at;
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    if (call.slots()[i].gather != Gather::rows || r.dim() == 0 || r.size(0) == 0)
      continue;
    const auto whole = place_of(r); // rows of a dense tensor: a dense range of it
    const auto row = whole.bytes / static_cast<std::size_t>(r.size(0));
    if (whole.data)
      at[i] = {static_cast<char*>(whole.data) + static_cast<std::size_t>(first) * row,
               static_cast<std::size_t>(rows) * row};
  }
  return at;
}

namespace {
// The byte offsets from `base` of every element of `t` (whose data starts `shift` bytes
// after it), sorted.
at::Tensor element_starts(const at::Tensor& t, std::int64_t shift) {
  const auto size = static_cast<std::int64_t>(t.element_size());
  auto starts = at::full({1}, shift, at::kLong);
  for (std::int64_t k = 0; k < t.dim(); ++k)
    starts =
        (starts.unsqueeze(-1) + at::arange(t.size(k), at::kLong) * (t.stride(k) * size)).flatten();
  return std::get<0>(starts.sort());
}

// Whether two views with the same row stride (columns of a host's records, one row per
// point) certainly miss each other: each row's elements lie within one row stride, and the
// rows' footprints do not meet on the circle of that stride. False: they may meet.
bool rows_apart(const at::Tensor& a, const at::Tensor& b, std::uintptr_t a_begin,
                std::uintptr_t b_begin) {
  if (a.dim() < 1 || b.dim() < 1 || a.stride(0) != b.stride(0) ||
      a.element_size() != b.element_size())
    return false;
  const auto size = static_cast<std::int64_t>(a.element_size());
  const auto row = a.stride(0) * size;
  const auto footprint = [&](const at::Tensor& t) {
    std::int64_t last = 0;
    for (std::int64_t k = 1; k < t.dim(); ++k) {
      if (t.stride(k) < 0)
        return row + 1;
      last += (t.size(k) - 1) * t.stride(k);
    }
    return (last + 1) * size;
  };
  const auto fa = footprint(a), fb = footprint(b);
  if (row <= 0 || fa > row || fb > row)
    return false;
  const auto shift = (static_cast<std::int64_t>(b_begin - a_begin) % row + row) % row;
  return shift >= fa && shift + fb <= row;
}
} // namespace

bool share_memory(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0 || !a.has_storage() ||
      !b.has_storage() || a.device() != b.device())
    return false;
  // The bytes each spans, from its first element to the end of its last.
  const auto span = [](const at::Tensor& t) {
    std::int64_t last = 0;
    for (std::int64_t k = 0; k < t.dim(); ++k)
      last += (t.size(k) - 1) * t.stride(k);
    const auto begin = reinterpret_cast<std::uintptr_t>(t.const_data_ptr());
    return std::pair{begin, begin + static_cast<std::uintptr_t>(last + 1) * t.element_size()};
  };
  const auto [a_begin, a_end] = span(a);
  const auto [b_begin, b_end] = span(b);
  if (a_end <= b_begin || b_end <= a_begin)
    return false;
  // Two dense tensors hold every byte of their spans. (One dense tensor may sit in the gaps
  // of a strided one: element by element then.)
  if (a.is_non_overlapping_and_dense() && b.is_non_overlapping_and_dense())
    return true;
  if (rows_apart(a, b, a_begin, b_begin))
    return false;
  // Spans that meet, a strided view among them: element by element. The last element of `b`
  // that starts before one of `a` ends meets it if it ends after that one starts (the
  // elements of `b` all have one size).
  const auto base = std::min(a_begin, b_begin);
  const auto starts_a = element_starts(a, static_cast<std::int64_t>(a_begin - base));
  const auto starts_b = element_starts(b, static_cast<std::int64_t>(b_begin - base));
  const auto size_a = static_cast<std::int64_t>(a.element_size());
  const auto size_b = static_cast<std::int64_t>(b.element_size());
  const auto before = at::searchsorted(starts_b, starts_a + size_a) - 1;
  const auto last_b = starts_b.index({before.clamp_min(0)});
  return ((before >= 0) & (last_b + size_b > starts_a)).any().item<bool>();
}

void check_destination(const at::Tensor& t, const std::string& label) {
  if (t.is_neg() || t.is_conj() || t._is_zerotensor())
    throw FatalError(label + " is a lazy view (" +
                     (t._is_zerotensor() ? "a zero tensor without memory"
                                         : "its memory holds its values negated or conjugated") +
                     "): the results would be written as plain values; pass a tensor that "
                     "holds its own values, e.g. a new one from torch.empty_like");
  if (t.requires_grad() && at::GradMode::is_enabled())
    throw FatalError(label + " requires grad: results are written into it in place, outside "
                             "autograd (as torch's out= arguments are); pass one that does not, or "
                             "call under torch.no_grad()");
  if (at::has_internal_overlap(t) == at::MemOverlap::Yes)
    throw FatalError(label + " has elements that share memory (an expanded or broadcast "
                             "view): pass a tensor whose elements are distinct, e.g. a slice of a "
                             "contiguous one");
}

std::vector<at::Tensor> writable(BoundCall& call, c10::ScalarType dtype, const Destinations& into) {
  std::vector<at::Tensor> targets;
  for (std::size_t i = 0; i < call.slots().size(); ++i) {
    const auto& slot = call.slots()[i];
    const auto& t = into.tensors[i];
    const auto& label = into.labels[i];
    const bool rows = slot.gather == Gather::rows;
    auto expected = slot.shape;
    if (rows && call.batched)
      expected.insert(expected.begin(), call.batch);
    if (!t.defined())
      throw FatalError(label + " is an undefined tensor; pass one of shape " +
                       shape_text(expected));
    // A block the same for every row may also be given with the batch axis, as Python's
    // jacobian() returns it: each row gets the one block.
    auto per_row = expected;
    per_row.insert(per_row.begin(), call.batch);
    const bool spread =
        slot.gather == Gather::shared && call.batched && t.sizes() == c10::IntArrayRef(per_row);
    if (!spread && t.sizes() != c10::IntArrayRef(expected))
      throw FatalError(label + " has shape " + shape_text(t.sizes()) + ", but this call's " +
                       "result has shape " + shape_text(expected) +
                       (slot.gather == Gather::shared && call.batched
                            ? " (the same for every row: or " + shape_text(per_row) + ")"
                            : std::string()) +
                       ": pass a tensor of that shape (any strides, on any device)");
    if (t.scalar_type() != dtype)
      throw FatalError(label + " has dtype " + c10::toString(t.scalar_type()) +
                       ", but the model "
                       "computes " +
                       c10::toString(dtype) + ": pass a " + c10::toString(dtype) + " tensor");
    check_destination(t, label);
    for (std::size_t j = 0; j < i; ++j)
      if (share_memory(t, into.tensors[j]))
        throw FatalError(label + " and " + into.labels[j] +
                         " share memory: the results would overwrite each other; pass tensors "
                         "that do not overlap");
    targets.push_back(rows && !call.batched ? t.unsqueeze(0) : t);
  }
  // Autograd sees the writes to come: a tensor it saved for backward and that this call
  // overwrites makes backward() raise torch's in-place error (tensors made in inference
  // mode have no version to bump).
  for (const auto& t : targets)
    if (!t.is_inference())
      t.unsafeGetTensorImpl()->bump_version();
  // An input the results overwrite is read from a copy: the results are those of the inputs
  // as given.
  for (auto* tensors : {&call.inputs, &call.params, &call.extras})
    for (auto& input : *tensors)
      for (const auto& t : into.tensors)
        if (share_memory(input, t)) {
          input = input.clone();
          break;
        }
  return targets;
}

void copy_into(const std::vector<at::Tensor>& into, const BoundCall& call,
               const std::vector<at::Tensor>& results) {
  for (std::size_t i = 0; i < into.size(); ++i) {
    const bool unbatched_rows = call.slots()[i].gather == Gather::rows && !call.batched;
    copy_rows(into[i], unbatched_rows ? results[i].unsqueeze(0) : results[i]);
  }
}

} // namespace neml2::detail

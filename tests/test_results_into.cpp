// Results into the caller's tensors: equal to the allocating calls, bit for bit, for every
// operation, policy and chunk size, through strided and offset views; refused cleanly when
// a tensor does not fit, with the caller's data untouched.

#include <set>
#include <thread>

#include <c10/core/CPUAllocator.h>
#include <c10/util/ScopeExit.h>

#include "graph/graph_calls.hpp"
#include "graph/recycling.hpp"
#include "internals.hpp" // the library's private parts
#include "model_checks.hpp"

using namespace neml2;
using test::contains;

namespace {

// A tensor like `t` whose memory is neither contiguous nor at offset 0: the transpose of a
// slice of a larger buffer, filled with a sentinel.
at::Tensor strided_like(const at::Tensor& t, double fill = 42) {
  if (t.dim() < 2)
    return at::full({t.numel() + 3}, fill, t.options()).narrow(0, 3, t.numel()).view(t.sizes());
  auto sizes = t.sizes().vec();
  std::swap(sizes[0], sizes[1]);
  sizes[0] += 2;
  return at::full(sizes, fill, t.options()).narrow(0, 2, t.size(1)).transpose(0, 1);
}

// Each tensor replaced by make(tensor), the same keys.
template <class Make>
TensorMap each(const TensorMap& tensors, Make make) {
  TensorMap out;
  for (const auto& [name, t] : tensors)
    out[name] = make(t);
  return out;
}

template <class Make>
VariablePairJacobian each(const VariablePairJacobian& blocks, Make make) {
  VariablePairJacobian out;
  for (const auto& [o, row] : blocks)
    out[o] = each(row, make);
  return out;
}

// Strided tensors of the same shapes (see strided_like).
template <class Tensors>
Tensors like(const Tensors& results) {
  return each(results, [](const at::Tensor& t) { return strided_like(t); });
}

// Dense tensors of the same shapes, filled with a sentinel: results may land in them.
template <class Tensors>
Tensors dense_like(const Tensors& results) {
  return each(results, [](const at::Tensor& t) {
    return at::full_like(t, 42, at::MemoryFormat::Contiguous);
  });
}

std::size_t landed() {
  return neml2::detail::Landing::landed_on_this_thread();
}

neml2::detail::Places places(std::initializer_list<at::Tensor> tensors) {
  neml2::detail::Places at;
  for (const auto& t : tensors)
    at.push_back(neml2::detail::place_of(t));
  return at;
}

// An operation's values and blocks against the same written into strided tensors by
// `into(values, blocks)`.
template <class Into>
void check_blocks_into(const TensorMap& values, const VariablePairJacobian& blocks, Into&& into) {
  auto values_into = like(values);
  auto blocks_into = like(blocks);
  into(values_into, blocks_into);
  CHECK(test::identical(values_into, values));
  for (const auto& [o, row] : blocks)
    CHECK(test::identical(blocks_into.at(o), row));
}

// Every operation into strided tensors, twice (the second call on other inputs into the
// same tensors), against the allocating calls.
template <class Model>
void check_every_operation(const Model& m, const test::Reference& ref) {
  for (const auto* c : {"b7", "b33"}) {
    CAPTURE(c);
    const TensorMap in = ref.group(std::string(c) + "/in");
    const auto other = [&] { // other values, same shapes
      TensorMap scaled;
      for (const auto& [name, x] : in)
        scaled[name] = 2 * x + 1e-3;
      return scaled;
    }();
    const auto tangents = ref.group(std::string(c) + "/tangent");
    const auto cotangents = ref.group(std::string(c) + "/cot");

    auto outputs = like(m.forward(in));
    for (const TensorMap* x : {&in, &other}) {
      m.forward_into(*x, outputs);
      CHECK(test::identical(outputs, m.forward(*x)));
    }
    const auto [values, output_tangents] = m.jvp(in, tangents);
    auto values_into = like(values), tangents_into = like(output_tangents);
    m.jvp_into(in, tangents, values_into, tangents_into);
    CHECK(test::identical(values_into, values));
    CHECK(test::identical(tangents_into, output_tangents));

    for (const TensorMap* x : {&in, &other}) {
      const auto [out, J] = m.jacobian(*x);
      check_blocks_into(out, J, [&](auto& v, auto& b) { m.jacobian_into(*x, v, b); });
    }
    const auto [out, P] = m.param_jacobian(in);
    check_blocks_into(out, P, [&](auto& v, auto& b) { m.param_jacobian_into(in, v, b); });

    auto grads = like(m.param_vjp(in, cotangents));
    m.param_vjp_into(in, cotangents, grads);
    CHECK(test::identical(grads, m.param_vjp(in, cotangents)));
  }
}

} // namespace

TEST_CASE("into the caller's tensors: every operation, policy and chunk size") {
  const auto stub = test::stub("elasticity_params", "elasticity");
  const test::Reference ref("elasticity_params");
  for (std::int64_t rows : {0, 1, 3, 7}) {
    CAPTURE(rows);
    check_every_operation(load_model(stub, "elasticity", SyncChunking{.batch_size = rows}), ref);
    if (rows > 0)
      check_every_operation(load_model(stub, "elasticity",
                                       GreedyPriorityCapacity{.devices = {"cpu"},
                                                              .batch_sizes = {rows},
                                                              .capacities = {2 * rows}}),
                            ref);
  }
  // A batched parameter: its gradient is per row.
  auto m = load_model(stub, "elasticity", SyncChunking{.batch_size = 3});
  for (const auto& [name, value] : ref.group("pbatch/param"))
    m.set_parameter(name, value);
  const auto in = ref.group("pbatch/in"), cot = ref.group("pbatch/cot");
  auto grads = like(m.param_vjp(in, cot));
  m.param_vjp_into(in, cot, grads);
  CHECK(test::identical(grads, m.param_vjp(in, cot)));
}

TEST_CASE("a call without a batch axis writes unbatched tensors; batch 0 writes nothing") {
  const test::Reference ref("elasticity");
  const auto m = load_model(test::stub("elasticity", "elasticity"), "elasticity",
                            SyncChunking{.batch_size = 2});
  const auto strain = ref["b1/in/strain"][0];
  auto stress = at::empty({6}, at::kDouble);
  m.forward_into({{"strain", strain}}, {{"stress", stress}});
  CHECK(test::identical(stress, m.forward({{"strain", strain}}).at("stress")));
  auto empty = at::empty({0, 6}, at::kDouble);
  m.forward_into({{"strain", at::empty({0, 6}, at::kDouble)}}, {{"stress", empty}});
  CHECK(empty.size(0) == 0);
}

TEST_CASE("a tensor that does not fit is refused before anything runs") {
  const test::Reference ref("elasticity");
  const auto m = load_model(test::stub("elasticity", "elasticity"), "elasticity",
                            SyncChunking{.batch_size = 3});
  const auto in = ref.group("b7/in");
  const auto [out, J] = m.jacobian(in);
  const auto refused = [&](const at::Tensor& stress, const at::Tensor& block) {
    auto good = strided_like(out.at("stress"));
    const auto before = good.clone();
    const auto message = test::fatal_message([&] {
      m.jacobian_into(in, {{"stress", stress.defined() ? stress : good}},
                      {{"stress", {{"strain", block.defined() ? block : good}}}});
    });
    CHECK(test::identical(good, before)); // untouched
    return message;
  };
  const auto block = J.at("stress").at("strain");
  CHECK(contains(refused(at::empty({7, 5}, at::kDouble), block),
                 "output 'stress' has shape [7, 5], but this call's result has shape [7, 6]"));
  CHECK(contains(refused(at::empty({7, 6}, at::kFloat), block),
                 "output 'stress' has dtype Float, but the model computes Double"));
  CHECK(contains(refused(at::empty({1, 6}, at::kDouble).expand({7, 6}), block),
                 "output 'stress' has elements that share memory"));
  CHECK(contains(refused({}, at::empty({7, 7}, at::kDouble)),
                 "block ['stress']['strain'] has shape [7, 7]"));
  // Lazy views would be written as plain values, read back negated or as zeros.
  CHECK(contains(refused(at::_neg_view(at::empty({7, 6}, at::kDouble)), block),
                 "output 'stress' is a lazy view (its memory holds its values negated"));
  CHECK(contains(refused(at::_efficientzerotensor({7, 6}, at::kDouble), block),
                 "output 'stress' is a lazy view (a zero tensor without memory)"));
  // Written in place outside autograd: refused where autograd would track it.
  CHECK(contains(refused(at::empty({7, 6}, at::kDouble).requires_grad_(), block),
                 "output 'stress' requires grad: results are written into it in place"));
  CHECK(contains(test::fatal_message([&] { m.forward_into(in, {}); }),
                 "no tensor given for output 'stress'"));
  CHECK(contains(test::fatal_message([&] {
                   m.forward_into(in, {{"stress", at::empty({7, 6}, at::kDouble)},
                                       {"strss", at::empty({7, 6}, at::kDouble)}});
                 }),
                 "output 'strss' is not a result of this call; it has: stress"));
  CHECK(contains(test::fatal_message([&] {
                   m.jacobian_into(in, {{"stress", at::empty({7, 6}, at::kDouble)}}, {});
                 }),
                 "no tensor given for the block ['stress']['strain']"));
  // Still usable.
  auto stress = at::empty({7, 6}, at::kDouble);
  m.forward_into(in, {{"stress", stress}});
  test::check_close(stress, ref["b7/out/stress"], "stress after errors");
}

TEST_CASE("a prepared call: names bound once, tensors in order, the same results") {
  const test::Reference ref("rates");
  for (std::int64_t rows : {0, 5}) {
    CAPTURE(rows);
    const auto m = load_model(test::stub("rates", "eq"), "eq", SyncChunking{.batch_size = rows});
    const auto in = ref.group("b33/in");
    const auto expected = m.forward(in);
    // The model's own order, and the reverse.
    auto names = m.input_names();
    for (int pass = 0; pass < 2; ++pass, std::reverse(names.begin(), names.end())) {
      const auto call = m.prepare(names);
      std::vector<at::Tensor> tensors;
      for (const auto& n : names)
        tensors.push_back(in.at(n));
      const auto outputs = call.forward(tensors);
      REQUIRE(outputs.size() == m.output_names().size());
      std::vector<at::Tensor> into;
      for (std::size_t o = 0; o < outputs.size(); ++o) {
        CHECK(test::identical(outputs[o], expected.at(m.output_names()[o])));
        into.push_back(strided_like(outputs[o]));
      }
      call.forward_into(tensors, into);
      for (std::size_t o = 0; o < outputs.size(); ++o)
        CHECK(test::identical(into[o], outputs[o]));
    }
  }
  const auto m = load_model(test::stub("rates", "eq"), "eq");
  CHECK(m.prepare().input_names() == m.input_names());
  CHECK(contains(test::fatal_message([&] { return m.prepare({"a"}); }),
                 "1 names given, but the model takes 8 inputs"));
  auto names = m.input_names();
  names[1] = names[0];
  CHECK(contains(test::fatal_message([&] { return m.prepare(names); }), "named twice"));
  names[1] = "z";
  CHECK(contains(test::fatal_message([&] { return m.prepare(names); }),
                 "'z' is not an input of this model"));
  const auto call = m.prepare();
  const auto one = at::zeros({2}, at::kDouble);
  CHECK(contains(test::fatal_message([&] { return call.forward(std::vector<at::Tensor>{one}); }),
                 "1 input tensors given, but this call was prepared for 8"));
  const std::vector<at::Tensor> eight(8, one);
  CHECK(
      contains(test::fatal_message([&] { call.forward_into(eight, std::vector<at::Tensor>{one}); }),
               "1 output tensors given, but the model has 3 outputs"));
}

namespace {
// Inputs of scalar_backward_euler_params: `rows` rows, one step from x = 0.5.
TensorMap backward_euler_inputs(std::int64_t rows) {
  const auto filled = [&](double v) { return at::full({rows}, v, at::kDouble); };
  return {{"a", at::linspace(0.3, 2.0, rows, at::kDouble)},
          {"x", filled(0.5)},
          {"x~1", filled(0.5)},
          {"t", filled(0.1)},
          {"t~1", filled(0.0)}};
}

} // namespace

TEST_CASE("into the caller's tensors through a composed (implicit) model") {
  auto m = load_model(test::stub("scalar_backward_euler_params", "model"), "model",
                      SyncChunking{.batch_size = 2});
  const auto in = backward_euler_inputs(5);
  const auto [out, J] = m.jacobian(in);
  check_blocks_into(out, J, [&](auto& v, auto& b) { m.jacobian_into(in, v, b); });
  const auto [values, P] = m.param_jacobian(in);
  REQUIRE_FALSE(P.empty());
  check_blocks_into(values, P, [&](auto& v, auto& b) { m.param_jacobian_into(in, v, b); });
}

// ------------------------------------------------------------------ results in place

TEST_CASE("a landing hands its targets to this thread's allocations of their size, once each") {
  const auto target = at::empty({4, 6}, at::kDouble);
  const auto other = at::empty({2, 6}, at::kDouble);
  const auto before = landed();
  {
    neml2::detail::Landing landing(places({target, other}), {});
    std::thread([&] { // another thread allocates as before
      CHECK(at::empty({4, 6}, at::kDouble).data_ptr() != target.data_ptr());
    })
        .join();
    const auto a = at::empty({4, 6}, at::kDouble);
    const auto b = at::empty({4, 6}, at::kDouble);
    const auto c = at::empty({2, 6}, at::kDouble);
    CHECK(a.data_ptr() == target.data_ptr());
    CHECK(b.data_ptr() != target.data_ptr()); // each target once
    CHECK(c.data_ptr() == other.data_ptr());
    std::vector<at::Tensor> results = {a, c};
    landing.settle(results);
    CHECK(results[0].data_ptr() == target.data_ptr()); // exactly its own: stays
    CHECK(results[1].data_ptr() == other.data_ptr());
    CHECK(at::empty({2, 6}, at::kDouble).data_ptr() != other.data_ptr()); // settled: over
  }
  CHECK(landed() == before + 2);
}

TEST_CASE("a landing refuses targets it must not write, and settles results out of others' "
          "targets") {
  const auto t0 = at::empty({4, 6}, at::kDouble), t1 = at::empty({4, 6}, at::kDouble);
  SUBCASE("a target the run reads, one that overlaps an earlier target, or misaligned") {
    const auto buffer = at::empty({25}, at::kDouble);
    const std::vector<at::Tensor> reads = {t1};
    auto targets = places({t0, t0, t1});
    CHECK(neml2::detail::place_of(buffer.narrow(0, 1, 24)).data == nullptr); // misaligned
    targets.push_back({static_cast<double*>(buffer.data_ptr()) + 1, 24 * sizeof(double)});
    neml2::detail::Landing landing(targets, {&reads});
    CHECK(at::empty({4, 6}, at::kDouble).data_ptr() == t0.data_ptr());
    for (int i = 0; i < 3; ++i) { // the second t0, t1 (read) and the misaligned slice
      const auto x = at::empty({4, 6}, at::kDouble);
      CHECK(x.data_ptr() != t0.data_ptr());
      CHECK(x.data_ptr() != t1.data_ptr());
      CHECK(x.data_ptr() != buffer.narrow(0, 1, 24).data_ptr());
    }
  }
  SUBCASE("results in each other's targets are copied out before either is written") {
    neml2::detail::Landing landing(places({t0, t1}), {});
    auto x = at::empty({4, 6}, at::kDouble), y = at::empty({4, 6}, at::kDouble);
    REQUIRE(x.data_ptr() == t0.data_ptr());
    REQUIRE(y.data_ptr() == t1.data_ptr());
    x.fill_(1);
    y.fill_(2);
    std::vector<at::Tensor> results = {y, x.narrow(0, 1, 2)}; // swapped; a view
    landing.settle(results);
    for (const auto& r : results) {
      CHECK(r.data_ptr() != t0.data_ptr());
      CHECK(r.data_ptr() != t1.data_ptr());
    }
    t0.fill_(-1); // what writing the results into their targets would do
    t1.fill_(-1);
    CHECK(at::equal(results[0], at::full({4, 6}, 2.0, at::kDouble)));
    CHECK(at::equal(results[1], at::full({2, 6}, 1.0, at::kDouble)));
  }
}

TEST_CASE("a landing serves torch's raw allocator interface: a target is never freed") {
  auto target = at::full({4, 6}, 7.0, at::kDouble);
  auto* allocator = c10::GetCPUAllocator();
  REQUIRE(static_cast<bool>(allocator->raw_deleter()));
  {
    neml2::detail::Landing landing(places({target}), {});
    // raw_allocate needs the context to be the data (it asserted before); raw_deallocate
    // frees through raw_deleter(), which must leave a target alone (ASan: a bad free).
    void* raw = allocator->raw_allocate(target.nbytes());
    CHECK(raw == target.data_ptr());
    allocator->raw_deallocate(raw);
    void* other = allocator->raw_allocate(target.nbytes()); // the target is taken: memory
    CHECK(other != target.data_ptr());
    static_cast<double*>(other)[0] = 1;
    allocator->raw_deallocate(other);
  }
  CHECK(at::equal(target, at::full({4, 6}, 7.0, at::kDouble)));
  // And as a tensor's storage: the DataPtr's deleter lets the target go, once.
  {
    neml2::detail::Landing landing(places({target}), {});
    auto landed_tensor = at::empty({4, 6}, at::kDouble);
    REQUIRE(landed_tensor.data_ptr() == target.data_ptr());
    CHECK(allocator->is_simple_data_ptr(landed_tensor.storage().data_ptr()));
  }
  void* after = allocator->raw_allocate(64); // the allocator beneath, as before
  allocator->raw_deallocate(after);
}

// ------------------------------------------------------------------ small blocks recycled

using neml2::detail::Recycling;

namespace {
at::Tensor doubles(std::int64_t count) {
  return at::empty({count}, at::kDouble);
}

std::size_t reused() {
  return Recycling::reused_on_this_thread();
}
} // namespace

TEST_CASE("a thread that recycles takes back the small blocks it freed; nothing else does") {
  auto* allocator = c10::GetCPUAllocator();
  std::thread([&] { // a thread of its own: nothing kept before
    {
      const Recycling scope;
      void* freed = doubles(100).data_ptr(); // 800 bytes: a block of 1024
      const auto again = doubles(128);       // 1024 bytes: the same block, all of it usable
      CHECK(again.data_ptr() == freed);
      again.fill_(3); // (ASan: within the block)
      CHECK(reused() == 1);
      CHECK(doubles(129).data_ptr() != freed);                    // a block of the next size
      const auto large = Recycling::largest / sizeof(double) + 1; // as before
      static_cast<void>(doubles(large));
      static_cast<void>(doubles(large));
      CHECK(reused() == 1);
      std::thread([] { // another thread allocates as before
        static_cast<void>(doubles(100));
        static_cast<void>(doubles(100));
        CHECK(reused() == 0);
      })
          .join();
      // torch's raw interface: the raw deleter knows a block (ASan: a bad free otherwise).
      void* raw = allocator->raw_allocate(200);
      allocator->raw_deallocate(raw);
      CHECK(allocator->raw_allocate(256) == raw);
      allocator->raw_deallocate(raw);
      CHECK(reused() == 2);
    }
    static_cast<void>(doubles(100)); // out of the scope: as before
    CHECK(reused() == 2);
  })
      .join();
  std::thread([] { // a block freed out of the scope is kept, up to Recycling::kept bytes
    const auto count = 2 * Recycling::kept / Recycling::largest;
    std::vector<at::Tensor> blocks;
    {
      const Recycling scope;
      for (std::size_t i = 0; i < count; ++i)
        blocks.push_back(doubles(Recycling::largest / sizeof(double)));
    }
    blocks.clear();
    const Recycling scope;
    for (std::size_t i = 0; i < count; ++i)
      blocks.push_back(doubles(Recycling::largest / sizeof(double)));
    CHECK(reused() == Recycling::kept / Recycling::largest);
  })
      .join();
}

TEST_CASE("a CPU graph call recycles the small blocks its earlier calls freed") {
  std::thread([] { // a thread of its own: nothing kept before
    const auto m = load_model(test::stub("scalar_backward_euler_params", "model"), "model");
    const auto in = backward_euler_inputs(3);
    const auto [out, J] = m.jacobian(in);
    CHECK(reused() > 0); // the Newton iterations' later graph calls
    const auto before = reused();
    const auto [again, J_again] = m.jacobian(in);
    CHECK(reused() > before);
    for (const auto& [name, value] : out)
      CHECK(at::equal(value, again.at(name)));
  })
      .join();
}

TEST_CASE("a call of a model with a solve recycles between its graph calls; an explicit one not") {
  // Between two graph calls (where the observer runs): an allocation freed, then one of the
  // same size. Recycled when the chain's scope covers it; as before in an explicit model.
  const auto between_calls = [](const auto& m, const TensorMap& in) {
    std::vector<bool> recycled;
    neml2::detail::observe_graph_calls([&](const std::string&, std::int64_t) {
      const auto before = reused();
      static_cast<void>(doubles(100));
      static_cast<void>(doubles(100));
      recycled.push_back(reused() > before);
    });
    const auto stop = c10::make_scope_exit([] { neml2::detail::observe_graph_calls({}); });
    static_cast<void>(m.forward(in));
    return recycled;
  };
  std::thread([&] { // a thread of its own: nothing kept before
    const auto implicit = load_model(test::stub("scalar_backward_euler_params", "model"), "model");
    const auto calls = between_calls(implicit, backward_euler_inputs(3));
    REQUIRE(calls.size() >= 2); // the Newton iterations
    CHECK(std::all_of(calls.begin(), calls.end(), [](bool r) { return r; }));
    const auto explicit_model = load_model(test::stub("elasticity", "elasticity"), "elasticity");
    const auto plain = between_calls(explicit_model, test::Reference("elasticity").group("b33/in"));
    REQUIRE(plain.size() == 1);
    CHECK_FALSE(plain.front());
  })
      .join();
}

TEST_CASE("what a graph-call observer allocates and keeps, or a call it makes, is never the "
          "caller's memory") {
  const auto stub = test::stub("elasticity_params", "elasticity");
  const test::Reference ref("elasticity_params");
  const TensorMap in = ref.group("b33/in");
  const auto expected = ref.group("b33/out");
  const auto m = load_model(stub, "elasticity", SyncChunking{});
  const auto nested = load_model(stub, "elasticity", SyncChunking{});
  std::vector<at::Tensor> kept;
  bool inside = false;
  neml2::detail::observe_graph_calls([&](const std::string&, std::int64_t rows) {
    if (rows != 33 || std::exchange(inside, true))
      return;
    // The size of the call's stress, kept past the call; and a whole call of this thread.
    kept.push_back(at::empty({rows, 6}, at::kDouble).fill_(-1));
    kept.push_back(nested.forward(in).at("stress"));
    inside = false;
  });
  const auto stop = c10::make_scope_exit([] { neml2::detail::observe_graph_calls({}); });
  auto outputs = dense_like(expected);
  const auto before = landed();
  m.forward_into(in, outputs);
  REQUIRE(kept.size() == 2);
  CHECK(landed() - before >= 1); // the call's own result still lands in place
  const auto& stress = outputs.at("stress");
  for (const auto& k : kept) {
    const auto* a = static_cast<const char*>(k.data_ptr());
    const auto* b = static_cast<const char*>(stress.data_ptr());
    CHECK((a + k.nbytes() <= b || b + stress.nbytes() <= a)); // no shared memory
  }
  test::check_close(outputs, expected, "forward_into", 1e-12);
  CHECK(at::equal(kept[0], at::full({33, 6}, -1.0, at::kDouble)));
  test::check_close(kept[1], expected.at("stress"), "nested forward", 1e-12);
}

TEST_CASE("results land in the caller's dense tensors and in kept memory: every operation, "
          "the same values") {
  const auto stub = test::stub("elasticity_params", "elasticity");
  const test::Reference ref("elasticity_params");
  const Session session(
      std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(stub, "elasticity"))),
      "cpu");
  const TensorMap in = ref.group("b33/in"); // 33 rows
  const auto tangents = ref.group("b33/tangent"), cotangents = ref.group("b33/cot");
  // chunk rows -> graph calls whose results can land: every chunk, the last of 1 row too
  // (the graph runs one row unpadded: Graph::probe_one_row).
  for (const auto& [rows, chunks] : {std::pair{0, 1}, {4, 9}, {16, 3}}) {
    CAPTURE(rows);
    const auto m = load_model(stub, "elasticity", SyncChunking{.batch_size = rows, .cpu_lanes = 1});
    const auto expected = session.forward(in);
    test::check_close(expected, ref.group("b33/out"), "forward", 1e-12);

    auto outputs = dense_like(expected);
    auto before = landed();
    m.forward_into(in, outputs);
    CHECK(landed() - before == static_cast<std::size_t>(chunks));
    CHECK(test::identical(outputs, expected));
    before = landed();
    const auto allocated = m.forward(in); // chunked: into kept memory; whole: the graph's own
    CHECK(landed() - before == static_cast<std::size_t>(rows == 0 ? 0 : chunks));
    CHECK(test::identical(allocated, expected));

    const auto [out, J] = session.jacobian(in);
    auto values = dense_like(out);
    auto blocks = dense_like(J);
    before = landed();
    m.jacobian_into(in, values, blocks);
    CHECK(landed() > before);
    CHECK(test::identical(values, out));
    for (const auto& [o, row] : J)
      CHECK(test::identical(blocks.at(o), row));

    const auto [jvp_out, jvp_tangents] = session.jvp(in, tangents);
    auto jvp_values = dense_like(jvp_out), jvp_into = dense_like(jvp_tangents);
    m.jvp_into(in, tangents, jvp_values, jvp_into);
    CHECK(test::identical(jvp_values, jvp_out));
    CHECK(test::identical(jvp_into, jvp_tangents));

    const auto [p_out, P] = session.param_jacobian(in);
    auto p_values = dense_like(p_out);
    auto p_blocks = dense_like(P);
    m.param_jacobian_into(in, p_values, p_blocks);
    CHECK(test::identical(p_values, p_out));
    for (const auto& [o, row] : P)
      CHECK(test::identical(p_blocks.at(o), row));

    auto grads = dense_like(session.param_vjp(in, cotangents));
    m.param_vjp_into(in, cotangents, grads); // summed over chunks: in another order
    test::check_close(grads, session.param_vjp(in, cotangents), "param_vjp", 1e-13);
  }
}

// A tensor over `data` (no storage of its own: torch's from_blob), shape `sizes`, strides
// `strides`.
at::Tensor over(double* data, at::IntArrayRef sizes, at::IntArrayRef strides) {
  return at::from_blob(data, sizes, strides, at::kDouble);
}

TEST_CASE("memory shared through separate storages (tensors made from one pointer) is "
          "judged by its bytes: inputs are read as given, destinations that meet are refused, "
          "interleaved ones that do not are written") {
  const auto stub = test::stub("elasticity", "elasticity");
  // 33 rows in chunks; 100000 rows: a whole-batch CPU call, run in pieces.
  for (const std::int64_t B : {33, 100000}) {
    CAPTURE(B);
    const auto strain = at::rand({B, 6}, at::kDouble).mul(1e-3);
    const auto chunk = B == 33 ? 5 : 0;
    const auto m = load_model(stub, "elasticity", SyncChunking{.batch_size = chunk});
    const auto pool = load_model(stub, "elasticity",
                                 GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {16}});
    const auto expected = m.forward({{"strain", strain}}).at("stress");
    for (const AnyDispatchedModel* model : {static_cast<const AnyDispatchedModel*>(&m),
                                            static_cast<const AnyDispatchedModel*>(&pool)}) {
      // Rows shifted by one row in one buffer, either way, each view its own storage.
      for (const std::int64_t shift : {1, -1}) {
        CAPTURE(shift);
        std::vector<double> buffer(static_cast<std::size_t>((B + 1) * 6));
        const auto input = over(buffer.data() + (shift > 0 ? 0 : 6), {B, 6}, {6, 1});
        const auto output = over(buffer.data() + (shift > 0 ? 6 : 0), {B, 6}, {6, 1});
        REQUIRE_FALSE(input.storage().is_alias_of(output.storage()));
        input.copy_(strain);
        model->forward_into({{"strain", input}}, {{"stress", output}});
        CHECK(test::identical(output, expected));
      }
      // Interleaved columns that meet (strided views of one buffer, separate storages).
      std::vector<double> wide(static_cast<std::size_t>(B * 9));
      const auto input = over(wide.data(), {B, 6}, {9, 1});
      input.copy_(strain);
      const auto output = over(wide.data() + 3, {B, 6}, {9, 1});
      model->forward_into({{"strain", input}}, {{"stress", output}});
      CHECK(test::identical(output, expected));
    }
  }
  // Two destinations over one buffer: interleaved and apart (written), or meeting (refused).
  const auto strain = at::rand({33, 6}, at::kDouble);
  const auto tangent = at::rand_like(strain);
  const auto m = load_model(stub, "elasticity", SyncChunking{.batch_size = 5});
  const auto [out, dout] = m.jvp({{"strain", strain}}, {{"strain", tangent}});
  std::vector<double> pair(33 * 12, 7.0);
  m.jvp_into({{"strain", strain}}, {{"strain", tangent}},
             {{"stress", over(pair.data(), {33, 6}, {12, 1})}},
             {{"stress", over(pair.data() + 6, {33, 6}, {12, 1})}});
  CHECK(test::identical(over(pair.data(), {33, 6}, {12, 1}), out.at("stress")));
  CHECK(test::identical(over(pair.data() + 6, {33, 6}, {12, 1}), dout.at("stress")));
  std::fill(pair.begin(), pair.end(), 7.0);
  CHECK(contains(test::fatal_message([&] {
                   m.jvp_into({{"strain", strain}}, {{"strain", tangent}},
                              {{"stress", over(pair.data(), {33, 6}, {12, 1})}},
                              {{"stress", over(pair.data() + 5, {33, 6}, {12, 1})}});
                 }),
                 "tangent of output 'stress' and output 'stress' share memory"));
  CHECK(std::all_of(pair.begin(), pair.end(), [](double x) { return x == 7.0; })); // untouched
  // A dense destination in the gaps of a strided one (rows 1000 values apart): they never
  // meet, though their spans do.
  std::vector<double> sparse(33 * 1000, 7.0);
  m.jvp_into({{"strain", strain}}, {{"strain", tangent}},
             {{"stress", over(sparse.data(), {33, 6}, {1000, 1})}},
             {{"stress", over(sparse.data() + 6, {33, 6}, {6, 1})}});
  CHECK(test::identical(over(sparse.data(), {33, 6}, {1000, 1}), out.at("stress")));
  CHECK(test::identical(over(sparse.data() + 6, {33, 6}, {6, 1}), dout.at("stress")));
  // ... and one that does meet a row of the strided one: refused.
  CHECK(contains(test::fatal_message([&] {
                   m.jvp_into({{"strain", strain}}, {{"strain", tangent}},
                              {{"stress", over(sparse.data(), {33, 6}, {1000, 1})}},
                              {{"stress", over(sparse.data() + 995, {33, 6}, {6, 1})}});
                 }),
                 "share memory"));
  // Rows of one buffer, every other one each: they never meet.
  std::vector<double> rows(66 * 6, 7.0);
  m.jvp_into({{"strain", strain}}, {{"strain", tangent}},
             {{"stress", over(rows.data(), {33, 6}, {12, 1})}},
             {{"stress", over(rows.data() + 6, {33, 6}, {12, 1})}});
  CHECK(test::identical(over(rows.data() + 6, {33, 6}, {12, 1}), dout.at("stress")));
}

TEST_CASE("a call bumps the autograd version of the tensors it writes: backward() through a "
          "tensor it overwrote raises torch's in-place error") {
  const auto m = load_model(test::stub("elasticity", "elasticity"), "elasticity",
                            SyncChunking{.batch_size = 5});
  const auto strain = at::rand({9, 6}, at::kDouble);
  auto stress = at::zeros({9, 6}, at::kDouble);
  const auto before = stress._version();
  m.forward_into({{"strain", strain}}, {{"stress", stress}});
  CHECK(stress._version() > before);
  // A tensor autograd saved (x * y saves y), overwritten by a call: backward refuses.
  const auto x = at::ones({9, 6}, at::kDouble).requires_grad_();
  const auto y = at::zeros({9, 6}, at::kDouble);
  const auto loss = (x * y).sum();
  m.forward_into({{"strain", strain}}, {{"stress", y}});
  CHECK_THROWS_WITH_AS(loss.backward(), doctest::Contains("modified by an inplace operation"),
                       c10::Error);
  // Inference tensors have no version: written all the same.
  at::Tensor inference;
  {
    c10::InferenceMode guard;
    inference = at::zeros({9, 6}, at::kDouble);
  }
  m.forward_into({{"strain", strain}}, {{"stress", inference}});
  CHECK(test::identical(inference, m.forward({{"strain", strain}}).at("stress")));
}

TEST_CASE("an output that is also the input: the call reads what it was given") {
  const test::Reference ref("elasticity");
  const auto m = load_model(test::stub("elasticity", "elasticity"), "elasticity", SyncChunking{});
  const auto strain = ref["b33/in/strain"].clone();
  const auto expected = m.forward({{"strain", strain}}).at("stress");
  m.forward_into({{"strain", strain}}, {{"stress", strain}});
  CHECK(at::equal(strain, expected));
}

TEST_CASE("outputs that overlap an input, shifted or strided, get the results of the inputs as "
          "given; outputs that overlap each other are refused, naming both, nothing written") {
  const test::Reference ref("elasticity");
  const auto stub = test::stub("elasticity", "elasticity");
  const auto strain = ref["b33/in/strain"];
  const std::int64_t B = strain.size(0);
  for (const std::int64_t chunk : {0, 5, 16}) {
    CAPTURE(chunk);
    const auto m = load_model(stub, "elasticity", SyncChunking{.batch_size = chunk});
    const auto pool =
        load_model(stub, "elasticity",
                   GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {chunk ? chunk : B}});
    const auto expected = m.forward({{"strain", strain}}).at("stress");
    for (const AnyDispatchedModel* model : {static_cast<const AnyDispatchedModel*>(&m),
                                            static_cast<const AnyDispatchedModel*>(&pool)}) {
      // Rows shifted by one in one buffer, either way: written in order, the output's row i
      // would overwrite the input's row i + 1 before it is read.
      for (const std::int64_t shift : {1, -1}) {
        CAPTURE(shift);
        auto buffer = at::empty({B + 1, 6}, at::kDouble);
        const auto input = buffer.narrow(0, shift > 0 ? 0 : 1, B);
        const auto output = buffer.narrow(0, shift > 0 ? 1 : 0, B);
        input.copy_(strain);
        model->forward_into({{"strain", input}}, {{"stress", output}});
        CHECK(test::identical(output, expected));
      }
      // Interleaved columns of one buffer (strided views whose ranges meet).
      auto wide = at::empty({B, 9}, at::kDouble);
      wide.narrow(1, 0, 6).copy_(strain);
      model->forward_into({{"strain", wide.narrow(1, 0, 6)}}, {{"stress", wide.narrow(1, 3, 6)}});
      CHECK(test::identical(wide.narrow(1, 3, 6), expected));
    }
    // Two results in one buffer: apart (interleaved, allowed) and overlapping (refused).
    const auto tangent = at::rand_like(strain);
    const auto [out, dout] = m.jvp({{"strain", strain}}, {{"strain", tangent}});
    auto pair = at::full({B, 12}, 7.0, at::kDouble);
    m.jvp_into({{"strain", strain}}, {{"strain", tangent}}, {{"stress", pair.narrow(1, 0, 6)}},
               {{"stress", pair.narrow(1, 6, 6)}});
    CHECK(test::identical(pair.narrow(1, 0, 6), out.at("stress")));
    CHECK(test::identical(pair.narrow(1, 6, 6), dout.at("stress")));
    pair.fill_(7.0);
    CHECK(contains(test::fatal_message([&] {
                     m.jvp_into({{"strain", strain}}, {{"strain", tangent}},
                                {{"stress", pair.narrow(1, 0, 6)}},
                                {{"stress", pair.narrow(1, 5, 6)}});
                   }),
                   "tangent of output 'stress' and output 'stress' share memory"));
    CHECK(at::equal(pair, at::full_like(pair, 7.0))); // untouched
  }
}

TEST_CASE("columns of one record buffer: apart or meeting, judged by the rows' footprints as the "
          "element-by-element check judges them") {
  // share_memory's fast path for views with one row stride (engine/placement.cpp), against
  // the element sets themselves.
  const auto meet = [](const at::Tensor& a, const at::Tensor& b) {
    std::set<const void*> bytes;
    const auto size = static_cast<std::int64_t>(a.element_size());
    const auto mark = [&](const at::Tensor& t, bool check) {
      for (std::int64_t e = 0; e < t.numel(); ++e) {
        std::int64_t offset = 0, rest = e;
        for (std::int64_t k = t.dim() - 1; k >= 0; --k) {
          offset += (rest % t.size(k)) * t.stride(k);
          rest /= t.size(k);
        }
        for (std::int64_t byte = 0; byte < size; ++byte) {
          const auto* p = static_cast<const char*>(t.const_data_ptr()) + offset * size + byte;
          if (check && bytes.count(p))
            return true;
          if (!check)
            bytes.insert(p);
        }
      }
      return false;
    };
    mark(a, false);
    return mark(b, true);
  };
  auto records = at::zeros({5, 13}, at::kDouble);
  const auto column = [&](std::int64_t first, std::int64_t n) {
    return records.narrow(1, first, n);
  };
  const std::vector<std::pair<at::Tensor, at::Tensor>> cases = {
      {column(0, 6), column(6, 6)},  // side by side
      {column(0, 6), column(5, 6)},  // one column shared
      {column(12, 1), column(0, 1)}, // the last column, the first of the next row
      {records.narrow(1, 0, 12).unflatten(1, {6, 2}).select(2, 0),
       records.narrow(1, 0, 12).unflatten(1, {6, 2}).select(2, 1)}, // interleaved components
      {column(0, 13), column(3, 2)},                                // one inside the other
      {records.narrow(0, 1, 4).narrow(1, 0, 2), column(11, 2)}};    // rows shifted: wraps around
  for (std::size_t c = 0; c < cases.size(); ++c) {
    CAPTURE(c);
    const auto& [a, b] = cases[c];
    CHECK(neml2::detail::share_memory(a, b) == meet(a, b));
    CHECK(neml2::detail::share_memory(b, a) == meet(a, b));
  }
}

TEST_CASE("a block the same for every row, given with the batch axis: each row gets it, in "
          "chunks, on lanes and through the asynchronous engine") {
  const auto stub = test::stub("elasticity", "elasticity");
  const test::Reference ref("elasticity");
  const auto in = ref.group("b7/in");
  const auto rows = in.at("strain").size(0);
  const auto expected = load_model(stub, "elasticity").jacobian(in);
  const auto& block = expected.second.at("stress").at("strain");
  REQUIRE(block.dim() == 2); // one (6, 6) block for every row
  const auto check = [&](const AnyDispatchedModel& m) {
    TensorMap out{{"stress", at::full({rows, 6}, 7.0, at::kDouble)}};
    auto J = at::full({rows + 2, 6, 6}, 7.0, at::kDouble).narrow(0, 1, rows); // strided rows
    m.jacobian_into(in, out, {{"stress", {{"strain", J}}}});
    CHECK(at::equal(out.at("stress"), expected.first.at("stress")));
    CHECK(at::equal(J, block.expand({rows, 6, 6})));
  };
  check(load_model(stub, "elasticity"));
  check(load_model(stub, "elasticity", SyncChunking{.batch_size = 3}));
  check(load_model(stub, "elasticity", SyncChunking{.batch_size = 2, .cpu_lanes = 2}));
  check(load_model(
      stub, "elasticity",
      GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {3}, .capacities = {6}}));
  // Another batch is refused, naming both shapes it takes.
  const auto m = load_model(stub, "elasticity");
  TensorMap out{{"stress", at::empty({rows, 6}, at::kDouble)}};
  const auto message = test::fatal_message([&] {
    m.jacobian_into(in, out, {{"stress", {{"strain", at::empty({rows + 1, 6, 6}, at::kDouble)}}}});
  });
  CHECK_MESSAGE(
      contains(message, "(the same for every row: or [" + std::to_string(rows) + ", 6, 6])"),
      message);
}

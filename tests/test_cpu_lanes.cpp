// CPU lanes: a call's chunks (or a whole batch's pieces) run side by side on the calling
// thread and torch's OpenMP team. Results are the same bits on any number of lanes (every
// model of models/, every call), chunks really run at once, a failure on a worker lane
// reaches the caller as it would on one lane, and bad lane counts are refused.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <neml2/detail/testing.hpp> // before_chunk

#include "model_checks.hpp"
#include "reference.hpp"
#include "scalar_model.hpp"
#include "tiled.hpp"

using namespace neml2;
using test::contains;
using test::tiled_to_rows;

namespace {

// The same bits, NaN where NaN.
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && at::equal(at::isnan(a), at::isnan(b)) &&
         at::equal(a.nan_to_num(0, 0, 0), b.nan_to_num(0, 0, 0));
}

// A call's results by name ("forward stress", "jacobian d stress/strain", ...), with the
// converged mask of a per-row failure.
using Results = std::map<std::string, at::Tensor>;

template <class F>
void record(Results& r, const std::string& call, F&& f) {
  try {
    f();
  } catch (const ConvergenceError& e) {
    REQUIRE(e.per_row());
    r[call + " converged"] = e.converged_mask();
    for (const auto& [name, t] : e.outputs())
      r[call + " " + name] = t;
  } catch (const FatalError& e) {
    // An artifact without the call's graphs (neml2-compile writes no derivative of a
    // sub-batched unknown): nothing to compare.
    if (!contains(e.what(), "was compiled without the graphs it needs"))
      throw;
  }
}

Results every_call(const AnyDispatchedModel& m, const TensorMap& in) {
  Results r;
  record(r, "forward", [&] {
    for (const auto& [name, t] : m.forward(in))
      r["forward " + name] = t;
  });
  record(r, "jacobian", [&] {
    const auto [out, J] = m.jacobian(in);
    for (const auto& [name, t] : out)
      r["jacobian " + name] = t;
    for (const auto& [o, row] : J)
      for (const auto& [i, t] : row)
        r["jacobian d " + o + "/" + i] = t;
  });
  record(r, "jvp", [&] {
    TensorMap tangents;
    for (const auto& [name, value] : in)
      tangents.emplace(name,
                       at::sin(at::arange(value.numel(), value.options())).reshape(value.sizes()));
    const auto [out, d] = m.jvp(in, tangents);
    for (const auto& [name, t] : d)
      r["jvp d " + name] = t;
  });
  record(r, "forward_into", [&] {
    TensorMap into;
    for (const auto& [name, t] : r)
      if (name.starts_with("forward ") && name != "forward converged")
        into[name.substr(8)] = at::full_like(t, -7.0);
    m.forward_into(in, into);
    for (const auto& [name, t] : into)
      r["forward_into " + name] = t;
  });
  if (!m.named_parameters().empty()) {
    record(r, "param_jacobian", [&] {
      const auto [out, P] = m.param_jacobian(in);
      for (const auto& [o, row] : P)
        for (const auto& [p, t] : row)
          r["param_jacobian d " + o + "/" + p] = t;
    });
    record(r, "param_vjp", [&] {
      TensorMap cotangents;
      for (const auto& name : m.output_names())
        cotangents.emplace(name, at::ones_like(r.at("forward " + name)));
      for (const auto& [name, t] : m.param_vjp(in, cotangents))
        r["param_vjp " + name] = t;
    });
  }
  return r;
}

// Holds each lane's first chunk until two lanes have started one (30 s at most): either
// lane may otherwise take every chunk before the other starts. On one lane the wait times
// out, and what the test checks after it fails.
struct TwoLanesStarted {
  std::mutex mutex;
  std::condition_variable arrived;
  std::set<std::size_t> lanes;
  void arrive(std::size_t lane) {
    std::unique_lock lock(mutex);
    if (!lanes.insert(lane).second)
      return;
    arrived.notify_all();
    arrived.wait_for(lock, std::chrono::seconds(30), [&] { return lanes.size() >= 2; });
  }
};

struct Case {
  const char* artifact;
  const char* model;
  const char* group; // reference inputs
  std::int64_t rows; // tiled to at least this many: several pieces on 2 and 3 lanes
};

// Every artifact of models/ with reference inputs (scalar_substepping's rows substep).
const std::vector<Case> every_model = {
    {"elasticity", "elasticity", "b33", 20000},
    {"elasticity_params", "elasticity", "b33", 20000},
    {"elasticity_subbatch", "elasticity", "b33", 20000},
    {"rates", "eq", "b33", 20000},
    {"perzyna", "perzyna", "b33", 20000},
    {"scalar_backward_euler", "model", "s1", 300},
    {"scalar_substepping", "model", "sub", 300},
    {"j2_radial_return", "model", "s1", 300},
    {"perzyna_viscoplasticity", "model", "s1", 300},
    {"chaboche_viscoplasticity", "model", "s1", 200},
    {"gtn_viscoplasticity", "model", "s1", 200},
    {"perzyna_gmres", "model", "s1", 200},
    {"perzyna_gmres_bjac", "model", "s1", 200},
    {"perzyna_gmres_chord", "model", "s1", 200},
    {"binned_precipitation", "model", "s1", 200},
    {"binned_dissolution", "model", "s0", 200},
    {"slip_systems", "model", "s1", 100},
    {"grains", "model", "s1", 100},
};

} // namespace

TEST_CASE("every model, every call: the same bits on 1, 2 and 3 lanes, whole and in chunks") {
  for (const auto& c : every_model) {
    const std::string artifact = c.artifact;
    CAPTURE(artifact);
    const test::Reference ref(c.artifact);
    const auto in = tiled_to_rows(ref.group(std::string(c.group) + "/in"), c.rows);
    for (const std::int64_t chunk : {std::int64_t{0}, std::int64_t{37}}) {
      CAPTURE(chunk);
      Results one;
      for (const std::int64_t lanes : {1, 2, 3}) {
        CAPTURE(lanes);
        const auto m = load_model(test::stub(c.artifact, c.model), c.model,
                                  SyncChunking{.batch_size = chunk, .cpu_lanes = lanes});
        const auto r = every_call(m, in);
        if (lanes == 1) {
          one = r;
          continue;
        }
        REQUIRE(r.size() == one.size());
        for (const auto& [name, t] : one) {
          CAPTURE(name);
          REQUIRE(r.count(name));
          CHECK(same_bits(r.at(name), t));
        }
      }
    }
  }
}

TEST_CASE("on two lanes, two chunks run at once; the observer sees each with its lane") {
  const test::Reference ref("j2_radial_return");
  const auto in = tiled_to_rows(ref.group("s1/in"), 100);
  AnyDispatchedModel m = load_model(test::stub("j2_radial_return", "model"), "model",
                                    SyncChunking{.batch_size = 10, .cpu_lanes = 2});
  const auto expected =
      load_model(test::stub("j2_radial_return", "model"), "model", SyncChunking{.cpu_lanes = 1})
          .forward(in);
  TwoLanesStarted started;
  neml2::detail::ModelAccess::before_chunk(m, [&](const ChunkEvent& e) { started.arrive(e.lane); });
  std::set<std::size_t> lanes, indices;
  std::set<std::thread::id> threads;
  m.set_observer([&](const ChunkEvent& e) {
    lanes.insert(e.lane); // one at a time: no lock
    indices.insert(e.index);
    threads.insert(std::this_thread::get_id());
  });
  CHECK(test::identical(m.forward(in), expected));
  CHECK(started.lanes == std::set<std::size_t>{0, 1});
  CHECK(lanes == std::set<std::size_t>{0, 1});
  CHECK(threads.size() == 2);
  CHECK(indices.size() == 10);
}

TEST_CASE("a chunk that fails on a worker lane: its error reaches the caller, the model stays "
          "usable") {
  const test::Reference ref("rates");
  const auto in = tiled_to_rows(ref.group("b33/in"), 400);
  AnyDispatchedModel m =
      load_model(test::stub("rates", "eq"), "eq", SyncChunking{.batch_size = 10, .cpu_lanes = 2});
  const auto expected = m.forward(in);
  std::atomic<int> failed_lane{-1};
  TwoLanesStarted started;
  neml2::detail::ModelAccess::before_chunk(m, [&](const ChunkEvent& e) {
    started.arrive(e.lane);
    if (e.lane == 1 && failed_lane.exchange(1) == -1)
      throw FatalError("chunk " + std::to_string(e.index) + " failed on lane 1");
  });
  const auto message = test::fatal_message([&] { return m.forward(in); });
  CHECK(contains(message, "failed on lane 1"));
  CHECK(failed_lane == 1);
  neml2::detail::ModelAccess::before_chunk(m, {});
  CHECK(test::identical(m.forward(in), expected));

  // Several chunks fail: the lowest one's error, as one lane taking them in order gives.
  neml2::detail::ModelAccess::before_chunk(m, [&](const ChunkEvent& e) {
    if (e.index >= 3)
      throw FatalError("chunk " + std::to_string(e.index) + " failed");
  });
  CHECK(contains(test::fatal_message([&] { return m.forward(in); }), "chunk 3 failed"));
}

TEST_CASE("rows that fail to converge on a worker lane: one ConvergenceError over the batch") {
  // x - x~1 - h a x^2 (x~1 = 0.5, h = 0.1): a = 0.25 is at rest (the old state solves the
  // step), a = 40 needs more Newton steps than a = 2.
  std::vector<double> a(200, 0.25);
  for (std::size_t k = 0; k < a.size(); k += 7)
    a[k] = k % 2 ? 40.0 : 2.0;
  const auto in = test::scalar_inputs(a);
  auto one = load_model(test::stub("scalar_backward_euler", "model"), "model",
                        SyncChunking{.batch_size = 9, .cpu_lanes = 1});
  auto two = load_model(test::stub("scalar_backward_euler", "model"), "model",
                        SyncChunking{.batch_size = 9, .cpu_lanes = 2});
  for (auto* m : {&one, &two}) {
    auto config = m->solver_config();
    config.miters = 4; // the a = 40 rows need more
    m->set_solver_config(config);
  }
  const auto failure = [&](const auto& m) {
    try {
      (void)m.forward(in);
    } catch (const ConvergenceError& e) {
      REQUIRE(e.per_row());
      return std::pair{e.converged_mask(), e.outputs()};
    }
    FAIL("no ConvergenceError");
    return std::pair{at::Tensor(), TensorMap{}};
  };
  const auto [mask_one, out_one] = failure(one);
  const auto [mask_two, out_two] = failure(two);
  CHECK_FALSE(mask_one.all().item<bool>());
  CHECK(mask_one.any().item<bool>());
  CHECK(at::equal(mask_one, mask_two));
  for (const auto& [name, t] : out_one)
    CHECK(same_bits(out_two.at(name), t));
}

TEST_CASE("the interrupt check stops a laned call: no chunk starts after it") {
  const test::Reference ref("rates");
  const auto in = tiled_to_rows(ref.group("b33/in"), 400);
  AnyDispatchedModel m =
      load_model(test::stub("rates", "eq"), "eq", SyncChunking{.batch_size = 4, .cpu_lanes = 2});
  std::atomic<int> chunks{0};
  std::atomic<bool> stopped{false};
  std::atomic<int> after{0};
  // Both lanes start, and the other lane is slow enough that the calling thread takes a
  // second chunk (it asks the check then) before the other has taken them all.
  TwoLanesStarted started;
  neml2::detail::ModelAccess::before_chunk(m, [&](const ChunkEvent& e) {
    started.arrive(e.lane);
    if (e.lane != 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ++chunks;
    if (stopped)
      ++after;
  });
  m.set_interrupt_check([&] {
    stopped = true;
    throw FatalError("interrupted by the host");
  });
  const auto expected =
      load_model(test::stub("rates", "eq"), "eq", SyncChunking{.cpu_lanes = 1}).forward(in);
  TensorMap out;
  for (const auto& [name, t] : expected)
    out[name] = at::full_like(t, std::numeric_limits<double>::quiet_NaN());
  CHECK(contains(test::fatal_message([&] { m.forward_into(in, out); }), "interrupted by the host"));
  CHECK(chunks < 100);
  // The chunks taken before the stop, whole and exact, and nothing after them: no hole.
  for (const auto& [name, t] : out) {
    const auto written = t.isnan().logical_not().reshape({t.size(0), -1}).all(1);
    const auto k = written.sum().item<std::int64_t>();
    CHECK(k % 4 == 0);
    CHECK(written.narrow(0, 0, k).all().item<bool>());
    CHECK(at::equal(t.narrow(0, 0, k), expected.at(name).narrow(0, 0, k)));
  }
  // The other lane takes no chunk once the calling thread has the check's error: those it
  // started while the error was on its way (unwinding takes microseconds) may finish.
  CHECK(after <= 3);
  m.set_interrupt_check({});
  neml2::detail::ModelAccess::before_chunk(m, {});
  CHECK(m.forward(in).at(m.output_names().front()).size(0) == in.begin()->second.size(0));
}

TEST_CASE("an observer on a lane may call models, its own included") {
  const test::Reference ref("elasticity");
  const auto in = tiled_to_rows(ref.group("b33/in"), 200);
  AnyDispatchedModel m = load_model(test::stub("elasticity", "elasticity"), "elasticity",
                                    SyncChunking{.batch_size = 20, .cpu_lanes = 2});
  const auto expected = m.forward(in);
  const auto small = TensorMap{{"strain", in.at("strain").narrow(0, 0, 3)}};
  std::vector<at::Tensor> nested;
  m.set_observer([&](const ChunkEvent& e) {
    if (e.index == 5)
      nested.push_back(m.forward(small).at("stress"));
  });
  CHECK(test::identical(m.forward(in), expected));
  REQUIRE(nested.size() == 1);
  CHECK(at::equal(nested.front(), expected.at("stress").narrow(0, 0, 3)));
}

TEST_CASE("several callers of one laned model: each call exact") {
  const test::Reference ref("j2_radial_return");
  const auto in = tiled_to_rows(ref.group("s1/in"), 300);
  const auto m =
      load_model(test::stub("j2_radial_return", "model"), "model", SyncChunking{.cpu_lanes = 2});
  const auto expected =
      load_model(test::stub("j2_radial_return", "model"), "model", SyncChunking{.cpu_lanes = 1})
          .forward(in);
  std::vector<TensorMap> results(3);
  std::vector<std::thread> threads;
  for (auto& r : results)
    threads.emplace_back([&] {
      for (int i = 0; i < 5; ++i)
        r = m.forward(in);
    });
  for (auto& t : threads)
    t.join();
  for (const auto& r : results)
    CHECK(test::identical(r, expected));
}

TEST_CASE("GreedyPriorityCapacity: a CPU chunk in pieces over the lanes, the same bits") {
  const test::Reference ref("perzyna_viscoplasticity");
  const auto in = tiled_to_rows(ref.group("s1/in"), 500);
  const auto policy = [](std::int64_t lanes) {
    return GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {200}, .cpu_lanes = lanes};
  };
  const auto stub = test::stub("perzyna_viscoplasticity", "model");
  const auto one = every_call(load_model(stub, "model", policy(1)), in);
  for (const std::int64_t lanes : {2, 3}) {
    const auto r = every_call(load_model(stub, "model", policy(lanes)), in);
    REQUIRE(r.size() == one.size());
    for (const auto& [name, t] : one) {
      CAPTURE(name);
      CHECK(same_bits(r.at(name), t));
    }
  }
}

TEST_CASE("bad lane counts are refused with the library's message") {
  const auto stub = test::stub("elasticity", "elasticity");
  for (const std::int64_t lanes : {std::int64_t{-1}, max_cpu_lanes + 1}) {
    CAPTURE(lanes);
    const auto message = test::fatal_message(
        [&] { return load_model(stub, "elasticity", SyncChunking{.cpu_lanes = lanes}); });
    CHECK(contains(message, "cpu_lanes is " + std::to_string(lanes) + "; it must be 0"));
    CHECK(contains(test::fatal_message([&] {
                     return load_model(stub, "elasticity",
                                       GreedyPriorityCapacity{.devices = {"cpu"},
                                                              .batch_sizes = {64},
                                                              .cpu_lanes = lanes});
                   }),
                   "cpu_lanes is " + std::to_string(lanes)));
  }
  // A member function answers as a data member does.
  struct Lanes : SyncChunking {
    std::int64_t cpu_lanes() const { return 2000; }
  };
  CHECK(contains(test::fatal_message([&] { return load_model(stub, "elasticity", Lanes{}); }),
                 "cpu_lanes is 2000"));
}

TEST_CASE("MaterialState: a history with cut points, on 1, 2 and 3 lanes, the same bits") {
  const test::Reference ref("chaboche_viscoplasticity");
  std::vector<TensorMap> steps;
  for (int n = 0; n < 5; ++n)
    steps.push_back(tiled_to_rows(ref.group(test::step_name(n) + "/in"), 300));
  const auto points = steps.front().begin()->second.size(0);
  std::vector<std::vector<at::Tensor>> histories;
  for (const std::int64_t lanes : {1, 2, 3}) {
    CAPTURE(lanes);
    auto model = load_model(test::stub("chaboche_viscoplasticity", "model"), "model",
                            SyncChunking{.cpu_lanes = lanes});
    auto config = model.solver_config();
    config.miters = 6; // some points need more: they are cut
    model.set_solver_config(config);
    TensorMap start;
    MaterialState probe(model, points);
    for (const auto& x : probe.roles().state)
      start.emplace(x, steps.front().at(x + "~1"));
    for (const auto& f : probe.roles().forces)
      start.emplace(f, steps.front().at(f + "~1"));
    MaterialState state(model, points, start);
    std::vector<at::Tensor> history;
    std::int64_t cut = 0;
    for (const auto& in : steps) {
      TensorMap forces;
      for (const auto& f : state.roles().forces)
        forces.emplace(f, in.at(f));
      const auto& r = state.step(forces, {.derivatives = true, .max_cuts = 4});
      cut += r.cut;
      history.push_back(r.converged);
      history.push_back(r.outputs.at("stress"));
      history.push_back(r.derivatives.at("stress").at("E"));
      state.accept();
    }
    if (lanes == 1)
      CHECK(cut > 0); // the cuts ran too
    histories.push_back(history);
  }
  for (std::size_t k = 1; k < histories.size(); ++k)
    for (std::size_t i = 0; i < histories[0].size(); ++i) {
      CAPTURE(k);
      CAPTURE(i);
      CHECK(same_bits(histories[k][i], histories[0][i]));
    }
}

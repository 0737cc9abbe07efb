// Submitted calls: the model's and a MaterialState's step on the worker thread, equal to
// the blocking calls; errors at the wait; the state guarded meanwhile. Run under TSan.

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <thread>

#include "core/worker_pool.hpp"
#include "model_checks.hpp"

using namespace neml2;

namespace {

DispatchedModel<SyncChunking> load(const std::string& artifact) {
  return test::load(artifact, "model");
}

} // namespace

TEST_CASE("a submitted call gives the blocking call's results, bit for bit, and its errors at "
          "the wait") {
  const test::Reference ref("j2_radial_return");
  const auto model = load("j2_radial_return");
  const auto in = ref.group("s3/in");
  auto forward = submit_forward(model, in);
  auto jacobian = submit_jacobian(model, in);
  const auto [out, J] = model.jacobian(in); // the host's own work meanwhile
  CHECK(test::identical(forward.wait(), out));
  const auto [out2, J2] = jacobian.wait();
  CHECK(test::identical(out2, out));
  CHECK(test::identical(J2.at("stress"), J.at("stress")));
  CHECK_FALSE(forward.valid());
  CHECK(test::contains(test::fatal_message([&] { static_cast<void>(forward.wait()); }),
                       "a handle is waited for once"));

  // A bad input: nothing thrown at submission, the blocking call's error at the wait.
  auto bad = in;
  bad.erase("E");
  auto failing = submit_forward(model, bad);
  std::string blocking, submitted;
  try {
    static_cast<void>(model.forward(bad));
  } catch (const FatalError& e) {
    blocking = e.what();
  }
  try {
    static_cast<void>(failing.wait());
  } catch (const FatalError& e) {
    submitted = e.what();
  }
  CHECK(!blocking.empty());
  CHECK(submitted == blocking);
}

TEST_CASE("a submitted step: the blocking step's result, and the state refuses other work until "
          "the wait") {
  const test::Reference ref("j2_radial_return");
  const auto model = load("j2_radial_return");
  const auto points = ref["s0/in/E"].size(0);
  MaterialState blocking(model, points), submitted(model, points);
  for (int n = 0; n < 5; ++n) {
    CAPTURE(n);
    const auto in = ref.group("s" + std::to_string(n) + "/in");
    const TensorMap forces{{"E", in.at("E")}};
    auto pending = submitted.submit(forces, in.at("t"), {.derivatives = true});
    const auto& expected = blocking.step(forces, in.at("t"), {.derivatives = true});
    const auto& r = pending.wait();
    CHECK(&r != &expected);
    CHECK(test::identical(r.outputs, expected.outputs));
    CHECK(at::equal(r.derivatives.at("stress").at("E"), expected.derivatives.at("stress").at("E")));
    submitted.accept();
    blocking.accept();
    CHECK(test::identical(submitted.start(), blocking.start()));
  }

  // While a step runs (held at its chunk by the observer): no step, submission, accept or
  // reject.
  const auto in = ref.group("s4/in");
  auto gated = load("j2_radial_return");
  std::promise<void> release;
  gated.set_observer([held = release.get_future().share()](const ChunkEvent&) { held.wait(); });
  MaterialState held_state(gated, points);
  auto pending = held_state.submit({{"E", in.at("E")}}, in.at("t"));
  for (const auto& refused : std::vector<std::function<void()>>{
           [&] {
             static_cast<void>(held_state.step({{"E", in.at("E")}}, in.at("t")));
           },
           [&] {
             static_cast<void>(held_state.submit({{"E", in.at("E")}}, in.at("t")));
           },
           [&] { held_state.accept(); }, [&] { held_state.reject(); }})
    CHECK(test::contains(test::fatal_message(refused), "a submitted step is running"));
  CHECK(held_state.pending()); // read while the worker runs the step (TSan: no race)
  CHECK_FALSE(pending.ready());
  release.set_value();
  pending.wait();
  held_state.accept();
  gated.set_observer({});

  // A bad force: refused by submit() itself, nothing submitted; the state as it was.
  const auto before = submitted.start();
  CHECK(test::contains(test::fatal_message([&] {
                         static_cast<void>(submitted.submit({{"strain", in.at("E")}}, in.at("t")));
                       }),
                       "'strain' is not a force or given input"));
  CHECK_FALSE(submitted.pending());
  CHECK(test::identical(submitted.start(), before));
}

TEST_CASE("a submitted step's handle gives its own step's results: the state takes no other step "
          "until the wait, however far the worker has got") {
  const test::Reference ref("j2_radial_return");
  const auto model = load("j2_radial_return");
  const auto in = ref.group("s3/in");
  const auto points = in.at("E").size(0);
  MaterialState blocking(model, points), state(model, points);
  const auto& expected = blocking.step({{"E", in.at("E")}}, in.at("t"));
  auto handle = state.submit({{"E", in.at("E")}}, in.at("t"));
  while (!handle.ready())
    std::this_thread::yield();
  // The worker is done, the handle not waited for: still refused.
  CHECK(test::contains(test::fatal_message([&] {
                         static_cast<void>(state.step({{"E", 0.1 * in.at("E")}}, in.at("t")));
                       }),
                       "has not been waited for"));
  CHECK_THROWS_AS(state.reject(), FatalError);
  CHECK(state.pending());
  const auto& r = handle.wait();
  CHECK(test::identical(r.outputs, expected.outputs));
  // After the wait the state is the host's again; a dropped handle releases it too.
  static_cast<void>(state.step({{"E", 0.1 * in.at("E")}}, in.at("t")));
  { auto dropped = state.submit({{"E", in.at("E")}}, in.at("t")); }
  CHECK(test::identical(state.step({{"E", in.at("E")}}, in.at("t")).outputs, expected.outputs));
}

TEST_CASE("forces and given inputs are captured at submit(): the host may reuse its buffers at "
          "once") {
  const test::Reference ref("j2_radial_return");
  auto model = load("j2_radial_return");
  const auto in = ref.group("s3/in");
  const auto points = in.at("E").size(0);
  MaterialState blocking(model, points);
  const auto& expected = blocking.step({{"E", in.at("E")}}, in.at("t"));
  blocking.accept();

  // The worker held at its first chunk until the host has rewritten its buffers.
  std::promise<void> release;
  model.set_observer([held = release.get_future().share()](const ChunkEvent&) { held.wait(); });
  MaterialState state(model, points);
  auto E = in.at("E").clone(), t = in.at("t").clone(); // E a given input, t a force
  auto handle = state.submit({{"E", E}}, t);
  E.mul_(3);
  t.add_(1);
  release.set_value();
  const auto& r = handle.wait();
  model.set_observer({});
  CHECK(test::identical(r.outputs, expected.outputs));
  state.accept();
  CHECK(at::equal(state.start().at("t"), blocking.start().at("t")));
}

TEST_CASE("a handle dropped without a wait waits for its call") {
  const test::Reference ref("j2_radial_return");
  const auto in = ref.group("s3/in");
  TensorMap out;
  {
    const auto model = load("j2_radial_return");
    auto pending = submit_forward(model, in);
    // The model is destroyed after the handle: the call has ended by then.
  }
  const auto model = load("j2_radial_return");
  CHECK(test::identical(submit_forward(model, in).wait(), model.forward(in)));
  CHECK(neml2::detail::WorkerPool::live_threads() >=
        1); // the worker, started by the first submission
}

TEST_CASE("a state destroyed while its submitted step runs waits for it") {
  const test::Reference ref("j2_radial_return");
  auto model = load_model(test::stub("j2_radial_return", "model"), "model",
                          SyncChunking{.batch_size = 8}); // 20 points: 3 chunks
  const auto in = ref.group("s3/in");
  std::promise<void> release;
  std::atomic<int> chunks{0};
  model.set_observer([held = release.get_future().share(), &chunks](const ChunkEvent&) {
    held.wait();
    ++chunks;
  });
  Submitted<const StepResult&> pending;
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    release.set_value();
  });
  {
    MaterialState state(model, in.at("E").size(0));
    pending = state.submit({{"E", in.at("E")}}, in.at("t"));
  } // the destructor waits for the step
  CHECK(chunks.load() == 3);
  releaser.join();
  model.set_observer({});
}

TEST_CASE("the host's index buffers are taken at the call: reused after step() or once submit() "
          "returns, they move nothing") {
  // StepOptions::points, then changed in place (point 0's index becomes 1) before accept(),
  // or right after submit(): the step and accept() are the points named at the call.
  const test::Reference ref("j2_radial_return");
  const auto model = load("j2_radial_return");
  const auto points = ref["s0/in/E"].size(0);
  const auto in = ref.group("s1/in");
  const auto idx = at::tensor(std::vector<std::int64_t>{0, 2});
  const auto pick = [&](const at::Tensor& t) { return t.index_select(0, idx); };
  const TensorMap forces{{"E", pick(in.at("E"))}};
  const auto t = pick(in.at("t"));
  MaterialState expected(model, points), stepped(model, points), submitted(model, points);
  const auto& r = expected.step(forces, t, {.points = idx});
  expected.accept();

  auto buffer = idx.clone();
  const auto& s = stepped.step(forces, t, {.points = buffer});
  buffer[0] = 1; // the host's buffer reused before accept()
  CHECK(test::identical(s.outputs, r.outputs));
  stepped.accept();
  CHECK(test::identical(stepped.start(), expected.start()));

  buffer = idx.clone();
  auto pending = submitted.submit(forces, t, {.points = buffer});
  buffer[0] = 1;
  buffer[1] = points + 5; // out of range now: the step must not see it
  const auto& p = pending.wait();
  CHECK(test::identical(p.outputs, r.outputs));
  submitted.accept();
  CHECK(test::identical(submitted.start(), expected.start()));
}

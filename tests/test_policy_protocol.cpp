// One protocol for every user of a policy: DispatchedModel (the synchronous loop and the
// asynchronous engine) and the node simulator ask a policy the same questions, as often,
// reach the same chunks and refuse the same bad answers in the same words. (The Python
// adapter against both: python/tests/test_policies.py.)

#include <algorithm>
#include <memory>
#include <numeric>
#include <string>

#include <neml2/simulate.hpp>

#include "reference.hpp"

using namespace neml2;
using test::contains;

namespace {

struct Asked {
  int compute_device = 0, chunk_rows = 0;
};

// Chunks of `rows` on the CPU, counting what it is asked.
struct Counted {
  using dispatch_mode = synchronous;
  std::vector<Device> devices = {"cpu"};
  std::int64_t rows = 3;
  std::shared_ptr<Asked> asked = std::make_shared<Asked>();
  Device compute_device() const {
    ++asked->compute_device;
    return "cpu";
  }
  std::int64_t chunk_rows(std::int64_t) const {
    ++asked->chunk_rows;
    return rows;
  }
};
static_assert(DispatchPolicy<Counted>);

// Never waits, so every chunk of a call is dispatched at once, in an order that depends only
// on its state: sizes 3, 1, 2, ... on devices 0, 1, 0, ... across calls.
struct NeverWaits {
  using dispatch_mode = asynchronous;
  struct state_type {
    std::int64_t dispatched = 0;
  };
  std::vector<Device> devices = {"cpu", "cpu"};
  std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t>, std::int64_t remaining,
                                        state_type& s) const {
    return ChunkChoice{static_cast<std::size_t>(s.dispatched % 2),
                       std::min<std::int64_t>(remaining, 1 + (s.dispatched + 2) % 3)};
  }
  void on_dispatched(std::size_t, std::int64_t, state_type& s) const { ++s.dispatched; }
  void on_completed(std::size_t, std::int64_t, double, state_type&) const {}
};
static_assert(DispatchPolicy<NeverWaits>);

struct Chunk {
  std::size_t index, device;
  std::int64_t first, rows;
  bool operator==(const Chunk&) const = default;
  friend std::ostream& operator<<(std::ostream& os, const Chunk& c) {
    return os << "{" << c.index << ", " << c.device << ", " << c.first << ", " << c.rows << "}";
  }
};

std::vector<Chunk> chunks_of(const Simulation& sim, std::size_t call) {
  std::vector<Chunk> chunks;
  for (const auto& c : sim.timeline)
    if (c.call == call)
      chunks.push_back({c.index, c.device, c.first, c.rows});
  return chunks;
}

// The chunks a model ran for one forward() of `in`, in dispatch order.
template <class Policy>
std::vector<Chunk> chunks_of(DispatchedModel<Policy>& model, const TensorMap& in) {
  std::vector<ChunkEvent> events;
  std::mutex mutex;
  model.set_observer([&](const ChunkEvent& e) {
    std::lock_guard lock(mutex);
    events.push_back(e);
  });
  (void)model.forward(in);
  model.set_observer({});
  std::sort(events.begin(), events.end(),
            [](const auto& a, const auto& b) { return a.index < b.index; });
  std::vector<Chunk> chunks;
  for (const auto& e : events)
    chunks.push_back({e.index, e.device_index, e.first, e.rows});
  return chunks;
}

template <class Policy>
DispatchedModel<Policy> load(Policy policy) {
  return load_model(test::stub("rates", "eq"), "eq", std::move(policy));
}

std::vector<SimulatedDevice> node(std::size_t devices) {
  return std::vector<SimulatedDevice>(devices, {ThroughputCurve::constant(1e6), 1e-6, 0});
}

} // namespace

TEST_CASE("a synchronous policy is asked once a call for its device and its rows, by a model "
          "and by the simulator alike") {
  const test::Reference ref("rates");
  const auto in = ref.group("b7/in");
  Counted policy;
  auto model = load(policy);
  const auto asked = model.policy().asked; // shared with the model's copy
  *asked = {};
  // Without an observer a small dense forward() may go straight to the graph: still asked
  // once each, and it computes what eager NEML2 did.
  for (const auto& [name, value] : model.forward(in))
    test::check_close(value, ref.group("b7/out").at(name), name);
  CHECK(asked->compute_device == 1);
  CHECK(asked->chunk_rows == 1);
  (void)model.jacobian(in);
  CHECK(asked->compute_device == 2);
  CHECK(asked->chunk_rows == 2);

  // The chunks the model runs are those the simulator schedules.
  const auto ran = chunks_of(model, in);
  CHECK(ran == std::vector<Chunk>{{0, 0, 0, 3}, {1, 0, 3, 3}, {2, 0, 6, 1}});
  *asked = {};
  const auto sim = simulate(model.policy(), node(1), 7, 2);
  CHECK(chunks_of(sim, 0) == ran);
  CHECK(chunks_of(sim, 1) == ran);
  CHECK(asked->compute_device == 2);
  CHECK(asked->chunk_rows == 2);
}

TEST_CASE("an asynchronous policy reaches the same chunks in a model and in the simulator, its "
          "state carried across calls") {
  const test::Reference ref("rates");
  const auto in = ref.group("b7/in");
  auto model = load(NeverWaits{});
  const auto first = chunks_of(model, in);
  const auto second = chunks_of(model, in);
  const auto sim = simulate(NeverWaits{}, node(2), 7, 2);
  CHECK(first == chunks_of(sim, 0));
  CHECK(second == chunks_of(sim, 1));
  CHECK(first != second); // the state moved on: the comparison above sees it
}

namespace {
// Every question an asynchronous policy is asked and what it answered, and every hook, in
// order (the seconds of a completion left out: the model's are measured, the simulator's
// are not).
using Log = std::vector<std::string>;

template <class Decide>
struct Logged {
  using dispatch_mode = asynchronous;
  struct state_type {
    std::int64_t dispatched = 0;
  };
  std::vector<Device> devices;
  Decide decide; // (rows_in_flight, remaining, dispatched so far) -> a choice or nullopt
  std::shared_ptr<Log> log = std::make_shared<Log>();
  std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t> rows_in_flight,
                                        std::int64_t remaining, state_type& s) const {
    std::string asked = "next {";
    for (const auto r : rows_in_flight)
      asked += std::to_string(r) + " ";
    asked += "} " + std::to_string(remaining);
    const auto choice = decide(rows_in_flight, remaining, s.dispatched);
    log->push_back(asked + (choice ? " -> " + std::to_string(choice->device) + ":" +
                                         std::to_string(choice->rows)
                                   : " -> wait"));
    return choice;
  }
  void on_dispatched(std::size_t d, std::int64_t rows, state_type& s) const {
    ++s.dispatched;
    log->push_back("dispatched " + std::to_string(d) + ":" + std::to_string(rows));
  }
  void on_completed(std::size_t d, std::int64_t rows, double, state_type&) const {
    log->push_back("completed " + std::to_string(d) + ":" + std::to_string(rows));
  }
};

template <class Decide>
Logged<Decide> logged(std::vector<Device> devices, Decide decide) {
  return {std::move(devices), std::move(decide)};
}

// What a model's two forward() calls and a simulation of two calls ask `policy`.
template <class Policy>
std::pair<Log, Log> asked_by_model_and_simulator(const Policy& policy) {
  const test::Reference ref("rates");
  const auto in = ref.group("b7/in");
  auto model = load(policy);
  model.policy().log->clear(); // the model's copy shares the log
  for (int call = 0; call < 2; ++call)
    for (const auto& [name, value] : model.forward(in))
      test::check_close(value, ref.group("b7/out").at(name), name);
  const auto by_model = *model.policy().log;
  policy.log->clear();
  (void)simulate(policy, node(policy.devices.size()), 7, 2);
  return {by_model, *policy.log};
}

std::string joined(const Log& log) {
  std::string text;
  for (const auto& line : log)
    text += "\n" + line;
  return text;
}

std::int64_t in_flight(std::span<const std::int64_t> rows_in_flight) {
  return std::accumulate(rows_in_flight.begin(), rows_in_flight.end(), std::int64_t{0});
}
} // namespace

TEST_CASE("the engine and the simulator make every decision of one schedule alike, policies "
          "that wait among them") {
  // Sizes 1, 2, 3, 1, ... from the policy's state, so a chunk asked twice shows.
  const auto size = [](std::int64_t remaining, std::int64_t dispatched) {
    return std::min<std::int64_t>(remaining, 1 + dispatched % 3);
  };
  const auto check = [](const std::pair<Log, Log>& asked) {
    const auto& [by_model, by_simulator] = asked;
    CAPTURE(joined(by_model));
    CAPTURE(joined(by_simulator));
    CHECK(by_model == by_simulator);
    CHECK(std::count_if(by_model.begin(), by_model.end(), [](const std::string& line) {
            return line.starts_with("completed");
          }) >= 6); // two calls of at least three chunks each
  };
  SUBCASE("never waits, on the calling thread's lane") {
    check(asked_by_model_and_simulator(
        logged({"cpu"}, [&](auto, std::int64_t remaining, std::int64_t dispatched) {
          return std::optional<ChunkChoice>(ChunkChoice{0, size(remaining, dispatched)});
        })));
  }
  SUBCASE("waits while 3 rows or more are in flight") {
    const auto asked = asked_by_model_and_simulator(
        logged({"cpu"}, [&](auto loads, std::int64_t remaining, std::int64_t dispatched) {
          return in_flight(loads) >= 3
                     ? std::nullopt
                     : std::optional<ChunkChoice>(ChunkChoice{0, size(remaining, dispatched)});
        }));
    check(asked);
    CHECK(std::count(asked.first.begin(), asked.first.end(), "next {3 } 4 -> wait") == 1);
  }
  SUBCASE("waits while any chunk is in flight, alternating between a worker's lane and the "
          "calling thread's") {
    const auto asked = asked_by_model_and_simulator(
        logged({"cpu", "cpu"}, [&](auto loads, std::int64_t remaining, std::int64_t dispatched) {
          return in_flight(loads) > 0
                     ? std::nullopt
                     : std::optional<ChunkChoice>(ChunkChoice{
                           static_cast<std::size_t>(dispatched % 2), size(remaining, dispatched)});
        }));
    check(asked);
    CHECK(std::count_if(asked.first.begin(), asked.first.end(),
                        [](const std::string& line) { return line.ends_with("-> wait"); }) >= 4);
  }
}

namespace {
struct NotListed : Counted {
  Device compute_device() const { return "cuda:1"; }
};
struct NegativeRows : Counted {
  std::int64_t chunk_rows(std::int64_t) const { return -2; }
};
struct BadIndex : NeverWaits {
  std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t>, std::int64_t,
                                        state_type&) const {
    return ChunkChoice{5, 1};
  }
};
struct NoRows : NeverWaits {
  std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t>, std::int64_t,
                                        state_type&) const {
    return ChunkChoice{1, 0};
  }
};
struct TooMany : NeverWaits {
  std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t>, std::int64_t remaining,
                                        state_type&) const {
    return ChunkChoice{0, remaining + 1};
  }
};
struct Waits : NeverWaits {
  std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t>, std::int64_t,
                                        state_type&) const {
    return std::nullopt;
  }
};
// chunks_in_flight() is asked for accelerators, when a model is made (before any session
// loads, so no GPU is needed to see the refusal).
template <std::int64_t N>
struct InFlight : NeverWaits {
  InFlight() { devices = {"cpu", "cuda:0"}; }
  std::int64_t chunks_in_flight(std::size_t) const { return N; }
};

// The model's refusal (at load or at the call) and the simulator's, for `Policy`.
template <class Policy>
std::pair<std::string, std::string> refusals(std::size_t devices) {
  const test::Reference ref("rates");
  const auto in = ref.group("b7/in");
  return {test::fatal_message([&] { (void)load(Policy{}).forward(in); }),
          test::fatal_message([&] { (void)simulate(Policy{}, node(devices), 7); })};
}
} // namespace

TEST_CASE("a policy's bad answers are refused in the same words by a model and the simulator") {
  const auto check = [](const std::pair<std::string, std::string>& refused,
                        const std::string& expected) {
    const auto& [by_model, by_simulator] = refused;
    CAPTURE(by_model);
    CAPTURE(by_simulator);
    CHECK(contains(by_simulator, expected));
    CHECK(contains(by_model, by_simulator)); // the model may add where it was asked
  };
  check(refusals<NotListed>(1), "the dispatch policy's compute_device() is cuda:1, which its "
                                "devices() does not list ({cpu})");
  check(refusals<NegativeRows>(1), "the dispatch policy's chunk_rows(7) returned -2; "
                                   "chunk_rows() must return >= 0");
  check(refusals<BadIndex>(2), "chose device index 5, but the policy lists 2 device(s) {cpu, cpu}");
  check(refusals<NoRows>(2), "chose 0 rows for cpu with 7 rows remaining");
  check(refusals<TooMany>(2), "chose 8 rows for cpu with 7 rows remaining");
  check(refusals<Waits>(2), "gave no chunk while every device was idle (7 of 7 rows left)");
  for (const auto& refused :
       {refusals<InFlight<0>>(2), refusals<InFlight<-1>>(2), refusals<InFlight<1025>>(2)})
    check(refused, "the dispatch policy's chunks_in_flight() returned ");
  check(refusals<InFlight<-1>>(2), "returned -1 for cuda:0; it must return 1 to 1024");
}

TEST_CASE("a synchronous model holds no asynchronous policy state") {
  // What DispatcherOf keeps beside the policy: nothing for a synchronous one (the state and
  // the engine exist only for asynchronous policies).
  using Sync = neml2::detail::DispatcherOf<SyncChunking>;
  using Async = neml2::detail::DispatcherOf<NeverWaits>;
  CHECK(sizeof(Sync) < sizeof(Async));
  // No vtable pointer, reference or state beside the policy (padding aside).
  CHECK(sizeof(Sync) <
        sizeof(neml2::detail::Dispatcher) + sizeof(SyncChunking) + 2 * sizeof(void*));
}

// Stress: thousands of chunks through the asynchronous engine while faults are injected at
// random (seeded): recoverable and fatal, thrown from chunks and from a user-written
// policy, with 8 host threads calling one model at once. Every call that returns must be
// exact against an independent reference (elasticity is linear: stress = strain C^T, with
// C from eager NEML2), every call that throws must throw the faults of its own chunks
// (none lost, none given to another call) with the right recoverable(), nothing may hang
// or leak, and the model must be exact afterwards.
//
// NEML2_DISPATCH_STRESS_CHUNKS sets the number of chunks (default 10,000; half through
// GreedyPriorityCapacity, half through the user-written policy), for slower builds
// (sanitizers).

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include <neml2/detail/testing.hpp> // before_chunk
#include <neml2/memory.hpp>

#include "counting_allocator.hpp"
#include "graph/graph_calls.hpp"
#include "internals.hpp" // the library's private parts
#include "model_checks.hpp"

using namespace neml2;

namespace {

constexpr std::uint64_t seed = 20261130;
constexpr int callers = 8;

std::int64_t chunks_to_run() {
  const char* text = std::getenv("NEML2_DISPATCH_STRESS_CHUNKS");
  return text ? std::max<std::int64_t>(std::atoll(text), 1000) : 10000;
}

// splitmix64 over the seed and `parts`: the same parts, the same draw, in every run.
std::uint64_t draw(std::initializer_list<std::uint64_t> parts) {
  std::uint64_t h = seed;
  for (const auto part : parts) {
    h += 0x9e3779b97f4a7c15ULL ^ part;
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
    h ^= h >> 31;
  }
  return h;
}

double uniform(std::uint64_t h) {
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

enum class Fault { none, convergence, fatal, foreign };

// With probability `rate`, one of the three faults (a third each).
Fault fault_of(std::uint64_t h, double rate) {
  if (uniform(h) >= rate)
    return Fault::none;
  return std::array{Fault::convergence, Fault::fatal, Fault::foreign}[(h & 0xffff) % 3];
}

// A fault carries a tag, "{fault <where> <kind>}", that the test finds again in the
// error the call throws (a foreign error's message is kept by the library's FatalError).
const char* kind_name(Fault f) {
  return f == Fault::convergence ? "convergence" : f == Fault::fatal ? "fatal" : "foreign";
}

std::string tag(const std::string& where, Fault f) {
  return "{fault " + where + " " + kind_name(f) + "}";
}

[[noreturn]] void raise(Fault f, const std::string& where) {
  const auto text = tag(where, f);
  if (f == Fault::convergence)
    throw ConvergenceError(text + " injected divergence");
  if (f == Fault::fatal)
    throw FatalError(text + " injected fatal fault");
  throw std::runtime_error(text + " injected foreign fault");
}

// One error a call threw: the fault's tag, and whether its type and recoverable() are
// what that fault's kind must give. Empty tag: not an injected fault.
struct Reported {
  std::string where;
  bool as_thrown = false;
};

Reported reported(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const Exception& e) {
    const std::string text = e.what();
    const auto open = text.find("{fault ");
    const auto close = text.find('}', open);
    if (open == std::string::npos || close == std::string::npos)
      return {};
    const auto inside = text.substr(open + 7, close - open - 7);
    const auto space = inside.rfind(' ');
    const auto where = inside.substr(0, space), kind = inside.substr(space + 1);
    const bool convergence = dynamic_cast<const ConvergenceError*>(&e) != nullptr;
    const bool fatal = dynamic_cast<const FatalError*>(&e) != nullptr;
    bool as_thrown = false;
    if (kind == "convergence")
      as_thrown = convergence && e.recoverable();
    else if (kind == "fatal")
      as_thrown = fatal && !e.recoverable() && e.details().empty();
    else // translated: still the original text, in full in details()
      as_thrown =
          fatal && !e.recoverable() && test::contains(e.details(), "injected foreign fault");
    return {where + " " + kind, as_thrown};
  } catch (...) {
    return {};
  }
}

// What one call threw: its errors in the order given (one, or an AggregateError's), each
// as reported(); `aggregate_right`: an AggregateError has two or more errors and is
// recoverable exactly when all are; a single error is never wrapped.
struct Thrown {
  std::vector<Reported> errors;
  bool library_error = false;
  bool aggregate_right = true;
};

Thrown thrown(const std::exception_ptr& error) {
  Thrown t;
  try {
    std::rethrow_exception(error);
  } catch (const AggregateError& e) {
    t.library_error = true;
    bool all_recoverable = true;
    for (const auto& inner : e.errors()) {
      t.errors.push_back(reported(inner));
      try {
        std::rethrow_exception(inner);
      } catch (const Exception& x) {
        all_recoverable = all_recoverable && x.recoverable();
        t.aggregate_right = t.aggregate_right && !dynamic_cast<const AggregateError*>(&x);
      } catch (...) {
        t.library_error = false;
      }
    }
    t.aggregate_right =
        t.aggregate_right && e.errors().size() >= 2 && e.recoverable() == all_recoverable;
  } catch (const Exception&) {
    t.library_error = true;
    t.errors.push_back(reported(error));
  } catch (...) {
  }
  return t;
}

// Ends the process with a message when nothing moves for `stall_seconds`: neither a chunk
// started nor a call ended (ctest's timeout is the second line of defence).
class Watchdog {
public:
  explicit Watchdog(std::string phase, int stall_seconds = 60)
      : _phase(std::move(phase))
      , _thread([this, stall_seconds] {
        std::unique_lock lock(_mutex);
        auto seen = _progress.load();
        while (!_stopped) {
          _wake.wait_for(lock, std::chrono::seconds(stall_seconds));
          if (_stopped)
            break;
          const auto now = _progress.load();
          if (now == seen) {
            std::fprintf(stderr,
                         "test_stress: %s: no chunk started and no call ended for %d s "
                         "(%lld events so far): a deadlock; aborting\n",
                         _phase.c_str(), stall_seconds, static_cast<long long>(now));
            std::abort();
          }
          seen = now;
        }
      }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(_mutex);
      _stopped = true;
    }
    _wake.notify_all();
    _thread.join();
  }
  void moved() { ++_progress; }

private:
  std::string _phase;
  std::atomic<std::int64_t> _progress{0};
  std::mutex _mutex;
  std::condition_variable _wake;
  bool _stopped = false;
  std::thread _thread;
};

// The independent reference: C = d(stress)/d(strain) from eager NEML2.
at::Tensor stiffness() {
  const test::Reference ref("elasticity");
  return ref["b1/jac/stress/strain"].reshape({6, 6}).clone();
}

// The largest error of `stress` against strain C^T, relative to the largest expected
// value; NaN (never <= a tolerance) where a row was not written.
double relative_error(const at::Tensor& stress, const at::Tensor& strain, const at::Tensor& C) {
  if (stress.sizes() != strain.sizes())
    return std::numeric_limits<double>::infinity();
  const auto expected = strain.matmul(C.t());
  return (stress - expected).abs().max().item<double>() / expected.abs().max().item<double>();
}

// One call of the storm, as a caller saw it.
struct Call {
  std::int64_t batch = 0;
  bool into = false;
  std::exception_ptr error; // null: it returned
  double error_of_results = 0;
};

// What an error says, an AggregateError's errors included.
std::string text_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const AggregateError& e) {
    std::string text = e.what();
    for (const auto& inner : e.errors())
      text += " | " + text_of(inner);
    return text;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "(not a std::exception)";
  }
}

// A storm's call against the faults of its places: with none it returned exact results;
// with some it threw library errors, returned for the caller's own checks.
std::optional<Thrown> outcome(const Call& call, const std::vector<std::string>& expected) {
  if (expected.empty()) {
    REQUIRE_MESSAGE(!call.error, "a call with no fault in its places threw");
    CHECK(call.error_of_results <= 1e-12);
    return std::nullopt;
  }
  REQUIRE_MESSAGE(call.error, "a call with a fault in its places returned: " << expected.front());
  auto t = thrown(call.error);
  REQUIRE_MESSAGE(t.library_error, "not the library's error: " << text_of(call.error));
  CHECK(t.aggregate_right);
  REQUIRE(!t.errors.empty());
  return t;
}

// `callers` threads call `model` with random strains (batches in [min_batch, max_batch],
// by forward() or forward_into() outputs filled with NaN) until `started` reaches
// `chunks`. Each thread's draws are its own (seeded): the same calls in every run.
template <class Model>
std::vector<Call> storm(const Model& model, const at::Tensor& C, std::int64_t min_batch,
                        std::int64_t max_batch, std::int64_t chunks,
                        const std::atomic<std::int64_t>& started, Watchdog& watchdog) {
  std::vector<std::vector<Call>> per_thread(callers);
  std::vector<std::thread> threads;
  for (int t = 0; t < callers; ++t)
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(draw({99, static_cast<std::uint64_t>(t)}));
      std::uniform_int_distribution<std::int64_t> batch_of(min_batch, max_batch);
      std::uniform_real_distribution<double> value(-1e-3, 1e-3);
      while (started.load() < chunks) {
        Call call;
        call.batch = batch_of(rng);
        call.into = rng() % 2 == 1;
        std::vector<double> values(static_cast<std::size_t>(call.batch * 6));
        for (auto& v : values)
          v = value(rng);
        const auto strain = at::tensor(values, at::kDouble).view({call.batch, 6});
        try {
          at::Tensor stress;
          if (call.into) {
            stress =
                at::full({call.batch, 6}, std::numeric_limits<double>::quiet_NaN(), at::kDouble);
            model.forward_into({{"strain", strain}}, {{"stress", stress}});
          } else
            stress = model.forward({{"strain", strain}}).at("stress");
          call.error_of_results = relative_error(stress, strain, C);
        } catch (...) {
          call.error = std::current_exception();
        }
        per_thread[t].push_back(std::move(call));
        watchdog.moved();
      }
    });
  for (auto& thread : threads)
    thread.join();
  std::vector<Call> calls;
  for (auto& list : per_thread)
    calls.insert(calls.end(), list.begin(), list.end());
  return calls;
}

// After the storm: the model exact at every batch the references have, derivatives too,
// and one large clean call exact against C.
template <class Model>
void check_reusable(const Model& model, const at::Tensor& C) {
  test::check_all_batches(model, test::Reference("elasticity"), true, false);
  const auto strain = 1e-3 * at::rand({1000, 6}, at::kDouble);
  CHECK(relative_error(model.forward({{"strain", strain}}).at("stress"), strain, C) <= 1e-12);
}

// ------------------------------------------------- a user-written policy that fails

// Books that the policy keeps beside its state, for the test to read.
struct Books {
  std::atomic<std::int64_t> dispatched{0}, completed{0}, disagreements{0};
};

// Two CPU lanes, chunk sizes and lanes drawn from the rows remaining (so a chunk's place
// in its call decides them), up to 24 rows in flight per lane. It fails sometimes: in
// next_chunk(), at a place drawn from the rows remaining, and in on_completed(), after
// chunks of 13 rows on lane 0 or 21 rows on lane 1. It checks that the loads it is given
// are the ones its own books say.
// What the test policies keep beside their state: the rows in flight on two lanes, as
// they were told, and their books.
struct BookedLoads {
  struct state_type {
    std::array<std::int64_t, 2> rows_in_flight{};
  };
  std::shared_ptr<Books> books = std::make_shared<Books>();
  void check_loads(std::span<const std::int64_t> given, const state_type& s) const {
    if (given[0] != s.rows_in_flight[0] || given[1] != s.rows_in_flight[1])
      ++books->disagreements;
  }
  void on_dispatched(std::size_t device, std::int64_t rows, state_type& s) const {
    s.rows_in_flight[device] += rows;
    ++books->dispatched;
  }
  void book_completed(std::size_t device, std::int64_t rows, state_type& s) const {
    s.rows_in_flight[device] -= rows;
    ++books->completed;
  }
};

struct Flaky : BookedLoads {
  using dispatch_mode = asynchronous;
  std::vector<Device> devices = {"cpu", "cpu"};

  static ChunkChoice plan(std::int64_t remaining) {
    const auto h = draw({2, static_cast<std::uint64_t>(remaining)});
    return {h % 2, std::min<std::int64_t>(remaining, 1 + static_cast<std::int64_t>(h >> 8) % 32)};
  }
  static Fault next_chunk_fault(std::int64_t remaining) {
    return fault_of(draw({3, static_cast<std::uint64_t>(remaining)}), 0.005);
  }
  static Fault completion_fault(std::size_t device, std::int64_t rows) {
    if (device == 0 && rows == 13)
      return Fault::convergence;
    if (device == 1 && rows == 21)
      return Fault::foreign;
    return Fault::none;
  }
  static std::string completion_place(std::size_t device, std::int64_t rows) {
    return "completed:" + std::to_string(device) + ":" + std::to_string(rows);
  }

  std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t> rows_in_flight,
                                        std::int64_t remaining, state_type& s) const {
    check_loads(rows_in_flight, s);
    if (const auto f = next_chunk_fault(remaining); f != Fault::none)
      raise(f, "next_chunk:" + std::to_string(remaining));
    const auto choice = plan(remaining);
    if (rows_in_flight[choice.device] >= 24)
      return std::nullopt;
    return choice;
  }
  void on_completed(std::size_t device, std::int64_t rows, double, state_type& s) const {
    book_completed(device, rows, s);
    if (const auto f = completion_fault(device, rows); f != Fault::none)
      raise(f, completion_place(device, rows));
  }
};
static_assert(AsynchronousPolicy<Flaky>);

// Faults in Flaky's chunks, drawn from the chunk's place: the same chunk of the same call
// fails the same way in every run, whatever runs beside it.
Fault chunk_fault(const ChunkEvent& e) {
  return fault_of(draw({4, e.index, static_cast<std::uint64_t>(e.first),
                        static_cast<std::uint64_t>(e.rows), e.device_index}),
                  0.015);
}

// What a call of `batch` rows through Flaky must throw, chunk by chunk: the tag of each
// place that fails (in chunk order), with or without the faults injected into chunks.
// Dispatch stops at a failure in next_chunk(); a chunk that fails does not report its
// on_completed() fault.
//
// The policy's faults depend on the rows remaining alone, and calls of different batches
// come to the same rows remaining as they near their ends: where one such place fails,
// most calls fail, and large batches nearly all. Batches of a few hundred rows keep a mix.
std::vector<std::string> flaky_faults(std::int64_t batch, bool chunk_faults = true) {
  std::vector<std::string> faults;
  std::size_t index = 0;
  for (std::int64_t first = 0; first < batch; ++index) {
    const auto remaining = batch - first;
    if (const auto f = Flaky::next_chunk_fault(remaining); f != Fault::none) {
      faults.push_back("next_chunk:" + std::to_string(remaining) + " " + kind_name(f));
      break;
    }
    const auto [device, rows] = Flaky::plan(remaining);
    const ChunkEvent e{index, device, "cpu", first, rows, 0};
    if (const auto f = chunk_faults ? chunk_fault(e) : Fault::none; f != Fault::none)
      faults.push_back("chunk:" + std::to_string(first) + " " + kind_name(f));
    else if (const auto g = Flaky::completion_fault(device, rows); g != Fault::none)
      faults.push_back(Flaky::completion_place(device, rows) + " " + kind_name(g));
    first += rows;
  }
  return faults;
}

// Counts of what a storm did, for the message at the end.
struct Tally {
  std::int64_t calls = 0, failed = 0, aggregates = 0, recoverable = 0;
  std::string text(const char* phase, std::int64_t chunks, std::int64_t faults) const {
    return std::string(phase) + ": " + std::to_string(chunks) + " chunks, " +
           std::to_string(faults) + " faults reported, " + std::to_string(calls) + " calls, " +
           std::to_string(failed) + " threw (" + std::to_string(aggregates) + " AggregateError, " +
           std::to_string(recoverable) + " recoverable)";
  }
  void count(const Call& call) {
    ++calls;
    if (!call.error)
      return;
    ++failed;
    try {
      std::rethrow_exception(call.error);
    } catch (const AggregateError& e) {
      ++aggregates;
      recoverable += e.recoverable();
    } catch (const Exception& e) {
      recoverable += e.recoverable();
    } catch (...) {
    }
  }
};

// Counts the bytes torch's CPU allocator holds while it lives. Each install outranks the
// last (c10 keeps the allocator of the highest priority so far).
class CountingScope {
public:
  CountingScope() {
    c10::SetCPUAllocator(&allocator(), ++priority());
    const auto before = allocator().live.load();
    const auto probe = at::empty({1024}, at::kByte);
    REQUIRE(allocator().live.load() == before + 1024);
  }
  ~CountingScope() { c10::SetCPUAllocator(allocator().base, ++priority()); }
  CountingScope(const CountingScope&) = delete;
  CountingScope& operator=(const CountingScope&) = delete;

  [[nodiscard]] std::int64_t live() const { return allocator().live.load(); }

private:
  static test::CountingAllocator& allocator() {
    static test::CountingAllocator allocator; // outlives every tensor it allocates
    return allocator;
  }
  static std::uint8_t& priority() {
    static std::uint8_t p = 100;
    return p;
  }
};

} // namespace

TEST_CASE("GreedyPriorityCapacity: a storm of chunk faults from 8 callers, none lost or "
          "misplaced, every returned call exact") {
  const auto chunks = chunks_to_run() / 2;
  const auto C = stiffness();
  const auto threads_before = neml2::detail::WorkerPool::live_threads();
  {
    const CountingScope counting;
    // Chunks of 4 rows, up to 3 in flight on the CPU lane (from any calls).
    constexpr std::int64_t rows = 4;
    auto model =
        load_model(test::stub("elasticity", "elasticity"), "elasticity",
                   GreedyPriorityCapacity{
                       .devices = {"cpu"}, .batch_sizes = {rows}, .capacities = {3 * rows}});
    check_reusable(model, C);
    release_result_memory(); // outputs kept for reuse count as live (neml2/memory.hpp)
    const auto live_before = counting.live();

    // Faults drawn in the order chunks start (seeded; which call meets which draw depends
    // on the threads): each is logged with its chunk, and its tag is its number.
    struct Injected {
      std::size_t index;
      std::int64_t first, rows;
      Fault fault;
    };
    std::mutex log_mutex;
    std::vector<Injected> log;
    std::atomic<std::int64_t> started{0};
    std::optional<Watchdog> watchdog(std::in_place, "GreedyPriorityCapacity storm");
    neml2::detail::ModelAccess::before_chunk(model, [&](const ChunkEvent& e) {
      watchdog->moved();
      const auto n = started++;
      const auto f = fault_of(draw({1, static_cast<std::uint64_t>(n)}), 0.05);
      if (f == Fault::none)
        return;
      std::size_t id = 0;
      {
        std::lock_guard lock(log_mutex);
        id = log.size();
        log.push_back({e.index, e.first, e.rows, f});
      }
      raise(f, "#" + std::to_string(id));
    });
    const auto calls = storm(model, C, 6, 80, chunks, started, *watchdog);
    neml2::detail::ModelAccess::before_chunk(model, {});
    watchdog.reset();

    std::vector<int> reports(log.size(), 0);
    Tally tally;
    for (const auto& call : calls) {
      CAPTURE(call.batch);
      tally.count(call);
      if (!call.error) {
        CHECK(call.error_of_results <= 1e-12);
        continue;
      }
      const auto t = thrown(call.error);
      REQUIRE(t.library_error);
      CHECK(t.aggregate_right);
      REQUIRE(!t.errors.empty());
      std::optional<std::size_t> previous_index;
      std::size_t first_index = std::numeric_limits<std::size_t>::max(), last_index = 0;
      for (const auto& r : t.errors) {
        REQUIRE_MESSAGE(r.where.starts_with("#"), "not an injected fault: " << r.where);
        CHECK(r.as_thrown);
        const auto id = std::stoul(r.where.substr(1));
        REQUIRE(id < log.size());
        ++reports[id];
        const auto& chunk = log[id];
        CHECK(r.where == "#" + std::to_string(id) + " " + kind_name(chunk.fault));
        // A chunk of this call: its place in this call's plan, in chunk order.
        CHECK(chunk.first == rows * static_cast<std::int64_t>(chunk.index));
        CHECK(chunk.first < call.batch);
        CHECK(chunk.rows == std::min(rows, call.batch - chunk.first));
        CHECK((!previous_index || *previous_index < chunk.index));
        previous_index = chunk.index;
        first_index = std::min(first_index, chunk.index);
        last_index = chunk.index;
      }
      // No chunk dispatched after a failure: a call's chunks run in order on the one CPU
      // worker, so a chunk that reports a fault was dispatched while the call's first
      // failing chunk was still in flight, with at most 3 chunks in flight: the faults of
      // one call lie within 3 consecutive chunks.
      CHECK(last_index - first_index < 3);
    }
    // Every fault reported once, by the call whose chunk it was.
    CHECK(std::count(reports.begin(), reports.end(), 1) == static_cast<long>(reports.size()));
    CHECK(started.load() >= chunks);
    CHECK(tally.failed > 0);
    CHECK(tally.failed < tally.calls);
    MESSAGE(tally.text("GreedyPriorityCapacity", started.load(),
                       static_cast<std::int64_t>(log.size())));

    // Nothing kept of the storm's calls, and the model as good as new.
    release_result_memory();
    CHECK(counting.live() == live_before);
    check_reusable(model, C);
  }
  CHECK(neml2::detail::WorkerPool::live_threads() == threads_before);
}

TEST_CASE("a user-written policy that fails: each call throws exactly its own chunks' "
          "and its policy's faults, every returned call exact") {
  const auto chunks = chunks_to_run() - chunks_to_run() / 2;
  const auto C = stiffness();
  const auto threads_before = neml2::detail::WorkerPool::live_threads();
  {
    const CountingScope counting;
    Flaky policy;
    const auto books = policy.books;
    auto model = load_model(test::stub("elasticity", "elasticity"), "elasticity", policy);
    // Batches of 40 or more rows: the first chunk (at most 32) never covers one, so every
    // chunk goes through the lanes.
    constexpr std::int64_t min_batch = 40, max_batch = 160;
    release_result_memory(); // outputs kept for reuse count as live (neml2/memory.hpp)
    const auto live_before = counting.live();

    std::atomic<std::int64_t> started{0};
    std::optional<Watchdog> watchdog(std::in_place, "user-written policy storm");
    neml2::detail::ModelAccess::before_chunk(model, [&](const ChunkEvent& e) {
      watchdog->moved();
      ++started;
      if (const auto f = chunk_fault(e); f != Fault::none)
        raise(f, "chunk:" + std::to_string(e.first));
    });
    const auto calls = storm(model, C, min_batch, max_batch, chunks, started, *watchdog);
    neml2::detail::ModelAccess::before_chunk(model, {});
    watchdog.reset();

    Tally tally;
    std::int64_t faults = 0;
    for (const auto& call : calls) {
      CAPTURE(call.batch);
      tally.count(call);
      const auto expected = flaky_faults(call.batch);
      const auto t = outcome(call, expected);
      if (!t)
        continue;
      faults += static_cast<std::int64_t>(t->errors.size());
      // The first fault of its plan always (it stops dispatch), then later ones whose
      // chunks were already in flight, in chunk order.
      CHECK(t->errors.front().where == expected.front());
      auto next = expected.begin();
      for (const auto& r : t->errors) {
        CHECK(r.as_thrown);
        next = std::find(next, expected.end(), r.where);
        CHECK_MESSAGE(next != expected.end(), r.where << " is not a fault of this call, or "
                                                      << "not in chunk order");
        if (next != expected.end())
          ++next;
      }
    }
    CHECK(started.load() >= chunks);
    CHECK(tally.failed > 0);
    CHECK(tally.failed < tally.calls);
    MESSAGE(tally.text("user-written policy", started.load(), faults));

    // The policy's books: every chunk dispatched completed, with the loads the engine gave.
    CHECK(books->dispatched.load() == started.load());
    CHECK(books->completed.load() == books->dispatched.load());
    CHECK(books->disagreements.load() == 0);

    release_result_memory();
    CHECK(counting.live() == live_before);
    // Reusable: exact at every batch the policy lets through (with no fault in its places),
    // against C and against the references.
    std::int64_t clean = 0;
    for (std::int64_t batch = 1; batch <= max_batch; ++batch)
      if (flaky_faults(batch, false).empty()) {
        const auto strain = 1e-3 * at::rand({batch, 6}, at::kDouble);
        CHECK(relative_error(model.forward({{"strain", strain}}).at("stress"), strain, C) <= 1e-12);
        ++clean;
      }
    CHECK(clean > 20);
    const test::Reference ref("elasticity");
    for (const auto& [c, batch] : {std::pair{"b1", 1}, {"b2", 2}, {"b7", 7}, {"b33", 33}})
      if (flaky_faults(batch, false).empty()) {
        test::check_forward(model, ref, c);
        test::check_jacobian(model, ref, c);
      }
    CHECK(books->disagreements.load() == 0);
  }
  CHECK(neml2::detail::WorkerPool::live_threads() == threads_before);
}

// ------------------------------------------------- failures at every stage of a call

namespace {

// GreedyPriorityCapacity over two CPU lanes (the calling thread's and a worker's), chunks of
// 5 rows from row 0 whichever lane takes them, room for one chunk on the first and two on
// the second (so calls wait for room). It fails in next_chunk() with 42 rows remaining and
// in on_completed() after a chunk of 4 rows, and keeps books of what it was told.
struct Staged : BookedLoads {
  using dispatch_mode = asynchronous;
  GreedyPriorityCapacity inner{
      .devices = {"cpu", "cpu"}, .batch_sizes = {5}, .capacities = {5, 10}};

  std::vector<Device> devices() const { return inner.devices; }
  std::size_t chunks_in_flight(std::size_t d) const { return inner.chunks_in_flight(d); }
  std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t> rows_in_flight,
                                        std::int64_t remaining, state_type& s) const {
    check_loads(rows_in_flight, s);
    if (remaining == 42)
      raise(Fault::fatal, "next_chunk:42");
    no_state none;
    return inner.next_chunk(rows_in_flight, remaining, none);
  }
  void on_completed(std::size_t device, std::int64_t rows, double, state_type& s) const {
    book_completed(device, rows, s);
    if (rows == 4)
      raise(Fault::convergence, "completed:4");
  }
};
static_assert(AsynchronousPolicy<Staged>);

// One call of the staged storm: its batch decides where it fails (stage_faults).
struct StagedCall : Call {
  bool bind_fault = false;  // called with an input the model does not have
  bool alloc_fault = false; // an allocation of its outputs' size failed on its thread
};

// The tags a call of `batch` rows may throw (empty: none; it must return exact results):
// each place of its plan of 5-row chunks that fails. The first in plan order always
// fails (dispatch goes in order until an error); later ones only if already in flight.
std::vector<std::string> stage_faults(const StagedCall& call) {
  if (call.bind_fault)
    return {"bind"};
  const auto b = call.batch;
  std::vector<std::string> tags;
  if (call.alloc_fault)
    tags.push_back("alloc foreign");
  if (b >= 42 && (b - 42) % 5 == 0)
    tags.push_back("next_chunk:42 fatal");
  if (b > 95)
    tags.push_back("observer:95 fatal");
  if (b % 5 == 3)
    tags.push_back("graph:3 fatal"); // its last chunk: 3 rows
  if (b % 5 == 4)
    tags.push_back("completed:4 convergence");
  return tags;
}

} // namespace

TEST_CASE("failures at every stage of a call (binding, output allocation, the policy, a graph, "
          "the observer) from 8 callers: each call throws its own, the others are exact, and "
          "nothing is left behind") {
  const auto chunks = chunks_to_run() / 2;
  const auto C = stiffness();
  const auto threads_before = neml2::detail::WorkerPool::live_threads();
  const auto memory_limit = result_memory_limit();
  {
    const CountingScope counting;
    set_result_memory_limit(0); // every output allocated anew: an allocation that can fail
    Staged policy;
    const auto books = policy.books;
    auto model = load_model(test::stub("elasticity", "elasticity"), "elasticity", policy);
    const auto live_before = counting.live();

    std::atomic<std::int64_t> started{0};
    std::optional<Watchdog> watchdog(std::in_place, "staged failures storm");
    neml2::detail::ModelAccess::before_chunk(model, [&](const ChunkEvent&) {
      watchdog->moved();
      ++started;
    });
    model.set_observer([](const ChunkEvent& e) {
      if (e.first == 95)
        raise(Fault::fatal, "observer:95");
    });
    neml2::detail::observe_graph_calls([](const std::string&, std::int64_t rows) {
      if (rows == 3)
        raise(Fault::fatal, "graph:3");
    });

    std::vector<std::vector<StagedCall>> per_thread(callers);
    std::vector<std::thread> threads;
    for (int t = 0; t < callers; ++t)
      threads.emplace_back([&, t] {
        std::mt19937_64 rng(draw({7, static_cast<std::uint64_t>(t)}));
        std::uniform_int_distribution<std::int64_t> batch_of(1, 120);
        std::uniform_real_distribution<double> value(-1e-3, 1e-3);
        while (started.load() < chunks) {
          StagedCall call;
          call.batch = batch_of(rng);
          call.into = rng() % 2 == 1;
          call.bind_fault = call.batch % 17 == 0;
          std::vector<double> values(static_cast<std::size_t>(call.batch * 6));
          for (auto& v : values)
            v = value(rng);
          const auto strain = at::tensor(values, at::kDouble).view({call.batch, 6});
          auto stress =
              at::full({call.batch, 6}, std::numeric_limits<double>::quiet_NaN(), at::kDouble);
          const auto failed_before = test::CountingAllocator::failed;
          if (!call.bind_fault && call.batch % 13 == 0) // the size of its outputs
            test::CountingAllocator::fail_bytes = stress.nbytes();
          try {
            const TensorMap in = {{call.bind_fault ? "strian" : "strain", strain}};
            if (call.into)
              model.forward_into(in, {{"stress", stress}});
            else
              stress = model.forward(in).at("stress");
          } catch (...) {
            call.error = std::current_exception();
          }
          test::CountingAllocator::fail_bytes = 0; // before the check allocates that size
          call.alloc_fault = test::CountingAllocator::failed > failed_before;
          if (!call.error)
            call.error_of_results = relative_error(stress, strain, C);
          per_thread[t].push_back(std::move(call));
          watchdog->moved();
        }
      });
    for (auto& thread : threads)
      thread.join();
    neml2::detail::observe_graph_calls({});
    model.set_observer({});
    neml2::detail::ModelAccess::before_chunk(model, {});
    watchdog.reset();

    Tally tally;
    std::map<std::string, std::int64_t> reported_by_stage;
    for (const auto& list : per_thread)
      for (const auto& call : list) {
        CAPTURE(call.batch);
        CAPTURE(call.into);
        tally.count(call);
        const auto expected = stage_faults(call);
        const auto t = outcome(call, expected);
        if (!t)
          continue;
        if (call.bind_fault) { // refused before anything was booked: no tag, one error
          CHECK(t->errors.size() == 1);
          CHECK(t->errors.front().where.empty());
          ++reported_by_stage["bind"];
          continue;
        }
        for (const auto& r : t->errors) {
          CHECK_MESSAGE(std::find(expected.begin(), expected.end(), r.where) != expected.end(),
                        "'" << r.where << "' is not a fault of this call");
          CHECK(r.as_thrown);
          ++reported_by_stage[r.where.substr(0, r.where.find_first_of(": "))];
        }
      }
    std::string stages;
    for (const auto& [stage, count] : reported_by_stage)
      stages += " " + stage + " " + std::to_string(count);
    const auto summary = tally.text("staged failures", started.load(), 0) + "; reported:" + stages;
    MESSAGE(summary);
    // Every stage failed at least once (the allocation while calls wait for room too).
    for (const char* stage : {"bind", "alloc", "next_chunk", "observer", "graph", "completed"})
      CHECK_MESSAGE(reported_by_stage[stage] > 0, stage << " never failed");
    CHECK(tally.failed < tally.calls);

    // Nothing of a failed call left anywhere: the policy told of every chunk's completion,
    // the loads back to zero, the memory given back, the model exact.
    CHECK(books->completed.load() == books->dispatched.load());
    CHECK(books->disagreements.load() == 0);
    release_result_memory();
    CHECK(counting.live() == live_before);
    set_result_memory_limit(memory_limit);
    for (const std::int64_t batch : {1, 7, 40, 61, 1000}) { // no fault in these plans
      const auto strain = 1e-3 * at::rand({batch, 6}, at::kDouble);
      CHECK(relative_error(model.forward({{"strain", strain}}).at("stress"), strain, C) <= 1e-12);
    }
    CHECK(books->disagreements.load() == 0);
  }
  set_result_memory_limit(memory_limit);
  CHECK(neml2::detail::WorkerPool::live_threads() == threads_before);
}

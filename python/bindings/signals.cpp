// Ctrl-C during a long call: Python runs its signal handlers on the main thread, between
// bytecodes, which a call that released the GIL never reaches. A C-level SIGINT handler of
// ours notes the signal and calls Python's; between chunks, the model's interrupt check
// (the library's, on the calling thread) then takes the GIL, only once a signal came, and
// runs Python's handlers: whatever they raise stops the call, which raises it unchanged.

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <mutex>
#include <utility>

#include "bindings.hpp" // Python.h, and with it PyThread_get_thread_ident

namespace neml2::python {
namespace {

std::atomic<bool> sigint_seen{false};
// The handler ours calls after noting the signal (Python's), one of the two forms.
std::atomic<void (*)(int)> chained_handler{nullptr};
std::atomic<void (*)(int, siginfo_t*, void*)> chained_action{nullptr};

void note_sigint(int signal, siginfo_t* info, void* context) {
  sigint_seen.store(true, std::memory_order_relaxed);
  if (auto* action = chained_action.load())
    action(signal, info, context);
  else if (auto* handler = chained_handler.load())
    handler(signal);
}

// Puts ours in front of SIGINT's handler, unless it is there already or the handler is
// SIG_DFL or SIG_IGN (then nothing would run Python's handlers anyway), so that a handler
// `signal.signal` installed since is chained too. A `sigaction` query is a system call
// (about 170 ns here): unless `now`, at most every 50 ms.
void watch_sigint(bool now) {
  using std::chrono::milliseconds;
  static std::atomic<std::int64_t> last{-1000}; // ms on the steady clock: long ago
  const std::int64_t ms = std::chrono::steady_clock::now().time_since_epoch() / milliseconds(1);
  auto seen = last.load(std::memory_order_relaxed);
  if (!now && (ms - seen < 50 || !last.compare_exchange_strong(seen, ms)))
    return;
  static std::mutex mutex;
  const std::lock_guard lock(mutex);
  struct sigaction current {};
  if (sigaction(SIGINT, nullptr, &current) != 0)
    return;
  const bool info = (current.sa_flags & SA_SIGINFO) != 0;
  if (info && current.sa_sigaction == &note_sigint)
    return;
  if (!info && (current.sa_handler == SIG_DFL || current.sa_handler == SIG_IGN))
    return;
  chained_action = info ? current.sa_sigaction : nullptr;
  chained_handler = info ? nullptr : current.sa_handler;
  struct sigaction ours = current;
  ours.sa_flags |= SA_SIGINFO;
  ours.sa_sigaction = &note_sigint;
  sigaction(SIGINT, &ours, nullptr);
}

unsigned long main_thread = 0; // Python's ident of its main thread, known at import
thread_local bool first_question = false; // of the call this thread is making

} // namespace

void starting_call() noexcept {
  first_question = true;
}

void init_signal_watch() {
  main_thread =
      py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
}

InterruptCheck python_interrupt_check(Interrupts pending) {
  watch_sigint(true);
  return [pending = std::move(pending)] {
    watch_sigint(std::exchange(first_question, false));
    // Only the main thread runs Python's handlers: another leaves the signal to it.
    if (!sigint_seen.load(std::memory_order_relaxed) || PyThread_get_thread_ident() != main_thread)
      return;
    py::gil_scoped_acquire gil;
    sigint_seen = false;
    if (PyErr_CheckSignals() == 0)
      return; // handled, nothing raised
    py::error_already_set raised;
    const auto what = std::string("a signal handler raised ") + raised.what() +
                      "; the call stopped between chunks and raises it";
    pending->keep(std::move(raised));
    throw FatalError(what);
  };
}

} // namespace neml2::python

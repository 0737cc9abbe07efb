#pragma once

/// @file policy.hpp
/// @brief What a dispatch policy must provide. A policy is a small copyable value type
/// that says where each chunk of a batch runs; it needs no base class.
///
/// Every policy declares its mode with a tag and lists the devices it may use (a member
/// function `devices()` or a data member `devices`); the model loads one session per
/// listed device. A synchronous policy runs its chunks one after another on the calling
/// thread:
/// @code
/// struct MyPolicy {
///   using dispatch_mode = neml2::synchronous;
///   std::array<neml2::Device, 1> devices() const { return {"cuda:0"}; }
///   neml2::Device compute_device() const { return "cuda:0"; }   // one of devices()
///   std::int64_t chunk_rows(std::int64_t batch) const { return batch > 65536 ? 65536 : 0; }
/// };
/// static_assert(neml2::DispatchPolicy<MyPolicy>);
/// @endcode
/// An asynchronous policy is asked (by a calling thread, or by a worker as a chunk completes,
/// one at a time) for the next chunk given the
/// rows in flight on each device, and is told when a chunk is dispatched and when it
/// completes. What it learns lives in its `state_type` (optional, default `no_state`):
/// the model owns one, and calls the three hooks with it under one lock, so a policy
/// stays an immutable configuration even when several threads call the model at once.
/// @code
/// struct RoundRobin {
///   using dispatch_mode = neml2::asynchronous;
///   struct state_type { std::size_t next = 0; };
///   std::vector<neml2::Device> devices = {"cpu", "cuda:0"};
///   std::optional<neml2::ChunkChoice> next_chunk(std::span<const std::int64_t> rows_in_flight,
///                                                std::int64_t remaining, state_type& s) const {
///     const auto d = s.next++ % devices.size();
///     if (rows_in_flight[d] > 0) return std::nullopt;        // wait for a completion
///     return neml2::ChunkChoice{d, std::min<std::int64_t>(remaining, 4096)};
///   }
///   void on_dispatched(std::size_t, std::int64_t, state_type&) const {}
///   void on_completed(std::size_t, std::int64_t, double /*seconds*/, state_type&) const {}
/// };
/// @endcode
/// Optional members: `validate() const` (called when a model is loaded with the policy),
/// and `chunks_in_flight(std::size_t device) const`, how many chunks may run at once on an
/// accelerator (1 to 1024, default 1; asked once per accelerator when a model is made, of a
/// policy of either mode): the loader runners of its session, so that many calls from
/// several threads run there at once, and for an asynchronous policy as many workers;
/// `cpu_lanes` (a data member or a `const` member function), how many threads run the CPU's
/// chunks side by side (0 to 1024; 0, the default: torch's intra-op thread count at each
/// call). What each answer means, and its
/// checks, are detail/policy_protocol.hpp's: a model, the simulator and the Python adapter
/// ask alike.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <ranges>
#include <span>
#include <type_traits>
#include <vector>

#include <neml2/device.hpp>

namespace neml2 {

/// Dispatch-mode tags, named by `using dispatch_mode = ...;` in a policy.
struct synchronous {};
struct asynchronous {};

/// An asynchronous policy's answer: `rows` rows (1 to the rows remaining) go to
/// `device`, an index into the policy's devices.
struct ChunkChoice {
  std::size_t device = 0; ///< index into the policy's devices
  std::int64_t rows = 0;  ///< rows of the next chunk
};

/// The most chunks an asynchronous policy may keep in flight on one accelerator
/// (`chunks_in_flight(d)`; a worker each).
inline constexpr std::int64_t max_chunks_in_flight = 1024;

/// The state of a policy that keeps none.
struct no_state {};

namespace detail {
template <class P>
struct state_of {
  using type = no_state;
};
template <class P>
requires requires {
  typename P::state_type;
}
struct state_of<P> {
  using type = typename P::state_type;
};
} // namespace detail

/// What an asynchronous policy keeps across chunks and calls: `P::state_type`, or no_state.
template <class P>
using policy_state_t = typename detail::state_of<P>::type;

namespace detail {
template <class P>
concept copyable_value = std::copy_constructible<P> && std::is_destructible_v<P>;

template <class P>
concept declares_dispatch_mode = requires {
  typename P::dispatch_mode;
}
&&(std::same_as<typename P::dispatch_mode, synchronous> ||
   std::same_as<typename P::dispatch_mode, asynchronous>);

template <class R>
concept device_range =
    std::ranges::range<R> && std::convertible_to<std::ranges::range_value_t<R>, Device>;

template <class P>
concept has_devices_function = requires(const P& p) {
  { p.devices() } -> device_range;
};

template <class P>
concept has_devices_member = requires(const P& p) {
  { p.devices } -> device_range;
};

template <class P>
concept lists_devices = has_devices_function<P> || has_devices_member<P>;

template <class P>
concept is_synchronous =
    declares_dispatch_mode<P> && std::same_as<typename P::dispatch_mode, synchronous>;

template <class P>
concept is_asynchronous =
    declares_dispatch_mode<P> && std::same_as<typename P::dispatch_mode, asynchronous>;

template <class P>
concept has_compute_device = requires(const P& p) {
  { p.compute_device() } -> std::convertible_to<Device>;
};

template <class P>
concept has_chunk_rows = requires(const P& p, std::int64_t batch) {
  { p.chunk_rows(batch) } -> std::convertible_to<std::int64_t>;
};

template <class P>
concept has_usable_state =
    std::default_initializable<policy_state_t<P>> && std::is_destructible_v<policy_state_t<P>>;

template <class P>
concept has_next_chunk = requires(const P& p, std::span<const std::int64_t> rows_in_flight,
                                  std::int64_t remaining, policy_state_t<P>& state) {
  { p.next_chunk(rows_in_flight, remaining, state) } -> std::same_as<std::optional<ChunkChoice>>;
};

template <class P>
concept has_on_dispatched = requires(const P& p, std::size_t device, std::int64_t rows,
                                     policy_state_t<P>& state) {
  p.on_dispatched(device, rows, state);
};

template <class P>
concept has_on_completed = requires(const P& p, std::size_t device, std::int64_t rows,
                                    double seconds, policy_state_t<P>& state) {
  p.on_completed(device, rows, seconds, state);
};
} // namespace detail

/// A policy that runs its chunks one after another on the calling thread.
template <class P>
concept SynchronousPolicy = detail::copyable_value<P> && detail::is_synchronous<P> &&
    detail::lists_devices<P> && detail::has_compute_device<P> && detail::has_chunk_rows<P>;

/// A policy whose chunks run concurrently: on a worker per accelerator, and the CPU's on
/// the calling thread.
template <class P>
concept AsynchronousPolicy = detail::copyable_value<P> && detail::is_asynchronous<P> &&
    detail::lists_devices<P> && detail::has_usable_state<P> && detail::has_next_chunk<P> &&
    detail::has_on_dispatched<P> && detail::has_on_completed<P>;

/// Anything DispatchedModel can be instantiated with.
template <class P>
concept DispatchPolicy = SynchronousPolicy<P> || AsynchronousPolicy<P>;

/// True for a policy whose chunks run concurrently (see AsynchronousPolicy).
template <class P>
inline constexpr bool is_asynchronous_policy_v = detail::is_asynchronous<P>;

/// The devices a policy lists, whichever way it lists them.
template <class P>
requires detail::lists_devices<P> std::vector<Device> listed_devices(const P& policy) {
  std::vector<Device> devices;
  if constexpr (detail::has_devices_function<P>)
    for (const auto& d : policy.devices())
      devices.emplace_back(d);
  else
    for (const auto& d : policy.devices)
      devices.emplace_back(d);
  return devices;
}

namespace detail {
/// One static_assert per requirement, worded for the policy's author, ending with the
/// concept itself so the two cannot disagree. Always true when it compiles.
template <class P>
consteval bool check_policy() {
  static_assert(copyable_value<P>, "a dispatch policy must be a copyable value type (the model "
                                   "keeps its own copy; put learned state in `state_type`)");
  static_assert(declares_dispatch_mode<P>,
                "a dispatch policy must declare `using dispatch_mode = neml2::synchronous;` "
                "(or neml2::asynchronous)");
  static_assert(lists_devices<P>,
                "a dispatch policy must provide `devices() const` (or a data member "
                "`devices`) giving a range of neml2::Device (the devices it may use)");
  if constexpr (is_synchronous<P>) {
    static_assert(has_compute_device<P>, "a synchronous dispatch policy must provide "
                                         "`compute_device() const` returning a neml2::Device");
    static_assert(has_chunk_rows<P>,
                  "a synchronous dispatch policy must provide `chunk_rows(std::int64_t batch) "
                  "const` returning the rows per chunk (0 = the whole batch)");
  } else if constexpr (is_asynchronous<P>) {
    static_assert(has_usable_state<P>, "an asynchronous dispatch policy's `state_type` must be "
                                       "default-constructible (the model creates one)");
    static_assert(has_next_chunk<P>,
                  "an asynchronous dispatch policy must provide `next_chunk(std::span<const "
                  "std::int64_t> rows_in_flight, std::int64_t remaining, state_type&) const` "
                  "returning std::optional<neml2::ChunkChoice> (nullopt = wait for a chunk "
                  "to complete)");
    static_assert(has_on_dispatched<P>,
                  "an asynchronous dispatch policy must provide `on_dispatched(std::size_t "
                  "device, std::int64_t rows, state_type&) const`");
    static_assert(has_on_completed<P>,
                  "an asynchronous dispatch policy must provide `on_completed(std::size_t "
                  "device, std::int64_t rows, double seconds, state_type&) const`");
  }
  static_assert(DispatchPolicy<P>, "the type does not model neml2::DispatchPolicy");
  return true;
}
} // namespace detail

} // namespace neml2

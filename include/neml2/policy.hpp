#pragma once

/// @file policy.hpp
/// @brief What a dispatch policy must provide. A policy is a small value type that says
/// where each chunk of a batch runs; it needs no base class.
///
/// Every policy declares its mode with a tag and lists the devices it may use:
/// @code
/// struct MyPolicy {
///   using dispatch_mode = neml2::synchronous;
///   std::array<neml2::Device, 1> devices() const { return {"cuda:0"}; }
///   neml2::Device compute_device() const { return "cuda:0"; }
///   std::int64_t chunk_rows(std::int64_t batch) const { return batch > 65536 ? 65536 : 0; }
/// };
/// static_assert(neml2::DispatchPolicy<MyPolicy>);
/// @endcode
/// A synchronous policy runs chunks one after another on the calling thread:
/// `compute_device()` and `chunk_rows(batch)` (0 = the whole batch in one call).
/// An optional `validate() const` is called when a model is loaded with the policy.

#include <concepts>
#include <cstdint>
#include <ranges>
#include <type_traits>

#include <neml2/device.hpp>

namespace neml2 {

/// Dispatch-mode tags, named by `using dispatch_mode = ...;` in a policy.
struct synchronous {};
struct asynchronous {};

namespace detail {
template <class P>
concept declares_dispatch_mode = requires {
  typename P::dispatch_mode;
}
&&(std::same_as<typename P::dispatch_mode, synchronous> ||
   std::same_as<typename P::dispatch_mode, asynchronous>);

template <class P>
concept lists_devices = requires(const P& p) {
  { p.devices() } -> std::ranges::range;
  requires std::convertible_to<std::ranges::range_value_t<decltype(p.devices())>, Device>;
};

template <class P>
concept has_compute_device = requires(const P& p) {
  { p.compute_device() } -> std::convertible_to<Device>;
};

template <class P>
concept has_chunk_rows = requires(const P& p, std::int64_t batch) {
  { p.chunk_rows(batch) } -> std::convertible_to<std::int64_t>;
};
} // namespace detail

/// True for a policy whose chunks run on worker threads, concurrently.
template <class P>
inline constexpr bool is_asynchronous_policy_v =
    std::same_as<typename P::dispatch_mode, asynchronous>;

/// A policy that runs its chunks one after another on the calling thread.
template <class P>
concept SynchronousPolicy =
    detail::declares_dispatch_mode<P> && std::same_as<typename P::dispatch_mode, synchronous> &&
    detail::lists_devices<P> && detail::has_compute_device<P> && detail::has_chunk_rows<P>;

/// Anything DispatchedModel can be instantiated with.
template <class P>
concept DispatchPolicy = SynchronousPolicy<P>;

namespace detail {
/// One static_assert per requirement, so a broken policy's diagnostic names what it
/// lacks. Always true when it compiles.
template <class P>
consteval bool check_policy() {
  static_assert(std::is_copy_constructible_v<P>, "a dispatch policy must be a copyable value type");
  static_assert(declares_dispatch_mode<P>,
                "a dispatch policy must declare `using dispatch_mode = neml2::synchronous;` "
                "(or neml2::asynchronous)");
  static_assert(lists_devices<P>, "a dispatch policy must provide `devices() const` returning a "
                                  "range of neml2::Device (the devices it may use)");
  if constexpr (declares_dispatch_mode<P>) {
    static_assert(!is_asynchronous_policy_v<P>,
                  "asynchronous dispatch policies are not supported by this version of "
                  "neml2-dispatch yet");
    static_assert(has_compute_device<P>, "a synchronous dispatch policy must provide "
                                         "`compute_device() const` returning a neml2::Device");
    static_assert(has_chunk_rows<P>,
                  "a synchronous dispatch policy must provide `chunk_rows(std::int64_t batch) "
                  "const` returning the rows per chunk (0 = the whole batch)");
  }
  return true;
}
} // namespace detail

} // namespace neml2

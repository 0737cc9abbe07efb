#pragma once

/// @file detail/model_core.hpp
/// @brief The compiled half of every DispatchedModel (src/engine/): its sessions and the
/// steps of a call that do not depend on the policy, behind a small interface the policy
/// templates drive. fmt's pattern: templates over a type-erased core. A synchronous call's
/// tensor work (binding, chunks, gathering, landing) is detail/sync_call.hpp's.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <neml2/artifact.hpp>
#include <neml2/detail/call_names.hpp>
#include <neml2/errors.hpp>
#include <neml2/observer.hpp>
#include <neml2/session.hpp>

namespace neml2::detail {

/// @brief One session per device a policy lists, the promoted parameters (the first
/// session's), the observer, and the steps of a call that do not depend on the policy.
class ModelCore {
public:
  /// Loads a session of `artifact` per device, each taking `concurrency[d]` calls at once.
  ModelCore(std::shared_ptr<const Artifact> artifact, std::vector<Device> devices,
            const std::vector<std::size_t>& concurrency, c10::ScalarType dtype,
            std::size_t cpu_lanes = 0);
  ~ModelCore();
  ModelCore(const ModelCore&) = delete;
  ModelCore& operator=(const ModelCore&) = delete;

  /// The first session: the master parameters, the metadata.
  [[nodiscard]] const Session& session() const noexcept;
  [[nodiscard]] Session& session() noexcept;
  [[nodiscard]] const std::vector<Session>& sessions() const noexcept;
  [[nodiscard]] std::vector<Session>& sessions() noexcept;
  /// The devices, as the policy listed them.
  [[nodiscard]] const std::vector<Device>& devices() const noexcept;
  void set_observer(ChunkObserver observer);
  void set_interrupt_check(InterruptCheck check);

  /// How a call's tensors are named (inputs in position, results as the public maps): the
  /// first session's, the same on every device.
  [[nodiscard]] CallNames names() const noexcept { return CallNames(session()); }

  /// The batch of a forward() the value graph on device `d` may take as given (a small
  /// dense CPU batch of a model without solve or parameters, nothing observed), or 0: then
  /// the call takes the bound path.
  [[nodiscard]] std::int64_t batch_as_given(std::size_t d,
                                            const std::vector<at::Tensor>& inputs) const;
  /// forward() of a call batch_as_given() accepted: outputs in output_names() order.
  [[nodiscard]] std::vector<at::Tensor>
  forward_as_given(std::size_t d, const std::vector<at::Tensor>& inputs) const;

  struct State; // src/engine/model_core.hpp
  [[nodiscard]] const State& state() const noexcept { return *_state; }
  [[nodiscard]] State& state() noexcept { return *_state; }

private:
  std::unique_ptr<State> _state;
};

} // namespace neml2::detail

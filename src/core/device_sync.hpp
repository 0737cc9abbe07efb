#pragma once

// Waiting for a device.

#include <c10/core/Device.h>

namespace neml2::detail {

/// Waits until the work queued on this thread's current stream of `device` is done.
void synchronize_current_stream(c10::Device device);

} // namespace neml2::detail

// Waiting for a device (see device_sync.hpp).

#include "core/device_sync.hpp"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace neml2::detail {

void synchronize_current_stream(c10::Device device) {
  c10::impl::getDeviceGuardImpl(device.type())->getStream(device).synchronize();
}

} // namespace neml2::detail

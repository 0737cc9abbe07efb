// Must not compile: the policy does not list its devices.
#include <neml2/dispatch.hpp>

struct NoDevices {
  using dispatch_mode = neml2::synchronous;
  neml2::Device compute_device() const { return "cpu"; }
  std::int64_t chunk_rows(std::int64_t) const { return 0; }
};

int main() {
  return sizeof(neml2::DispatchedModel<NoDevices>) > 0 ? 0 : 1;
}

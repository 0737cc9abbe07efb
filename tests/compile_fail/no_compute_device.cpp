// Must not compile: a synchronous policy that does not say where chunks run.
#include <neml2/dispatch.hpp>

struct NoComputeDevice {
  using dispatch_mode = neml2::synchronous;
  std::array<neml2::Device, 1> devices() const { return {"cpu"}; }
  std::int64_t chunk_rows(std::int64_t) const { return 0; }
};

int main() {
  return sizeof(neml2::DispatchedModel<NoComputeDevice>) > 0 ? 0 : 1;
}

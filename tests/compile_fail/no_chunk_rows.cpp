// Must not compile: a synchronous policy without a chunk size.
#include <neml2/dispatch.hpp>

struct NoChunkRows {
  using dispatch_mode = neml2::synchronous;
  std::array<neml2::Device, 1> devices() const { return {"cpu"}; }
  neml2::Device compute_device() const { return "cpu"; }
};

int main() {
  return sizeof(neml2::DispatchedModel<NoChunkRows>) > 0 ? 0 : 1;
}

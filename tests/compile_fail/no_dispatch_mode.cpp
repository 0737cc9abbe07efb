// Must not compile: the policy does not say whether it is synchronous.
#include <neml2/dispatch.hpp>

struct NoDispatchMode {
  std::array<neml2::Device, 1> devices() const { return {"cpu"}; }
  neml2::Device compute_device() const { return "cpu"; }
  std::int64_t chunk_rows(std::int64_t) const { return 0; }
};

int main() {
  return sizeof(neml2::DispatchedModel<NoDispatchMode>) > 0 ? 0 : 1;
}

// Must not compile: an asynchronous policy that never says where the next chunk goes.
#include <neml2/dispatch.hpp>

struct NoNextChunk {
  using dispatch_mode = neml2::asynchronous;
  std::vector<neml2::Device> devices = {"cpu"};
  void on_dispatched(std::size_t, std::int64_t, neml2::no_state&) const {}
  void on_completed(std::size_t, std::int64_t, double, neml2::no_state&) const {}
};

int main() {
  return sizeof(neml2::DispatchedModel<NoNextChunk>) > 0 ? 0 : 1;
}

// Must not compile: an asynchronous policy that is never told a chunk was dispatched.
#include <neml2/dispatch.hpp>

struct NoOnDispatched {
  using dispatch_mode = neml2::asynchronous;
  std::vector<neml2::Device> devices = {"cpu"};
  std::optional<neml2::ChunkChoice> next_chunk(std::span<const std::int64_t>, std::int64_t,
                                               neml2::no_state&) const {
    return neml2::ChunkChoice{0, 1};
  }
  void on_completed(std::size_t, std::int64_t, double, neml2::no_state&) const {}
};

int main() {
  return sizeof(neml2::DispatchedModel<NoOnDispatched>) > 0 ? 0 : 1;
}

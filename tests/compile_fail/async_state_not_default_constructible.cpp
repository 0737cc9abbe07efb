// Must not compile: an asynchronous policy whose state_type the model cannot make.
#include <neml2/dispatch.hpp>

struct StateNeedsArgument {
  using dispatch_mode = neml2::asynchronous;
  struct state_type {
    explicit state_type(int) {}
  };
  std::vector<neml2::Device> devices = {"cpu"};
  std::optional<neml2::ChunkChoice> next_chunk(std::span<const std::int64_t>, std::int64_t,
                                               state_type&) const {
    return neml2::ChunkChoice{0, 1};
  }
  void on_dispatched(std::size_t, std::int64_t, state_type&) const {}
  void on_completed(std::size_t, std::int64_t, double, state_type&) const {}
};

int main() {
  return sizeof(neml2::DispatchedModel<StateNeedsArgument>) > 0 ? 0 : 1;
}

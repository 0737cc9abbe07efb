// Must not compile: a policy the model cannot keep a copy of.
#include <memory>

#include <neml2/dispatch.hpp>

struct NotCopyable : neml2::SyncChunking {
  std::unique_ptr<int> learned;
};

int main() {
  return sizeof(neml2::DispatchedModel<NotCopyable>) > 0 ? 0 : 1;
}

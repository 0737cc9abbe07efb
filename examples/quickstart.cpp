// Quickstart: load a compiled model, evaluate a batch in chunks, take its Jacobian, and
// catch a bad input.
//
//   neml2-compile elasticity.i --model elasticity -d :      (writes aoti/elasticity_aoti.i)
//   quickstart aoti/elasticity_aoti.i

#include <iostream>

#include <neml2/dispatch.hpp>

int main(int argc, char** argv) {
  const std::string stub = argc > 1 ? argv[1] : "aoti/elasticity_aoti.i";

  // Whole batches on the CPU, 4096 material points per graph call.
  auto model = neml2::load_model(stub, "elasticity",
                                 neml2::SyncChunking{.device = "cpu", .batch_size = 4096});
  std::cout << "inputs: " << model.input_names()[0] << ", outputs: " << model.output_names()[0]
            << "\n";

  const auto strain = 1e-3 * at::rand({10000, 6}, at::kDouble);
  const auto stress = model.forward({{"strain", strain}}).at("stress");
  std::cout << "stress of point 0: " << stress[0] << "\n";

  // d(stress)/d(strain): the same for every point here, so it comes back unbatched.
  const auto [outputs, J] = model.jacobian({{"strain", strain}});
  std::cout << "stiffness block: " << J.at("stress").at("strain").sizes() << "\n";

  try {
    (void)model.forward({{"strain", at::rand({10, 5}, at::kDouble)}});
  } catch (const neml2::Exception& e) {
    std::cout << (e.recoverable() ? "recoverable" : "fatal") << " error: " << e.what() << "\n";
  }
  return 0;
}

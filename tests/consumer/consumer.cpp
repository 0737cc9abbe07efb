// Loads a compiled model through the package (installed, or added as a subdirectory),
// without naming the model (the stub holds one), and checks one stress value against the
// analytic answer for linear isotropic elasticity (E = 100, nu = 0.3); and that
// neml2/version.hpp says the version the CMake package says.
#include <cmath>
#include <cstdio>
#include <string_view>

#include <ATen/ATen.h>

#include <neml2/dispatch.hpp>

int main(int argc, char** argv) {
  if (argc != 2)
    return 2;
  const auto model = neml2::load_model(argv[1], neml2::SyncChunking{.batch_size = 2});
  auto strain = at::zeros({3, 6}, at::kDouble);
  strain.select(1, 0).fill_(1e-3); // uniaxial strain
  const auto stress = model.forward({{"strain", strain}}).at("stress");
  const double E = 100, nu = 0.3;
  const double expected = E * (1 - nu) / ((1 + nu) * (1 - 2 * nu)) * 1e-3;
  const double got = stress[2][0].item<double>();
  const bool ok = std::abs(got - expected) <= 1e-12 * expected;
  const bool version_ok = std::string_view(neml2::dispatch_version) == PACKAGE_VERSION;
  std::printf("neml2-dispatch %s (package %s): %s\n", neml2::dispatch_version, PACKAGE_VERSION,
              version_ok ? "same" : "MISMATCH");
  std::printf("sigma_xx = %.12g, analytic %.12g: %s\n", got, expected, ok ? "matches" : "MISMATCH");
  return ok && version_ok ? 0 : 1;
}

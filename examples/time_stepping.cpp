// Time stepping an implicit model the way a finite-element host does, through
// neml2::MaterialState: the library keeps every material point's state (the start of the
// step and its trial end); the points whose Newton fails in a step retry it alone in
// bisected spans while the others keep their step; the host accepts each step. A point
// that fails even in the smallest span, or a fatal error, stops the run.
//
//   neml2-compile perzyna_viscoplasticity.i --model model -d :   (writes aoti/model_aoti.i)
//   time_stepping aoti/model_aoti.i

#include <iostream>

#include <neml2/dispatch.hpp>

int main(int argc, char** argv) {
  const std::string stub = argc > 1 ? argv[1] : "aoti/model_aoti.i";
  try {
    auto model = neml2::load_model(stub, "model");
    // A tight iteration cap, as hosts use to keep steps cheap: large increments fail it.
    auto config = model.solver_config();
    config.miters = 8;
    model.set_solver_config(config);

    // 64 points loaded to a strain of 1 % to 20 % over one second, in steps of 0.1 s: the
    // fastest ones take strain increments too large for Newton from the old stress.
    const std::int64_t points = 64;
    const auto opts = at::TensorOptions(at::kDouble);
    const auto final_strain = at::linspace(0.01, 0.2, points, opts).unsqueeze(1) *
                              at::tensor({1.0, -0.5, -0.5, 0.0, 0.0, 0.0}, opts);
    neml2::MaterialState state(model, points); // stress-free, at t = 0

    std::int64_t cut = 0, spans = 0;
    for (int n = 1; n <= 10; ++n) {
      const double t = 0.1 * n;
      const auto& step = state.step({{"E", final_strain * t}}, at::full({points}, t, opts),
                                    {.max_cuts = 6});
      if (step.failed > 0) {
        std::cout << step.failed << " points failed at step " << n << " even in spans of 2^-6\n";
        return 1;
      }
      cut += step.cut;
      spans += step.substeps.sum().item<std::int64_t>();
      state.accept();
    }

    const auto& stress = state.start().at("stress");
    std::cout << "finished " << points << " points in 10 steps; " << cut
              << " point-steps were cut, " << spans << " spans in all\n"
              << "final stress of the slowest and fastest points: " << stress[0][0].item<double>()
              << ", " << stress[points - 1][0].item<double>() << "\n";
    return 0;
  } catch (const neml2::Exception& e) {
    std::cout << "fatal error, stopping: " << e.what() << "\n";
    return 1;
  }
}

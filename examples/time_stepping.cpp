// Time stepping an implicit model the way a finite-element host does: a strain-driven
// history over many material points, each with its own time step. When Newton fails for
// some points (a recoverable neml2::ConvergenceError), the points that converged keep
// their step, and only the failed ones retry with half their step. A fatal error stops.
//
//   neml2-compile perzyna_viscoplasticity.i --model model -d :   (writes aoti/model_aoti.i)
//   time_stepping aoti/model_aoti.i

#include <iostream>

#include <neml2/dispatch.hpp>

namespace {

// The state of every point at the end of its last accepted step.
struct History {
  at::Tensor t, strain, stress, plastic; // (P,), (P, 6), (P, 6), (P,)
};

neml2::TensorMap by_name(const std::vector<std::string>& names,
                         const std::vector<at::Tensor>& values) {
  neml2::TensorMap out;
  for (std::size_t i = 0; i < names.size(); ++i)
    out.emplace(names[i], values[i]);
  return out;
}

} // namespace

int main(int argc, char** argv) {
  const std::string stub = argc > 1 ? argv[1] : "aoti/model_aoti.i";
  auto model = neml2::load_model(stub, "model");
  // A tight iteration cap, as hosts use to keep steps cheap: large increments fail it.
  auto config = model.solver_config();
  config.miters = 8;
  model.set_solver_config(config);

  // 64 points loaded to a strain of 1 % to 20 % over one second, in steps of 0.1 s: the
  // fastest ones take strain increments too large for Newton from the old stress.
  const std::int64_t points = 64;
  const double end_time = 1.0;
  const auto opts = at::TensorOptions(at::kDouble);
  const auto final_strain = at::linspace(0.01, 0.2, points, opts).unsqueeze(1) *
                            at::tensor({1.0, -0.5, -0.5, 0.0, 0.0, 0.0}, opts);
  History h{at::zeros({points}, opts), at::zeros({points, 6}, opts), at::zeros({points, 6}, opts),
            at::zeros({points}, opts)};
  auto dt = at::full({points}, 0.1, opts);

  std::int64_t calls = 0, halvings = 0;
  while ((h.t < end_time - 1e-12).any().item<bool>()) {
    const auto active = (h.t < end_time - 1e-12).nonzero().squeeze(1);
    const auto t_old = h.t.index_select(0, active);
    const auto t_new = at::minimum(t_old + dt.index_select(0, active), at::full({}, end_time));
    const auto strain_new = final_strain.index_select(0, active) * (t_new / end_time).unsqueeze(1);
    const auto stress_old = h.stress.index_select(0, active);
    const auto plastic_old = h.plastic.index_select(0, active);
    const neml2::TensorMap inputs = {{"E", strain_new},
                                     {"E~1", h.strain.index_select(0, active)},
                                     {"t", t_new},
                                     {"t~1", t_old},
                                     {"stress", stress_old},
                                     {"stress~1", stress_old},
                                     {"equivalent_plastic_strain", plastic_old},
                                     {"equivalent_plastic_strain~1", plastic_old}};

    neml2::TensorMap outputs;
    auto accepted = at::ones({active.size(0)}, at::kBool);
    ++calls;
    try {
      outputs = model.forward(inputs);
    } catch (const neml2::ConvergenceError& e) {
      if (!e.per_row())
        throw;
      // Keep the points that converged; halve the step of the others and retry them.
      accepted = e.converged_mask();
      outputs = e.outputs().empty() ? by_name(model.output_names(), e.results()) : e.outputs();
      const auto failed = active.masked_select(~accepted);
      dt.index_copy_(0, failed, dt.index_select(0, failed) / 2);
      halvings += failed.size(0);
      if ((dt.index_select(0, failed) < 1e-6).any().item<bool>()) {
        std::cout << "step below 1e-6 s: giving up\n";
        return 1;
      }
    } catch (const neml2::Exception& e) {
      std::cout << "fatal error, stopping: " << e.what() << "\n";
      return 1;
    }
    const auto done = active.masked_select(accepted);
    const auto rows = accepted.nonzero().squeeze(1);
    h.t.index_copy_(0, done, t_new.index_select(0, rows));
    h.strain.index_copy_(0, done, strain_new.index_select(0, rows));
    h.stress.index_copy_(0, done, outputs.at("stress").index_select(0, rows));
    h.plastic.index_copy_(0, done, outputs.at("equivalent_plastic_strain").index_select(0, rows));
  }

  std::cout << "finished " << points << " points in " << calls << " calls; halved the step of "
            << halvings << " point-steps\n"
            << "final stress of the slowest and fastest points: " << h.stress[0][0].item<double>()
            << ", " << h.stress[points - 1][0].item<double>() << "\n";
  return 0;
}

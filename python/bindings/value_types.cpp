// The value types Python builds and hands to the library: the built-in policies
// (SyncChunking, GreedyPriorityCapacity) and the Newton settings (SolverConfig,
// KrylovConfig).

#include <string>
#include <vector>

#include <neml2/dispatch.hpp>

#include "bindings.hpp"

namespace neml2::python {

using namespace pybind11::literals;

// The docstring of both policies' cpu_lanes (the library checks the value at load_model).
constexpr const char* cpu_lanes_doc =
    "Threads that run the CPU's chunks side by side, the calling one included (1 to 1024); "
    "0: torch's intra-op thread count (torch.get_num_threads()) at each call. Results are "
    "the same bits on any number.";

void bind_policies(py::module_& m) {
  py::class_<SyncChunking>(m, "SyncChunking",
                           "The whole batch on one device, in chunks of `batch_size` rows (0: "
                           "one call), on the CPU `cpu_lanes` chunks at once.")
      .def(py::init([](const Device& device, std::int64_t batch_size, std::int64_t cpu_lanes) {
             return SyncChunking{
                 .device = device, .batch_size = batch_size, .cpu_lanes = cpu_lanes};
           }),
           "device"_a = Device("cpu"), "batch_size"_a = 0, "cpu_lanes"_a = 0)
      .def_property(
          "device", [](const SyncChunking& p) { return p.device.str(); },
          [](SyncChunking& p, const Device& d) { p.device = d; }, "Where every chunk runs.")
      .def_readwrite("batch_size", &SyncChunking::batch_size,
                     "Rows per graph call; 0: the whole batch at once.")
      .def_readwrite("cpu_lanes", &SyncChunking::cpu_lanes, cpu_lanes_doc)
      .def("__repr__", [](const SyncChunking& p) {
        return "SyncChunking(device='" + p.device.str() +
               "', batch_size=" + std::to_string(p.batch_size) +
               ", cpu_lanes=" + std::to_string(p.cpu_lanes) + ")";
      });

  py::class_<GreedyPriorityCapacity>(
      m, "GreedyPriorityCapacity",
      "One batch over several devices at once: each chunk goes to the device of highest "
      "priority whose rows in flight plus its batch size stay within its capacity. Lists of "
      "length 1 apply to every device; capacities and priorities may be empty (one chunk "
      "in flight; all equal). The CPU's chunk is cut into pieces over its `cpu_lanes`.")
      .def(py::init([](const std::vector<Device>& devices,
                       const std::vector<std::int64_t>& batch_sizes,
                       const std::vector<std::int64_t>& capacities,
                       const std::vector<double>& priorities, std::int64_t cpu_lanes) {
             return GreedyPriorityCapacity{.devices = devices,
                                           .batch_sizes = batch_sizes,
                                           .capacities = capacities,
                                           .priorities = priorities,
                                           .cpu_lanes = cpu_lanes};
           }),
           "devices"_a, "batch_sizes"_a, "capacities"_a = std::vector<std::int64_t>{},
           "priorities"_a = std::vector<double>{}, "cpu_lanes"_a = 0)
      .def_property(
          "devices", [](const GreedyPriorityCapacity& p) { return device_strings(p.devices); },
          [](GreedyPriorityCapacity& p, const std::vector<Device>& d) { p.devices = d; },
          "The pool: at most one CPU, each device once.")
      .def_readwrite("batch_sizes", &GreedyPriorityCapacity::batch_sizes,
                     "Rows per chunk: one per device, or one for all.")
      .def_readwrite("capacities", &GreedyPriorityCapacity::capacities,
                     "Rows in flight per device; empty: one chunk.")
      .def_readwrite("priorities", &GreedyPriorityCapacity::priorities,
                     "Higher first; empty: all equal.")
      .def_readwrite("cpu_lanes", &GreedyPriorityCapacity::cpu_lanes, cpu_lanes_doc)
      .def("__repr__", [](const GreedyPriorityCapacity& p) {
        return std::string(py::str("GreedyPriorityCapacity(devices={}, batch_sizes={}, "
                                   "capacities={}, priorities={}, cpu_lanes={})")
                               .format(device_strings(p.devices), p.batch_sizes, p.capacities,
                                       p.priorities, p.cpu_lanes));
      });
}

void bind_solver_config(py::module_& m) {
  py::class_<SolverConfig::Krylov>(m, "KrylovConfig",
                                   "NEML2's GMRES settings of a matrix-free Newton step.")
      .def(py::init<>())
      .def_readwrite("method", &SolverConfig::Krylov::method)
      .def_readwrite("restart", &SolverConfig::Krylov::restart)
      .def_readwrite("max_its", &SolverConfig::Krylov::max_its)
      .def_readwrite("abs_tol", &SolverConfig::Krylov::abs_tol)
      .def_readwrite("rel_tol", &SolverConfig::Krylov::rel_tol)
      .def_readwrite("cache_strategy", &SolverConfig::Krylov::cache_strategy)
      .def_readwrite("cache_max_its", &SolverConfig::Krylov::cache_max_its);
  py::class_<NewtonFactors>(m, "NewtonFactors",
                            "Each point's factored Newton matrix, kept from one call to the "
                            "next (Model.forward(inputs, factors)): the chord. Pass the same "
                            "object to the calls of a history over the same points.")
      .def(py::init<>())
      .def_property_readonly("points", &NewtonFactors::points,
                             "The points it holds slots for (0 before the first call).")
      .def_property_readonly("nbytes", &NewtonFactors::bytes, "The bytes it holds.")
      .def("clear", &NewtonFactors::clear, "Forgets every point's factor.");

  py::class_<SolverConfig>(m, "SolverConfig",
                           "The Newton settings of an implicit model (a copy: change it, then "
                           "Model.set_solver_config).")
      .def(py::init<>())
      .def_readwrite("atol", &SolverConfig::atol)
      .def_readwrite("rtol", &SolverConfig::rtol)
      .def_readwrite("miters", &SolverConfig::miters)
      .def_readwrite("substep_del_tol", &SolverConfig::substep_del_tol)
      .def_readwrite("ls_type", &SolverConfig::ls_type, "BACKTRACKING or STRONG_WOLFE")
      .def_readwrite("ls_max_iters", &SolverConfig::ls_max_iters)
      .def_readwrite("ls_cutback", &SolverConfig::ls_cutback)
      .def_readwrite("ls_c", &SolverConfig::ls_c)
      .def_readwrite("solver_kind", &SolverConfig::solver_kind, "direct or krylov")
      .def_readwrite("krylov", &SolverConfig::krylov)
      .def_readwrite("compact_below", &SolverConfig::compact_below)
      .def_readwrite("row_pass", &SolverConfig::row_pass,
                     "on the CPU, Newton's steps as one pass over the rows (True) or as "
                     "tensor operations (False)")
      .def_readwrite("chord", &SolverConfig::chord,
                     "chord Newton where steps are direct on the CPU in double: each point "
                     "steps from its last factored Newton matrix while its residual falls by "
                     "chord_rate a step")
      .def_readwrite("chord_rate", &SolverConfig::chord_rate)
      .def("__repr__", [](const SolverConfig& c) {
        return std::string(py::str("SolverConfig(atol={}, rtol={}, miters={}, ls_type='{}', "
                                   "ls_max_iters={}, ls_cutback={}, ls_c={}, solver_kind='{}')")
                               .format(c.atol, c.rtol, c.miters, c.ls_type, c.ls_max_iters,
                                       c.ls_cutback, c.ls_c, c.solver_kind));
      });
}

} // namespace neml2::python

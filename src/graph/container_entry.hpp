#pragma once

// The AOTI model container's entry points, reached past its runner: loading asks it how
// many results a call returns, and a CPU call goes straight to it (graph_run.cpp).

#include <cstddef>
#include <string>

#include <fmt/format.h>
#include <torch/csrc/inductor/aoti_runner/model_container_runner.h>

#include <neml2/errors.hpp>

namespace neml2::detail {

// What AOTIModelContainerRunner::run() calls: the model container's C entry point, its
// handle and its proxy executor. Called directly, a graph call does without the runner's
// two vectors of handles per call and the hash map it builds of the results' handles.
struct ContainerEntry : torch::inductor::AOTIModelContainerRunner {
  using Run = decltype(&AOTInductorModelContainerRun);
  static Run run(const AOTIModelContainerRunner& r) { return r.*(&ContainerEntry::run_func_); }
  static AOTInductorModelContainerHandle container(const AOTIModelContainerRunner& r) {
    return r.*(&ContainerEntry::container_handle_);
  }
  static AOTIProxyExecutorHandle proxy(const AOTIModelContainerRunner& r) {
    return r.*(&ContainerEntry::proxy_executor_handle_);
  }
  static std::size_t outputs(const AOTIModelContainerRunner& r, const std::string& file) {
    std::size_t n = 0;
    if ((r.*(&ContainerEntry::get_num_outputs_func_))(container(r), &n) != AOTI_RUNTIME_SUCCESS)
      throw FatalError(fmt::format("loading '{}': its compiled library could not say how many "
                                   "results it returns; recompile the artifact with neml2-compile",
                                   file));
    return n;
  }
};

} // namespace neml2::detail

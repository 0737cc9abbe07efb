#pragma once

// Test support: the compiled artifacts and eager-NEML2 reference values made at build time
// (cmake/ModelArtifacts.cmake), and comparisons with a relative tolerance.

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include <neml2/dispatch.hpp>

#include "doctest_torch.hpp"
#include "reference_file.hpp"

namespace test {

namespace fs = std::filesystem;

/// ${build}/artifacts: <name>/ (what neml2-compile wrote) and <name>.ref/ (references).
inline fs::path artifacts() {
  return NEML2_DISPATCH_TEST_ARTIFACTS;
}

/// The stub of artifact `name`, compiled from a model named `model`.
inline fs::path stub(const std::string& name, const std::string& model) {
  return artifacts() / name / (model + "_aoti.i");
}

/// The artifact in root folder `root`, shared as a Session takes it.
inline std::shared_ptr<const neml2::Artifact> load_artifact(const fs::path& root) {
  return std::make_shared<const neml2::Artifact>(neml2::read_artifact(root));
}

/// A CPU session of artifact `name` (compiled from a model named "model"), its solver
/// configuration changed by `change` when one is given.
inline neml2::Session session(const std::string& name,
                              const std::function<void(neml2::SolverConfig&)>& change = {}) {
  neml2::Session s(load_artifact(neml2::resolve_artifact_root(stub(name, "model"), "model")),
                   "cpu");
  if (change) {
    auto config = s.solver_config();
    change(config);
    s.set_solver_config(config);
  }
  return s;
}

/// A model of artifact `name`, compiled from a model named `model`, under `policy`.
template <class Policy = neml2::SyncChunking>
neml2::DispatchedModel<Policy> load(const std::string& name, const std::string& model,
                                    Policy policy = {}) {
  return neml2::load_model(stub(name, model), model, std::move(policy));
}

/// The name of a history's step `s` in a reference ("s3": "s3/in", "s3/out", ...).
inline std::string step_name(int s) {
  return "s" + std::to_string(s);
}

/// Reference tensors by name ("b7/in/strain", ...), read once per artifact.
class Reference {
public:
  explicit Reference(const std::string& name)
      : _tensors(read_reference(artifacts() / (name + ".ref"))) {
    REQUIRE_MESSAGE(!_tensors.empty(), "no reference values for " << name);
  }

  [[nodiscard]] const at::Tensor& operator[](const std::string& key) const {
    const auto it = _tensors.find(key);
    if (it == _tensors.end())
      FAIL("no reference value '" << key << "'");
    return it->second;
  }

  /// Every tensor under "<prefix>/" keyed by the rest of its name.
  [[nodiscard]] neml2::TensorMap group(const std::string& prefix) const {
    neml2::TensorMap out;
    for (const auto& [key, t] : _tensors)
      if (key.rfind(prefix + "/", 0) == 0 && key.find('/', prefix.size() + 1) == std::string::npos)
        out.emplace(key.substr(prefix.size() + 1), t);
    return out;
  }

private:
  std::map<std::string, at::Tensor> _tensors;
};

/// |actual - expected| <= rtol * max|expected| elementwise, after broadcasting, with the
/// same shape unless `broadcast`.
inline void check_close(const at::Tensor& actual, const at::Tensor& expected,
                        const std::string& what, double rtol = 1e-10, bool broadcast = false) {
  INFO(what);
  REQUIRE(actual.defined());
  if (!broadcast)
    REQUIRE_MESSAGE(actual.sizes() == expected.sizes(),
                    "shape " << actual.sizes() << " vs reference " << expected.sizes());
  const auto a = actual.to(at::kCPU, at::kDouble);
  const auto scale = std::max(expected.abs().max().item<double>(), 1e-300);
  const auto error = (a - expected).abs().max().item<double>() / scale;
  CHECK_MESSAGE(error <= rtol, "relative error " << error << " > " << rtol);
}

inline void check_close(const neml2::TensorMap& actual, const neml2::TensorMap& expected,
                        const std::string& what, double rtol = 1e-10) {
  REQUIRE(actual.size() == expected.size());
  for (const auto& [name, t] : expected) {
    REQUIRE_MESSAGE(actual.count(name), what << ": no '" << name << "' in the result");
    check_close(actual.at(name), t, what + " '" + name + "'", rtol);
  }
}

/// Bitwise equal: same shape, same values (NaN nowhere).
inline bool identical(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && at::equal(a.to(at::kCPU), b.to(at::kCPU));
}

inline bool identical(const neml2::TensorMap& a, const neml2::TensorMap& b) {
  if (a.size() != b.size())
    return false;
  for (const auto& [name, t] : a)
    if (!b.count(name) || !identical(t, b.at(name)))
      return false;
  return true;
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// The message of the neml2::FatalError that f throws (fails the test if none).
template <class F>
std::string fatal_message(F&& f) {
  try {
    f();
  } catch (const neml2::FatalError& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected neml2::FatalError, got another exception: " << e.what());
  }
  FAIL("expected neml2::FatalError, nothing was thrown");
  return {};
}

} // namespace test

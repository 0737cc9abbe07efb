// neml2-dispatch info: what an artifact offers (inputs, outputs, parameters, operations,
// segments, devices and dtypes), as text or JSON.

#include <cstdio>
#include <memory>

#include <neml2/artifact_info.hpp>

#include "arguments.hpp"
#include "commands.hpp"

namespace program {
namespace {

struct InfoCommand {
  ModelArguments model;
  bool json = false;
  CLI::App* add(CLI::App& app) {
    auto* c = app.add_subcommand("info", "what an artifact offers: inputs, outputs, parameters, "
                                         "operations, segments, devices and dtypes");
    model.add(c);
    c->add_flag("--json", json, "print JSON instead of text");
    return c;
  }

  void run() const {
    const auto info = neml2::artifact_info(model.artifact());
    std::fputs((json ? neml2::artifact_info_json(info) : neml2::format_artifact_info(info)).c_str(),
               stdout);
  }
};

} // namespace

void add_info_command(CLI::App& app) {
  auto command = std::make_shared<InfoCommand>();
  command->add(app)->callback([command] { command->run(); });
}

} // namespace program

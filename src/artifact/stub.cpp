// Reading the stub neml2-compile writes (<name>_aoti.i) with nmhit, NEML2's own HIT
// parser, so that a stub reads here exactly as NEML2 reads it. Only [Models]/[<model>]
// matters to the runtime; [Tensors] (Python expressions, triple-quoted multi-line text
// included) and [Settings] are parsed and ignored, as NEML2's runtime ignores them.
//
// Three things nmhit does are guarded before or instead of calling it (found by hand and
// by fuzz_stub; docs/reliability-runs.md): deep nesting (its time grows with the cube of
// the depth, and 10,000 nested sections overflow the stack), `!include` (it opens any
// path, relative to the working directory, /dev/stdin included), and `${...}` in the
// fields we read (a field that refers to itself recurses until the stack overflows).

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nmhit/nmhit.h>

#include <neml2/artifact.hpp>

#include "artifact/files.hpp"

namespace fs = std::filesystem;

namespace neml2 {
namespace {

constexpr std::size_t max_depth = 64;

// The nesting of [name] ... [] and the `!include`s outside quoted text and comments,
// checked before nmhit sees the text.
void check_structure(std::string_view text, const fs::path& stub) {
  std::size_t depth = 0;
  int line = 1;
  const auto skip_to = [&](std::size_t from, std::size_t to) {
    line += static_cast<int>(std::count(text.begin() + from, text.begin() + to, '\n'));
  };
  // A quote opens a string only where a value starts; inside a word (don't) nmhit skips
  // it as an unexpected character and reads on, sections included.
  const auto starts_value = [&](std::size_t i) {
    return i == 0 || std::string_view(" \t\r\n=").find(text[i - 1]) != std::string_view::npos;
  };
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\n') {
      ++line;
    } else if (c == '#') {
      i = std::min(text.find('\n', i), text.size()) - 1;
    } else if ((c == '\'' || c == '"') && starts_value(i)) {
      // '...', "...", '''...''' or """...""" (unterminated: nmhit's error, not ours).
      const bool triple = text.substr(i, 3) == std::string(3, c);
      const auto open = triple ? 3 : 1;
      const auto close = text.find(text.substr(i, open), i + open);
      const auto end = close == std::string_view::npos ? text.size() : close + open;
      skip_to(i, end);
      i = end - 1;
    } else if (c == '[') {
      const auto close = text.find_first_of("]\n", i);
      if (close == std::string_view::npos || text[close] == '\n')
        continue;
      auto name = text.substr(i + 1, close - i - 1);
      name.remove_prefix(std::min(name.find_first_not_of(" \t"), name.size()));
      name.remove_suffix(name.size() - std::min(name.find_last_not_of(" \t") + 1, name.size()));
      if (name.empty() || name == ".." || name == "../")
        depth -= depth > 0;
      else if (++depth > max_depth)
        throw FatalError(fmt::format("{}:{}: section [{}] is nested more than {} deep; a stub "
                                     "written by neml2-compile nests 2 deep",
                                     stub.string(), line, name, max_depth));
      i = close;
    } else if (c == '!' && text.substr(i, 8) == "!include") {
      throw FatalError(fmt::format("{}:{}: !include is not read in a stub (neml2-compile writes "
                                   "none, and nmhit would resolve it against the working "
                                   "directory): put the included text into the stub",
                                   stub.string(), line));
    }
  }
}

std::unique_ptr<nmhit::Node> parse(std::string_view text, const fs::path& stub) {
  check_structure(text, stub);
  try {
    return nmhit::parse_text(std::string(text));
  } catch (const nmhit::Error& e) {
    std::vector<std::string> messages;
    for (const auto& m : e.messages) {
      auto message = m.line > 0
                         ? fmt::format("{}:{}:{}: {}", stub.string(), m.line, m.column, m.message)
                         : fmt::format("{}: {}", stub.string(), m.message);
      if (std::find(messages.begin(), messages.end(), message) == messages.end())
        messages.push_back(std::move(message));
    }
    if (messages.empty())
      messages.push_back(fmt::format("{}: {}", stub.string(), e.what()));
    throw FatalError(fmt::format("{}; a stub is HIT as neml2-compile writes it (read with "
                                 "nmhit, NEML2's parser): regenerate it with neml2-compile",
                                 fmt::join(messages, "; ")));
  }
}

// The model sections of every top-level [Models], in order.
std::vector<const nmhit::Node*> model_blocks(const nmhit::Node& root) {
  std::vector<const nmhit::Node*> blocks;
  for (const auto* top : root.children(nmhit::NodeType::Section))
    if (top->path() == "Models")
      for (const auto* block : top->children(nmhit::NodeType::Section))
        blocks.push_back(block);
  return blocks;
}

std::vector<std::string> names_of(const std::vector<const nmhit::Node*>& blocks) {
  std::vector<std::string> names;
  for (const auto* block : blocks)
    if (std::find(names.begin(), names.end(), block->path()) == names.end())
      names.push_back(block->path());
  return names;
}

std::string listed(const std::vector<std::string>& names) {
  return names.empty() ? "none" : fmt::format("{}", fmt::join(names, ", "));
}

// A field of the model block, as NEML2 reads a string parameter (quotes stripped), or
// nullopt when absent.
std::optional<std::string> field(const nmhit::Node& block, const std::string& key,
                                 const std::string& where) {
  const auto* node = block.find(key);
  if (!node || node->type() != nmhit::NodeType::Field)
    return std::nullopt;
  const auto& raw = static_cast<const nmhit::Field*>(node)->raw_val();
  if (nmhit::has_brace_expr(raw))
    throw FatalError(fmt::format("{}: {} = {} holds a ${{...}} expression, which a stub does not "
                                 "take; write the value itself, as neml2-compile does",
                                 where, key, raw));
  try {
    return block.param<std::string>(key);
  } catch (const nmhit::Error& e) {
    throw FatalError(fmt::format("{}: {}: {}", where, key, e.what()));
  }
}

} // namespace

namespace detail {

std::vector<std::string> stub_models(std::string_view text, const fs::path& stub) {
  return names_of(model_blocks(*parse(text, stub)));
}

fs::path artifact_root_from_stub(std::string_view text, const fs::path& stub,
                                 const std::optional<std::string>& model) {
  const auto root = parse(text, stub);
  const auto blocks = model_blocks(*root);
  const auto names = names_of(blocks);
  if (blocks.empty())
    throw FatalError(fmt::format("{}: no model under [Models]; a stub written by neml2-compile "
                                 "has [Models]/[<model>] with type = AOTIModel",
                                 stub.string()));
  if (!model && names.size() > 1)
    throw FatalError(fmt::format("{}: the stub holds {} models ({}); name the one to load",
                                 stub.string(), names.size(), listed(names)));
  const auto name = model.value_or(names.front());
  const auto it = std::find_if(blocks.begin(), blocks.end(),
                               [&](const auto* block) { return block->path() == name; });
  if (it == blocks.end())
    throw FatalError(fmt::format("{}: no model '{}' under [Models] (models there: {}); pass one "
                                 "of those names",
                                 stub.string(), name, listed(names)));
  const auto where = fmt::format("{}:{}: [Models]/[{}]", stub.string(), (*it)->line(), name);
  const auto type = field(**it, "type", where);
  if (type != "AOTIModel")
    throw FatalError(fmt::format(
        "{} has type = {}, expected AOTIModel: this is not a compiled-model stub; compile it "
        "with neml2-compile <input.i> --model {} and load the <name>_aoti.i it writes",
        where, type.value_or("(none)"), name));
  const auto path = field(**it, "artifact_path", where);
  if (!path || path->empty())
    throw FatalError(fmt::format("{} has no artifact_path; set it to the artifact root folder "
                                 "(relative to the stub's folder, or absolute)",
                                 where));
  const fs::path target = *path;
  return target.is_absolute() ? target : stub.parent_path() / target;
}

} // namespace detail

namespace {
std::string read_stub(const fs::path& stub) {
  return detail::read_text(stub, "the stub (the <name>_aoti.i file that neml2-compile writes)");
}

fs::path resolve(const fs::path& path, const std::optional<std::string>& model) {
  const auto status = detail::status_of(path, "the stub or artifact root");
  if (fs::is_directory(status))
    return path;
  if (!fs::exists(status))
    throw FatalError(fmt::format("'{}' does not exist: pass a stub (<name>_aoti.i) or an "
                                 "artifact root folder written by neml2-compile",
                                 path.string()));
  return detail::artifact_root_from_stub(read_stub(path), path, model);
}
} // namespace

fs::path artifact_root_from_stub(const fs::path& stub, const std::string& model) {
  return detail::artifact_root_from_stub(read_stub(stub), stub, model);
}

fs::path artifact_root_from_stub(const fs::path& stub) {
  return detail::artifact_root_from_stub(read_stub(stub), stub);
}

std::vector<std::string> stub_models(const fs::path& stub) {
  return detail::stub_models(read_stub(stub), stub);
}

fs::path resolve_artifact_root(const fs::path& path, const std::string& model) {
  return resolve(path, model);
}

fs::path resolve_artifact_root(const fs::path& path) {
  return resolve(path, std::nullopt);
}

} // namespace neml2

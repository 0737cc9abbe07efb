// Reading the stub neml2-compile writes (<name>_aoti.i) with nmhit, NEML2's own HIT
// parser, so that a stub reads here exactly as NEML2 reads it. Only [Models]/[<model>]
// matters to the runtime; [Tensors] (Python expressions, triple-quoted multi-line text
// included) and [Settings] are parsed and ignored, as NEML2's runtime ignores them.
//
// What nmhit does with hostile text is guarded before calling it (found by hand and by
// fuzz_stub; docs/reliability-runs.md): deep nesting (its time grows with the cube of the
// depth, and 10,000 nested sections overflow the stack), many sections or fields (its time
// grows with the square of a section's fields), `!include` (it opens any path, relative to
// the working directory, /dev/stdin included), `${...}` in the fields we read (a field that
// refers to itself recurses until the stack overflows), and a stub of more than 1 MiB.

#include <algorithm>
#include <cctype>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nmhit/nmhit.h>

#include <neml2/artifact.hpp>

#include "core/bounded_files.hpp"

namespace fs = std::filesystem;

namespace neml2 {
namespace {

constexpr std::size_t max_depth = 64;
// Counted anywhere in the text, inside quotes and comments too, so that no misreading of
// where nmhit's strings begin can hide them: nmhit's time grows with the cube of the
// nesting (0.15 s for 1,024 nested sections, 8.6 s for 2,000) and with the square of a
// section's fields (0.08 s for 10,000, 5.8 s for 100,000). The stubs neml2-compile wrote
// for models/ and fuzz/corpus/stub/ hold at most 13 '[' and 9 '=' (with [Tensors] and
// [Settings]) in at most 640 bytes: margins of 80, 1,000 and 1,600.
constexpr std::size_t max_sections = 1024;
constexpr std::size_t max_assignments = 10000;
constexpr std::string_view regenerate_stub = "regenerate it with neml2-compile";

// nmhit's field names: a quote opens a string only after one of them and '=' (or ':=').
bool field_name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) ||
         std::string_view("!*+-./<>_~").find(c) != std::string_view::npos;
}

// Whether a quote at `i` opens a string for nmhit: it follows `name =` (or `name :=`) and
// nothing else on its line. Elsewhere nmhit skips the quote as an unexpected character
// and reads on (`x = don't`, a quote at the start of a line), sections included. Where
// nmhit opens one and this does not (`x = 1 y = '...'` on one line), the text inside is
// read as the stub's: an over-count, never a miss.
bool opens_string(std::string_view text, std::size_t i) {
  const auto back_over = [&](std::size_t j, auto&& skip) {
    while (j > 0 && skip(text[j - 1]))
      --j;
    return j;
  };
  const auto blank = [](char c) { return c == ' ' || c == '\t'; };
  auto j = back_over(i, blank);
  if (j == 0 || text[j - 1] != '=')
    return false;
  --j;
  if (j > 0 && text[j - 1] == ':')
    --j;
  const auto name_end = back_over(j, blank);
  const auto name_begin = back_over(name_end, field_name_char);
  if (name_begin == name_end)
    return false;
  const auto line_begin = back_over(name_begin, blank);
  return line_begin == 0 || text[line_begin - 1] == '\n';
}

// Section headers and '=' anywhere in the text: bounds that hold whatever nmhit takes for
// a string, a comment or a ${...} expression.
void check_counts(std::string_view text, const fs::path& stub) {
  std::size_t sections = 0;
  for (auto i = text.find('['); i != std::string_view::npos; i = text.find('[', i + 1)) {
    const auto next = text.find_first_not_of(" \t", i + 1);
    const auto rest = next == std::string_view::npos ? std::string_view() : text.substr(next);
    sections += !rest.starts_with("]") && !rest.starts_with("..");
  }
  if (sections > max_sections)
    throw FatalError(fmt::format("{}: {} section headers (counted as '[' anywhere in the text), "
                                 "more than the {} read at most; a stub written by neml2-compile "
                                 "has fewer than 20: {}",
                                 stub.string(), sections, max_sections, regenerate_stub));
  if (const auto n = static_cast<std::size_t>(std::count(text.begin(), text.end(), '='));
      n > max_assignments)
    throw FatalError(fmt::format("{}: {} fields (counted as '=' anywhere in the text), more than "
                                 "the {} read at most; a stub written by neml2-compile has fewer "
                                 "than 20: {}",
                                 stub.string(), n, max_assignments, regenerate_stub));
}

// The nesting of [name] ... [] and the `!include`s outside quoted text and comments,
// checked before nmhit sees the text.
void check_structure(std::string_view text, const fs::path& stub) {
  detail::check_size(text.size(), detail::max_stub_bytes, "the stub", stub.string(),
                     regenerate_stub);
  std::size_t depth = 0;
  int line = 1;
  const auto skip_to = [&](std::size_t from, std::size_t to) {
    line += static_cast<int>(std::count(text.begin() + from, text.begin() + to, '\n'));
  };
  // Inside a ${...} expression (it may span lines) nothing opens a string or a comment. A
  // comment starts a line: after a value nmhit takes '#' as part of it, or skips it as an
  // unexpected character, and reads on.
  std::size_t braces = 0;
  bool blank_line = true; // so far
  // The next ']' or line end, found once for a stretch of '[' (a line of them stays linear).
  auto header_end = std::string_view::npos;
  bool searched = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const bool first_on_line = blank_line;
    blank_line = blank_line && (c == ' ' || c == '\t');
    if (c == '\n') {
      ++line;
      blank_line = true;
    } else if (c == '$' && text.substr(i, 2) == "${") {
      ++braces;
      ++i;
    } else if (braces > 0 && (c == '{' || c == '}')) {
      braces += c == '{' ? 1 : -1;
    } else if (braces == 0 && c == '#' && first_on_line) {
      i = std::min(text.find('\n', i), text.size()) - 1;
    } else if (braces == 0 && (c == '\'' || c == '"') && opens_string(text, i)) {
      // '...', "...", '''...''' or """...""" (unterminated: nmhit reads it to the end).
      const bool triple = text.substr(i, 3) == std::string(3, c);
      const auto open = triple ? 3 : 1;
      const auto close = text.find(text.substr(i, open), i + open);
      const auto end = close == std::string_view::npos ? text.size() : close + open;
      skip_to(i, end);
      i = end - 1;
    } else if (c == '[') {
      if (!searched || (header_end != std::string_view::npos && header_end < i))
        header_end = text.find_first_of("]\n", i);
      searched = true;
      const auto close = header_end;
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
  check_counts(text, stub);
  try {
    return nmhit::parse_text(std::string(text));
  } catch (const nmhit::Error& e) {
    // The first few, each once: nmhit reports every unexpected character (a million for a
    // stub of a million), and a search of the list per message was quadratic.
    constexpr std::size_t shown = 10;
    std::vector<std::string> messages;
    std::set<std::string> seen;
    std::size_t more = 0;
    for (const auto& m : e.messages) {
      auto message = m.line > 0
                         ? fmt::format("{}:{}:{}: {}", stub.string(), m.line, m.column, m.message)
                         : fmt::format("{}: {}", stub.string(), m.message);
      if (messages.size() == shown)
        ++more;
      else if (seen.insert(message).second)
        messages.push_back(std::move(message));
    }
    if (more > 0)
      messages.push_back(fmt::format("{} more messages", more));
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

// In order, each once (a set: a search of the list per block was quadratic in the blocks).
std::vector<std::string> names_of(const std::vector<const nmhit::Node*>& blocks) {
  std::vector<std::string> names;
  std::set<std::string> seen;
  for (const auto* block : blocks)
    if (auto name = block->path(); seen.insert(name).second)
      names.push_back(std::move(name));
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
  return detail::read_text(stub, "the stub (the <name>_aoti.i file that neml2-compile writes)",
                           detail::max_stub_bytes, regenerate_stub);
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

// Loading one compiled graph and checking it: against its own file name, against what
// metadata.json implies, and on every call.

#include "graph/graph.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <charconv>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <regex>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/ScopeExit.h>
#include <caffe2/serialize/inline_container.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/inductor/aoti_runner/model_container_runner.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <neml2/detail/graph_calls.hpp>
#include <neml2/errors.hpp>

#include "artifact/files.hpp"
#include "core/shape_text.hpp"
#include "graph/landing.hpp"

namespace fs = std::filesystem;

namespace neml2::detail {
namespace {

// Some artifacts call neml2::opaque_pow (a pow hidden from Inductor's fusion).
void register_custom_operators() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (c10::Dispatcher::singleton().findSchema({"neml2::opaque_pow", ""}).has_value())
      return;
    static torch::Library library(torch::Library::FRAGMENT, "neml2", std::nullopt, __FILE__,
                                  __LINE__);
    library.def(
        "opaque_pow(Tensor base, Tensor exponent) -> Tensor",
        [](const at::Tensor& base, const at::Tensor& exponent) { return at::pow(base, exponent); });
  });
}

constexpr std::string_view recompile = "recompile the artifact with neml2-compile";

[[noreturn]] void not_a_package(const fs::path& file, const std::string& why) {
  throw FatalError(fmt::format("graph file '{}' is not a compiled graph neml2-dispatch can use "
                               "({}); the artifact is damaged or incomplete: recompile it with "
                               "neml2-compile",
                               file.string(), why));
}

// The text records read here (the generated wrapper and its metadata): at most 16 MiB, a
// margin of 160 over the largest real wrapper (99 KiB, of the models in models/). A run of
// one character class longer than 4 KiB (the longest real one: 156 characters) is refused
// too: std::regex matches \d+, \w+ and \s* by recursion, one frame per character, and
// 100,000 of them overflow the stack.
constexpr std::size_t max_wrapper_bytes = std::size_t(16) << 20;
constexpr std::size_t max_run = 4096;
// What a signature may declare: far more than any real graph (a few dozen arguments of at
// most 6 dimensions), little enough that nothing sized by it runs out of memory.
constexpr std::size_t max_arguments = 1 << 16;
constexpr std::size_t max_dims = 64;

// The records read here: the generated wrapper's source and its metadata.
bool read_as_text(const std::string& record) {
  return record.ends_with("wrapper.cpp") || record.ends_with("wrapper_metadata.json");
}

// The folder every record of a PyTorch archive sits in, from the name of the zip's first
// local file header (the same record PyTorch takes the archive's name from).
std::string archive_name(std::string_view bytes, const fs::path& file) {
  if (bytes.size() < 30)
    not_a_package(file, "shorter than a zip header");
  const auto* header = reinterpret_cast<const unsigned char*>(bytes.data());
  if (header[0] != 'P' || header[1] != 'K' || header[2] != 3 || header[3] != 4)
    not_a_package(file, "not a zip archive");
  const auto name_length = std::size_t(header[26]) | std::size_t(header[27]) << 8;
  if (bytes.size() < 30 + name_length)
    not_a_package(file, "truncated zip header");
  const auto name = bytes.substr(30, name_length);
  const auto slash = name.find('/');
  if (slash == std::string::npos || slash == 0)
    not_a_package(file, "its records are not in one folder");
  return std::string(name.substr(0, slash));
}

std::uint32_t crc32(const unsigned char* data, std::size_t size) {
  static const auto table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      auto c = i;
      for (int k = 0; k < 8; ++k)
        c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  std::uint32_t c = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < size; ++i)
    c = table[(c ^ data[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

// Every record of the package against the CRC-32 its zip directory stores: the loader
// does not check them, and a damaged shared library inside would run (SIGILL, SIGSEGV).
// And every record's size: PyTorch's reader allocates what the directory says before it
// reads a record. And what PyTorch's reader checks when it opens the archive (the folder
// of the directory's first entry, a version record it can parse and supports): when its
// constructor throws, torch 2.12 leaks the zip reader it opened.
void check_records(std::string_view bytes, const std::string& folder, const fs::path& file) {
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  const auto size = bytes.size();
  const auto u16 = [&](std::size_t at) {
    return at + 2 <= size ? std::uint32_t(data[at]) | std::uint32_t(data[at + 1]) << 8 : 0u;
  };
  const auto u32 = [&](std::size_t at) { return u16(at) | u16(at + 2) << 16; };
  const auto damaged = [&](const std::string& why) { not_a_package(file, why); };
  // The end-of-central-directory record: 22 bytes plus a comment of at most 64 KiB.
  std::size_t end = std::string::npos;
  for (std::size_t at = size >= 22 ? size - 22 : 0; size >= 22; --at) {
    if (u32(at) == 0x06054b50u) {
      end = at;
      break;
    }
    if (at == 0 || size - at > 22 + 0xFFFF)
      break;
  }
  if (end == std::string::npos)
    damaged("no zip directory at its end: truncated");
  const auto entries = u16(end + 10);
  std::size_t at = u32(end + 16);
  if (at == 0xFFFFFFFFu || entries == 0xFFFFu)
    damaged("a zip64 archive, which neml2-compile writes only for graphs larger than 4 GiB");
  // `.data/version` and `version`: the text of a stored record, nullopt in a compressed one.
  std::optional<std::optional<std::string>> version, old_version;
  for (std::uint32_t e = 0; e < entries; ++e) {
    if (u32(at) != 0x02014b50u)
      damaged(fmt::format("zip directory entry {} is damaged", e));
    const auto method = u16(at + 10);
    const auto crc = u32(at + 16);
    const std::size_t stored = u32(at + 20);
    const std::size_t unpacked = u32(at + 24);
    const std::size_t local = u32(at + 42);
    const auto name_length = u16(at + 28);
    const std::string name(bytes.substr(std::min(at + 46, size), name_length));
    const auto next = at + 46 + name_length + u16(at + 30) + u16(at + 32);
    if (u32(local) != 0x04034b50u)
      damaged(fmt::format("record '{}' is damaged", name));
    const auto begin = local + 30 + u16(local + 26) + u16(local + 28);
    if (begin + stored > size)
      damaged(fmt::format("record '{}' is cut short", name));
    if ((method == 0 && unpacked != stored) || unpacked > max_package_bytes ||
        (unpacked > max_wrapper_bytes && read_as_text(name)))
      damaged(fmt::format("record '{}' says it unpacks to {} bytes", name, unpacked));
    if (method == 0 && crc32(data + begin, stored) != crc)
      damaged(fmt::format("record '{}' fails its CRC-32 check", name));
    if (e == 0 && !name.starts_with(folder + "/"))
      damaged(
          fmt::format("its zip directory's first record '{}' is not in folder '{}'", name, folder));
    if (name == folder + "/.data/version" || name == folder + "/version")
      (name.ends_with(".data/version") ? version : old_version) =
          method == 0 ? std::optional(std::string(bytes.substr(begin, stored))) : std::nullopt;
    at = next;
  }
  if (!version && !old_version)
    damaged(fmt::format("it holds no version record ('{}/version')", folder));
  const auto stored_text = version ? *version : *old_version;
  if (!stored_text) // compressed (neml2-compile stores every record): PyTorch's reader reads it
    return;
  const auto& text = *stored_text;
  std::uint64_t number = 0;
  try {
    number = std::stoull(text); // as PyTorch's reader reads it
  } catch (const std::exception&) {
    damaged(fmt::format("its version record holds '{}', not a number",
                        first_lines(std::string_view(text).substr(0, 40), 1)));
  }
  if (number < caffe2::serialize::kMinSupportedFileFormatVersion ||
      number > caffe2::serialize::kMaxSupportedFileFormatVersion)
    damaged(fmt::format("its archive format version {} is not one PyTorch reads ({} to {})", number,
                        caffe2::serialize::kMinSupportedFileFormatVersion,
                        caffe2::serialize::kMaxSupportedFileFormatVersion));
}

// A decimal number the wrapper's regular expressions matched, at most `most`.
template <class T>
T number(const std::ssub_match& digits, T most, const fs::path& file, const char* what) {
  T value{};
  const auto* first = &*digits.first;
  const auto [end, error] = std::from_chars(first, first + digits.length(), value);
  if (error != std::errc() || value > most)
    not_a_package(file,
                  fmt::format("its wrapper holds {} {}, more than {}", what, digits.str(), most));
  return value;
}

// The generated wrapper's input checks, one `check_input_<i>` function per argument.
std::vector<GraphInput> wrapper_inputs(const std::string& source, const fs::path& file) {
  static const std::regex function(R"(static void check_input_(\d+)\()");
  static const std::regex dtype(R"(_expected_dtype = aoti_torch_dtype_(\w+)\(\))");
  static const std::regex below(R"(_size\[(\d+)\] < (\d+)\))");
  static const std::regex above(R"(_size\[(\d+)\] > (\d+)\))");
  static const std::regex fixed(R"(if \((\d+) != \w+_size\[(\d+)\]\))");
  static const std::regex stride(R"(_stride\[(\d+)\])");
  constexpr auto most_rows = std::numeric_limits<std::int64_t>::max();
  std::vector<std::pair<std::size_t, std::size_t>> bodies; // (start, index)
  for (std::sregex_iterator it(source.begin(), source.end(), function), end; it != end; ++it)
    bodies.emplace_back(it->position(),
                        number<std::size_t>((*it)[1], max_arguments, file, "input number"));
  std::vector<GraphInput> inputs(bodies.size());
  for (std::size_t k = 0; k < bodies.size(); ++k) {
    const auto start = source.begin() + static_cast<std::ptrdiff_t>(bodies[k].first);
    const auto stop = k + 1 < bodies.size()
                          ? source.begin() + static_cast<std::ptrdiff_t>(bodies[k + 1].first)
                          : source.end();
    if (bodies[k].second >= inputs.size())
      continue;
    auto& in = inputs[bodies[k].second];
    std::size_t rank = 0;
    const auto dim = [&](const std::ssub_match& m) {
      const auto d = number<std::size_t>(m, max_dims - 1, file, "dimension");
      rank = std::max<std::size_t>(rank, d + 1);
      return d;
    };
    const auto size = [&](const std::ssub_match& m) {
      return number<std::int64_t>(m, most_rows, file, "size");
    };
    std::smatch m;
    if (std::regex_search(start, stop, m, dtype))
      in.dtype = m[1].str();
    std::vector<std::pair<std::size_t, std::int64_t>> sizes;
    for (std::sregex_iterator it(start, stop, fixed), end; it != end; ++it)
      sizes.emplace_back(dim((*it)[2]), size((*it)[1]));
    for (std::sregex_iterator it(start, stop, stride), end; it != end; ++it)
      dim((*it)[1]);
    for (std::sregex_iterator it(start, stop, below), end; it != end; ++it)
      if (dim((*it)[1]) == 0)
        in.min_rows = size((*it)[2]);
    for (std::sregex_iterator it(start, stop, above), end; it != end; ++it)
      if (dim((*it)[1]) == 0)
        in.max_rows = size((*it)[2]);
    in.sizes.assign(rank, -1);
    for (const auto& [d, s] : sizes)
      in.sizes[d] = s;
  }
  return inputs;
}

// A text record the regular expressions will read: no run longer than they can match.
void check_runs(std::string_view text, const fs::path& file, const std::string& record) {
  const auto kind = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' ? 1
           : std::isspace(static_cast<unsigned char>(c))           ? 2
                                                                   : 0;
  };
  std::size_t run = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    run = i > 0 && kind(text[i]) != 0 && kind(text[i]) == kind(text[i - 1]) ? run + 1 : 1;
    if (run > max_run)
      not_a_package(file, fmt::format("its record '{}' holds a word or a blank of more than {} "
                                      "characters",
                                      record, max_run));
  }
}

// Bytes of a package in memory, for PyTorch's reader.
class BytesReader final : public caffe2::serialize::ReadAdapterInterface {
public:
  explicit BytesReader(std::string_view bytes)
      : _bytes(bytes) {}
  std::size_t size() const override { return _bytes.size(); }
  std::size_t read(std::uint64_t pos, void* buf, std::size_t n, const char*) const override {
    if (pos >= _bytes.size())
      return 0;
    n = std::min<std::size_t>(n, _bytes.size() - pos);
    std::memcpy(buf, _bytes.data() + pos, n);
    return n;
  }

private:
  std::string_view _bytes;
};

std::atomic<const GraphCallObserver*> graph_call_observer{nullptr};

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

// The calling thread's current stream of `device`, for the runner (which, given none, takes
// the current stream of whichever device is current); none on the CPU.
void* stream_of(c10::Device device) {
  return device.is_cpu()
             ? nullptr
             : c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
}

std::string shape_of(const std::vector<std::int64_t>& sizes) {
  std::vector<std::string> dims;
  for (auto s : sizes)
    dims.push_back(s < 0 ? "B" : std::to_string(s));
  return fmt::format("({})", fmt::join(dims, ", "));
}

} // namespace

// Arguments padded to the exported minimum, made once at load (a graph keeps none of its
// arguments): a call of fewer rows copies into them and allocates nothing. One call at
// a time uses them; a concurrent one allocates its own.
struct Graph::Padding {
  std::mutex mutex;
  std::vector<at::Tensor> args; // the padded call's arguments: buffers where batched
};

void observe_graph_calls(GraphCallObserver observer) {
  const auto* kept = observer ? new GraphCallObserver(std::move(observer)) : nullptr;
  delete graph_call_observer.exchange(kept);
}

GraphSignature read_graph_signature(std::string_view bytes, const fs::path& file) {
  check_size(bytes.size(), max_package_bytes, "graph file", file.string(), recompile);
  GraphSignature s;
  s.archive_name = archive_name(bytes, file);
  check_records(bytes, s.archive_name, file);
  std::string source;
  try {
    caffe2::serialize::PyTorchStreamReader reader(std::make_shared<BytesReader>(bytes));
    for (const auto& record : reader.getAllRecords()) {
      if (!read_as_text(record))
        continue;
      const auto [data, size] = reader.getRecord(record);
      std::string text(static_cast<const char*>(data.get()), size);
      check_runs(text, file, record);
      if (record.ends_with("wrapper.cpp"))
        source = std::move(text);
      else {
        static const std::regex key(R"re("AOTI_DEVICE_KEY":\s*"(\w+)")re");
        std::smatch m;
        if (std::regex_search(text, m, key))
          s.device_type = m[1].str();
      }
    }
  } catch (const FatalError&) {
    throw;
  } catch (const std::exception& e) {
    not_a_package(file, first_lines(e.what()));
  }
  static const std::regex counts(R"(AOTInductorModelBase\(\s*(\d+),\s*(\d+),)");
  std::smatch m;
  if (source.empty() || !std::regex_search(source, m, counts))
    not_a_package(file, "it holds no generated wrapper source to check its signature against");
  s.num_inputs = number<std::size_t>(m[1], max_arguments, file, "an input count");
  s.num_outputs = number<std::size_t>(m[2], max_arguments, file, "an output count");
  s.inputs = wrapper_inputs(source, file);
  if (s.inputs.size() != s.num_inputs)
    not_a_package(file, fmt::format("its wrapper declares {} inputs but checks {}", s.num_inputs,
                                    s.inputs.size()));
  return s;
}

GraphSignature read_graph_signature(const fs::path& file) {
  return read_graph_signature(read_text(file, "graph file", max_package_bytes, recompile), file);
}

Graph::Graph(const fs::path& leaf, const std::string& package, const c10::Device& device,
             c10::ScalarType dtype, std::size_t runners, std::string listed_as)
    : _file((leaf / package).string())
    , _listed_as(std::move(listed_as))
    , _device(device.str())
    , _torch_device(device) {
  const fs::path file = _file;
  std::error_code ec;
  // A FIFO or a device in its place is read_graph_signature's error: it is no file.
  if (const auto status = fs::status(file, ec); !fs::exists(status) || fs::is_directory(status))
    throw FatalError(fmt::format("graph file '{}' (metadata.json {}) is missing; the artifact "
                                 "is incomplete: recompile it with neml2-compile",
                                 _file, _listed_as));
  _signature = read_graph_signature(file);
  if (_signature.archive_name != file.stem().string())
    throw FatalError(fmt::format(
        "graph file '{}' (metadata.json {}) holds the graph '{}', not '{}': a file was copied "
        "or renamed over another; recompile the artifact with neml2-compile",
        _file, _listed_as, _signature.archive_name, file.stem().string()));
  if (!_signature.device_type.empty() &&
      _signature.device_type != c10::DeviceTypeName(device.type(), true))
    throw FatalError(fmt::format("graph '{}' was compiled for {}, but it sits in the folder of "
                                 "graphs for {}: recompile with neml2-compile --device {}",
                                 _file, _signature.device_type, _device,
                                 c10::DeviceTypeName(device.type(), true)));
  const auto expected = dtype_folder(dtype);
  for (std::size_t i = 0; i < _signature.inputs.size(); ++i) {
    const auto& found = _signature.inputs[i].dtype;
    if (found.starts_with("float") && found != expected)
      throw FatalError(fmt::format(
          "graph '{}' takes {} inputs, but it sits in a {} folder: the artifact's graphs are "
          "not in the dtype their folder names (neml2-compile 3.1 --dtype float32 writes "
          "float64 graphs), and running them on {} data would give garbage. Compile with "
          "--dtype {} and pass {} inputs",
          _file, found, expected, expected, found, found));
  }
  for (const auto& in : _signature.inputs)
    if (in.batched()) {
      _min_rows = std::max(_min_rows, in.min_rows);
      _max_rows = std::min(_max_rows, in.max_rows);
    }
  if (_max_rows < std::max<std::int64_t>(_min_rows, 1))
    fail(fmt::format("its batch range [{}, {}] is empty", _min_rows, _max_rows));
  if (_min_rows > 1 && device.is_cpu()) {
    _padding = std::make_unique<Padding>();
    for (const auto& in : _signature.inputs) {
      auto sizes = in.sizes;
      if (!in.batched() ||
          std::any_of(sizes.begin() + 1, sizes.end(), [](auto d) { return d < 0; })) {
        _padding->args.emplace_back();
        continue;
      }
      sizes.front() = _min_rows;
      const auto type = in.dtype.empty() ? dtype : dtype_from_name(in.dtype);
      _padding->args.push_back(at::empty(sizes, at::TensorOptions().dtype(type)));
    }
  }

  // Loader construction is not thread-safe in torch: one at a time, process-wide.
  static std::mutex construction;
  std::lock_guard lock(construction);
  // Loading for cuda:N makes N the thread's current device: the guard puts back the one
  // the caller had (the probe call of expect() takes the stream of _torch_device anyway).
  c10::OptionalDeviceGuard restore;
  if (!device.is_cpu())
    restore.reset_device(device);
  register_custom_operators();
  _loader =
      translate_foreign_errors(fmt::format("loading '{}' for {}", _file, _device).c_str(), [&] {
        return std::make_unique<torch::inductor::AOTIModelPackageLoader>(
            _file, "model", /*run_single_threaded=*/false,
            /*num_runners=*/runners, device.index());
      });
  _container_outputs = ContainerEntry::outputs(*_loader->get_runner(), _file);
}

Graph::Graph() = default;
Graph::~Graph() = default;
Graph::Graph(Graph&&) noexcept = default;
Graph& Graph::operator=(Graph&&) noexcept = default;

void Graph::fail(const std::string& what) const {
  throw FatalError(fmt::format("graph '{}' (metadata.json {}) does not match metadata.json: {}; "
                               "the graph belongs to another model or the metadata was edited: "
                               "recompile the artifact with neml2-compile",
                               _file, _listed_as, what));
}

// A graph exported with a static batch (neml2-compile `[Settings] dynamic_batch = false`)
// checks a fixed leading size where a dynamic one checks a range: its batch axes are those
// metadata.json calls batched (-1), or, where it does not say, every input's leading axis
// when all share one size. They become a range [N, N], so the padding and splitting below
// serve other batch sizes; a probe of one row repeated tells whether rows are
// interchangeable at all (a per-row tensor baked in makes each row different).
void Graph::pin_fixed_batch(const std::vector<std::optional<Shape>>& arguments) {
  auto& inputs = _signature.inputs;
  if (_fixed_rows > 0 || inputs.empty() ||
      std::any_of(inputs.begin(), inputs.end(), [](const GraphInput& in) { return in.batched(); }))
    return;
  std::vector<std::size_t> axes;
  for (std::size_t i = 0; i < inputs.size() && i < arguments.size(); ++i)
    if (arguments[i] && !arguments[i]->empty() && arguments[i]->front() < 0)
      axes.push_back(i);
  if (axes.empty() &&
      std::none_of(arguments.begin(), arguments.end(), [](const auto& a) { return a.has_value(); }))
    for (std::size_t i = 0; i < inputs.size(); ++i)
      if (!inputs[i].sizes.empty())
        axes.push_back(i);
  if (axes.empty())
    return;
  const auto rows = inputs[axes.front()].sizes.front();
  for (auto i : axes)
    if (inputs[i].sizes.empty() || inputs[i].sizes.front() != rows)
      return; // no common batch: the argument checks below say what differs
  for (auto i : axes) {
    inputs[i].sizes.front() = -1;
    inputs[i].min_rows = inputs[i].max_rows = rows;
  }
  _fixed_rows = _min_rows = _max_rows = rows;
  if (rows < 2)
    return;
  std::vector<at::Tensor> probe;
  for (const auto& in : inputs) {
    auto sizes = in.sizes;
    const auto options = at::TensorOptions()
                             .dtype(in.dtype.empty() ? _result_dtype : dtype_from_name(in.dtype))
                             .device(_torch_device);
    if (!in.batched()) {
      probe.push_back(at::zeros(sizes, options));
      continue;
    }
    sizes.front() = 1;
    const auto row = at::linspace(0.3, 0.7, numel(Shape(sizes.begin(), sizes.end())), options);
    sizes.front() = rows;
    probe.push_back(row.reshape(Shape(sizes.begin() + 1, sizes.end())).expand(sizes).contiguous());
  }
  std::vector<at::Tensor> results;
  try {
    results = run_checked(probe);
  } catch (const FatalError&) { // cannot tell: refuse other batch sizes rather than guess
    _rows_differ = true;
    return;
  }
  for (const auto& r : results) {
    if (r.dim() == 0 || r.size(0) != rows)
      continue;
    const auto first = r.narrow(0, 0, 1);
    const auto same =
        ((r - first).abs() <= 1e-12 * (1 + first.abs())) | (at::isnan(r) & at::isnan(first));
    _rows_differ = _rows_differ || !same.all().item<bool>();
  }
}

void Graph::expect(const std::vector<std::optional<Shape>>& arguments, std::size_t results) {
  pin_fixed_batch(arguments);
  if (results == unchecked_results)
    return;
  if (_signature.num_inputs != arguments.size())
    fail(fmt::format("it takes {} arguments, metadata.json implies {}", _signature.num_inputs,
                     arguments.size()));
  if (_signature.num_outputs != results)
    fail(fmt::format("it returns {} results, metadata.json implies {}", _signature.num_outputs,
                     results));
  for (std::size_t i = 0; i < arguments.size(); ++i)
    if (arguments[i] && _signature.inputs[i].sizes != *arguments[i])
      fail(fmt::format("argument {} is {} in the graph but {} in metadata.json", i,
                       shape_of(_signature.inputs[i].sizes), shape_of(*arguments[i])));
}

void Graph::expect(const std::vector<std::optional<Shape>>& arguments, std::vector<Result> results,
                   c10::ScalarType dtype) {
  expect(arguments, results.size());
  _results = std::move(results);
  _result_dtype = dtype;
  // The probe: zeros of the shapes the graph takes, at its smallest batch.
  std::vector<at::Tensor> zeros;
  for (const auto& in : _signature.inputs) {
    auto sizes = in.sizes;
    for (auto& d : sizes)
      d = d < 0 ? std::max<std::int64_t>(_min_rows, 1) : d;
    const auto type = in.dtype.empty() ? dtype : dtype_from_name(in.dtype);
    zeros.push_back(at::zeros(sizes, at::TensorOptions().dtype(type).device(_torch_device)));
  }
  static_cast<void>(run(zeros));
}

std::vector<at::Tensor> Graph::run(const std::vector<at::Tensor>& given) const {
  // Graphs read their arguments as dense row-major arrays, but results of other graphs can
  // come back column-major (J2's flow direction has strides (1, B)).
  std::vector<at::Tensor> dense;
  for (std::size_t i = 0; i < given.size(); ++i)
    if (given[i].defined() && !given[i].is_contiguous()) {
      if (dense.empty())
        dense = given;
      dense[i] = given[i].contiguous();
    }
  const auto& args = dense.empty() ? given : dense;
  if (args.size() != _signature.num_inputs)
    fail(fmt::format("called with {} arguments, it takes {}", args.size(), _signature.num_inputs));
  std::int64_t rows = -1;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const auto& in = _signature.inputs[i];
    const auto& t = args[i];
    bool ok = t.defined() && t.dim() == static_cast<std::int64_t>(in.sizes.size());
    for (std::size_t d = 0; ok && d < in.sizes.size(); ++d)
      ok = in.sizes[d] < 0 || t.size(static_cast<std::int64_t>(d)) == in.sizes[d];
    if (ok && in.batched()) {
      ok = rows < 0 || t.size(0) == rows;
      rows = t.size(0);
    }
    if (!ok)
      fail(fmt::format("argument {} has shape {}, the graph takes {}", i,
                       t.defined() ? shape_text(t.sizes()) : "undefined", shape_of(in.sizes)));
  }
  if (_rows_differ && rows >= 0 && rows != _fixed_rows)
    throw FatalError(fmt::format(
        "graph '{}' was compiled for exactly {} rows (neml2-compile with [Settings] "
        "dynamic_batch = false) and gives equal rows different results (a per-row tensor baked "
        "into it, e.g. a [Tensors] entry bound to a coefficient), so a call of {} rows has no "
        "meaning: call it with batches of exactly {} rows (SyncChunking batch_size = {}), or "
        "make that tensor a promoted parameter (-p) and recompile with a dynamic batch",
        _file, _fixed_rows, rows, _fixed_rows, _fixed_rows));
  if (rows > _max_rows)
    return run_split(args, rows);
  if (const auto* observer = graph_call_observer.load(std::memory_order_acquire)) {
    const LandingPause not_the_graph; // what the observer allocates and keeps is its own
    (*observer)(_file, rows < 0 ? 1 : rows);
  }
  if (rows >= 0 && rows < _min_rows)
    return run_padded(args, rows);
  return run_checked(args);
}

// Fewer rows than the graph was exported for (one host point, an active set down to one
// row): the last row repeated (zeros for none), the results cut back in place.
std::vector<at::Tensor> Graph::run_padded(const std::vector<at::Tensor>& args,
                                          std::int64_t rows) const {
  std::unique_lock<std::mutex> reuse; // this graph's padded arguments, unless a call has them
  if (_padding)
    reuse = std::unique_lock(_padding->mutex, std::try_to_lock);
  std::vector<at::Tensor> own(reuse.owns_lock() ? 0 : args.size());
  auto& padded = reuse.owns_lock() ? _padding->args : own;
  const auto release = c10::make_scope_exit([&] { // the caller's tensors are not kept
    for (std::size_t i = 0; i < args.size(); ++i)
      if (!_signature.inputs[i].batched())
        padded[i].reset();
  });
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (!_signature.inputs[i].batched()) {
      padded[i] = args[i];
      continue;
    }
    c10::DimVector sizes(args[i].sizes());
    sizes[0] = _min_rows;
    if (rows == 0)
      padded[i] = at::zeros(sizes, args[i].options());
    else if (args[i].is_cpu()) { // copied by hand: a third of the cost of cat/expand
      auto& kept = padded[i];
      if (!kept.defined() || kept.sizes() != c10::IntArrayRef(sizes) ||
          kept.dtype() != args[i].dtype())
        kept = at::empty(sizes, args[i].options());
      const auto row = args[i].nbytes() / rows;
      auto* to = static_cast<char*>(padded[i].data_ptr());
      const auto* from = static_cast<const char*>(args[i].const_data_ptr());
      std::memcpy(to, from, rows * row);
      for (auto r = rows; r < _min_rows; ++r)
        std::memcpy(to + r * row, from + (rows - 1) * row, row);
    } else {
      sizes[0] = _min_rows - rows;
      padded[i] = at::cat({args[i], args[i].narrow(0, rows - 1, 1).expand(sizes)});
    }
  }
  auto results = run_checked(padded);
  for (auto& r : results) {
    if (r.dim() == 0 || r.size(0) != _min_rows)
      continue;
    // A result that is a padded argument (an input passed through, as the same tensor) is
    // copied: the buffer is written again by the next padded call.
    if (std::any_of(padded.begin(), padded.end(),
                    [&](const at::Tensor& a) { return a.defined() && a.is_alias_of(r); }))
      r = r.clone();
    // The graph's own fresh result, cut to the rows asked for in place (strides kept):
    // what narrow() gives without a dispatch.
    r.unsafeGetTensorImpl()->set_size(0, rows);
  }
  return results;
}

// More rows than the graph was exported for: pieces of the largest batch it takes (the
// last padded if need be), their per-row results joined.
std::vector<at::Tensor> Graph::run_split(const std::vector<at::Tensor>& args,
                                         std::int64_t rows) const {
  std::vector<std::vector<at::Tensor>> pieces;
  for (std::int64_t first = 0; first < rows; first += _max_rows) {
    auto part = args;
    for (std::size_t i = 0; i < part.size(); ++i)
      if (_signature.inputs[i].batched())
        part[i] = args[i].narrow(0, first, std::min(_max_rows, rows - first));
    pieces.push_back(run(part));
  }
  auto results = std::move(pieces.front());
  for (std::size_t r = 0; r < results.size(); ++r) {
    if (results[r].dim() == 0 || results[r].size(0) != _max_rows)
      continue; // the same for every row
    std::vector<at::Tensor> parts = {results[r]};
    for (std::size_t p = 1; p < pieces.size(); ++p)
      parts.push_back(pieces[p][r]);
    results[r] = at::cat(parts);
  }
  return results;
}

// One call of the model container on the CPU: new handles for the arguments (the
// container takes them), the results taken from the handles it returns (one tensor may
// come back under several outputs, as one handle).
std::vector<at::Tensor> Graph::run_container(const std::vector<at::Tensor>& args) const {
  namespace aoti = torch::aot_inductor;
  auto& runner = *_loader->get_runner();
  c10::SmallVector<AtenTensorHandle, 8> in, out(_container_outputs, nullptr);
  for (const auto& t : args)
    in.push_back(aoti::new_tensor_handle(at::Tensor(t)));
  const Recycling small_blocks;
  const auto error =
      ContainerEntry::run(runner)(ContainerEntry::container(runner), in.data(), in.size(),
                                  out.data(), out.size(), nullptr, ContainerEntry::proxy(runner));
  if (error != AOTI_RUNTIME_SUCCESS) // the handles are left: taken or not, nothing says
    throw FatalError(fmt::format("running '{}' on {}: the AOTI runtime's call failed (its reason "
                                 "is printed above, on standard error); a graph that fails on "
                                 "inputs this library accepted does not match its artifact: "
                                 "recompile it with neml2-compile",
                                 _file, _device));
  std::vector<at::Tensor> results(out.size());
  for (std::size_t r = 0; r < out.size(); ++r) {
    if (!out[r])
      continue;
    const auto first = std::find(out.begin(), out.begin() + r, out[r]);
    if (first != out.begin() + r) {
      results[r] = results[first - out.begin()];
      continue;
    }
    auto* t = aoti::tensor_handle_to_tensor_pointer(out[r]);
    results[r] = std::move(*t);
    delete t;
  }
  return results;
}

std::vector<at::Tensor> Graph::run_checked(const std::vector<at::Tensor>& args) const {
  std::vector<at::Tensor> results;
  if (_torch_device.is_cpu())
    results = run_container(args);
  else // the runner of each accelerator has its own run_impl(); it is not bypassed
    try {
      results = _loader->run(args, stream_of(_torch_device));
    } catch (const std::exception& e) {
      throw FatalError(fmt::format("running '{}' on {}: {}", _file, _device, first_lines(e.what())),
                       e.what());
    }
  if (results.size() != _signature.num_outputs)
    fail(fmt::format("it returned {} results, its signature says {}", results.size(),
                     _signature.num_outputs));
  if (_results.empty())
    return results;
  std::int64_t rows = 1;
  for (std::size_t i = 0; i < args.size(); ++i)
    if (_signature.inputs[i].batched())
      rows = args[i].size(0);
  for (std::size_t r = 0; r < results.size(); ++r) {
    const auto& t = results[r];
    const auto& expected = _results[r].trailing;
    bool ok = t.defined() && t.scalar_type() == _result_dtype &&
              t.dim() == static_cast<std::int64_t>(expected.size()) + 1 &&
              (t.size(0) == rows || t.size(0) == 1);
    for (std::size_t d = 0; ok && d < expected.size(); ++d) {
      const auto size = t.size(static_cast<std::int64_t>(d) + 1);
      ok = size == expected[d] || (_results[r].broadcast && size == 1);
    }
    if (!ok)
      fail(fmt::format("result {} is {} {}, metadata.json implies {} (B, {})", r,
                       t.defined() ? c10::toString(t.scalar_type()) : "undefined",
                       t.defined() ? shape_text(t.sizes()) : "", c10::toString(_result_dtype),
                       fmt::join(expected, ", ")));
  }
  return results;
}

} // namespace neml2::detail

// What the fuzz targets (fuzz/) found, kept as inputs that must give a FatalError naming
// the field, and every seed of their corpora replayed: each parses or is a FatalError.

#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>

#include <caffe2/serialize/inline_container.h>
#include <doctest/doctest.h>

#include <neml2/artifact.hpp>
#include <neml2/errors.hpp>
#include <neml2/tune.hpp>

#include "graph/graph.hpp"

namespace fs = std::filesystem;
using neml2::FatalError;

namespace {

const fs::path corpus = fs::path(NEML2_DISPATCH_TEST_SOURCES) / ".." / "fuzz" / "corpus";

std::string read(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return std::move(text).str();
}

// The FatalError's message, or a failed check when parsing succeeds or throws another type.
std::string metadata_error(const std::string& seed) {
  try {
    (void)neml2::detail::parse_metadata(read(corpus / "metadata" / seed), "fuzz");
    FAIL_CHECK(seed << " parsed without an error");
  } catch (const FatalError& e) {
    return e.what();
  }
  return {};
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A real graph package rewritten by PyTorch's own archive writer (valid CRC-32s), its
// generated wrapper's source edited by `edit`; given `version`, with an old-style version
// record (`<folder>/version`) holding it (torch 2.12's writer then writes no other).
std::string repackaged(const std::function<void(std::string&)>& edit,
                       const std::optional<std::string>& version = std::nullopt) {
  caffe2::serialize::PyTorchStreamReader reader(
      (fs::path(NEML2_DISPATCH_TEST_ARTIFACTS) / "elasticity" / "elasticity" / "cpu" / "float64" /
       "elasticity.pt2")
          .string());
  std::string bytes;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, std::size_t n) {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  for (const auto& record : reader.getAllRecords()) {
    const auto [data, size] = reader.getRecord(record);
    std::string text(static_cast<const char*>(data.get()), size);
    if (record.ends_with("wrapper.cpp"))
      edit(text);
    if (record != ".data/version" && record != ".data/serialization_id" && record != "byteorder")
      writer.writeRecord(record, text.data(), text.size()); // the rest the writer writes itself
  }
  if (version)
    writer.writeRecord("version", version->data(), version->size());
  writer.writeEndOfFile();
  return bytes;
}

// Replaces the first `from` in `text` by `to` (it must be there).
std::function<void(std::string&)> replacing(const std::string& from, const std::string& to) {
  return [=](std::string& text) {
    const auto at = text.find(from);
    REQUIRE(at != std::string::npos);
    text.replace(at, from.size(), to);
  };
}

// read_graph_signature's FatalError on `bytes`, or a failed check.
std::string package_error(const std::string& bytes) {
  try {
    (void)neml2::detail::read_graph_signature(bytes, "r/cpu/float64/m.pt2");
    FAIL_CHECK("the package was read without an error");
  } catch (const FatalError& e) {
    return e.what();
  }
  return {};
}

} // namespace

TEST_CASE("a float where metadata.json needs an integer is a FatalError naming the field") {
  // Was undefined behaviour: nlohmann casts 1e300 to std::int64_t (UBSan: float-cast-overflow).
  const auto shape = metadata_error("float_shape.json");
  CHECK(has(shape, "field 'inputs[0].base_shape': 1e+300 is not an integer"));
  // Was silently read as schema 14.
  CHECK(has(metadata_error("float_schema_version.json"), "14.5 is not an integer"));
}

TEST_CASE("an integer out of range in metadata.json is a FatalError naming the field") {
  // Was read as -1 (2^64 - 1 cast to std::int64_t).
  CHECK(has(metadata_error("unsigned_shape.json"),
            "field 'inputs[0].base_shape': 18446744073709551615 is out of range"));
  // Was signed overflow (undefined behaviour) while counting the parameter's elements.
  CHECK(has(metadata_error("overflowing_shape.json"),
            "field 'parameters[0].shape': size 9223372036854775807 in [9223372036854775807, "
            "9223372036854775807] is not a size between 0 and"));
}

TEST_CASE("a stub nested deeper than any stub is a FatalError, not a stack overflow") {
  // 300,000 nested blocks overflowed the stack when the block tree was destroyed (ASan);
  // 250,000 stay within the size bound (1 MiB), so that the depth guard answers.
  std::string deep;
  for (int i = 0; i < 250000; ++i)
    deep += "[a]\n";
  CHECK_THROWS_WITH_AS((void)neml2::detail::artifact_root_from_stub(deep, "deep_aoti.i", "model"),
                       doctest::Contains("deep_aoti.i:65: section [a] is nested more than 64"),
                       FatalError);
}

TEST_CASE("JSON nested past any real file, or with too many values, is refused before parsing") {
  // nlohmann's parser and the copies of its values take whatever a file asks for; a real
  // metadata.json nests 8 deep and a tune file 5.
  const std::string deep(100000, '[');
  CHECK_THROWS_WITH_AS((void)neml2::detail::parse_metadata(deep, "r"),
                       doctest::Contains("metadata.json: JSON nested more than 64 deep (line 1); "
                                         "regenerate the artifact with neml2-compile"),
                       FatalError);
  CHECK_THROWS_WITH_AS(
      (void)neml2::parse_tune_file("{\"a\":\n" + deep, "t.json"),
      doctest::Contains("tune file t.json: JSON nested more than 64 deep (line 2)"), FatalError);
  std::string many = "{\"values\": [0";
  for (int i = 0; i < 4200000; ++i)
    many += ",0";
  CHECK_THROWS_WITH_AS((void)neml2::detail::parse_metadata(many + "]}", "r"),
                       doctest::Contains("metadata.json: more than 4194304 JSON values (line 1)"),
                       FatalError);
  // Brackets inside strings are text, escaped quotes included.
  CHECK_THROWS_WITH_AS((void)neml2::detail::parse_metadata("{\"a\": \"\\\"" + deep + "\"}", "r"),
                       doctest::Contains("field 'schema_version': missing"), FatalError);
}

TEST_CASE("a number JSON cannot hold in a tune file is a FatalError") {
  // Found by fuzz_tune: nlohmann's out_of_range (not a parse_error) left parse_tune_file.
  CHECK_THROWS_WITH_AS(
      (void)neml2::parse_tune_file(read(corpus / "tune" / "number_overflow.json"), "t.json"),
      doctest::Contains("tune file t.json is not valid JSON ([json.exception."
                        "out_of_range.406] number overflow parsing '1e400')"),
      FatalError);
}

TEST_CASE("a generated wrapper with numbers or words no real one has is a FatalError") {
  const auto fails_with = [](const std::function<void(std::string&)>& edit,
                             const std::string& part) {
    const auto message = package_error(repackaged(edit));
    CHECK_MESSAGE(has(message, part), message);
    CHECK_MESSAGE(has(message, "graph file 'r/cpu/float64/m.pt2' is not a compiled graph"),
                  message);
  };
  // The untouched package reads.
  CHECK(neml2::detail::read_graph_signature(repackaged([](std::string&) {}), "m.pt2").num_inputs ==
        1);
  // Was std::out_of_range from std::stoul, not a FatalError.
  fails_with(
      replacing("static void check_input_0(", "static void check_input_99999999999999999999999("),
      "its wrapper holds input number 99999999999999999999999, more than 65536");
  fails_with(replacing("AOTInductorModelBase(", "AOTInductorModelBase(99999999999999999999"),
             "an input count 999999999999999999991, more than 65536");
  // Was a write at index 2^64 - 1 of an empty vector (the rank wrapped to 0).
  fails_with(replacing("static void check_input_0(",
                       "static void check_input_0(if (5 != x_size[18446744073709551615])"),
             "its wrapper holds dimension 18446744073709551615, more than 63");
  fails_with(replacing("_size[0]", "_stride[99999] _size[0]"),
             "its wrapper holds dimension 99999, more than 63");
  // Was a stack overflow: std::regex matches \w+ by recursion, one frame per character.
  fails_with(replacing("aoti_torch_dtype_float64", "aoti_torch_dtype_" + std::string(100000, 'f')),
             "holds a word or a blank of more than 4096 characters");
}

TEST_CASE("a zip directory no real package has is a FatalError before PyTorch's reader") {
  const auto good = repackaged([](std::string&) {});
  const auto end = good.rfind("PK\x05\x06");
  REQUIRE(end != std::string::npos);
  const auto u32_at = [&](std::size_t at) {
    std::uint32_t v = 0;
    std::memcpy(&v, good.data() + at, 4);
    return v;
  };
  // The size a stored record unpacks to, as its directory entry says: PyTorch's reader
  // would allocate it (4 GiB here) before reading the record.
  auto unpacked = good;
  const auto first_entry = u32_at(end + 16);
  std::memset(unpacked.data() + first_entry + 24, 0xf0, 4);
  CHECK(has(package_error(unpacked), "says it unpacks to 4042322160 bytes"));
  // A zip64 archive: nothing of it was checked.
  auto zip64 = good;
  std::memset(zip64.data() + end + 10, 0xff, 2);
  CHECK(has(package_error(zip64), "a zip64 archive, which neml2-compile writes only for graphs "
                                  "larger than 4 GiB"));
}

TEST_CASE("a zip directory whose entries name one record many times is refused: each byte "
          "of the file is checked once") {
  // Was minutes of work for an 11 MB file: the record's CRC-32 recomputed for each entry.
  const auto good = repackaged([](std::string&) {});
  const auto end = good.rfind("PK\x05\x06");
  REQUIRE(end != std::string::npos);
  const auto u16_at = [&](std::size_t at) {
    return std::uint32_t(static_cast<unsigned char>(good[at])) |
           std::uint32_t(static_cast<unsigned char>(good[at + 1])) << 8;
  };
  const auto u32_at = [&](std::size_t at) { return u16_at(at) | u16_at(at + 2) << 16; };
  const auto put = [](std::string& bytes, std::size_t at, std::uint32_t v, int width) {
    for (int k = 0; k < width; ++k)
      bytes[at + k] = static_cast<char>((v >> (8 * k)) & 0xff);
  };
  const std::size_t directory = u32_at(end + 16), entries = u16_at(end + 10);
  // The directory's entry of the largest record.
  std::string largest;
  std::uint32_t largest_stored = 0;
  for (std::size_t e = 0, at = directory; e < entries; ++e) {
    const auto length = 46 + u16_at(at + 28) + u16_at(at + 30) + u16_at(at + 32);
    if (largest.empty() || u32_at(at + 20) > largest_stored) {
      largest = good.substr(at, length);
      largest_stored = u32_at(at + 20);
    }
    at += length;
  }
  REQUIRE(largest_stored > largest.size()); // each copy names more bytes than it adds
  // The directory with 20000 more copies of that entry (the same record each time) after
  // its own entries; what follows them (the end records) moved along.
  const std::size_t copies = 20000, after = directory + u32_at(end + 12);
  std::string hostile = good.substr(0, after);
  for (std::size_t k = 0; k < copies; ++k)
    hostile += largest;
  const auto moved = hostile.size() - after;
  hostile += good.substr(after);
  const auto new_end = end + moved;
  put(hostile, new_end + 8, static_cast<std::uint32_t>(entries + copies), 2);
  put(hostile, new_end + 10, static_cast<std::uint32_t>(entries + copies), 2);
  put(hostile, new_end + 12, static_cast<std::uint32_t>(after + moved - directory), 4);
  const auto message = package_error(hostile);
  CHECK_MESSAGE(has(message, "bytes, more than the file's"), message);
  CHECK_MESSAGE(has(message, "records that overlap"), message);
}

TEST_CASE("an archive PyTorch's reader would refuse on opening is a FatalError before it") {
  // Found by fuzz_package: PyTorch's reader takes the archive's folder from the zip
  // directory's first entry, finds no version record there and throws, leaking the zip
  // reader it opened (torch 2.12; LeakSanitizer).
  const auto differs = package_error(read(corpus / "package" / "directory_folder_differs.pt2"));
  CHECK_MESSAGE(has(differs, "its zip directory's first record "
                             "'elasticity_fbxed_batch/data/aotinductor/model/"),
                differs);
  CHECK_MESSAGE(has(differs, "is not in folder 'elasticity_fixed_batch'"), differs);
  // No version record at all: the good package with its name changed in the directory
  // (the directory's names are not covered by a CRC-32).
  auto good = repackaged([](std::string&) {});
  const auto entry = good.rfind("/version"); // the directory's entry (its last mention)
  REQUIRE(entry != std::string::npos);
  good.replace(entry, 8, "/versioX");
  const auto missing = package_error(good);
  CHECK_MESSAGE(has(missing, "it holds no version record ('archive/version')"), missing);
  // A version record PyTorch's reader cannot parse, or a version it does not read.
  const auto words = package_error(repackaged([](std::string&) {}, "seven\n"));
  CHECK_MESSAGE(has(words, "its version record holds 'seven', not a number"), words);
  const auto future = package_error(repackaged([](std::string&) {}, "99\n"));
  CHECK_MESSAGE(has(future, "its archive format version 99 is not one PyTorch reads (1 to "),
                future);
  // The same package with a version it reads is no error: what the two above test is the
  // version alone.
  CHECK_NOTHROW((void)neml2::detail::read_graph_signature(repackaged([](std::string&) {}, "3\n"),
                                                          "r/cpu/float64/m.pt2"));
}

TEST_CASE("every seed of the fuzz corpora parses or is a FatalError") {
  int replayed = 0;
  for (const auto& entry : fs::directory_iterator(corpus / "metadata")) {
    CAPTURE(entry.path());
    try {
      (void)neml2::detail::parse_metadata(read(entry.path()), "fuzz");
    } catch (const FatalError&) {
    }
    ++replayed;
  }
  for (const auto& entry : fs::directory_iterator(corpus / "stub")) {
    CAPTURE(entry.path());
    for (const char* model : {"model", "elasticity", "eq"})
      try {
        (void)neml2::detail::artifact_root_from_stub(read(entry.path()), entry.path(), model);
      } catch (const FatalError&) {
      }
    ++replayed;
  }
  for (const auto& entry : fs::directory_iterator(corpus / "tune")) {
    CAPTURE(entry.path());
    try {
      (void)neml2::parse_tune_file(read(entry.path()), entry.path().string());
    } catch (const FatalError&) {
    }
    ++replayed;
  }
  for (const auto& entry : fs::directory_iterator(corpus / "package")) {
    CAPTURE(entry.path());
    try {
      (void)neml2::detail::read_graph_signature(read(entry.path()), entry.path());
    } catch (const FatalError&) {
    }
    ++replayed;
  }
  CHECK(replayed >= 20);
}

// Stubs as neml2-compile writes them, read with nmhit (NEML2's HIT parser): every section
// it writes loads, the model name may be left out when the stub holds one model, and the
// guards in front of nmhit turn what would hang or crash it into FatalErrors.

#include <sys/stat.h>

#include "model_checks.hpp"
#include "scratch.hpp"

using namespace neml2;
using test::contains;
using test::Scratch;
namespace fs = std::filesystem;

namespace {

const fs::path corpus = fs::path(NEML2_DISPATCH_TEST_SOURCES) / ".." / "fuzz" / "corpus" / "stub";

// The stress of uniaxial strain 1e-3 through linear isotropic elasticity (E = 100, nu =
// 0.3), the elasticity artifact's baked coefficients: analytic, not from the artifact.
void check_elasticity(const DispatchedModel<SyncChunking>& model) {
  auto strain = at::zeros({4, 6}, at::kDouble);
  strain.select(1, 0).fill_(1e-3);
  const auto stress = model.forward({{"strain", strain}}).at("stress");
  const double E = 100, nu = 0.3;
  const double lambda = E * nu / ((1 + nu) * (1 - 2 * nu)), mu = E / (2 * (1 + nu));
  CHECK(stress[3][0].item<double>() == doctest::Approx((lambda + 2 * mu) * 1e-3).epsilon(1e-12));
  CHECK(stress[3][1].item<double>() == doctest::Approx(lambda * 1e-3).epsilon(1e-12));
}

std::string with_model(const std::string& before, const std::string& model = "elasticity") {
  return before + "[Models]\n  [" + model +
         "]\n    type = AOTIModel\n    artifact_path = 'elasticity'\n  []\n[]\n";
}

// The guards in front of nmhit refuse `text` (as the stub g_aoti.i) with a message holding `part`.
void refused(const std::string& text, const std::string& part) {
  CHECK_THROWS_WITH_AS((void)neml2::detail::artifact_root_from_stub(text, "g_aoti.i"),
                       doctest::Contains(part.c_str()), FatalError);
}

} // namespace

TEST_CASE("a stub with [Settings] and [Tensors] (a triple-quoted multi-line expr) loads") {
  // What neml2-compile 3.1 writes for an input with [Settings] and a `type = Python`
  // tensor (neml2.cli.aoti_compile.emit_aoti_stub), beside a real artifact root.
  Scratch s;
  s.copy_root("elasticity", "elasticity");
  const auto stub = s.write("elasticity_aoti.i", test::read(corpus / "tensors_settings_aoti.i"));
  REQUIRE(contains(test::read(stub), "expr = '''\n"));
  CHECK(artifact_root_from_stub(stub, "elasticity") == s.dir / "elasticity");
  CHECK(artifact_root_from_stub(stub) == s.dir / "elasticity");
  check_elasticity(load_model(stub));
}

TEST_CASE("text that looks like HIT inside triple quotes is the expression's, not the stub's") {
  // A line-by-line reader would close [Tensors] at the '[]' inside the expression and take
  // its artifact_path; nmhit reads the whole string as one value.
  Scratch s;
  s.copy_root("elasticity", "elasticity");
  for (const std::string quote : {"'''", "\"\"\""}) {
    CAPTURE(quote);
    const auto stub =
        s.write("model_aoti.i",
                with_model("[Tensors]\n  [E]\n    type = Python\n    expr = " + quote +
                           "\n[]\n[Models]\n  [elasticity]\n    artifact_path = 'elsewhere'\n"
                           "result = Scalar(torch.tensor(100.0))  # it's [fine]\n" +
                           quote + "\n  []\n[]\n"));
    CHECK(resolve_artifact_root(stub) == s.dir / "elasticity");
    CHECK(stub_models(stub) == std::vector<std::string>{"elasticity"});
  }
}

TEST_CASE("the model name: optional for one model, and several are listed when left out") {
  Scratch s;
  s.copy_root("elasticity", "elasticity");
  const auto one = s.write("one_aoti.i", with_model(""));
  check_elasticity(load_model(one));
  check_elasticity(load_model(one, SyncChunking{.batch_size = 3}));
  check_elasticity(load_model(s.dir / "elasticity", SyncChunking{.batch_size = 3}));
  CHECK(load_model(one, SyncChunking{.batch_size = 3}).policy().batch_size == 3);

  const auto two = s.write(
      "two_aoti.i", "[Models]\n  [first]\n    type = AOTIModel\n    artifact_path = 'elasticity'\n"
                    "  []\n  [second]\n    type = AOTIModel\n    artifact_path = 'other'\n"
                    "  []\n[]\n");
  CHECK(stub_models(two) == std::vector<std::string>{"first", "second"});
  CHECK(artifact_root_from_stub(two, "second") == s.dir / "other");
  const auto message = test::fatal_message([&] { return load_model(two); });
  CHECK(contains(message, "two_aoti.i: the stub holds 2 models (first, second); name the one"));
  CHECK(contains(test::fatal_message([&] { return resolve_artifact_root(two); }),
                 "holds 2 models (first, second)"));
  CHECK(contains(test::fatal_message([&] { return artifact_root_from_stub(two, "third"); }),
                 "no model 'third' under [Models] (models there: first, second)"));
}

TEST_CASE("the guards before nmhit: deep nesting, !include and ${...} are FatalErrors") {
  const auto fails_with = refused;
  // nmhit takes minutes over 20,000 nested sections and overflows the stack at 10,000; a
  // quote inside a word (which nmhit skips, reading on) must not hide them from the guard.
  std::string nested = "x = don't\n";
  for (int i = 0; i < 10000; ++i)
    nested += "[a]\n";
  fails_with(nested, "g_aoti.i:66: section [a] is nested more than 64 deep");
  // nmhit would open the path itself, relative to the working directory.
  fails_with("!include /dev/stdin\n" + with_model(""), "g_aoti.i:1: !include is not read");
  // A field that refers to itself recurses in nmhit until the stack overflows.
  fails_with("[Models]\n  [m]\n    type = AOTIModel\n    artifact_path = ${Models/m/artifact_path}"
             "\n  []\n[]\n",
             "artifact_path = ${Models/m/artifact_path} holds a ${...} expression");
  // Elsewhere (a [Tensors] entry) nothing is evaluated.
  CHECK(neml2::detail::artifact_root_from_stub(
            with_model("[Tensors]\n  [E]\n    expr = ${E}\n  []\n[]\n"), "dir/g_aoti.i") ==
        fs::path("dir/elasticity"));
}

TEST_CASE("nmhit's own errors name the stub, the line and the column") {
  const auto message = test::fatal_message([] {
    return neml2::detail::artifact_root_from_stub("[Models]\n  just words\n[]\n", "bad_aoti.i",
                                                  "m");
  });
  CHECK(contains(message, "bad_aoti.i:2:8: unexpected character 'w'; bad_aoti.i:2:9: syntax"));
  CHECK(contains(message, "regenerate it with neml2-compile"));
}

TEST_CASE("nesting behind a quote nmhit does not take for a string is seen by the guard") {
  // nmhit opens a string only after `name =`; a quote elsewhere (first on a line, after a
  // value, inside ${...}) it skips and reads on. 20,000 nested sections behind such a
  // quote parsed for minutes, then overflowed the stack.
  std::string nested;
  for (int i = 0; i < 20000; ++i)
    nested += "[a]\n";
  for (int i = 0; i < 20000; ++i)
    nested += "[]\n";
  for (const std::string before :
       {"'\n", "\"x\n", "x = 1\n  'y\n", "x = a='b\n", "x = ${a 'b}\n", "x = ${a\ny = 'b}\n"}) {
    CAPTURE(before);
    refused(before + nested, "section [a] is nested more than 64 deep");
  }
  // After `name =` a quote does open a string, and what it holds is not counted.
  std::string quoted = "[Tensors]\n  [E]\n    expr = '\n";
  for (int i = 0; i < 100; ++i)
    quoted += "[a]\n";
  CHECK(neml2::detail::artifact_root_from_stub(with_model(quoted + "'\n  []\n[]\n"),
                                               "d/g_aoti.i") == fs::path("d/elasticity"));
  // Nor a comment that starts a line; after a value nmhit reads on, and so does the guard.
  std::string one_line;
  for (int i = 0; i < 20000; ++i)
    one_line += "[a]";
  refused("x = #" + one_line, "g_aoti.i:1: section [a] is nested more than 64 deep");
}

TEST_CASE("sections and fields beyond any stub are counted before nmhit reads them") {
  // Sibling blocks took time quadratic in their number; nmhit's time for a section's fields
  // grows with their square (5.8 s for 100,000).
  std::string siblings = "[Models]\n";
  for (int i = 0; i < 5000; ++i)
    siblings += "  [m" + std::to_string(i) + "]\n  []\n";
  refused(siblings + "[]\n", "g_aoti.i: 5001 section headers (counted as '[' anywhere in "
                             "the text), more than the 1024 read at most");
  std::string fields = "[Models]\n  [m]\n";
  for (int i = 0; i < 20000; ++i)
    fields += "    x" + std::to_string(i) + " = 1\n";
  refused(fields + "  []\n[]\n", "g_aoti.i: 20000 fields (counted as '=' anywhere in the "
                                 "text), more than the 10000 read at most");
  // Hidden where the depth guard does not look, they are still counted: a quote that
  // never closes after `name =` holds the rest of the text.
  std::string hidden = "x = '\n";
  for (int i = 0; i < 2000; ++i)
    hidden += "[a]\n";
  refused(hidden, "2000 section headers");
  // Far larger than any stub (1 MiB): refused before nmhit reads it.
  const auto large = with_model(std::string(2 << 20, '\n'));
  refused(large, "the stub 'g_aoti.i' is " + std::to_string(large.size()) +
                     " bytes, more than the 1048576 bytes read at most");
  // A stub of many models well within the bounds still loads, by name.
  std::string many = "[Models]\n";
  for (int i = 0; i < 500; ++i)
    many += "  [m" + std::to_string(i) + "]\n    type = AOTIModel\n    artifact_path = 'r" +
            std::to_string(i) + "'\n  []\n";
  CHECK(neml2::detail::artifact_root_from_stub(many + "[]\n", "d/g_aoti.i", "m499") ==
        fs::path("d/r499"));
}

TEST_CASE("a stub of a million bad characters fails in linear time, with a short message") {
  // Both were quadratic: the guard searched each '[' a line end, and nmhit's million
  // messages (one per unexpected character) were each searched for in the list.
  refused(std::string(1000000, '['), "1000000 section headers");
  const auto message = test::fatal_message(
      [] { return neml2::detail::artifact_root_from_stub(std::string(1000000, '%'), "g_aoti.i"); });
  CHECK(contains(message, "g_aoti.i:1:10: unexpected character '%'; 999990 more messages; a stub "
                          "is HIT"));
  CHECK(message.size() < 1000);
}

TEST_CASE("a stub that is not a regular file is refused before it is opened") {
  Scratch s;
  const auto fifo = s.dir / "fifo_aoti.i";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0); // opening it to read would wait for a writer
  const auto device = s.dir / "zero_aoti.i";
  fs::create_symlink("/dev/zero", device); // reading it would never end
  for (const auto& [stub, kind] : {std::pair{fifo, "FIFO"}, {device, "character device"}}) {
    CAPTURE(stub);
    const auto message = test::fatal_message([&] { return resolve_artifact_root(stub, "m"); });
    CHECK(contains(message, "the stub (the <name>_aoti.i file that neml2-compile writes) '" +
                                stub.string() + "' is not a regular file but a " + kind));
    CHECK(contains(test::fatal_message([&] { return artifact_root_from_stub(stub); }),
                   "is not a regular file"));
  }
  // Larger than any stub, on disk: refused by its size, before it is read.
  const auto large = s.write("large_aoti.i", "");
  fs::resize_file(large, std::uintmax_t(1) << 30); // sparse: no disk used
  CHECK(contains(test::fatal_message([&] { return artifact_root_from_stub(large, "m"); }),
                 "' is 1073741824 bytes, more than the 1048576 bytes read at most"));
}

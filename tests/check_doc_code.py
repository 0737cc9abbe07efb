#!/usr/bin/env python3
"""Every C++ and Python code block of the user docs compiles or runs (issue 60, item 5).

  check_doc_code.py REPO_ROOT BUILD_DIR         compile the C++ blocks, syntax-check the
                                                Python ones, check every marker
  check_doc_code.py --self-test REPO_ROOT BUILD_DIR
                                                feed the checks broken blocks; each must be
                                                caught, and the sound ones pass
  check_doc_code.py --list REPO_ROOT            every block, and how it is checked
  check_doc_code.py --run-python DOC REPO_ROOT ARTIFACTS WORKDIR
                                                run DOC's Python blocks in WORKDIR (made
                                                and laid out here) with the installed
                                                neml2_dispatch: python/tests/test_doc_examples.py

The docs: README.md, docs/*.md and python/README.md. Their ```cpp and ```python blocks are
checked; ```sh, ```cmake, ```text and untagged blocks are not.

C++ (BUILD_DIR/compile_commands.json gives the flags: CMake writes it with
CMAKE_EXPORT_COMPILE_COMMANDS ON; without it the check fails and says so). The flags are a
library translation unit's (its defines, include directories and warnings; not its private
include root src/, so a block sees the public headers only, nor its precompiled header),
and, where the build has MPI, those that neml2::dispatch_mpi adds (a translation unit that
defines NEML2_DISPATCH_MPI): a block is compiled as a host linking neml2::dispatch_mpi
compiles it. `g++ -std=c++20 -fsyntax-only`. Each block goes in a namespace of its own
(doc_code_N), after `#include <neml2/dispatch.hpp>` (what every snippet assumes) and the
block's own #include lines, which move to the top of its translation unit. Blocks that
include the same neml2 headers share one translation unit (each costs about 5 s of
<ATen/ATen.h>); `#line` directives make the compiler name the doc's own file and line. A
block that names MPIRankAssign or includes <mpi.h> is left out, and says so, where the
build has no MPI.

Python: in this check each block must parse (compile()). The blocks run in
python/tests/test_doc_examples.py (scripts/python-test.sh), against the installed module:
each doc's blocks in order, in one namespace (a later block uses what an earlier one
made), in a fresh process whose working folder holds the stubs the docs name
(aoti/elasticity_aoti.i: build/artifacts/elasticity_params, elasticity with its promoted
parameters; aoti/model_aoti.i: build/artifacts/j2_radial_return, J2 plasticity; with a
GPU, their *_gpu builds where NEML2_DISPATCH_GPU_TESTS made them), each linked beside its
artifact root. Every `nd.NAME` a block reads must be the module's. A block that raises
fails, with the doc's file and line in its traceback.

Markers. A block is complete unless the line right before its fence says otherwise:

  <!-- doc-code: WORD... (why) -->

(an HTML comment: GitHub does not show it). Every marker but `continues` gives its reason
in parentheses. The words:

  body          C++: the block is statements; it is compiled as the body of a function
                whose parameters are the names the preludes below declare. Without it a
                C++ block is compiled at namespace scope (declarations, definitions, a
                main), where a statement does not compile.
  PRELUDE       a name of CPP_PRELUDES (C++) or PY_PRELUDES (Python) below: what the block
                takes from its surroundings. C++: parameters (then `body` is required) or
                a header. Python: code run in the namespace before the block.
  continues     the block goes on from the block of its language before it in the same
                doc: compiled as one with it, under that block's marker (one step of a
                walk-through that shows a program piece by piece).
  excerpt=PATH  C++: the block is lines of PATH (a file of this repository that the build
                compiles), which are checked instead: the block's non-blank lines, without
                `//` comments and with runs of spaces made one, are consecutive non-blank
                lines of PATH read the same way. For a piece that cannot compile alone (a
                part of a struct) of a file that does.
  cuda          Python: the block needs a CUDA device. Without one it must run up to that
                device and stop there: an error whose message names cuda (what it does
                before, it does; where one is found, it runs whole).

A marker that is not right before a ```cpp or ```python fence, an unknown word, a prelude
of the other language, `body` on a Python block, a missing reason, or `continues` with no
block before it is a finding.

Exit 0 with a one-line summary when every block holds; otherwise print each finding (the
doc's file and line, and the compiler's or Python's message) and exit 1.
"""

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

UMBRELLA = "<neml2/dispatch.hpp>"

# C++ preludes: `params` are the parameters of the function a `body` block is compiled in
# (what the snippet takes from the host code around it); `header` a file of the repository
# included at the top of the block's translation unit.
CPP_PRELUDES = {
    "stub": dict(params="const std::string& stub",
                 about="the path of a stub (the host's own)"),
    "model": dict(params="neml2::DispatchedModel<neml2::SyncChunking>& model",
                  about="a loaded model"),
    "inputs": dict(params="const neml2::TensorMap& inputs", about="a call's inputs"),
    "out": dict(params="neml2::TensorMap& out", about="where the host keeps a call's outputs"),
    "pooled": dict(params="bool pooled", about="the host's choice of policy (its input file's)"),
    "host_loop": dict(
        params="std::int64_t points, int steps, int residual_evaluations, "
               "const at::Tensor& strain_iterate, double t_n",
        about="a finite-element host's time loop: its points, steps, global Newton "
              "iterations, the strain of the current iterate and the step's end time"),
    "host_step": dict(
        params="neml2::MaterialState& state, const neml2::TensorMap& forces, const at::Tensor& t, "
               "std::int64_t points, const std::function<void()>& assemble_other_terms",
        about="a host's MaterialState, one step's forces and time, its points and its own work"),
    "chord_history": dict(
        params="neml2::TensorMap& state, int steps, "
               "const std::function<neml2::TensorMap(int, const neml2::TensorMap&)>& inputs_of",
        about="a history: the state the host carries, its steps and each step's inputs"),
    "tune_host": dict(
        params="const std::string& stub, std::int64_t points_per_call, const at::Tensor& my_strains",
        about="a host that tunes: its stub, the rows of its calls and a sample of its strains"),
    "throughput_balancing": dict(header="examples/throughput_balancing.hpp",
                                 about="the policy docs/custom-policy.md walks through"),
}

# Python preludes: code run in the doc's namespace before the block (`ARTIFACTS`, the
# built artifacts folder, and the modules torch, nd (neml2_dispatch) and neml2 are there).
PY_PRELUDES = {
    "stub": dict(code='stub = "aoti/model_aoti.i"', about="a stub holding the model 'model'"),
    "elasticity": dict(code='model = nd.load_model("aoti/elasticity_aoti.i", "elasticity")',
                       about="model: elasticity, its E and nu promoted parameters (the doc's "
                             "first model, loaded again: a block between may have replaced it)"),
    "quick_tune": dict(
        code="nd.tune = _quick(nd.tune)",
        about="the tuner's budget capped at 1 s a device (this check measures nothing; "
              "without a GPU the block stops at it after the CPU's sweep)"),
    "measured": dict(code="measured = torch.zeros_like(strain)",
                     about="measured stresses to fit (the shape of the strain before)"),
    "policy": dict(code="policy = nd.SyncChunking(batch_size=16)", about="a policy"),
    "neml2_inputs": dict(
        code="_write_neml2_inputs(ARTIFACTS)",
        about="NEML2 input files in the working folder: model_aoti.i and regression.i, J2 "
              "plasticity compiled (type = AOTIModel) with a strain history, a "
              "TransientDriver `driver` and a TransientRegression `regression` (its gold "
              "written here by NEML2's own AOTIModel)"),
    "failing_call": dict(
        code="model, inputs = _failing_call()",
        about="model: J2 plasticity allowed no Newton update (miters = 1); inputs: strains "
              "from 0 to 3 times yield, whose rows past yield then fail to converge"),
}

MARKER = re.compile(r"^\s*<!--\s*doc-code:(.*?)-->\s*$")
FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)")
LANGUAGES = {"cpp": "cpp", "c++": "cpp", "python": "python", "py": "python"}
INCLUDE = re.compile(r"^\s*#\s*include\s*([<\"][^>\"]+[>\"])")
NEEDS_MPI = re.compile(r"\bMPIRankAssign\b|<mpi\.h>|\bMPI_\w+")


def doc_paths(root):
    root = Path(root)
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "python" / "README.md"]
    return [d.relative_to(root).as_posix() for d in docs if d.is_file()]


# ---------------------------------------------------------------- reading the docs


@dataclass
class Block:
    doc: str  # relative to the root
    line: int  # of the first code line
    language: str  # "cpp" or "python"
    lines: list  # the code
    marker_line: int = 0
    words: list = field(default_factory=list)
    reason: str = ""
    pieces: list = field(default_factory=list)  # (first line, lines) of blocks continuing it

    @property
    def where(self):
        return f"{self.doc}:{self.line}"

    def has(self, word):
        return word in self.words

    @property
    def preludes(self):
        table = CPP_PRELUDES if self.language == "cpp" else PY_PRELUDES
        return [w for w in self.words if w in table]

    @property
    def excerpt(self):
        return next((w.split("=", 1)[1] for w in self.words if w.startswith("excerpt=")), None)

    def all_pieces(self):
        return [(self.line, self.lines)] + self.pieces


def parse_marker(text):
    """(words, reason) of a marker's text."""
    text = text.strip()
    reason = ""
    if "(" in text:
        at = text.index("(")
        reason = text[at + 1:text.rindex(")")] if ")" in text[at:] else text[at + 1:]
        text = text[:at]
    return text.split(), reason.strip()


def read_blocks(doc, text):
    """(blocks, findings) of a doc's ```cpp and ```python blocks; blocks marked `continues`
    are folded into the block they continue."""
    lines = text.split("\n")
    blocks, findings = [], []
    pending = None  # (line number, words, reason) of a marker waiting for its fence
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(line)
        fence = FENCE.match(line)
        if pending and not fence:
            findings.append(f"{doc}:{pending[0]}: a doc-code marker not right before a "
                            f"```cpp or ```python fence")
            pending = None
        if marker:
            words, reason = parse_marker(marker.group(1))
            pending = (i + 1, words, reason)
            i += 1
            continue
        if not fence:
            i += 1
            continue
        indent, tag = fence.group(1), fence.group(2).lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        code = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:end]]
        language = LANGUAGES.get(tag)
        if language is None:
            if pending:
                findings.append(f"{doc}:{pending[0]}: a doc-code marker before a ```{tag} "
                                f"block, which is not checked")
        else:
            block = Block(doc, i + 2, language, code)
            if pending:
                block.marker_line, block.words, block.reason = pending
            blocks.append(block)
        pending = None
        i = end + 1
    if pending:
        findings.append(f"{doc}:{pending[0]}: a doc-code marker not right before a ```cpp or "
                        f"```python fence")
    kept = []
    for block in blocks:
        findings += check_marker(block)
        if block.has("continues"):
            before = next((b for b in reversed(kept) if b.language == block.language), None)
            if before is None:
                findings.append(f"{block.where}: marked `continues`, but no {block.language} "
                                f"block comes before it in {doc}")
                continue
            before.pieces.append((block.line, block.lines))
            continue
        kept.append(block)
    return kept, findings


def check_marker(block):
    """Findings about a block's marker words."""
    where = f"{block.doc}:{block.marker_line}"
    ours, theirs = (CPP_PRELUDES, PY_PRELUDES) if block.language == "cpp" else (PY_PRELUDES, CPP_PRELUDES)
    findings = []
    words = block.words
    if not words:
        return []
    if "continues" in words:
        if len(words) > 1:
            findings.append(f"{where}: `continues` stands alone (the block it continues has "
                            f"the marker)")
        return findings
    if not block.reason:
        findings.append(f"{where}: the marker gives no reason in parentheses: say why the "
                        f"block is not complete")
    for w in words:
        if w in ours or (w == "body" and block.language == "cpp") or \
                (w == "cuda" and block.language == "python") or \
                (w.startswith("excerpt=") and block.language == "cpp"):
            continue
        if w in theirs or w in ("body", "cuda") or w.startswith("excerpt="):
            findings.append(f"{where}: `{w}` does not apply to a {block.language} block")
        else:
            findings.append(f"{where}: unknown doc-code word `{w}` (body, continues, "
                            f"excerpt=PATH, cuda, or a prelude: {', '.join(sorted(ours))})")
    if block.language == "cpp":
        needing = [w for w in words if CPP_PRELUDES.get(w, {}).get("params")]
        if needing and "body" not in words:
            findings.append(f"{where}: {', '.join(needing)} declare names a function body "
                            f"takes: add `body`")
        if block.excerpt and len(words) > 1:
            findings.append(f"{where}: an excerpt is checked against its file alone: no other "
                            f"word")
    return findings


def read_docs(root, docs=None):
    blocks, findings = [], []
    for doc in docs if docs is not None else doc_paths(root):
        found, more = read_blocks(doc, (Path(root) / doc).read_text(encoding="utf-8"))
        blocks += found
        findings += more
    return blocks, findings


# ---------------------------------------------------------------- C++


class NoCompileCommands(Exception):
    pass


@dataclass
class Flags:
    compiler: str
    args: list
    mpi: bool


def compile_flags(root, build):
    """The compiler and flags of a library translation unit in BUILD/compile_commands.json,
    with neml2::dispatch_mpi's additions where the build has MPI."""
    path = Path(build) / "compile_commands.json"
    if not path.is_file():
        raise NoCompileCommands(
            f"{path} does not exist: configure the build with CMAKE_EXPORT_COMPILE_COMMANDS ON "
            f"(set in CMakeLists.txt, or -DCMAKE_EXPORT_COMPILE_COMMANDS=ON) so that the doc "
            f"blocks compile with the library's own flags")
    entries = json.loads(path.read_text())
    src = (Path(root) / "src").resolve().as_posix()

    def argv(entry):
        return entry.get("arguments") or shlex.split(entry["command"])

    def source(entry):
        return (Path(entry.get("directory", ".")) / entry["file"]).resolve().as_posix()

    # A library source, or (a unity build) a unit compiled with the library's private root.
    library = [e for e in entries if source(e).startswith(src + "/")] or \
        [e for e in entries if f"-I{src}" in argv(e) or src in
         [v for o, v in zip(argv(e), argv(e)[1:]) if o == "-I"]]
    if not library:
        raise NoCompileCommands(f"{path} lists no translation unit of the library ({src}/)")
    base = argv(library[0])
    compiler, args = base[0], filtered(base[1:], library[0]["file"], src)
    args = [a for a in args if a != source(library[0])]
    # What neml2::dispatch_mpi adds, from a unit that links it (an example's, if any): its
    # NEML2_DISPATCH_MPI definition and MPI's include directories (outside this tree).
    linked = sorted((e for e in entries if any(a.startswith("-DNEML2_DISPATCH_MPI") for a in argv(e))),
                    key=lambda e: "/examples/" not in source(e))
    mpi = linked[0] if linked else None
    if mpi:
        root_path = Path(root).resolve().as_posix() + "/"
        have = set(_options(args))
        for option in _options(filtered(argv(mpi)[1:], mpi["file"], src)):
            if option in have:
                continue
            if option[0].startswith("-DNEML2_DISPATCH_MPI") or (
                    option[0] in ("-I", "-isystem") and len(option) == 2 and
                    not option[1].startswith(root_path)) or (
                    option[0].startswith("-I") and len(option[0]) > 2 and
                    not option[0][2:].startswith(root_path)):
                args += list(option)
    return Flags(compiler, args, mpi is not None)


def _options(args):
    """args as (option,) or (option, value) tuples."""
    out, i = [], 0
    while i < len(args):
        if args[i] in ("-isystem", "-I", "-D", "-include", "-iquote") and i + 1 < len(args):
            out.append((args[i], args[i + 1]))
            i += 2
        else:
            out.append((args[i],))
            i += 1
    return out


def filtered(args, source, src):
    """A translation unit's flags without what concerns its own compilation: its source, its
    output and dependency files, its precompiled header, optimisation, and the library's
    private include root."""
    kept, skip = [], False
    drop_with_value = {"-o", "-MF", "-MT", "-MQ", "-include", "-x"}
    for k, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in drop_with_value:
            skip = True
            continue
        if a in ("-c", "-MD", "-MMD", "-Winvalid-pch") or a == source or a.startswith(("-O", "-g")):
            continue
        if a.startswith("-std="):
            continue
        if a == "-I" and k + 1 < len(args) and args[k + 1].rstrip("/") == src:
            skip = True
            continue
        if a.startswith("-I") and a[2:].rstrip("/") == src:
            continue
        kept.append(a)
    return kept


def block_includes(block):
    """The block's #include lines (each piece's) and its code with them blanked (the line
    numbers kept)."""
    includes, pieces = [], []
    for first, lines in block.all_pieces():
        code = []
        for ln in lines:
            m = INCLUDE.match(ln)
            if m:
                includes.append(m.group(1))
                code.append("")
            else:
                code.append(ln)
        pieces.append((first, code))
    return includes, pieces


def cpp_units(blocks, root, mpi):
    """(translation units, findings, notes): each unit a dict with its text and the blocks
    in it; excerpts checked here."""
    units, findings, notes = {}, [], []
    for n, block in enumerate(blocks):
        if block.language != "cpp":
            continue
        if block.excerpt:
            findings += check_excerpt(block, root)
            continue
        includes, pieces = block_includes(block)
        text = "\n".join(ln for _, code in pieces for ln in code)
        if not mpi and (NEEDS_MPI.search(text) or "<mpi.h>" in includes):
            notes.append(f"{block.where}: not compiled: this build has no MPI "
                         f"(MPIRankAssign needs neml2::dispatch_mpi)")
            continue
        key = tuple(sorted({i for i in includes if i.startswith("<neml2/") and i != UMBRELLA}))
        unit = units.setdefault(key, dict(headers=[UMBRELLA], blocks=[], body=[]))
        headers = [i for i in includes if i not in unit["headers"]]
        headers += [f'"{(Path(root).resolve() / CPP_PRELUDES[p]["header"]).as_posix()}"'
                    for p in block.preludes if CPP_PRELUDES[p].get("header")]
        unit["headers"] += [h for h in dict.fromkeys(headers) if h not in unit["headers"]]
        unit["blocks"].append(block)
        unit["body"].append(wrap(block, pieces, n))
    out = []
    for key, unit in units.items():
        text = "// Generated by tests/check_doc_code.py: the docs' C++ blocks.\n"
        text += "".join(f"#include {h}\n" for h in unit["headers"])
        text += "\n".join(unit["body"]) + "\n"
        out.append(dict(key=key, text=text, blocks=unit["blocks"]))
    return out, findings, notes


def wrap(block, pieces, n):
    """The block in its namespace, and as a function body when marked `body`."""
    code = []
    for first, lines in pieces:
        code.append(f'#line {first} "{block.doc}"')
        code += lines
    inner = "\n".join(code)
    if MAIN.search(inner):
        inner = ('#pragma GCC diagnostic push\n#pragma GCC diagnostic ignored "-Wreturn-type"\n'
                 f'{inner}\n#pragma GCC diagnostic pop')
    if block.has("body"):
        params = ", ".join(CPP_PRELUDES[p]["params"] for p in block.preludes
                           if CPP_PRELUDES[p].get("params"))
        inner = f"[[maybe_unused]] void block({params}) {{\n{inner}\n}}"
    return f"namespace doc_code_{n} {{ // {block.where}\n{inner}\n}} // namespace doc_code_{n}\n"


def normalized(line):
    line = re.sub(r"//.*", "", line)
    return " ".join(line.split())


def check_excerpt(block, root):
    path = Path(root) / block.excerpt
    if not path.is_file():
        return [f"{block.where}: excerpt of {block.excerpt}, which is not a file of the tree"]
    theirs = [normalized(ln) for ln in path.read_text(encoding="utf-8").split("\n")]
    theirs = [ln for ln in theirs if ln]
    findings = []
    for first, lines in block.all_pieces():
        ours = [(first + k, normalized(ln)) for k, ln in enumerate(lines)]
        ours = [(k, ln) for k, ln in ours if ln]
        if not ours:
            continue
        texts = [ln for _, ln in ours]
        starts = [s for s in range(len(theirs) - len(texts) + 1) if theirs[s:s + len(texts)] == texts]
        if starts:
            continue
        # Name the first line that is not in the file (or not where it should be).
        at = next((k for k, ln in ours if ln not in theirs), None)
        why = (f"line {at} is not in {block.excerpt}" if at is not None else
               f"its lines are not consecutive in {block.excerpt}")
        findings.append(f"{block.doc}:{first}: excerpt of {block.excerpt}: {why} (the block's "
                        f"lines without // comments must be the file's, in order)")
    return findings


DIAGNOSTIC = re.compile(r"^(?P<file>[^:\s][^:]*):(?P<line>\d+):(?:\d+:)? (?P<kind>error|warning|fatal error)")
# Warnings a snippet gives by being a snippet (names it shows but does not use).
# A designated initializer that names only the fields it sets is how the API is meant to
# be used (GCC 12's -Wextra warns of the others).
QUIET = ["-Wno-unused-variable", "-Wno-unused-parameter", "-Wno-unused-but-set-variable",
         "-Wno-unused-local-typedefs", "-Wno-unused-function", "-Wno-missing-field-initializers"]
# A block's `int main` is compiled in a namespace, where it is not the program's main, which
# alone may end without a return.
MAIN = re.compile(r"\bint\s+main\s*\(")


def compile_units(units, flags, folder):
    """Compiles every unit at once; [(unit, returncode, output)]."""
    running = []
    for k, unit in enumerate(units):
        source = Path(folder) / f"doc_code_{k}.cpp"
        source.write_text(unit["text"])
        command = [flags.compiler, *flags.args, "-std=c++20", "-fsyntax-only", *QUIET, str(source)]
        running.append((unit, subprocess.Popen(command, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True, cwd=folder)))
    return [(unit, p.wait(), p.stdout.read()) for unit, p in running]


def compile_findings(results):
    """Findings from the compilers' output: per block the diagnostics its lines got (errors,
    and warnings, which a doc's code should not give either)."""
    findings = []
    for unit, status, output in results:
        lines = output.splitlines()
        blamed = {}
        for k, ln in enumerate(lines):
            m = DIAGNOSTIC.match(ln)
            if not m:
                continue
            block = owner(unit["blocks"], m.group("file"), int(m.group("line")))
            if block is None:
                continue
            context = [ln]
            for c in lines[k + 1:k + 4]:  # the source line and its caret
                if not c.startswith(" "):
                    break
                context.append(c)
            blamed.setdefault(block.where, []).append("\n".join("    " + c for c in context))
        for where, messages in blamed.items():
            findings.append(f"{where}: does not compile:\n" + "\n".join(messages[:6]))
        if status != 0 and not blamed:
            findings.append("a translation unit of doc blocks failed without a diagnostic on "
                            "a doc line:\n" + "\n".join("    " + c for c in lines[-40:]))
    return findings


def owner(blocks, file, line):
    for b in blocks:
        if b.doc != file:
            continue
        for first, lines in b.all_pieces():
            if first <= line < first + max(len(lines), 1):
                return b
    return None


# ---------------------------------------------------------------- Python


def python_findings(blocks):
    findings = []
    for b in blocks:
        if b.language != "python":
            continue
        for first, lines in b.all_pieces():
            try:
                compile("\n" * (first - 1) + "\n".join(lines), b.doc, "exec")
            except SyntaxError as e:
                findings.append(f"{b.doc}:{e.lineno}: not Python: {e.msg}")
    return findings


def layout_workdir(artifacts, workdir, cuda=False):
    """The stubs the docs name, linked beside their artifact roots under WORKDIR/aoti/; with
    a GPU, the artifacts that have its graphs too where the build made them
    (NEML2_DISPATCH_GPU_TESTS)."""
    artifacts, aoti = Path(artifacts), Path(workdir) / "aoti"
    aoti.mkdir(parents=True, exist_ok=True)
    for stub, (artifact, model) in {"elasticity_aoti.i": ("elasticity_params", "elasticity"),
                                    "model_aoti.i": ("j2_radial_return", "model")}.items():
        if cuda and (artifacts / f"{artifact}_gpu" / f"{model}_aoti.i").is_file():
            artifact += "_gpu"
        source = artifacts / artifact / f"{model}_aoti.i"
        if not source.is_file():
            raise FileNotFoundError(f"{source} is missing: build the artifacts first "
                                    f"(the target neml2_dispatch_artifacts)")
        for name, target in ((stub, source), (model, artifacts / artifact / model)):
            link = aoti / name
            if not link.exists():
                link.symlink_to(target)


NEML2_INPUT = """\
[Models]
  [model]
    type = AOTIModel
    artifact_path = '{root}'
  []
[]
[Tensors]
  [times]
    type = Python
    expr = 'Scalar(torch.linspace(0, 1, 6, dtype=torch.float64).unsqueeze(-1).expand(6, 8).contiguous())'
  []
  [strains]
    type = Python
    expr = 'SR2(torch.linspace(0, 0.03, 6, dtype=torch.float64).view(6, 1, 1) * torch.tensor([1.0, -0.5, -0.5, 0.1, 0.0, 0.0], dtype=torch.float64) * torch.linspace(0.1, 1.0, 8, dtype=torch.float64).view(1, 8, 1))'
  []
[]
[Drivers]
  [driver]
    type = TransientDriver
    model = 'model'
    prescribed_time = 'times'
    prescribed_SR2_names = 'E'
    prescribed_SR2_values = 'strains'
  []
  [regression]
    type = TransientRegression
    driver = 'driver'
    reference = 'gold.pt'
    rtol = 1e-10
    atol = 1e-12
  []
[]
"""


def _write_neml2_inputs(artifacts):
    import neml2

    text = NEML2_INPUT.format(root=Path(artifacts) / "j2_radial_return" / "model")
    for name in ("model_aoti.i", "regression.i"):
        Path(name).write_text(text)
    driver = neml2.load_input("model_aoti.i").get_driver("driver")
    driver.run()
    driver.save_result("gold.pt")


def _quick(tune):
    def quick(*args, **kwargs):
        kwargs["budget_seconds"] = min(kwargs.get("budget_seconds", 1.0), 1.0)
        return tune(*args, **kwargs)
    return quick


def _failing_call():
    import neml2_dispatch as nd
    import torch

    model = nd.load_model("aoti/model_aoti.i", "model")
    config = model.solver_config()
    config.miters = 1  # no Newton update: the rows past yield fail, the elastic ones converge
    model.set_solver_config(config)
    rows = 64
    inputs = {}
    for name, shape in zip(model.input_names, model.input_base_shapes):
        inputs[name] = torch.zeros(rows, *shape, dtype=torch.float64)
    strain = torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0], dtype=torch.float64)
    inputs["E"] = torch.linspace(0, 0.03, rows, dtype=torch.float64).unsqueeze(-1) * strain
    inputs["t"] = torch.ones(rows, dtype=torch.float64)
    return model, inputs


def run_python(root, doc, artifacts, workdir):
    """Runs DOC's Python blocks in order in one namespace, in WORKDIR; 0 when every block
    ran (or, marked cuda without a GPU, stopped at the GPU), else 1."""
    import traceback

    import neml2  # noqa: F401  (imported first, as the module does)
    import torch

    import neml2_dispatch as nd

    blocks, findings = read_docs(root, [doc])
    if findings:
        print("\n".join(findings))
        return 1
    blocks = [b for b in blocks if b.language == "python"]
    cuda = torch.cuda.is_available()
    layout_workdir(artifacts, workdir, cuda)
    os.chdir(workdir)
    namespace = {"__name__": "__doc_code__", "ARTIFACTS": str(artifacts), "torch": torch,
                 "nd": nd, "neml2": neml2, "_write_neml2_inputs": _write_neml2_inputs,
                 "_failing_call": _failing_call, "_quick": _quick}
    failed = 0
    for block in blocks:
        source = "\n".join("\n".join(lines) for _, lines in block.all_pieces())
        missing = [n for n in module_names(source) if not hasattr(nd, n)]
        if missing:
            print(f"{block.where}: nd.{', nd.'.join(missing)}: not in neml2_dispatch")
            failed += 1
        started = time.monotonic()
        try:
            for p in block.preludes:
                exec(PY_PRELUDES[p]["code"], namespace)
            for first, lines in block.all_pieces():
                exec(compile("\n" * (first - 1) + "\n".join(lines), str(Path(root) / doc), "exec"),
                     namespace)
        except Exception as e:  # noqa: BLE001  (any error a block raises is the finding)
            if block.has("cuda") and not cuda and "cuda" in str(e).lower():
                print(f"{block.where}: stopped at CUDA, as marked (no GPU here): "
                      f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            print(f"{block.where}: raised:")
            traceback.print_exc()
            failed += 1
            continue
        if block.has("cuda") and not cuda:
            print(f"{block.where}: marked cuda, but it ran whole without a GPU: drop the word")
            failed += 1
            continue
        print(f"{block.where}: ran ({time.monotonic() - started:.1f} s)")
    print(f"{doc}: {len(blocks) - failed} of {len(blocks)} Python blocks hold")
    return 1 if failed else 0


def module_names(source):
    """The NAMEs of `nd.NAME` a block reads."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id == "nd" and node.attr not in names:
            names.append(node.attr)
    return names


# ---------------------------------------------------------------- running


def check(root, build):
    """(findings, summary)."""
    started = time.monotonic()
    blocks, findings = read_docs(root)
    flags = compile_flags(root, build)
    units, more, notes = cpp_units(blocks, root, flags.mpi)
    findings += more
    findings += python_findings(blocks)
    with tempfile.TemporaryDirectory(prefix="doc_code_") as folder:
        findings += compile_findings(compile_units(units, flags, folder))
    cpp = [b for b in blocks if b.language == "cpp"]
    compiled = sum(len(u["blocks"]) for u in units)
    excerpts = sum(1 for b in cpp if b.excerpt)
    python = sum(1 for b in blocks if b.language == "python")
    for note in notes:
        print(note)
    return findings, (f"{compiled} C++ blocks compiled in {len(units)} translation units, "
                      f"{excerpts} excerpts matched, {python} Python blocks parsed "
                      f"(run by python/tests/test_doc_examples.py), "
                      f"{time.monotonic() - started:.0f} s")


def list_blocks(root):
    blocks, findings = read_docs(root)
    for b in blocks:
        how = ("excerpt of " + b.excerpt if b.excerpt else
               "function body" if b.has("body") else
               "namespace scope" if b.language == "cpp" else "run")
        extra = [w for w in b.words if w not in ("body",) and not w.startswith("excerpt=")]
        pieces = f", {len(b.pieces)} continuing" if b.pieces else ""
        print(f"{b.where}: {b.language}, {how}{pieces}"
              + (f" [{' '.join(extra)}]" if extra else "") + (f": {b.reason}" if b.reason else ""))
    print("\n".join(findings))
    return 1 if findings else 0


SELF_TEST_CPP = [
    # (case, marker, code, compiles)
    ("a sound declaration at namespace scope", "",
     'auto model = neml2::load_model("x_aoti.i");', True),
    ("a misspelled API name", "", 'auto model = neml2::load_modle("x_aoti.i");', False),
    ("an unmarked statement snippet", "",
     'auto model = neml2::load_model("x_aoti.i");\nmodel.set_observer({});', False),
    ("the same snippet marked body", "<!-- doc-code: body (statements) -->",
     'auto model = neml2::load_model("x_aoti.i");\nmodel.set_observer({});', True),
    ("a body using its preludes", "<!-- doc-code: body model inputs (statements) -->",
     'const auto out = model.forward(inputs);', True),
    ("a misspelled member", "<!-- doc-code: body model inputs (statements) -->",
     'const auto out = model.forwrd(inputs);', False),
    ("a name no prelude gives", "<!-- doc-code: body model (statements) -->",
     'const auto out = model.forward(inputs);', False),
    ("a call with the wrong arguments", "<!-- doc-code: body model inputs (statements) -->",
     'const auto out = model.jacobian(inputs, 3);', False),
    ("a designated initializer the policy lacks", "",
     'auto p = neml2::SyncChunking{.device = "cpu", .chunk_size = 4096};', False),
    ("a discarded result", "<!-- doc-code: body model inputs (statements) -->",
     'model.forward(inputs);', False),
    ("a continued body", "<!-- doc-code: body stub (statements) -->",
     'auto model = neml2::load_model(stub);\n```\n\ntext\n\n<!-- doc-code: continues -->\n'
     '```cpp\nmodel.set_observer({});', True),
]

SELF_TEST_MARKERS = [
    # (case, doc text, expected finding or None)
    ("an unknown word", "<!-- doc-code: bdy (statements) -->\n```cpp\nint x;\n```\n", "unknown doc-code word"),
    ("a prelude without body", "<!-- doc-code: model (a model) -->\n```cpp\nint x;\n```\n", "add `body`"),
    ("a marker without its reason", "<!-- doc-code: body -->\n```cpp\nint x;\n```\n", "no reason"),
    ("a stray marker", "<!-- doc-code: body (x) -->\n\ntext\n```cpp\nint x;\n```\n", "not right before"),
    ("a marker before a sh block", "<!-- doc-code: body (x) -->\n```sh\nls\n```\n", "not checked"),
    ("continues with nothing before", "<!-- doc-code: continues -->\n```cpp\nint x;\n```\n",
     "no cpp block comes before"),
    ("a C++ word on Python", "<!-- doc-code: body (x) -->\n```python\nx = 1\n```\n", "does not apply"),
    ("a Python prelude on C++", "<!-- doc-code: body measured (x) -->\n```cpp\nint x;\n```\n",
     "does not apply"),
    ("an excerpt that is the file's",
     "<!-- doc-code: excerpt=examples/throughput_balancing.hpp (a piece) -->\n```cpp\n"
     "  void on_dispatched(std::size_t, std::int64_t, state_type&) const {}\n```\n", None),
    ("an excerpt that is not",
     "<!-- doc-code: excerpt=examples/throughput_balancing.hpp (a piece) -->\n```cpp\n"
     "  void on_dispatched(std::size_t, std::int64_t) const {}\n```\n", "is not in"),
    ("an excerpt out of order",
     "<!-- doc-code: excerpt=examples/throughput_balancing.hpp (a piece) -->\n```cpp\n"
     "  int rounds = 4;\n  std::int64_t min_chunk = 512;\n```\n", "not consecutive"),
    ("an excerpt of no file", "<!-- doc-code: excerpt=examples/nothing.hpp (a piece) -->\n"
     "```cpp\nint x;\n```\n", "not a file"),
    ("Python that does not parse", "```python\nmodel = nd.load_model(stub\n```\n", "not Python"),
    ("Python that parses", "<!-- doc-code: stub cuda (x) -->\n```python\nmodel = nd.load_model(stub)\n```\n", None),
]


def self_test(root, build):
    started = time.monotonic()
    failures = []
    # Markers, excerpts and Python syntax.
    for case, text, expected in SELF_TEST_MARKERS:
        blocks, found = read_blocks("selftest.md", text)
        found += [f for b in blocks if b.language == "cpp" and b.excerpt for f in check_excerpt(b, root)]
        found += python_findings(blocks)
        if expected is None and found:
            failures.append(f"{case}: reported, but it is sound:\n    " + "\n    ".join(found))
        elif expected is not None and not any(expected in f for f in found):
            failures.append(f"{case}: not reported (expected '{expected}'); reported:\n    "
                            + "\n    ".join(found or ["nothing"]))
    # No compile_commands.json: a clear failure, not a skip.
    with tempfile.TemporaryDirectory() as empty:
        try:
            compile_flags(root, empty)
            failures.append("a build without compile_commands.json was accepted")
        except NoCompileCommands as e:
            if "CMAKE_EXPORT_COMPILE_COMMANDS" not in str(e):
                failures.append(f"a build without compile_commands.json: unclear message: {e}")
    # A build without MPI leaves out the blocks that need it, and says so.
    blocks, _ = read_blocks("mpi.md", "```cpp\nauto p = neml2::MPIRankAssign({});\n```\n")
    _, _, notes = cpp_units(blocks, root, mpi=False)
    if not any("no MPI" in n for n in notes):
        failures.append("an MPIRankAssign block in a build without MPI: not left out")
    # Compilation: every case in one translation unit, each its own doc.
    blocks = []
    for k, (case, marker, code, _) in enumerate(SELF_TEST_CPP):
        found, more = read_blocks(f"case{k}.md", f"{marker}\n```cpp\n{code}\n```\n".lstrip("\n"))
        if more or len(found) != 1:
            failures.append(f"{case}: the case itself is malformed: {more}")
        blocks += found
    flags = compile_flags(root, build)
    units, more, _ = cpp_units(blocks, root, flags.mpi)
    with tempfile.TemporaryDirectory(prefix="doc_code_self_test_") as folder:
        found = compile_findings(compile_units(units, flags, folder))
    for k, (case, _, _, compiles) in enumerate(SELF_TEST_CPP):
        mine = [f for f in found if f.startswith(f"case{k}.md:")]
        if compiles and mine:
            failures.append(f"{case}: reported, but it compiles:\n" + "\n".join(mine))
        elif not compiles and not mine:
            failures.append(f"{case}: compiled, but it must not")
    cases = len(SELF_TEST_MARKERS) + len(SELF_TEST_CPP) + 2
    if failures:
        print("\n".join(failures))
        print(f"self-test: {len(failures)} of {cases} cases wrong")
        return 1
    print(f"self-test: {cases} cases, each broken block reported and each sound one passed "
          f"({time.monotonic() - started:.0f} s)")
    return 0


def main(argv):
    args = argv[1:]
    try:
        if args[:1] == ["--run-python"] and len(args) == 5:
            return run_python(args[2], args[1], args[3], args[4])
        if args[:1] == ["--list"] and len(args) == 2:
            return list_blocks(args[1])
        if args[:1] == ["--self-test"] and len(args) == 3:
            return self_test(args[1], args[2])
        if len(args) == 2 and not args[0].startswith("-"):
            findings, summary = check(args[0], args[1])
            if findings:
                print("\n".join(findings))
                print(f"{len(findings)} finding(s)")
                return 1
            print(summary)
            return 0
    except NoCompileCommands as e:
        print(f"check_doc_code.py: {e}", file=sys.stderr)
        return 1
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))

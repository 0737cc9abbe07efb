#!/usr/bin/env python3
"""The claims docs/performance.md and docs/architecture.md make can be checked, and hold
(issue 48, part 3).

  check_docs.py REPO_ROOT               check both docs
  check_docs.py --self-test REPO_ROOT   feed the checks small broken docs; each must be caught

REPO_ROOT must be inside a git work tree: without one no commit can be checked, so the
check fails (it does not skip). A shallow clone fails on the commits it lacks.

docs/performance.md
  - At most 400 lines.
  - Its sections begin at `##` headings; the text above the first (the preamble) states
    no figure and is not read. Code fences are commands and are not read.
  - A figure is every table, and every prose block (a paragraph, or a list item with its
    continuation lines) that states a measured number: a decimal (0.44, 1,095.5) or a
    number with a unit (µs ms ns s min, KiB MiB GiB kB MB GB, GB/s Gflop/s, 10 %, 1.5x).
    Backtick spans, link targets, dates, clock times (08:01) and commits are not numbers
    here, and other integers (2^20 rows, 7 rounds) are not measured ones.
  - A figure names its run: a date (YYYY-MM-DD) and a commit (7 to 40 lowercase hex
    characters with a letter and a digit, outside backtick spans; an abbreviation of
    digits alone is written longer until it holds a letter: 52505960c). A prose block
    names both itself. A table names both in its caption (the prose block right above
    it, only blank lines between) or in every row below its header; a table right after
    a heading, a fence or another table has no caption. So a table or a measurement
    added without its run fails.
  - Every commit-like token of the doc (outside backtick spans and fences) is a commit of
    the repository (`git cat-file -e HASH^{commit}`), and no commit of a figure is
    younger than the latest date the figure names (a run cannot predate its commit).
  - A figure's section, or the `##` section it is in, holds a ```sh fence: the command
    that reproduces it.

docs/architecture.md
  Every backtick span outside code fences (a span may cross a line break) is read as the
  first of these it is; a span that is none of them is not a code name and not checked:
  - a quoted string: "graph/call.hpp" is checked as a path, any other ("cuda:1") is a
    value;
  - an include, <neml2/x.hpp>, checked as a path; other headers (<ATen/ATen.h>) are
    foreign;
  - a path: letters, digits and _ . - / { } , * only, and it ends with /, its last part
    has a file extension (EXTENSION: .cpp .hpp .py .json ...), or its first part is a
    top-level entry of the tree (src/...). It must be a file or folder relative to the
    root, src/, include/ or include/neml2/; a bare file name (no /) may be anywhere.
    {a,b} expands, * globs, NAME.in stands for a generated NAME. A path holding "..."
    (an elision) or made of an extension alone (.pt2) is not checked;
  - a hyphenated program or target name (`neml2-dispatch`): a token of the code;
  - a name: an identifier, qualified by :: or . or not (`detail::CallProtocol::run`,
    `model.prepare`), then template or call arguments or not (`chunk_rows(B)`,
    `DispatcherOf<Policy>`); * globs (`*_into`). Each component is a whole word of the
    code (after a `.`, the member of a variable, only the last), and for each `X::Y` the
    code spells `X::Y` or a file that declares X (class, struct, namespace, enum) holds
    the word Y. CamelCase words in the arguments (`ChunkEvent` in
    `std::function<void(const ChunkEvent&)>`) are words of the code too.
  A span of one character (`A`, `n`) is a symbol, and one whose text outside its
  brackets holds a space, an operator or other punctuation (`(B, *base)`,
  `ls_max_iters > 2`, `nm -C`, `1e-13`) an expression or a command: neither is checked.
  The code: the files git lists (tracked, or untracked and not ignored) under src/,
  include/, apps/, python/, tests/ and cmake/ with a code extension (CODE_SUFFIXES; not
  this script). FOREIGN lists the names the doc quotes from outside the repository; an
  entry the doc does not quote, or that the tree holds, is a finding too.

Exit 0 with a one-line summary when every claim holds; otherwise print each finding with
its file and line, and exit 1.
"""

import datetime
import fnmatch
import re
import subprocess
import sys
import tempfile
from pathlib import Path

MAX_PERFORMANCE_LINES = 400

# Names docs/architecture.md quotes that are not this repository's: torch's AOTI model
# container and its locks, and the artifact's layout (docs/artifact-contract.md).
FOREIGN = [
    "aoti_runtime/model_container.h",
    "model_exec_mutex_",
    "models_mutex_",
    "metadata.json",
    "float32/",
]

CODE_FOLDERS = ("src/", "include/", "apps/", "python/", "tests/", "cmake/")
CODE_SUFFIXES = (".cpp", ".hpp", ".h", ".py", ".pyi", ".txt", ".cmake", ".in", ".sh", ".toml")
PATH_BASES = ("", "src/", "include/", "include/neml2/")
THIS_SCRIPT = "tests/check_docs.py"


# ---------------------------------------------------------------- the repository


class NotACheckout(Exception):
    pass


class Repo:
    """The git work tree at `root`: its files and its commits."""

    def __init__(self, root):
        self.root = Path(root)
        if not self.root.is_dir() or self._git("rev-parse", "--is-inside-work-tree") != "true":
            raise NotACheckout(
                f"{self.root} is not in a git work tree, so the commits docs/performance.md "
                f"names cannot be checked; run the check in a clone")
        listed = self._git("ls-files", "--cached", "--others", "--exclude-standard", "-z") or ""
        self.files = sorted({f for f in listed.split("\0") if f and (self.root / f).is_file()})
        self.folders = {p + "/" for f in self.files for p in _parents(f)}
        self.top_level = {f.split("/")[0] for f in self.files}
        self._dates = {}

    def _git(self, *args):
        try:
            done = subprocess.run(["git", "-C", str(self.root), *args], capture_output=True,
                                  text=True, check=False)
        except FileNotFoundError:
            raise NotACheckout("git is not installed, so no commit can be checked")
        return done.stdout.strip() if done.returncode == 0 else None

    def commit_date(self, commit):
        """The commit's date (the committer's, YYYY-MM-DD), or None: no such commit."""
        if commit not in self._dates:
            day = None
            if self._git("cat-file", "-e", f"{commit}^{{commit}}") is not None:
                day = self._git("show", "-s", "--format=%cs", f"{commit}^{{commit}}")
            self._dates[commit] = datetime.date.fromisoformat(day) if day else None
        return self._dates[commit]

    def is_path(self, path):
        return path in self.files or (path.rstrip("/") + "/") in self.folders

    def glob(self, pattern):
        return [p for p in self.files + sorted(self.folders) if fnmatch.fnmatchcase(p, pattern)]


def _parents(path):
    parts = path.split("/")[:-1]
    return ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]


# ---------------------------------------------------------------- performance.md

DATE = re.compile(r"(?<![\w-])(20\d\d-\d\d-\d\d)(?![\w-])")
COMMIT = re.compile(r"(?<![\w/.-])([0-9a-f]{7,40})(?![\w-])")
CLOCK = re.compile(r"(?<![\w:])\d\d:\d\d(?![\w:])")
CODE_SPAN = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
UNITS = r"(?:µs|ms|ns|s|min|KiB|MiB|GiB|kB|KB|MB|GB|GB/s|Gflop/s)"
MEASURED = re.compile(
    r"(?<![\w.^])\d+(?:,\d{3})*(?:\.\d+)?(?:\s?" + UNITS + r"(?![\w/])|\s?%|x(?!\w))"
    r"|(?<![\w.^])\d+(?:,\d{3})*\.\d+(?![\w.]|/\w)")  # or a decimal: 0.44, 1,095.5


def commits_in(text):
    """Commit-like tokens: 7-40 lowercase hex characters with a letter and a digit."""
    return [c for c in COMMIT.findall(CODE_SPAN.sub(" ", text))
            if re.search(r"[a-f]", c) and re.search(r"\d", c)]


def dates_in(text):
    dates = []
    for d in DATE.findall(text):
        try:
            dates.append(datetime.date.fromisoformat(d))
        except ValueError:
            pass
    return dates


def measured_numbers(text):
    text = CODE_SPAN.sub(" ", text)
    text = LINK_TARGET.sub("] ", text)
    text = DATE.sub(" ", text)
    text = CLOCK.sub(" ", text)
    for c in commits_in(text):
        text = text.replace(c, " ")
    return [m.group(0) for m in MEASURED.finditer(text)]


class Block:
    def __init__(self, kind, first_line, section, chapter):
        self.kind = kind  # "table", "prose", "fence" or "heading"
        self.first_line = first_line
        self.lines = []
        self.section = section  # the heading it is under (None in the preamble)
        self.chapter = chapter  # the `##` heading it is under

    @property
    def text(self):
        return "\n".join(self.lines)


def blocks_of(doc):
    """The doc's blocks in order: headings (`##` and deeper), fences, tables and prose
    blocks (a paragraph, or a list item with its continuation lines)."""
    blocks = []
    section = chapter = None
    current = fence = None
    for number, line in enumerate(doc.split("\n"), 1):
        stripped = line.strip()
        if fence is not None:
            fence.lines.append(line)
            if stripped.startswith("```"):
                fence = None
            continue
        if stripped.startswith("```"):
            fence = Block("fence", number, section, chapter)
            fence.lines.append(line)
            blocks.append(fence)
            current = None
            continue
        heading = re.match(r"(#+)\s", line)
        if heading:
            current = None
            if len(heading.group(1)) == 1:  # the title: the preamble goes on
                continue
            section = line
            if len(heading.group(1)) == 2:
                chapter = line
            blocks.append(Block("heading", number, section, chapter))
            continue
        if not stripped:
            current = None
            continue
        kind = "table" if stripped.startswith("|") else "prose"
        item = re.match(r"\s*(?:[-*+]|\d+\.)\s", line)
        if current is None or current.kind != kind or (kind == "prose" and item):
            current = Block(kind, number, section, chapter)
            blocks.append(current)
        current.lines.append(line)
    return blocks


def data_rows(table):
    """(line number, row) of a table's rows below its header's separator."""
    rows, seen_separator = [], False
    for k, row in enumerate(table.lines):
        if seen_separator:
            rows.append((table.first_line + k, row))
        elif set(row.strip()) <= set("|-: "):
            seen_separator = True
    return rows


def check_performance(doc, repo, name="docs/performance.md"):
    """Findings ("file:line: what") for the performance page."""
    findings = []
    count = len(doc.splitlines())
    if count > MAX_PERFORMANCE_LINES:
        findings.append(f"{name}: {count} lines; at most {MAX_PERFORMANCE_LINES} (history goes "
                        f"to CHANGELOG.md)")

    blocks = blocks_of(doc)
    for block in blocks:
        if block.kind == "fence":
            continue
        for k, line in enumerate(block.lines):
            for c in commits_in(line):
                if repo.commit_date(c) is None:
                    findings.append(f"{name}:{block.first_line + k}: {c} is not a commit of "
                                    f"this repository")

    def run_not_named(text):
        """What the text lacks to name a run, or None."""
        dates, commits = dates_in(text), commits_in(text)
        if not dates or not commits:
            return "no " + " and no ".join(
                w for w, have in (("date (YYYY-MM-DD)", dates), ("commit", commits)) if not have)
        for c in commits:
            day = repo.commit_date(c)
            if day is not None and day > max(dates):
                return f"commit {c} ({day}) is younger than the run's date ({max(dates)})"
        return None

    commanded = {b.section for b in blocks
                 if b.kind == "fence" and re.match(r"\s*```(sh|bash|shell)\b", b.lines[0])}
    for k, block in enumerate(blocks):
        if block.section is None or block.kind not in ("prose", "table"):
            continue
        if block.kind == "prose":
            numbers = measured_numbers(block.text)
            if not numbers:
                continue
            why = run_not_named(block.text)
            if why:
                findings.append(f"{name}:{block.first_line}: a figure ({', '.join(numbers[:3])}) "
                                f"with {why}")
        else:
            caption = blocks[k - 1] if k > 0 and blocks[k - 1].kind == "prose" else None
            why = run_not_named(caption.text) if caption else "no caption"
            if why:
                rows = data_rows(block)
                bad = [(n, run_not_named(row)) for n, row in rows if run_not_named(row)]
                if bad or not rows:
                    if bad:
                        why += f"; nor does every row name its run (line {bad[0][0]}: {bad[0][1]})"
                    findings.append(f"{name}:{block.first_line}: a table whose run is not "
                                    f"named: {why}")
        if block.section not in commanded and block.chapter not in commanded:
            findings.append(f"{name}:{block.first_line}: a figure with no command: no ```sh "
                            f"fence in its section ({block.section.strip()}) or its ## section")
    return findings


# ---------------------------------------------------------------- architecture.md

IDENT = r"[A-Za-z_*~][\w*]*"
NAME = re.compile(rf"^{IDENT}(?:(?:::|\.){IDENT})*$")
PROGRAM = re.compile(r"^[A-Za-z_]\w*(?:-\w+)+$")
PATH_CHARS = re.compile(r"^[\w.{},*/-]+$")
# A last part ending so is a file name, not a member (`drop_in.py`, not `model.prepare`).
EXTENSION = re.compile(r"\.(?:cpp|hpp|h|py|md|json|txt|sh|i|in|cmake|toml|pt2|so|yml|yaml)$")


class Code:
    """The words of the code, the X::Y it spells and which files declare what."""

    def __init__(self, repo):
        self.words, self.programs, self.pairs = set(), set(), set()
        self.declared = {}  # name -> the word sets of the files that declare it
        for f in repo.files:
            if not f.startswith(CODE_FOLDERS) or not f.endswith(CODE_SUFFIXES) or f == THIS_SCRIPT:
                continue
            text = (repo.root / f).read_text(encoding="utf-8", errors="replace")
            words = set(re.findall(r"[A-Za-z_]\w*", text))
            self.words |= words
            self.programs |= set(re.findall(r"(?<![\w-])[A-Za-z_]\w*(?:-\w+)+", text))
            self.pairs |= set(re.findall(r"([A-Za-z_]\w*)\s*::\s*~?([A-Za-z_]\w*)", text))
            for decl in re.findall(r"\b(?:class|struct|union|enum(?:\s+class)?|namespace)\s+"
                                   r"(?:\[\[[^\]]*\]\]\s*)?([A-Za-z_][\w:]*)", text):
                for part in decl.split("::"):
                    self.declared.setdefault(part, []).append(words)

    def has_word(self, word):
        word = word.lstrip("~")
        if "*" in word:
            return any(fnmatch.fnmatchcase(w, word) for w in self.words)
        return word in self.words

    def holds(self, outer, inner):
        """Whether the code has `outer::inner`: spelled so, or inner in a file that
        declares outer."""
        if (outer, inner) in self.pairs or "*" in outer + inner:
            return True
        return any(inner.lstrip("~") in words for words in self.declared.get(outer, []))


def code_spans(doc):
    """(line number, text) of each backtick span outside ``` fences."""
    kept, fenced = [], False
    for line in doc.split("\n"):
        if line.strip().startswith("```"):
            fenced = not fenced
            kept.append("")
        else:
            kept.append("" if fenced else line)
    text = "\n".join(kept)
    return [(text.count("\n", 0, m.start()) + 1, m.group(1).replace("\n", " "))
            for m in re.finditer(r"`([^`]+)`", text)]


def split_arguments(span):
    """(the span outside its bracketed groups, the groups' text), or None when the brackets
    do not balance."""
    closing = {")": "(", ">": "<", "]": "[", "}": "{"}
    outside, inside, stack = [], [], []
    for ch in span:
        if ch in "(<[{":
            if stack:
                inside.append(ch)
            stack.append(ch)
        elif ch in closing:
            if not stack or stack[-1] != closing[ch]:
                return None
            stack.pop()
            inside.append(ch if stack else " ")
        else:
            (inside if stack else outside).append(ch)
    return None if stack else ("".join(outside), "".join(inside))


def expand_braces(path):
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for part in m.group(1).split(",")
            for q in expand_braces(path[:m.start()] + part + path[m.end():])]


def check_path(path, repo):
    """None when the path is in the tree, else why not."""
    if "..." in path or re.fullmatch(r"\.\w+", path):
        return None
    names = {f.rsplit("/", 1)[-1] for f in repo.files}
    for each in expand_braces(path):
        if "/" not in each:  # a bare file name, anywhere in the tree
            if each in names or each + ".in" in names or fnmatch.filter(names, each):
                continue
            return f"no file named {each} in the tree"
        candidates = [base + each for base in PATH_BASES]
        if not any(repo.glob(c) if "*" in c else repo.is_path(c) or repo.is_path(c + ".in")
                   for c in candidates):
            return (f"{each} is no file or folder of the tree (relative to the root, src/, "
                    f"include/ or include/neml2/)")
    return None


def classify(span, repo):
    """("path", text), ("program", text), ("name", (head, arguments)), or (None, why not a
    code name)."""
    s = span.strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'":
        inner = s[1:-1]
        return ("path", inner) if "/" in inner and PATH_CHARS.match(inner) else (None, "a value")
    if s.startswith("<") and s.endswith(">") and s.count("<") == 1:
        inner = s[1:-1]
        return ("path", inner) if inner.startswith("neml2/") else (None, "a foreign header")
    if PATH_CHARS.match(s) and ("/" in s or EXTENSION.search(s)):
        if s.endswith("/") or EXTENSION.search(s) or s.split("/")[0] in repo.top_level:
            return "path", s
        return None, "not a path (no extension, no trailing /)"
    if len(s) == 1:
        return None, "a symbol"
    if PROGRAM.match(s):
        return "program", s
    parts = split_arguments(s)
    if parts is None or not NAME.match(parts[0]):
        return None, "an expression or a command"
    return "name", parts


def check_name(head, arguments, code):
    """None when the name is the code's, else why not."""
    components = head.split(".")[-1].split("::")  # after a `.`: a member of a variable
    missing = [c for c in components if not code.has_word(c)]
    if missing:
        return f"{', '.join(missing)}: no such word in the code"
    for outer, inner in zip(components, components[1:]):
        if not code.holds(outer, inner):
            return (f"{inner} is not in {outer}: the code spells no {outer}::{inner}, and no "
                    f"file declaring {outer} holds {inner}")
    types = [w for w in re.findall(r"[A-Za-z_]\w*", re.sub(r"\"[^\"]*\"", " ", arguments))
             if re.match(r"[A-Z]\w*[a-z]", w)]
    missing = [t for t in types if not code.has_word(t)]
    if missing:
        return f"{', '.join(missing)} (in its arguments): no such word in the code"
    return None


def check_span(kind, what, repo, code):
    if kind == "path":
        return check_path(what, repo)
    if kind == "program":
        return None if what in code.programs else "no such program or target name in the code"
    return check_name(*what, code)


def check_architecture(doc, repo, code, foreign=FOREIGN, name="docs/architecture.md"):
    """(findings, how many code names were checked) for the architecture page."""
    findings, used, checked = [], set(), 0
    for line, span in code_spans(doc):
        kind, what = classify(span, repo)
        why = None if kind is None else check_span(kind, what, repo, code)
        if span.strip() in foreign:
            if span.strip() not in used and kind is not None and why is None:
                findings.append(f"check_docs.py: FOREIGN entry '{span.strip()}' is in the "
                                f"tree; remove it")
            used.add(span.strip())
        elif kind is not None:
            checked += 1
            if why:
                findings.append(f"{name}:{line}: `{span}`: {why}")
    findings += [f"check_docs.py: FOREIGN entry '{f}' is quoted nowhere in {name}; remove it"
                 for f in foreign if f not in used]
    if checked == 0:
        findings.append(f"{name}: no code name found; is it the architecture page?")
    return findings, checked


# ---------------------------------------------------------------- running


def check(root):
    """(findings, summary) for the repository at root."""
    repo = Repo(root)
    performance = repo.root / "docs" / "performance.md"
    architecture = repo.root / "docs" / "architecture.md"
    missing = [f"{doc}: no such file" for doc in (performance, architecture) if not doc.is_file()]
    if missing:
        return missing, ""
    findings = check_performance(performance.read_text(encoding="utf-8"), repo)
    more, checked = check_architecture(architecture.read_text(encoding="utf-8"), repo,
                                       Code(repo))
    return findings + more, (f"docs/performance.md: every figure names its run; "
                             f"docs/architecture.md: {checked} code names, all in the tree")


def self_test(root):
    """Feeds the checks broken docs (each must be reported) and sound ones (none may be)."""
    repo = Repo(root)
    code = Code(repo)
    head = repo._git("rev-parse", "--short=12", "HEAD")
    day = repo.commit_date(head).isoformat()
    sound = f"# T\n\n## A\n\n```sh\nrun it\n```\n\nOne call: 1.5 ms ({day}, {head}).\n"
    performance_cases = [
        ("a sound doc", sound, None),
        ("a figure with no date", sound + f"\nTwo calls: 3.0 ms ({head}).\n", "no date"),
        ("a figure with no commit", sound + f"\nTwo calls: 3.0 ms ({day}).\n", "no commit"),
        ("a commit that does not exist",
         sound + f"\nTwo calls: 3.0 ms ({day}, 0123456789abcdef0123456789abcdef01234567).\n",
         "is not a commit"),
        ("a run dated before its commit", sound + f"\nTwo calls: 3.0 ms (2000-01-01, {head}).\n",
         "younger than"),
        ("an undated table", sound + "\nAn older run:\n\n| a | b |\n|---|---|\n| 1 | 2 |\n",
         "a table whose run is not named"),
        ("a table under its heading", sound + "\n### B\n\n| a | b |\n|---|---|\n| 1 | 2 |\n",
         "no caption"),
        ("a table dated row by row",
         sound + f"\n| a | run |\n|---|---|\n| 1.5 | {day} ({head}) |\n", None),
        ("a figure with no command", f"# T\n\n## A\n\nOne call: 1.5 ms ({day}, {head}).\n",
         "no command"),
        ("a list item without its run", sound + "\n- 2.5x faster\n", "no date"),
        ("a 401-line doc", sound + "\n" * (401 - len(sound.splitlines())), "401 lines"),
        ("a 400-line doc", sound + "\n" * (400 - len(sound.splitlines())), None),
    ]
    architecture_cases = [
        ("names in the tree", "`SyncCall`, `detail::CallProtocol::run`, "
         "`src/engine/sync_call.cpp`, `neml2/memory.hpp`, `chunk_rows(batch)`, `*_into`, "
         "`neml2-dispatch`, `1e-13`, `\"cuda:1\"`, `(B, *base)`, `ls_max_iters > 2`, `n`, "
         "`.pt2`, `torch_thing`",
         ["torch_thing"], None),
        ("a name that does not exist", "`SyncCall` and `NoSuchCallAnywhere`", [], "NoSuchCall"),
        ("a qualifier that does not hold", "`SyncCall::decide_rows`", [], "is not in SyncCall"),
        ("a path that does not exist", "`src/engine/no_such_file.cpp`", [], "no file or folder"),
        ("a bare file that does not exist", "`no_such_file.hpp`", [], "no file named"),
        ("an argument type that does not exist", "`DispatcherOf<NoSuchPolicyType>`", [],
         "in its arguments"),
        ("a foreign entry quoted nowhere", "`SyncCall`", ["torch_thing"], "quoted nowhere"),
        ("a foreign entry in the tree", "`SyncCall`", ["SyncCall"], "is in the tree"),
    ]
    failures = []
    for case, doc, expected in performance_cases:
        failures += _expect(case, check_performance(doc, repo, name="synthetic"), expected)
    for case, doc, foreign, expected in architecture_cases:
        found, _ = check_architecture(doc, repo, code, foreign=foreign, name="synthetic")
        failures += _expect(case, found, expected)
    with tempfile.TemporaryDirectory() as folder:
        try:
            Repo(folder)
            failures.append("a folder outside any git work tree was accepted")
        except NotACheckout:
            pass
    cases = len(performance_cases) + len(architecture_cases) + 1
    if failures:
        print("\n".join(failures))
        print(f"self-test: {len(failures)} of {cases} cases wrong")
        return 1
    print(f"self-test: {cases} cases, each broken doc reported and each sound one passed")
    return 0


def _expect(case, found, expected):
    """Why the findings are not what the case expects, as a list (empty when they are)."""
    if expected is None:
        return [f"{case}: reported, but it is sound:\n    " + "\n    ".join(found)] if found else []
    if not any(expected in f for f in found):
        return [f"{case}: not reported (expected '{expected}'); reported:\n    " +
                "\n    ".join(found or ["nothing"])]
    return []


def main(argv):
    args = argv[1:]
    testing = "--self-test" in args
    args = [a for a in args if a != "--self-test"]
    if len(args) != 1:
        print("usage: check_docs.py [--self-test] REPO_ROOT", file=sys.stderr)
        return 2
    try:
        if testing:
            return self_test(args[0])
        findings, summary = check(args[0])
    except NotACheckout as e:
        print(f"check_docs.py: {e}", file=sys.stderr)
        return 1
    if findings:
        print("\n".join(findings))
        print(f"{len(findings)} finding(s)")
        return 1
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

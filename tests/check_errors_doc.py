#!/usr/bin/env python3
"""Every error message docs/errors.md quotes is one the code can print (issue 24, item 6).

  check_errors_doc.py REPO_ROOT [ERRORS_MD]   (ERRORS_MD defaults to REPO_ROOT/docs/errors.md)

A quoted message is a backtick span holding a space (a single token such as `max_rows`,
`dtype` or `\\n` names a field, not a message) in the "example message" column of a table,
or in prose (outside tables and ``` blocks; there a span may run over a line break).
Other columns (situation, fix, test) and code blocks are not read. In a quote, `…` stands
for an elided part (a shortened path, the rest of the message) and `\\n` for a line break;
everything else is the text as printed, example values included (`...`, `<name>` are
printed text, and `N`, `cpu`, `strain` values like any other).

What the code can print: templates made of the string literals of src/**/*.{cpp,hpp},
include/**/*.hpp and apps/**/*.cpp (comments skipped, escapes decoded, adjacent literals
joined). A literal is cut into pieces at its fmt fields ({}, {0}, {:.3g}) and printf
conversions (%s); literals chained with + in one statement form one template; a value
goes between two pieces.

A quote matches when every word of it is accounted for (its ends, and the text next to
each `…`, are open: code text may run past them):
  - covered by code text: a piece of 4 characters or more, with a letter and a non-word
    character (a bare word such as "stub" or "missing" is a value), found whole and not
    inside a word; or a template whose pieces all appear in order;
  - or a value: a token that is no plain word (a number, a path, a name with . _ ~ or
    digits), an item of a list ("known: a, b, c", "{cpu, cuda:0}"), or a plain word
    where a template takes a value (its pieces on both sides, or on one side when that
    piece covers on its own and the value ends the template);
  - or text that foreign code prints (torch, nmhit, nlohmann::json, strerror, a test's
    injected fault), listed in FOREIGN; an entry no quote uses is an error too;
and a piece of 8 characters or more covers part of it. So example values may be
anything, while a changed word of message text fails.

Exit 0 with a one-line summary when every quote matches; otherwise print each failing
quote with its line number in the doc and the words no code text holds, and exit 1.
"""

import re
import sys
from pathlib import Path

MIN_PIECE = 4  # a piece of code text shorter than this covers nothing on its own
MIN_ANCHOR = 8  # every quote needs one covering piece at least this long
ELLIPSIS = "…"

# Text printed by code outside this repository, inside one of our messages. Exact text:
# an edit to the surrounding words is still checked.
FOREIGN = [
    # nmhit (NEML2's HIT parser), entry 3
    "unexpected character 'newline in section header'",
    "syntax error, unexpected [, expecting ']'",
    "unexpected character 'w'",
    "syntax error, unexpected [], expecting end of file",
    "duplicate field 'artifact_path': use ':=' to override",
    # strerror, entry 11
    "Too many levels of symbolic links",
    # nlohmann::json, entries 12 and 15
    "[json.exception.parse_error.101] parse error at line 2, column 24: "
    "syntax error while parsing object key - unexpected ','; expected string literal",
    "[json.exception.type_error.302] type must be string, but is number",
    # PyTorch and its AOTInductor runtime, entries 38, 44, 81, 84
    "File not found: /tmp/e9Xkwn/elasticity/data/aotinductor/model/chtcn",
    "PyTorch is not linked with support for xpu devices",
    "run_func_( container_handle_, input_handles.data(), input_handles.size(), "
    "output_handles.data(), output_handles.size(), "
    "reinterpret_cast<AOTInductorStreamHandle>(stream_handle), proxy_executor_handle_) "
    "API call failed at /pytorch/torch/csrc/inductor/aoti_runner/model_container_runner.cpp, "
    "line 150",
    "expand is unsupported for Sparse tensors",
    # faults the tests inject, entries 53, 85 and 86
    "bookkeeping bug",
    "planning bug",
    "foreign fault",
    "chunk 0 diverged",
    "chunk 1 is broken",
]

SOURCES = [("src", ("*.cpp", "*.hpp")), ("include", ("*.hpp",)), ("apps", ("*.cpp",))]


# ---------------------------------------------------------------- the doc's quotes


def backtick_spans(text):
    """(offset, text) of each `...` span (single backticks; a span may cross lines)."""
    return [(m.start(1), m.group(1)) for m in re.finditer(r"`([^`]+)`", text)]


def table_cells(line):
    """A table row's cells, split at | outside backtick spans."""
    cells, cur, tick = [], [], False
    for ch in line.strip().strip("|"):
        if ch == "`":
            tick = not tick
        if ch == "|" and not tick:
            cells.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    cells.append("".join(cur))
    return [c.strip() for c in cells]


def quoted_messages(doc):
    """(line number, quote) of every quoted message, in the order of the doc."""
    quotes = []
    lines = doc.split("\n")
    column = None  # index of the "example message" column in the current table
    prose = []  # (line number, text) of the current prose paragraph
    fenced = False

    def flush_prose():
        if not prose:
            return
        text = "\n".join(t for _, t in prose)
        starts = [0]
        for _, t in prose:
            starts.append(starts[-1] + len(t) + 1)
        for offset, span in backtick_spans(text):
            if " " in span.strip() or "\n" in span.strip():
                row = max(i for i, s in enumerate(starts[:-1]) if s <= offset)
                quotes.append((prose[row][0], span.replace("\n", " ")))
        prose.clear()

    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            flush_prose()
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("|"):
            flush_prose()
            cells = table_cells(line)
            if column is None:  # a header row
                column = cells.index("example message") if "example message" in cells else -1
            elif column >= 0 and column < len(cells) and not set(line) <= set("|-: "):
                for _, span in backtick_spans(cells[column]):
                    if " " in span.strip():
                        quotes.append((number, span))
            continue
        column = None
        if line.strip():
            prose.append((number, line))
        else:
            flush_prose()
    flush_prose()
    return quotes


# ---------------------------------------------------------------- the code's literals

LITERAL_PREFIXES = {"u8", "u", "U", "L", "R", "u8R", "uR", "UR", "LR"}
SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "a": "\a", "b": "\b",
                  "f": "\f", "v": "\v", "\\": "\\", "'": "'", '"': '"', "?": "?"}


def decode_escapes(body):
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        nxt = body[i + 1]
        if nxt == "x":
            m = re.match(r"[0-9A-Fa-f]+", body[i + 2:])
            out.append(chr(int(m.group(0), 16)))
            i += 2 + len(m.group(0))
        elif nxt in "01234567" and re.match(r"[0-7]{1,3}", body[i + 1:]).group(0) != "0":
            m = re.match(r"[0-7]{1,3}", body[i + 1:])
            out.append(chr(int(m.group(0), 8)))
            i += 1 + len(m.group(0))
        elif nxt in "uU":
            n = 4 if nxt == "u" else 8
            out.append(chr(int(body[i + 2:i + 2 + n], 16)))
            i += 2 + n
        else:
            out.append(SIMPLE_ESCAPES.get(nxt, nxt))
            i += 2
    return "".join(out)


def templates_of(src):
    """The message templates of one C++ source: each a list of pieces of literal text,
    with a value between two pieces. A template is one string literal (adjacent ones
    joined) cut at its fmt fields, or literals chained with + in one statement; it starts
    (ends) with an empty piece when a value comes first (last)."""
    templates = []
    chain = None  # the template being chained with +
    pending = False  # the chain's last literal is followed by +
    i, n = 0, len(src)
    last = ""  # the last significant character before i

    def literal_at(i):
        """(decoded text, index after) of the literal starting at i, or None."""
        m = re.match(r"(u8|u|U|L)?(R)?\"", src[i:])
        if not m:
            return None
        if m.group(2):  # R"delim( ... )delim"
            open_paren = src.index("(", i + m.end())
            delim = src[i + m.end():open_paren]
            close = src.index(")" + delim + '"', open_paren)
            return src[open_paren + 1:close], close + len(delim) + 2
        j = i + m.end()
        while src[j] != '"':
            j += 2 if src[j] == "\\" else 1
        return decode_escapes(src[i + m.end():j]), j + 1

    def skip_blank(i):
        while i < n:
            if src.startswith("//", i):
                j = src.find("\n", i)
                i = n if j < 0 else j
            elif src.startswith("/*", i):
                j = src.find("*/", i + 2)
                i = n if j < 0 else j + 2
            elif src[i].isspace():
                i += 1
            else:
                break
        return i

    def close_chain():
        nonlocal chain, pending
        if chain is not None:
            templates.append(chain + [""] if pending else chain)
        chain, pending = None, False

    while i < n:
        j = skip_blank(i)
        if j != i:
            i = j
            continue
        ch = src[i]
        lit = None
        if ch == '"':
            lit = literal_at(i)
        elif ch.isalpha() or ch == "_":
            word = re.match(r"[A-Za-z_]\w*", src[i:]).group(0)
            if word in LITERAL_PREFIXES and src.startswith('"', i + len(word)):
                lit = literal_at(i)
        if lit is not None:
            text, i = lit
            while True:  # adjacent literals, and a suffix such as sv
                i = skip_blank(i)
                m = re.match(r"[A-Za-z_]\w*", src[i:])
                if m and not literal_at(i):
                    if src[i - 1] == '"':  # "..."sv
                        i += m.end()
                        continue
                    break
                nxt = literal_at(i)
                if nxt is None:
                    break
                text += nxt[0]
                i = nxt[1]
            pieces = pieces_of(text)
            if chain is not None and pending:
                chain += pieces
            else:
                close_chain()
                chain = ([""] + pieces) if last == "+" else pieces
            i = skip_blank(i)
            pending = i < n and src[i] == "+" and not src.startswith("++", i)
            last = '"'
            continue
        if ch == ";" or ch == "{" or ch == "}":
            close_chain()
        if ch.isalpha() or ch == "_":
            i += re.match(r"[A-Za-z_]\w*", src[i:]).end()
            last = "a"
            continue
        if ch.isdigit() or (ch == "." and i + 1 < n and src[i + 1].isdigit()):
            # a pp-number, whose digit separators (1'000) start no character literal
            i += re.match(r"\.?\d(?:[eEpP][+-]|['.\w])*", src[i:]).end()
            last = "0"
            continue
        if ch == "'":
            j = i + 1
            while src[j] != "'":
                j += 2 if src[j] == "\\" else 1
            i = j + 1
            last = "'"
            continue
        last = ch
        i += 1
    close_chain()
    return templates


# fmt's replacement fields ({}, {0}, {:.3g}) and printf's conversions (%s, %5.2f)
FIELD = re.compile(r"\{(?:\d+|[A-Za-z_]\w*)?(?::[^{}]*)?\}"
                   r"|%[-+#0]*\d*(?:\.\d+)?(?:hh|h|ll|l|L|z|j|t)?[sdiufFgGeExXcp]")


def pieces_of(literal):
    """A literal cut at its fields ({{, }} and %% read as {, } and %)."""
    escaped = literal.replace("{{", "\x02").replace("}}", "\x03").replace("%%", "\x04")
    return [p.replace("\x02", "{").replace("\x03", "}").replace("\x04", "%")
            for p in FIELD.split(escaped)]


def source_files(root):
    for folder, patterns in SOURCES:
        for pattern in patterns:
            yield from sorted((root / folder).rglob(pattern))


# ---------------------------------------------------------------- matching


def covering(piece):
    """Whether a piece of code text covers doc text: 4 characters or more, a letter, and
    not a bare word (a literal such as "stub" or "missing" is a value, not a message)."""
    return (len(piece) >= MIN_PIECE and re.search(r"[A-Za-z]", piece) is not None
            and re.search(r"\W", piece) is not None)


def is_word(ch):
    return ch.isalnum()


class Code:
    def __init__(self, templates):
        pieces = {p for t in templates for p in t if covering(p)}
        self.pieces = sorted(pieces)
        # all pieces between separators: "text\x01" is in it when text ends a piece,
        # "\x01text" when text starts one, and text when it is part of one
        self.all = "\x01" + "\x01".join(self.pieces) + "\x01"
        # templates of two pieces or more whose pieces are too short to cover alone: they
        # cover where the whole template matches ("a '{}' line search")
        self.templates = []
        for t in sorted({tuple(t) for t in templates}):
            inner = [p for p in t if p]
            if len(inner) >= 2 and not all(covering(p) for p in inner):
                pattern = ".+?".join(f"({re.escape(p)})" for p in inner)
                self.templates.append((inner, re.compile(pattern, re.S)))
        # the slots where a template takes a value: (piece before, piece after)
        self.slots = sorted({(t[k], t[k + 1]) for t in templates for k in range(len(t) - 1)})

    def cover(self, frag):
        """Per character of a fragment (whose ends are open), whether code text covers it;
        and the longest covering piece."""
        covered = [False] * len(frag)
        longest = 0

        def mark(a, b):
            nonlocal longest
            for k in range(a, b):
                covered[k] = True
            longest = max(longest, b - a)

        def boundary_ok(a, b):
            left = a == 0 or not (is_word(frag[a - 1]) and is_word(frag[a]))
            right = b == len(frag) or not (is_word(frag[b - 1]) and is_word(frag[b]))
            return left and right

        if frag in self.all:  # the whole fragment is part of one piece
            mark(0, len(frag))
            return covered, len(frag)
        for piece in self.pieces:
            start = frag.find(piece)
            while start >= 0:
                if boundary_ok(start, start + len(piece)):
                    mark(start, start + len(piece))
                start = frag.find(piece, start + 1)
        for inner, pattern in self.templates:
            if all(p in frag for p in inner):
                for m in pattern.finditer(frag):
                    if boundary_ok(m.start(), m.end()):
                        for g in range(1, len(inner) + 1):
                            mark(*m.span(g))
        # a piece cut by the fragment's start (end): the fragment starts (ends) with its end
        # (start)
        for k in range(len(frag), MIN_PIECE - 1, -1):
            if boundary_ok(0, k) and (frag[:k] + "\x01") in self.all:
                mark(0, k)
                break
        for k in range(len(frag), MIN_PIECE - 1, -1):
            if boundary_ok(len(frag) - k, len(frag)) and ("\x01" + frag[-k:]) in self.all:
                mark(len(frag) - k, len(frag))
                break
        return covered, longest

    def takes_value(self, left, right):
        """Whether a template takes a value between the doc text left and right (each may
        be cut by the fragment's end)."""
        def side(text, piece, at_end):
            if at_end:  # piece must end text, or text be the cut end of piece
                return len(piece) if text.endswith(piece) else (
                    len(text) if piece.endswith(text) else -1)
            return len(piece) if text.startswith(piece) else (
                len(text) if piece.startswith(text) else -1)

        for before, after in self.slots:
            if not before and not after:
                continue
            a = side(left, before, True) if before else 0
            b = side(right, after, False) if after else 0
            if a < 0 or b < 0:
                continue
            if before and after:
                if a + b >= 3:
                    return True
            else:  # a value at a template's end: the piece next to it must be substantial
                p = before or after
                if max(a, b) == len(p) and covering(p):
                    return True
        return False


PLAIN_TOKEN = re.compile(r"^[(\[{'\"]*([A-Za-z]+)[)\]}'\",.;:!?]*$")


def is_value(code, frag, covered, m):
    """Whether the token m of a fragment is covered or a value: not a plain word (a number,
    a path, a name with . _ ~ or digits), a word the code's text covers, an item of a list
    of values, or a word where a template takes a value."""
    token = PLAIN_TOKEN.match(m.group(0))
    if not token:
        return True
    s, e = m.start() + token.start(1), m.start() + token.end(1)
    if all(covered[s:e]):
        return True
    before = frag[:m.start()]
    # an item of a list of values: "(known: a, b, c)", "{cpu, cuda:0}"
    if m.group(0).endswith(",") and (m.group(0)[0] in "([{" or
                                     re.search(r"(^|[:=(\[{]|, )\s*$", before)):
        return True
    if before.endswith(", ") and (m.end() == len(frag) or re.search(r"[)\]};]$", m.group(0))):
        return True
    # the value may be the word alone or with its brackets, quotes and punctuation
    return any(code.takes_value(frag[:a], frag[b:])
               for a in range(m.start(), s + 1) for b in range(e, m.end() + 1))


def check_quote(code, quote):
    """(None if the code can print the quote, else why not; the FOREIGN entries it uses)."""
    text = quote.replace("\\n", "\n")
    foreign_used = [f for f in FOREIGN if f in text]
    longest = 0
    unexplained = []
    for frag in text.split(ELLIPSIS):
        covered, piece_len = code.cover(frag)
        longest = max(longest, piece_len)
        for f in foreign_used:
            start = frag.find(f)
            while start >= 0:
                covered[start:start + len(f)] = [True] * len(f)
                start = frag.find(f, start + 1)
        unexplained += [m.group(0) for m in re.finditer(r"\S+", frag)
                        if not is_value(code, frag, covered, m)]
    if unexplained:
        return f"words no code text holds: {' '.join(unexplained)}", foreign_used
    if longest < MIN_ANCHOR and not foreign_used:
        return f"no code text of {MIN_ANCHOR} or more characters in it", foreign_used
    return None, foreign_used


def main(argv):
    if len(argv) not in (2, 3):
        print("usage: check_errors_doc.py REPO_ROOT [ERRORS_MD]", file=sys.stderr)
        return 2
    root = Path(argv[1])
    doc_path = Path(argv[2]) if len(argv) == 3 else root / "docs" / "errors.md"
    if not doc_path.is_file():
        print(f"{doc_path}: no such file", file=sys.stderr)
        return 2
    sources = list(source_files(root))
    if not sources:
        print(f"{root}: no C++ sources under src/, include/ or apps/; pass the repository root",
              file=sys.stderr)
        return 2
    code = Code([t for path in sources for t in templates_of(path.read_text(encoding="utf-8"))])
    quotes = quoted_messages(doc_path.read_text(encoding="utf-8"))
    failures = []
    used = set()
    for line, quote in quotes:
        why, foreign = check_quote(code, quote)
        used.update(foreign)
        if why:
            failures.append(f"{doc_path}:{line}: `{quote}`\n    {why}")
    failures += [f"{Path(__file__).name}: FOREIGN entry '{f}' is quoted nowhere in {doc_path}; "
                 f"remove it" for f in FOREIGN if f not in used]
    if not quotes:
        failures.append(f"{doc_path}: no quoted message found; is it the error catalogue?")
    if failures:
        print("\n".join(failures))
        print(f"{len(failures)} problem(s) in {len(quotes)} quoted messages of {doc_path}")
        return 1
    print(f"{len(quotes)} quoted messages in {doc_path}, all found in the code")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

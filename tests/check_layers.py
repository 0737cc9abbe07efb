"""The layers of src/ include only downwards: a file in one layer includes private headers
of its own layer or of layers listed before it in LAYERS (docs/architecture.md#layers).
Prints each include that goes up and exits 1; else a one-line summary.
    check_layers.py REPO_ROOT"""

import pathlib
import re
import sys

LAYERS = ["core", "artifact", "graph", "implicit", "session", "engine", "engine/async", "tools"]


def layer_of(path: str) -> str:
    """The deepest layer a src/-relative path lies in."""
    return max((l for l in LAYERS if path.startswith(l + "/")), key=len)


def main() -> int:
    src = pathlib.Path(sys.argv[1]) / "src"
    include = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
    problems, count = [], 0
    for f in sorted(src.rglob("*.[ch]pp")):
        here = f.relative_to(src).as_posix()
        if "/" not in here:
            problems.append(f"{here}: not in a layer's folder")
            continue
        mine = LAYERS.index(layer_of(here))
        for target in include.findall(f.read_text()):
            count += 1
            if "/" not in target or target.split("/")[0] not in {l.split("/")[0] for l in LAYERS}:
                problems.append(f"{here}: includes \"{target}\", not from the src/ root")
            elif LAYERS.index(layer_of(target)) > mine:
                problems.append(f"{here} ({layer_of(here)}) includes \"{target}\" ({layer_of(target)})")
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"{count} private includes in src/, each within its layer or downwards")
    return 0


if __name__ == "__main__":
    sys.exit(main())

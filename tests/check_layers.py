"""Every include goes downwards (docs/architecture.md#layers). A file of src/ lies in the
layer of its folder; a public header (include/neml2/) in the layer PUBLIC_HEADERS gives it.
A file includes private headers ("graph/call.hpp") and public ones (<neml2/session.hpp>)
of its own layer or of layers listed before it in LAYERS; a public header includes no
private one. Prints what it checked, then each include that goes up, each public header
the table does not place, and exits 1 on any; else 0.
    check_layers.py REPO_ROOT"""

import fnmatch
import pathlib
import re
import sys

# policies: header-only (no folder in src/), above what a policy must not know (sessions)
# and below the engine that holds them. The umbrella is above every layer: the library
# includes what it uses, never it (nor ATen whole with it).
LAYERS = ["core", "artifact", "graph", "implicit", "session", "policies", "engine",
          "engine/async", "host", "tools", "umbrella"]

# Each public header's layer: that of the code it declares, low enough for every public
# header and src/ file that includes it. A new header goes here (the check fails until it
# does); a pattern places a family whose members always share a layer.
PUBLIC_HEADERS = {
    # what every layer uses: errors, devices, the vocabulary of a call, the version
    "errors.hpp": "core",
    "device.hpp": "core",
    "tensor_map.hpp": "core",
    "version.hpp": "core",  # generated in the build tree (cmake/version.hpp.in)
    "artifact.hpp": "artifact",
    "newton_factors.hpp": "implicit",  # the chord's slots, kept by a caller between calls
    # the caller's tensors for a call's results, in slot order: the positional form of
    # graph/call.hpp, beside BoundCall
    "detail/destinations.hpp": "graph",
    "session.hpp": "session",
    "detail/call_names.hpp": "session",  # a session's calls by name, for the engine and the host
    "memory.hpp": "session",  # src/session/result_memory.cpp
    "policy.hpp": "policies",
    "policies/*.hpp": "policies",  # every policy, and what one needs (its settings)
    "observer.hpp": "engine",
    "dispatch_fwd.hpp": "engine",
    "any_dispatched_model.hpp": "engine",
    "prepared_call.hpp": "engine",
    "dispatched_model.hpp": "engine",
    "detail/dispatcher.hpp": "engine",
    "detail/model_core.hpp": "engine",
    "detail/request.hpp": "engine",
    "detail/sync_call.hpp": "engine",
    "detail/testing.hpp": "engine",  # the tests' hooks into a model; included by tests only
    "detail/policy_protocol.hpp": "engine",
    # compiled in engine/async/, but DispatcherOf<P> (engine) holds one
    "detail/async_engine.hpp": "engine",
    # the asynchronous decisions: the engine's and the simulator's (tools)
    "detail/async_schedule.hpp": "engine/async",
    "material_state.hpp": "host",
    "submitted.hpp": "host",
    "tune.hpp": "tools",
    "simulate.hpp": "tools",
    "artifact_info.hpp": "tools",
    "detail/tune_*.hpp": "tools",
    "dispatch.hpp": "umbrella",
}
GENERATED = {"version.hpp"}  # placed, though not in include/neml2/ of the source tree

INCLUDE = re.compile(r'^\s*#\s*include\s*(?:"([^"]+)"|<neml2/([^>]+)>)', re.M)


def src_layer(path: str) -> str:
    """The deepest layer a src/-relative path lies in."""
    return max((l for l in LAYERS if path.startswith(l + "/")), key=len)


def public_layer(header: str):
    """The table's layer of a header relative to include/neml2/; None when it has none."""
    if header in PUBLIC_HEADERS:
        return PUBLIC_HEADERS[header]
    for pattern, layer in PUBLIC_HEADERS.items():
        if "*" in pattern and fnmatch.fnmatchcase(header, pattern):
            return layer
    return None


def main() -> int:
    root = pathlib.Path(sys.argv[1])
    src, public = root / "src", root / "include" / "neml2"
    problems = []
    counts = {"private in src/": 0, "public in src/": 0, "between public headers": 0}
    folders = {l.split("/")[0] for l in LAYERS}
    rank = LAYERS.index

    headers = sorted(f.relative_to(public).as_posix() for f in public.rglob("*.hpp"))
    placed = {}
    for h in headers:
        layer = public_layer(h)
        if layer is None:
            problems.append(f"include/neml2/{h}: in no layer; place it in PUBLIC_HEADERS "
                            f"(tests/check_layers.py)")
        else:
            placed.setdefault(layer, []).append(h)

    def check(here: str, mine: str, text: str, in_src: bool):
        for private, target in INCLUDE.findall(text):
            if private:
                if not in_src:
                    problems.append(f"{here}: includes \"{private}\", a private header, from a "
                                    f"public one (installed without src/)")
                    continue
                counts["private in src/"] += 1
                if "/" not in private or private.split("/")[0] not in folders:
                    problems.append(f"{here}: includes \"{private}\", not from the src/ root")
                elif rank(src_layer(private)) > rank(mine):
                    problems.append(f"{here} ({mine}) includes \"{private}\" "
                                    f"({src_layer(private)})")
                continue
            counts["public in src/" if in_src else "between public headers"] += 1
            layer = public_layer(target)
            if layer is None:
                problems.append(f"{here}: includes <neml2/{target}>, which no layer holds")
            elif rank(layer) > rank(mine):
                problems.append(f"{here} ({mine}) includes <neml2/{target}> ({layer})")

    for f in sorted(src.rglob("*.[ch]pp")):
        here = f.relative_to(src).as_posix()
        if "/" not in here:
            problems.append(f"src/{here}: not in a layer's folder")
            continue
        check(f"src/{here}", src_layer(here), f.read_text(), True)
    for h in headers:
        if public_layer(h) is not None:
            check(f"include/neml2/{h}", public_layer(h), (public / h).read_text(), False)

    print("layers, lowest first: " + " < ".join(LAYERS))
    for layer in LAYERS:
        if layer in placed:
            print(f"  {layer}: " + " ".join(placed[layer]))
    absent = [h for h in PUBLIC_HEADERS if "*" not in h and h not in GENERATED and
              h not in headers]
    if absent:
        print("  placed, not (yet) in include/neml2/: " + " ".join(absent))
    print(f"checked {sum(counts.values())} includes: " +
          ", ".join(f"{n} {what}" for what, n in counts.items()))
    for p in problems:
        print(p)
    if problems:
        return 1
    print("each within its layer or downwards")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""neml2-compile with a cache outside the build tree.

    compile_artifact.py INPUT.i --out DIR [neml2-compile options...]

Compiles INPUT.i with the given options into DIR (DIR/<model>/ and, unless --no-stub,
DIR/<model>_aoti.i). The result is cached under $NEML2_DISPATCH_CACHE/artifacts (default
~/.cache/neml2-dispatch/artifacts), keyed by the input's content, the options, the neml2,
torch and Python versions and the CPU, so rebuilds and CI reruns on the same machine reuse
it. Run it with the project environment's python.
"""

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_key(input_file: Path, options: list[str]) -> str:
    h = hashlib.sha256()
    for part in [input_file.read_bytes(), "\0".join(options).encode(),
                 metadata.version("neml2").encode(), metadata.version("torch").encode(),
                 sys.version.encode(), cpu_model().encode()]:
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def main() -> int:
    args = sys.argv[1:]
    if len(args) < 3 or "--out" not in args:
        print(__doc__, file=sys.stderr)
        return 2
    i = args.index("--out")
    out = Path(args[i + 1])
    options = args[:i] + args[i + 2:]
    input_file = Path(options[0]).resolve()
    options = options[1:]

    cache_root = Path(os.environ.get("NEML2_DISPATCH_CACHE",
                                     Path.home() / ".cache" / "neml2-dispatch")) / "artifacts"
    entry = cache_root / cache_key(input_file, options)
    if not entry.is_dir():
        tmp = cache_root / f"{entry.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        cmd = [sys.executable, "-m", "neml2.cli.aoti_compile", str(input_file), *options,
               "--output-dir", str(tmp), "-q"]
        print("neml2-compile", " ".join(cmd[3:]), flush=True)
        result = subprocess.run(cmd)
        if result.returncode != 0 or not any(tmp.glob("*/metadata.json")):
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"neml2-compile failed for {input_file}", file=sys.stderr)
            return result.returncode
        try:
            tmp.rename(entry)
        except OSError:  # another process finished the same entry first
            shutil.rmtree(tmp, ignore_errors=True)

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(entry, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

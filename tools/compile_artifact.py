#!/usr/bin/env python3
"""neml2-compile with a cache outside the build tree.

    compile_artifact.py INPUT.i --out DIR [neml2-compile options...]

Compiles INPUT.i with the given options into DIR (DIR/<model>/ and, unless --no-stub,
DIR/<model>_aoti.i). The result is cached under $NEML2_DISPATCH_CACHE/artifacts (default
~/.cache/neml2-dispatch/artifacts), keyed by the input's content, the options, the neml2,
torch and Python versions and the CPU, so rebuilds and CI reruns on the same machine reuse
it. Run it with the project environment's python.

Inductor checks which vector instruction sets the compiler can build by compiling and
loading six test programs, each in a fresh python: about 9 s of every neml2-compile.
This tool runs that check once per machine (torch, python, CPU and compiler) and, where
it finds every set the CPU lists buildable, tells each neml2-compile so
(TORCHINDUCTOR_VEC_ISA_OK=1: the same sets, hence the same code, without the check).
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


VEC_ISA_PROBE = """
import torch._inductor.config as config
from torch._inductor import cpu_vec_isa
checked = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
cpu_vec_isa.valid_vec_isa_list.cache_clear()
config.cpp.vec_isa_ok = True
assumed = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
print("same" if checked == assumed else "differs", checked, assumed)
"""


def compiler_version() -> str:
    compiler = os.environ.get("CXX") or shutil.which("g++") or "c++"
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              check=False).stdout
    except OSError:
        return compiler


def inductor_env(cache: Path) -> dict[str, str]:
    """The environment for neml2-compile: TORCHINDUCTOR_VEC_ISA_OK=1 where inductor's own
    check, run once for this machine, finds every vector set the CPU lists buildable."""
    env = dict(os.environ)
    if "TORCHINDUCTOR_VEC_ISA_OK" in env:
        return env
    h = hashlib.sha256()
    for part in [metadata.version("torch"), sys.version, cpu_model(), compiler_version()]:
        h.update(part.encode() + b"\0")
    answer = cache / f"vec-isa-{h.hexdigest()[:20]}"
    if not answer.is_file():
        probe = subprocess.run([sys.executable, "-c", VEC_ISA_PROBE], capture_output=True,
                               text=True, check=False)
        verdict = probe.stdout.strip() if probe.returncode == 0 else "failed"
        cache.mkdir(parents=True, exist_ok=True)
        tmp = answer.with_name(f"{answer.name}.tmp-{os.getpid()}")
        tmp.write_text(verdict + "\n")
        tmp.replace(answer)
    if answer.read_text().startswith("same "):
        env["TORCHINDUCTOR_VEC_ISA_OK"] = "1"
    return env


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
        result = subprocess.run(cmd, env=inductor_env(cache_root.parent))
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

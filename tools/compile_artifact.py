#!/usr/bin/env python3
"""neml2-compile with a cache outside the build tree.

    compile_artifact.py INPUT.i --out DIR [neml2-compile options...]

Compiles INPUT.i with the given options into DIR (DIR/<model>/ and, unless --no-stub,
DIR/<model>_aoti.i). The result is cached under $NEML2_DISPATCH_CACHE/artifacts (default
~/.cache/neml2-dispatch/artifacts), keyed by the input's content, the options, the neml2,
torch and Python versions and the CPU, so rebuilds and CI reruns on the same machine reuse
it. Run it with the project environment's python.

Inductor picks the vector instruction sets it generates code for by building a test
program per set and loading each in a fresh python: about 9 s of every neml2-compile
(TORCHINDUCTOR_VEC_ISA_OK=1 skips only some of them). The answers depend on the machine
alone, so this tool records them once per machine (torch, python, CPU and compiler) and
hands them to each neml2-compile: the same answers, hence the same code, without the
checks. Each neml2-compile also runs without Inductor's pool of compile workers (make
already runs the compiles side by side). Both: 52.6 -> 48.0 s for a five-graph model.
"""

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
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


# The key of one check: the flags and the test program (the same in both snippets below).
CHECK_KEY = """
import hashlib
def check_key(isa, code):
    return hashlib.sha256(f"{isa._arch_flags}\\0{code}".encode()).hexdigest()
"""

# Runs Inductor's checks and prints each one's answer, as JSON.
VEC_ISA_PROBE = CHECK_KEY + """
import json
from torch._inductor import cpu_vec_isa
answers = {}
check_build = cpu_vec_isa.VecISA.check_build
def recorded(isa, code):
    answers[check_key(isa, code)] = ok = check_build(isa, code)
    return ok
cpu_vec_isa.VecISA.check_build = recorded
cpu_vec_isa.valid_vec_isa_list()
print(json.dumps(answers))
"""

# neml2-compile with the recorded answers (argv: the answers file, then its arguments); a
# check not recorded runs as usual.
NEML2_COMPILE = CHECK_KEY + """
import json, runpy, sys
from torch._inductor import cpu_vec_isa
with open(sys.argv.pop(1)) as f:
    answers = json.load(f)
check_build = cpu_vec_isa.VecISA.check_build
def answered(isa, code):
    ok = answers.get(check_key(isa, code))
    return check_build(isa, code) if ok is None else ok
cpu_vec_isa.VecISA.check_build = answered
sys.argv[0] = "neml2-compile"
runpy.run_module("neml2.cli.aoti_compile", run_name="__main__", alter_sys=True)
"""


def compiler_version() -> str:
    compiler = os.environ.get("CXX") or shutil.which("g++") or "c++"
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              check=False).stdout
    except OSError:
        return compiler


def vec_isa_answers(cache: Path) -> Path:
    """The file of Inductor's vector-ISA answers for this machine, made on first use."""
    h = hashlib.sha256()
    for part in [metadata.version("torch"), sys.version, cpu_model(), compiler_version()]:
        h.update(part.encode() + b"\0")
    answers = cache / f"vec-isa-answers-{h.hexdigest()[:20]}.json"
    if not answers.is_file():
        probe = subprocess.run([sys.executable, "-c", VEC_ISA_PROBE], capture_output=True,
                               text=True, check=False)
        try:  # no answers (each neml2-compile checks for itself) where the probe fails
            recorded = json.loads(probe.stdout.splitlines()[-1]) if probe.returncode == 0 else {}
        except (IndexError, ValueError):
            recorded = {}
        cache.mkdir(parents=True, exist_ok=True)
        tmp = answers.with_name(f"{answers.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(recorded) + "\n")
        tmp.replace(answers)
    return answers


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
        arguments = [str(input_file), *options, "--output-dir", str(tmp), "-q"]
        print("neml2-compile", " ".join(arguments), flush=True)
        answers = vec_isa_answers(cache_root.parent)
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-c", NEML2_COMPILE, str(answers), *arguments],
                                env={"TORCHINDUCTOR_COMPILE_THREADS": "1", **os.environ})
        if result.returncode != 0 or not any(tmp.glob("*/metadata.json")):
            shutil.rmtree(tmp, ignore_errors=True)
            why = (f"exit status {result.returncode}; its message is above" if result.returncode
                   else "it exited 0 but wrote no <model>/metadata.json")
            print(f"neml2-compile failed for {input_file} ({why})", file=sys.stderr)
            return result.returncode or 1
        took = time.monotonic() - start
        print(f"neml2-compile {input_file.name} for {out.name} took {took:.0f} s", flush=True)
        try:
            tmp.rename(entry)
        except OSError:  # another process finished the same entry first
            shutil.rmtree(tmp, ignore_errors=True)

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(entry, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

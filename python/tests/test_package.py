"""The installed wheel (scripts/python-test.sh): the module, the C++ package a CMake
project finds with `python -m neml2_dispatch --cmake-prefix`, and the neml2-dispatch
program as a console script. (The C++ consumer build itself is in the script.)"""

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import neml2_dispatch as nd
from conftest import ROOT


def test_cmake_prefix_holds_the_cpp_package():
    done = subprocess.run([sys.executable, "-m", "neml2_dispatch", "--cmake-prefix"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    prefix = Path(done.stdout.strip())
    assert prefix == Path(nd.__file__).parent
    for part in ["include/neml2/dispatch.hpp", "include/neml2/version.hpp",
                 "lib/libneml2_dispatch.a", "lib/libneml2_dispatch_tools.a",
                 "lib/cmake/neml2_dispatch/neml2_dispatchConfig.cmake",
                 "lib/cmake/neml2_dispatch/neml2_dispatchConfigVersion.cmake",
                 "lib/cmake/neml2_dispatch/neml2_dispatchTorch.cmake", "bin/neml2-dispatch",
                 "share/neml2-dispatch/plot_tune.py"]:
        assert (prefix / part).is_file(), f"{part} is not in the wheel's package"


def test_requires_python_is_what_its_torch_requires():
    def least(spec):  # ">=3.10" -> (3, 10)
        found = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip())
        assert found, f"Requires-Python {spec!r} is not of the form >=X.Y"
        return tuple(int(x) for x in found.groups())

    ours = metadata.metadata("neml2_dispatch")["Requires-Python"]
    torch = metadata.metadata("torch")["Requires-Python"]
    assert least(ours) >= least(torch), f"the wheel allows Python {ours}, its torch {torch}"


def test_version_is_the_projects():
    text = (ROOT / "CMakeLists.txt").read_text()
    version = re.search(r"project\(neml2_dispatch VERSION (\S+)", text).group(1)
    assert nd.__version__ == version
    done = subprocess.run([sys.executable, "-m", "neml2_dispatch", "--version"],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == version
    from importlib.metadata import version as installed_version

    assert installed_version("neml2-dispatch") == version


def test_console_script_runs_the_program(elasticity):
    script = Path(sys.executable).parent / "neml2-dispatch"
    assert script.is_file(), f"no console script at {script}"
    done = subprocess.run([str(script), "info", str(elasticity)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "strain" in done.stdout and "stress" in done.stdout
    bad = subprocess.run([str(script), "info", "/nonexistent_aoti.i"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "does not exist" in bad.stdout + bad.stderr

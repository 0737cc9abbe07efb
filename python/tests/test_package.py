"""The installed wheel (scripts/python-test.sh): the module, the C++ package a CMake
project finds with `python -m neml2_dispatch --cmake-prefix`, and the neml2-dispatch
program as a console script. (The C++ consumer build itself is in the script.)"""

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

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


def test_runpaths_name_no_folder_of_the_builder():
    package = Path(nd.__file__).parent
    for binary in [Path(nd._core.__file__), package / "bin" / "neml2-dispatch"]:
        dynamic = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True,
                                 check=True).stdout
        paths = [p for line in dynamic.splitlines() if "RUNPATH" in line or "RPATH" in line
                 for p in re.search(r"\[(.*)\]", line).group(1).split(":")]
        assert all(p.startswith("$ORIGIN") for p in paths), f"{binary.name}: {paths}"


def _import_with(tmp_path, version, cuda):
    """`import neml2_dispatch` from a copy of the installed package whose build record
    says it was compiled against torch `version` with CUDA `cuda`."""
    import shutil

    where = tmp_path / f"{version}-{cuda}"
    copy = where / "neml2_dispatch"
    shutil.copytree(Path(nd.__file__).parent, copy, ignore=shutil.ignore_patterns(
        "lib", "include", "bin", "share"))
    (copy / "_build_info.py").write_text(f"torch_version = {version!r}\ntorch_cuda = {cuda!r}\n")
    return subprocess.run([sys.executable, "-c", "import neml2_dispatch"], capture_output=True,
                          text=True, timeout=300, cwd=where,
                          env={**os.environ, "PYTHONPATH": str(where)})


def test_import_refuses_a_torch_it_was_not_compiled_for(tmp_path):
    import torch

    from neml2_dispatch import _build_info

    assert _build_info.torch_version == torch.__version__.split("+")[0]
    same = _import_with(tmp_path, _build_info.torch_version, _build_info.torch_cuda)
    assert same.returncode == 0, same.stderr
    other = _import_with(tmp_path, "2.11.0", None)
    assert other.returncode != 0
    assert "compiled against torch 2.11.0" in other.stderr and "torch==2.11.*" in other.stderr
    assert "undefined symbol" not in other.stderr


@pytest.mark.parametrize("built, running, problem", [
    (("2.12.1", None), ("2.12.0+cpu", None), None),
    (("2.12.1", None), ("2.12.1+cu130", "13.0"), None),  # a CPU build under a CUDA torch
    (("2.12.1", "13.0"), ("2.12.1+cu130", "13.0"), None),
    (("2.12.1", "13.0"), ("2.12.1+cpu", None), "without CUDA"),
    (("2.12.1", "12.8"), ("2.12.1+cu130", "13.0"), "with CUDA 13.0"),
    (("2.12.1", None), ("2.11.0", None), "compiled against torch 2.12.1"),
    (("2.12.1", None), ("2.13.0.dev20270101", None), "torch==2.12.*"),
    (("", None), ("2.12.1", None), "does not say which torch"),
])
def test_torch_check_decides_from_versions(built, running, problem):
    from neml2_dispatch._torch_check import mismatch

    said = mismatch(*built, *running)
    if problem is None:
        assert said is None
    else:
        assert said is not None and problem in said and "rebuild" in said


@pytest.mark.parametrize("version, said", [
    ("__version__ = '2.11.0+cpu'\ncuda = None\n", "the torch found is 2.11.0"),
    (None, "cannot tell which torch"),
])
def test_the_build_refuses_a_torch_of_another_release(tmp_path, version, said):
    """A torch folder that says 2.11.0, or nothing (its libraries empty files): configure
    stops at once with the pinned release and how to get it."""
    fake = tmp_path / "torch"
    (fake / "lib").mkdir(parents=True)
    (fake / "include" / "torch").mkdir(parents=True)
    for lib in ["libtorch.so", "libtorch_cpu.so", "libc10.so", "libgomp.so.1"]:
        (fake / "lib" / lib).touch()
    if version:
        (fake / "version.py").write_text(version)
    done = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"),
                           f"-DNEML2_DISPATCH_TORCH_DIR={fake}"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0
    text = " ".join((done.stdout + done.stderr).split())
    pinned = re.search(r"^torch==(\d+\.\d+)", (ROOT / "requirements.txt").read_text(), re.M)[1]
    assert said in text and f"written for torch {pinned}.x" in text, text


def test_an_editable_install_is_refused_clearly(tmp_path):
    """pip install -e calls the backend's build_editable: CMake stops before compiling."""
    code = ("import sys, scikit_build_core.build as backend; "
            f"backend.build_editable({str(tmp_path)!r}, "
            f"{{'build-dir': {str(tmp_path / 'cmake')!r}}})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=ROOT / "python")
    assert done.returncode != 0
    text = " ".join((done.stdout + done.stderr).split())
    assert "cannot be installed editable" in text, text[-2000:]
    assert not list(tmp_path.glob("*.whl"))

"""Is the torch this process imports one the module can run with? The module is compiled
against the C++ interface of one torch (``_build_info.py``), which holds within its
major.minor release; a module that links torch's CUDA runner needs a torch with CUDA.
Checked at import, before the module loads (where a mismatch would otherwise surface as
an "undefined symbol" or a missing library)."""

from __future__ import annotations

import re

REBUILD = ("or rebuild neml2_dispatch against this torch: "
           "pip install --no-build-isolation --force-reinstall ./python (docs/python.md)")


def _series(version: str) -> tuple[int, int] | None:
    found = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(found[1]), int(found[2])) if found else None


def mismatch(built_version: str, built_cuda: str | None, version: str, cuda: str | None,
             where: str = "") -> str | None:
    """What is wrong with running a module built against torch `built_version` (CUDA
    `built_cuda`, or None) under torch `version` (CUDA `cuda`), or None when nothing is."""
    built, running = _series(built_version), _series(version)
    at = f" ({where})" if where else ""
    if built is None:
        return (f"neml2_dispatch does not say which torch it was compiled against "
                f"(_build_info.py: {built_version!r}); {REBUILD}")
    if running != built:
        return (f"neml2_dispatch was compiled against torch {built_version}, but this process "
                f"imports torch {version}{at}; its C++ interface differs between releases. "
                f"Install torch=={built[0]}.{built[1]}.* (pip install "
                f"'torch=={built[0]}.{built[1]}.*'), {REBUILD}")
    if built_cuda and not cuda:
        return (f"neml2_dispatch was compiled against torch {built_version} with CUDA "
                f"{built_cuda} and links its CUDA runner, but this process imports a torch "
                f"without CUDA ({version}{at}). Install a CUDA build of torch "
                f"{built[0]}.{built[1]} (CUDA {built_cuda.split('.')[0]}.x), {REBUILD} "
                "(a build against a CPU torch runs under either)")
    if built_cuda and cuda and built_cuda.split(".")[0] != cuda.split(".")[0]:
        return (f"neml2_dispatch was compiled against torch {built_version} with CUDA "
                f"{built_cuda}, but this process imports torch {version} with CUDA {cuda}"
                f"{at}. Install torch {built[0]}.{built[1]} for CUDA "
                f"{built_cuda.split('.')[0]}.x, {REBUILD}")
    return None


def check() -> None:
    """Raises ImportError when the imported torch is not one the module can run with."""
    import torch

    from . import _build_info

    problem = mismatch(_build_info.torch_version, _build_info.torch_cuda, torch.__version__,
                       torch.version.cuda, torch.__file__)
    if problem:
        raise ImportError(problem)

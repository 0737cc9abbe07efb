"""Compiled NEML2 models (the `.pt2` artifacts ``neml2-compile`` writes) evaluated over large
batches, each batch cut into chunks and run where a policy says: the Python face of the
neml2-dispatch C++ library.

    import torch, neml2_dispatch as nd
    model = nd.load_model("aoti/elasticity_aoti.i", "elasticity",
                          nd.SyncChunking(device="cpu", batch_size=16384))
    stress = model.forward({"strain": strain})["stress"]

Tensors go in and come out as dicts keyed by variable name and are never copied; the GIL
is released for the whole of every call. Every error is a :class:`Error` (a RuntimeError)
carrying the library's message. See docs/python.md.
"""

import json as _json
import os as _os
from typing import Any, Mapping, Sequence  # noqa: F401  (annotations)

import torch as _torch  # noqa: F401  (libtorch and torch's Python types, before the module)

try:  # NEML2 defines the torch operator neml2::opaque_pow when imported, unconditionally (a
    # second definition is an error); the library defines it only when absent. Imported
    # first, NEML2's definition is the one, whichever of the two a program uses next.
    import neml2 as _neml2  # noqa: F401
except ImportError:
    _neml2 = None

from . import _torch_check

_torch_check.check()  # the torch imported is one the module can run with, or ImportError

from ._core import (  # noqa: E402
    AggregateError,
    ChunkEvent,
    ConvergenceError,
    Error,
    FatalError,
    GreedyPriorityCapacity,
    KrylovConfig,
    Model,
    NewtonFactors,
    PreparedCall,
    SolverConfig,
    SyncChunking,
    __version__,
    tuned_policy,
)
from . import _core, _ops  # noqa: E402

_ops.install(Model)  # the calls go through torch operators when a graph is wanted

__all__ = [
    "AggregateError", "ChunkEvent", "ConvergenceError", "Error", "FatalError",
    "GreedyPriorityCapacity", "KrylovConfig", "Model", "NewtonFactors", "PreparedCall",
    "SolverConfig",
    "SyncChunking", "__version__", "artifact_info", "cmake_prefix", "load_model",
    "program", "simulate", "tune", "tuned_policy",
]

if _neml2 is not None:  # DispatchedAOTIModel, registered with NEML2's factory
    from .drop_in import DispatchedAOTIModel, dispatch_aoti_models  # noqa: E402, F401

    __all__ += ["DispatchedAOTIModel", "dispatch_aoti_models"]

_HERE = _os.path.dirname(_os.path.abspath(__file__))


def load_model(path: "_os.PathLike | str", name: "str | None" = None, policy: "Any" = None,
               dtype: "_torch.dtype" = _torch.float64) -> Model:
    """Loads model `name` from a stub (or an artifact root; the name may be left out when
    the stub holds one model), dispatched by `policy` (default: SyncChunking(), whole
    batches on the CPU), computing in `dtype`. ``load_model(stub, policy)`` leaves the
    name out, as in C++."""
    return _ops.register(_core.load_model(path, name, policy, dtype))


def artifact_info(path, name=None, *, text=False):
    """What an artifact offers (``neml2-dispatch info``): its inputs, outputs and
    parameters with their shapes, the operations its graphs can run, its segments and
    solver settings, the device/dtype folders present. A dict (the ``--json`` form), or
    the text for people with ``text=True``."""
    if text:
        return _core._artifact_info_text(_os.fspath(path), name)
    return _json.loads(_core._artifact_info_json(_os.fspath(path), name))


def tune(path: "_os.PathLike | str", name: "str | None" = None,
         devices: "str | _torch.device | Sequence[str | _torch.device]" = ("cpu",), *,
         operation: str = "forward",
         dtype: "_torch.dtype" = _torch.float64, batch_rows: int = 1 << 16, min_rows: int = 1,
         max_rows: int = 1 << 22, budget_seconds: float = 30.0, warmup: int = 1,
         repeats: int = 5, sample: "Mapping[str, Any] | None" = None,
         ranges: "Mapping[str, tuple[float, float]] | None" = None, low: float = 1e-4,
         high: float = 1e-3, seed: int = 0, overlap_test: bool = True, lane_test: bool = True,
         on_point: "Any" = None, out: "_os.PathLike | str | None" = None) -> "dict[str, Any]":
    """Measures throughput against rows per chunk on each device (``neml2-dispatch tune``):
    a sweep per device through SyncChunking, then the overlap and lane tests. Returns the
    tune file's content as a dict: ``devices[k]["points"]`` (rows, median, low, high rows/s,
    repeats, out_of_memory) and ``recommendations`` (the policies it suggests). ``out=FILE``
    also writes the tune file, which :func:`tuned_policy` loads. The options are
    ``neml2::TuneOptions``' fields: ``sample`` is a dict of (n, ...) tensors tiled to each
    size, ``ranges`` ({input: (low, high)}) and ``low``/``high`` bound generated values;
    ``on_point(device_index, point)`` is called after each size. The GIL is released while
    it measures."""
    if isinstance(devices, (str, _torch.device)):
        devices = [devices]
    return _json.loads(_core._tune(
        _os.fspath(path), name,
        [d if isinstance(d, _torch.device) else str(d) for d in devices], operation=operation,
        dtype=dtype,
        batch_rows=batch_rows, min_rows=min_rows, max_rows=max_rows,
        budget_seconds=budget_seconds, warmup=warmup, repeats=repeats, sample=sample,
        ranges=dict(ranges or {}), low=low, high=high, seed=seed, overlap_test=overlap_test,
        lane_test=lane_test, on_point=on_point, out=None if out is None else _os.fspath(out)))


def simulate(policy: "Any", devices: "Sequence[Mapping[str, Any]]", batch: int,
             calls: int = 1) -> "dict[str, Any]":
    """Replays throughput curves through ``policy`` on a virtual clock (``neml2-dispatch
    simulate``): ``calls`` calls of ``batch`` rows, the policy called as a model calls it.
    ``devices`` holds one entry per device of the policy: a dict with ``curve`` (rows per
    second, or (rows, rows per second) pairs by increasing rows) and optional
    ``chunk_overhead`` and ``transfer_seconds_per_row`` seconds, or a device of a
    :func:`tune` result (the CPU's with the result's lanes added:
    ``dict(device, cpu_lanes=result["cpu_lanes"])``; its rates are all lanes'). Returns a dict: makespan, ideal, efficiency, per device busy and
    idle seconds, and the timeline of every chunk (dispatched, start, compute_start, end)."""
    return _json.loads(_core._simulate(policy, devices, batch, calls))


def cmake_prefix():
    """The prefix a C++ project passes to find_package(neml2_dispatch) (as
    CMAKE_PREFIX_PATH): the wheel's package folder, which holds include/, lib/ (the static
    libraries and lib/cmake/neml2_dispatch) and bin/neml2-dispatch. A FileNotFoundError
    where the module was not installed from the wheel (a build tree has no package)."""
    if not _os.path.isdir(_os.path.join(_HERE, "lib", "cmake", "neml2_dispatch")):
        raise FileNotFoundError(
            f"no C++ package beside the module in {_HERE}: it is installed by the wheel "
            "(pip install ./python); a build tree's package is `cmake --install build`")
    return _HERE


def program():
    """The path of the neml2-dispatch program the wheel installed (the console script
    ``neml2-dispatch`` runs it)."""
    path = _os.path.join(_HERE, "bin", "neml2-dispatch")
    if not _os.path.isfile(path):
        raise FileNotFoundError(f"no neml2-dispatch program in {_HERE}/bin (installed by the wheel)")
    return path

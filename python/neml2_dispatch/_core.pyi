"""Type stubs of neml2_dispatch's compiled core (import neml2_dispatch instead)."""

from os import PathLike
from typing import (Callable, Literal, Mapping, Optional, Protocol, Sequence, Type, TypeVar, Union,
                    overload)

import torch

__version__: str

TensorDict = Mapping[str, torch.Tensor]
BlockDict = Mapping[str, Mapping[str, torch.Tensor]]
StrPath = Union[str, PathLike]

class Error(RuntimeError):
    """Base of every error neml2_dispatch raises, with the library's message."""
    recoverable: bool
    details: str

class FatalError(Error):
    """A retry would fail the same way: bad input, a malformed artifact, a foreign error."""

class ConvergenceError(Error):
    """A nonlinear solve did not converge (recoverable)."""
    per_row: bool
    converged_mask: Optional[torch.Tensor]
    failed_rows: int
    worst_residual: float
    reasons: Optional[torch.Tensor]
    """(B,) int8: why each row failed, an index into `reason_names` (0, none, where the row
    converged)."""
    residual_norms: Optional[torch.Tensor]
    """(B,) float64: each failed row's last residual norm (NaN where it was not finite; 0 where
    the row converged)."""
    reason_names: tuple[str, ...]
    """("none", "not_converged", "non_finite", "singular"), indexed by the codes of `reasons`."""
    outputs: dict[str, torch.Tensor]
    results: list[Optional[torch.Tensor]]

class AggregateError(Error):
    """Several errors at once (concurrent chunks), in chunk order."""
    errors: list[Error]

class SyncChunking:
    """The whole batch on one device, in chunks of `batch_size` rows (0: one call), on the
    CPU `cpu_lanes` chunks at once."""
    device: str
    batch_size: int
    cpu_lanes: int
    """Threads that run the CPU's chunks side by side, the calling one included (1 to 1024);
    0: torch's intra-op thread count (torch.get_num_threads()) at each call."""
    def __init__(self, device: str = "cpu", batch_size: int = 0,
                 cpu_lanes: int = 0) -> None: ...

class GreedyPriorityCapacity:
    """One batch over several devices at once (see the class docstring)."""
    devices: list[str]
    batch_sizes: list[int]
    capacities: list[int]
    priorities: list[float]
    cpu_lanes: int
    """Threads the CPU's chunk is cut into pieces over, the calling one included (1 to 1024);
    0: torch's intra-op thread count (torch.get_num_threads()) at each call."""
    def __init__(self, devices: Sequence[str], batch_sizes: Sequence[int],
                 capacities: Sequence[int] = ..., priorities: Sequence[float] = ...,
                 cpu_lanes: int = 0) -> None: ...

class PythonSynchronousPolicy(Protocol):
    """A synchronous policy written in Python (docs/python.md)."""
    dispatch_mode: Literal["synchronous"]
    devices: Union[Sequence[str], Callable[[], Sequence[str]]]
    def compute_device(self) -> str: ...
    def chunk_rows(self, batch: int) -> int: ...

class PythonAsynchronousPolicy(Protocol):
    """An asynchronous policy written in Python: its methods are called one at a time."""
    dispatch_mode: Literal["asynchronous"]
    devices: Union[Sequence[str], Callable[[], Sequence[str]]]
    def next_chunk(self, rows_in_flight: list[int],
                   remaining: int) -> Optional[tuple[int, int]]: ...
    def on_dispatched(self, device: int, rows: int) -> None: ...
    def on_completed(self, device: int, rows: int, seconds: float) -> None: ...

Policy = Union[SyncChunking, GreedyPriorityCapacity, PythonSynchronousPolicy,
               PythonAsynchronousPolicy]
P = TypeVar("P", SyncChunking, GreedyPriorityCapacity)

class KrylovConfig:
    method: str
    restart: int
    max_its: int
    abs_tol: float
    rel_tol: float
    cache_strategy: str
    cache_max_its: int
    def __init__(self) -> None: ...

class SolverConfig:
    """The Newton settings of an implicit model (a copy)."""
    atol: float
    rtol: float
    miters: int
    substep_del_tol: float
    ls_type: str
    ls_max_iters: int
    ls_cutback: float
    ls_c: float
    solver_kind: str
    krylov: KrylovConfig
    compact_below: float
    row_pass: bool
    chord: bool
    chord_rate: float
    def __init__(self) -> None: ...

class NewtonFactors:
    """Each point's factored Newton matrix, kept from one call to the next: the chord."""
    def __init__(self) -> None: ...
    @property
    def points(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def clear(self) -> None: ...

class ChunkEvent:
    """One chunk of a call, reported when it completes."""
    @property
    def index(self) -> int: ...
    @property
    def device_index(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def first(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def seconds(self) -> float: ...
    @property
    def lane(self) -> int:
        """The CPU lane that ran it: 0 is the calling thread (and every chunk off the CPU)."""

class PreparedCall:
    """A call bound once to input names (Model.prepare)."""
    @property
    def input_names(self) -> list[str]: ...
    def forward(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """No autograd graph: an argument that requires grad is refused in grad mode."""
    def forward_into(self, inputs: Sequence[torch.Tensor],
                     outputs: Sequence[torch.Tensor]) -> None: ...

class Model:
    """A compiled model dispatched by a policy (load_model)."""
    def forward(self, inputs: TensorDict,
                factors: NewtonFactors | None = None) -> dict[str, torch.Tensor]:
        """With `factors`, each point's Newton factor kept from call to call (the chord);
        refused on a call that builds an autograd graph."""
    def jvp(self, inputs: TensorDict,
            tangents: TensorDict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]: ...
    def jacobian(self, inputs: TensorDict, factors: NewtonFactors | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
        """J[out][in] of shape (B, *in_sub_batch, *out_base, *in_base) in any grad mode (a
        block the same for every row: an expanded view)."""
    def param_jacobian(self, inputs: TensorDict
                       ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]: ...
    def param_vjp(self, inputs: TensorDict, cotangents: TensorDict) -> dict[str, torch.Tensor]: ...
    def forward_into(self, inputs: TensorDict, outputs: TensorDict) -> None:
        """No autograd graph: an argument that requires grad is refused in grad mode."""
    def jvp_into(self, inputs: TensorDict, tangents: TensorDict, outputs: TensorDict,
                 output_tangents: TensorDict) -> None: ...
    def jacobian_into(self, inputs: TensorDict, outputs: TensorDict, J: BlockDict) -> None: ...
    def param_jacobian_into(self, inputs: TensorDict, outputs: TensorDict, P: BlockDict) -> None: ...
    def param_vjp_into(self, inputs: TensorDict, cotangents: TensorDict,
                       gradients: TensorDict) -> None: ...
    def prepare(self, names: Optional[Sequence[str]] = None) -> PreparedCall: ...
    def set_observer(self, observer: Optional[Callable[[ChunkEvent], object]]) -> None: ...
    def named_parameters(self) -> dict[str, torch.Tensor]: ...
    def set_parameter(self, name: str, value: torch.Tensor) -> None: ...
    def _with_parameters(self, call: str, parameters: TensorDict, *args: object) -> object: ...
    def solver_config(self) -> SolverConfig: ...
    def set_solver_config(self, config: SolverConfig) -> None: ...
    @property
    def input_names(self) -> list[str]: ...
    @property
    def output_names(self) -> list[str]: ...
    @property
    def input_base_shapes(self) -> list[list[int]]: ...
    @property
    def output_base_shapes(self) -> list[list[int]]: ...
    @property
    def input_sub_batch_shapes(self) -> list[list[int]]: ...
    @property
    def output_shapes(self) -> list[list[int]]:
        """Each output's shape per row, sub-batch axes included."""
    @property
    def parameter_base_shapes(self) -> dict[str, list[int]]: ...
    @property
    def device(self) -> str: ...
    @property
    def devices(self) -> list[str]: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def policy(self) -> Policy: ...

@overload
def load_model(path: StrPath, name: Optional[str] = None, policy: Optional[Policy] = None,
               dtype: torch.dtype = torch.float64) -> Model: ...
@overload
def load_model(path: StrPath, policy: Policy, *, dtype: torch.dtype = torch.float64) -> Model: ...
def tuned_policy(kind: Type[P], tune_file: StrPath, path: StrPath, name: Optional[str] = None,
                 dtype: torch.dtype = torch.float64) -> P: ...
def _artifact_info_json(path: StrPath, name: Optional[str] = None) -> str: ...
def _artifact_info_text(path: StrPath, name: Optional[str] = None) -> str: ...
def _tune(path: StrPath, name: Optional[str], devices: Sequence[str], *,
          operation: str = "forward", dtype: torch.dtype = torch.float64,
          batch_rows: int = 65536, min_rows: int = 1, max_rows: int = 4194304,
          budget_seconds: float = 30.0, warmup: int = 1, repeats: int = 5,
          sample: Optional[TensorDict] = None, ranges: Mapping[str, tuple[float, float]] = ...,
          low: float = 1e-4, high: float = 1e-3, seed: int = 0, overlap_test: bool = True,
          lane_test: bool = True, on_point: Optional[Callable[[int, dict], object]] = None,
          out: Optional[StrPath] = None) -> str: ...
def _simulate(policy: Policy, devices: Sequence[Mapping[str, object]], batch: int,
              calls: int = 1) -> str: ...

"""NEML2's own workflows on the dispatcher: ``DispatchedAOTIModel``, a model type registered
with NEML2's factory that is NEML2's ``AOTIModel`` (the type the stubs ``neml2-compile``
writes name) run by this library under a policy.

It presents the surface of ``neml2.aoti.AOTIModel`` (it is one: ``input_spec``,
``output_spec``, the positional typed ``__call__`` NEML2's drivers use, ``jvp``,
``jacobian``, ``param_jacobian``, ``param_vjp``, ``named_parameters``, ``set_parameter``),
so ``TransientDriver``, ``TransientRegression`` and ``neml2-run`` drive it unchanged. Its
calls are those of a :class:`neml2_dispatch.Model`: the GIL released for each, implicit
models solved per row, results with an autograd graph when an input or a parameter
requires grad.

One line switches unchanged stubs to it (``type = AOTIModel`` blocks then load as this
type)::

    nd.dispatch_aoti_models(nd.SyncChunking(batch_size=16384))   # for good
    with nd.dispatch_aoti_models(policy):                         # or for a block of code
        driver = neml2.load_input("model_aoti.i").get_driver("driver")

``neml2-run --load neml2_dispatch.switch_aoti_models INPUT DRIVER`` does the same for the
program. A stub may also name the type, with an optional policy of its own::

    [Models]
      [model]
        type = DispatchedAOTIModel
        artifact_path = 'model'
        policy = GreedyPriorityCapacity      # or SyncChunking (default)
        devices = 'cpu cuda:0'
        batch_sizes = '1024 65536'
        capacities = '1024 262144'           # GreedyPriorityCapacity only, optional
        priorities = '1 2'                   # GreedyPriorityCapacity only, optional
        cpu_lanes = 2                        # optional; 0 (default): torch's thread count
      []
    []
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nmhit
import torch
from neml2 import factory as _factory
from neml2.aoti import AOTIModel
from neml2.schema import HitSchema, option
from torch import nn

from . import _core, _ops

# The policy a switched AOTIModel block gets (None: SyncChunking on the load's device).
_default_policy: list[Any] = [None]

_POLICY_OPTIONS = ("policy", "devices", "batch_sizes", "capacities", "priorities", "cpu_lanes")


class _Runtime:
    """A dispatched model with the surface of NEML2's bound runtime (``AOTIModel._inner``)."""

    def __init__(self, model: _core.Model, solves: bool = False) -> None:
        self.model = model
        self.solves = solves  # whether the model has a Newton solve (a solver config)
        self.device = torch.device(model.device)
        self.dtype = model.dtype
        self.input_names = model.input_names
        self.output_names = model.output_names
        # A driver's calls are a history over the same points: with the solver config's
        # chord, each point's Newton factor is kept from call to call.
        self.factors = _core.NewtonFactors()

    def _chord(self, inputs):
        """The factors, when the chord is asked for and the call records no graph."""
        if not self.solves or not self.model.solver_config().chord or \
                _ops.wanted(self.model, inputs):
            return None
        return self.factors

    def forward(self, inputs):
        return self.model.forward(inputs, self._chord(inputs))

    def jvp(self, inputs, tangents, param_overrides=None):
        _no_overrides(param_overrides)
        return self.model.jvp(inputs, tangents)

    def jacobian(self, inputs, param_overrides=None):
        _no_overrides(param_overrides)
        return self.model.jacobian(inputs, self._chord(inputs))

    def param_jacobian(self, inputs, param_overrides=None):
        _no_overrides(param_overrides)
        return self.model.param_jacobian(inputs)

    def param_vjp(self, inputs, cotangents, param_overrides=None):
        _no_overrides(param_overrides)
        return self.model.param_vjp(inputs, cotangents)

    def named_parameters(self):
        return self.model.named_parameters()

    def set_parameter(self, name, value):
        self.model.set_parameter(name, value)


def _no_overrides(overrides) -> None:
    if overrides:
        raise _core.FatalError(
            f"DispatchedAOTIModel: param_overrides ({', '.join(overrides)}) are not supported "
            "by the dispatcher; set the parameters with set_parameter(name, value) instead")


@_factory.register_neml2_object("DispatchedAOTIModel")
class DispatchedAOTIModel(AOTIModel):
    """NEML2's ``AOTIModel`` run by neml2_dispatch under a policy (see the module's text).

    ``DispatchedAOTIModel(artifact_root, device=None, dtype=None, policy=None)``: the
    artifact root ``neml2-compile`` wrote; ``policy`` any policy :func:`load_model` takes
    (default: ``SyncChunking`` on ``device``, ``"cpu"`` when None); ``dtype`` the
    ``<dtype>`` leaf (``"float64"`` when None). The dispatched model is ``.model``.
    """

    # What NEML2's factory accepts in the block (an option it does not list is refused
    # there); from_hit reads them.
    hit = HitSchema(
        AOTIModel.hit.fields[0],  # artifact_path, as NEML2's AOTIModel takes it
        option("policy", str, "SyncChunking (default) or GreedyPriorityCapacity.",
               default="SyncChunking"),
        option("devices", list, "The policy's devices (default: the load's device).",
               default=[]),
        option("batch_sizes", list, "Rows per chunk, one per device (default: whole batches).",
               default=[]),
        option("capacities", list, "GreedyPriorityCapacity: rows in flight per device.",
               default=[]),
        option("priorities", list, "GreedyPriorityCapacity: the order devices are filled in.",
               default=[]),
        option("cpu_lanes", int, "Threads that run the CPU's chunks side by side, the calling "
               "one included; 0: torch's intra-op thread count (torch.get_num_threads()).",
               default=0),
    )

    @classmethod
    def from_hit(cls, node, factory) -> "DispatchedAOTIModel":
        given = {child.path().rsplit("/", 1)[-1]
                 for child in node.children(nmhit.NodeType.Field)}
        path = Path(node.param_str("artifact_path"))
        if not path.is_absolute():  # relative to the stub, as neml2-compile writes it
            path = factory._path.parent / path
        device = getattr(factory, "_device", None)
        policy = _policy_from_hit(node, device) if given & set(_POLICY_OPTIONS) else None
        return cls(path.resolve(), device=device, dtype=getattr(factory, "_dtype", None),
                   policy=policy)

    def __init__(self, artifact_root, device=None, dtype=None, policy=None) -> None:
        nn.Module.__init__(self)
        from . import SyncChunking, load_model

        root = Path(artifact_root)
        if policy is None:
            policy = _default_policy[0]
        if policy is None:
            policy = SyncChunking(device=str(device) if device is not None else "cpu")
        dtype = getattr(torch, str(dtype or "float64").replace("torch.", ""))
        self.model = load_model(root, policy=policy, dtype=dtype)
        with open(root / "metadata.json") as f:  # checked by load_model already
            metadata = json.load(f)
        self._inner = _Runtime(self.model, "solver_config" in metadata)
        aliases = metadata.get("boundary_aliases", {})
        in_alias, out_alias = aliases.get("inputs", {}), aliases.get("outputs", {})
        self.input_spec = self._spec_from_meta(metadata["inputs"], in_alias)
        self.output_spec = self._spec_from_meta(metadata["outputs"], out_alias)
        self.input_sub_batch = {in_alias.get(v["name"], v["name"]):
                                tuple(v.get("sub_batch_shape", ())) for v in metadata["inputs"]}
        self.input_labels = {in_alias.get(v["name"], v["name"]):
                             tuple(v.get("sub_batch_labels", ())) for v in metadata["inputs"]}
        self.output_labels = {out_alias.get(v["name"], v["name"]):
                              tuple(v.get("sub_batch_labels", ())) for v in metadata["outputs"]}


    def _broadcast_to_common_batch(self, raw_inputs, per_input_sub_ndim):
        """NEML2's broadcast of the inputs to one batch shape, without its copies where the
        library needs none: when every input has the same batch axes, or none (and no
        sub-batch axes: the library broadcasts such an input over the batch itself), the
        inputs pass as they are. Otherwise NEML2's (expanded, copied)."""
        shapes = set()
        for name, t in raw_inputs.items():
            sub = per_input_sub_ndim[name]
            batch = tuple(t.shape[: t.dim() - self.input_spec[name].BASE_NDIM - sub])
            if batch or sub:
                shapes.add(batch)
        if len(shapes) > 1 or () in shapes:
            return super()._broadcast_to_common_batch(raw_inputs, per_input_sub_ndim)
        return dict(raw_inputs), torch.Size(next(iter(shapes), ()))


def _policy_from_hit(node, device) -> Any:
    from . import GreedyPriorityCapacity, SyncChunking

    def listed(name, convert):
        if node.find(name) is None:
            return []
        return [convert(v) for v in node.param_list_str(name)]

    kind = node.param_optional_str("policy", "SyncChunking")
    devices = listed("devices", str) or [str(device) if device is not None else "cpu"]
    batch_sizes = listed("batch_sizes", int)
    cpu_lanes = node.param_optional_int("cpu_lanes", 0)
    where = f"[{node.fullpath()}]"
    if kind == "SyncChunking":
        if len(devices) != 1 or len(batch_sizes) > 1 or node.find("capacities") is not None \
                or node.find("priorities") is not None:
            raise _core.FatalError(
                f"{where}: policy = SyncChunking takes one device and at most one batch "
                f"size (devices = '{' '.join(devices)}', batch_sizes = "
                f"'{' '.join(map(str, batch_sizes))}'); for several devices use "
                "policy = GreedyPriorityCapacity")
        return SyncChunking(device=devices[0], batch_size=batch_sizes[0] if batch_sizes else 0,
                            cpu_lanes=cpu_lanes)
    if kind == "GreedyPriorityCapacity":
        return GreedyPriorityCapacity(devices=devices, batch_sizes=batch_sizes,
                                      capacities=listed("capacities", int),
                                      priorities=listed("priorities", float),
                                      cpu_lanes=cpu_lanes)
    raise _core.FatalError(f"{where}: policy = {kind!r} is not a policy a stub can name; "
                           "give SyncChunking or GreedyPriorityCapacity")


class dispatch_aoti_models:  # noqa: N801  (used as a function)
    """Makes every ``type = AOTIModel`` block NEML2's factory loads from now on a
    :class:`DispatchedAOTIModel` under `policy` (None: ``SyncChunking`` on the load's
    device). As a context manager, only inside the ``with`` block: each ``with`` of the
    object switches on entry and puts back on exit what was in force at its entry, so one
    object kept in a variable switches at every ``with``, and nested ``with`` blocks (of it
    or of others) unwind in order. The call's own switch is taken over by the object's
    first ``with`` that finds it still in force, which puts back what the call found:
    ``with dispatch_aoti_models(policy):`` switches for the block only."""

    def __init__(self, policy: Any = None) -> None:
        self._policy = policy
        self._by_call: tuple[Any, Any] | None = _switch(policy)  # what the call found
        self._entered: list[tuple[Any, Any]] = []

    def __enter__(self) -> "dispatch_aoti_models":
        kind, policy = _in_force()
        if self._by_call is not None and kind is DispatchedAOTIModel and policy is self._policy:
            self._entered.append(self._by_call)  # the call's switch, now this block's
            self._by_call = None
        else:
            self._entered.append(_switch(self._policy))
        return self

    def __exit__(self, *exc) -> None:
        _factory._registry["AOTIModel"], _default_policy[0] = self._entered.pop()


def _in_force() -> tuple[Any, Any]:
    """The type NEML2's factory loads for ``AOTIModel`` and the switched policy."""
    return _factory._registry.get("AOTIModel"), _default_policy[0]


def _switch(policy: Any) -> tuple[Any, Any]:
    """Switches AOTIModel blocks to DispatchedAOTIModel under `policy`; returns what was in
    force before."""
    before = _in_force()
    _factory._registry["AOTIModel"] = DispatchedAOTIModel
    _default_policy[0] = policy
    return before

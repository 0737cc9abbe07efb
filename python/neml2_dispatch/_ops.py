"""A model's calls as torch operators (``torch.library``): ``neml2_dispatch::forward``,
``::jvp``, ``::jacobian``, ``::param_jacobian`` and ``::param_vjp``, each with a fake
implementation (the shapes its results take) and an autograd formula.

``Model.forward`` and the other calls run the library directly (no operator, no graph)
unless a graph is wanted: under ``torch.compile`` / ``torch.export`` (Dynamo traces the
operator, no graph break), or when grad mode is on and an input or a promoted parameter
requires grad. Then the call goes through its operator and its results carry a graph:

- the outputs of every call are differentiable with respect to the inputs (their
  gradient is ``J^T g`` from the ``jacobian`` graph) and the parameters (``param_vjp``);
- the derivative results (tangents, Jacobian blocks, parameter gradients) are not:
  differentiating them would need second derivatives, which no artifact holds, and
  ``backward`` through them raises a ``FatalError`` that says so.

Under an operator every Jacobian block has the batch axis (a block the graph returns
unbatched is expanded), so that its shape is known before the call.

The operators find the model by a handle (a str, a constant of a traced graph); the
model keeps what they read in ``model._op`` (names, shapes, its parameter tensors), a
plain Python object that Dynamo can trace.
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import is_grad_enabled
from torch.compiler import is_compiling

from . import _core

_models: "weakref.WeakValueDictionary[str, _core.Model]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)


@dataclass
class OpInfo:
    """What the operators need of a model, kept on it as ``model._op``."""

    handle: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]
    parameter_shapes: tuple[tuple[int, ...], ...]
    # The model's own parameter tensors by name (the ones its calls use).
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    # (output index, input index) of each Jacobian block, (output, parameter) of each
    # parameter Jacobian block: what the artifact compiled.
    jacobian_pairs: tuple[tuple[int, int], ...] = ()
    param_pairs: tuple[tuple[int, int], ...] = ()

    @property
    def vjp_params(self) -> tuple[int, ...]:
        """The parameters param_vjp gives a gradient of: those of a compiled pair."""
        return tuple(sorted({p for _, p in self.param_pairs}))


def register(model: "_core.Model") -> "_core.Model":
    """Gives a freshly loaded model its handle and ``model._op``."""
    handle = str(next(_handles))  # a str: a constant Dynamo never makes symbolic
    input_pairs, parameter_pairs = model._derivative_pairs
    inputs = tuple(model.input_names)
    outputs = tuple(model.output_names)
    params = dict(model.named_parameters())
    pshapes = model.parameter_base_shapes
    pairs = _pairs(input_pairs, outputs, inputs)
    ppairs = _pairs(parameter_pairs, outputs, tuple(params))
    model._op = OpInfo(handle, inputs, outputs, tuple(map(tuple, model.input_base_shapes)),
                       tuple(map(tuple, model.output_base_shapes)),
                       tuple(tuple(pshapes[p]) for p in params), params, pairs, ppairs)
    _models[handle] = model
    return model


def _pairs(named, outputs, wrt):
    """Index pairs of the derivative blocks the artifact compiled, in (output, of) order."""
    return tuple(sorted({(outputs.index(out), wrt.index(of)) for out, of in named}))


def _model(handle: str) -> "_core.Model":
    model = _models.get(handle)
    if model is None:
        raise _core.FatalError(
            f"neml2_dispatch operator: model {handle} no longer exists (it was collected); "
            "keep the model alive while a graph that calls it can run")
    return model


def refresh_parameters(model: "_core.Model") -> None:
    """After ``set_parameter``: the model's parameter tensors may be new ones."""
    model._op.params = dict(model.named_parameters())


# ---- when a call goes through its operator -------------------------------------------


def wanted(model, inputs, more=None) -> bool:
    """Whether a call needs its operator: traced (torch.compile, torch.export), or a graph
    to record. Called on every call: kept to a few attribute reads."""
    if is_compiling():
        return True
    if not is_grad_enabled():
        return False
    params = model._op.params
    try:
        for t in inputs.values():
            if t.requires_grad:
                return True
        if more is not None:
            for t in more.values():
                if t.requires_grad:
                    return True
    except AttributeError:
        return False  # not a dict of tensors: the library's own error
    for p in params.values():
        if p.requires_grad:
            return True
    return False


def _ordered(op: OpInfo, inputs) -> list[torch.Tensor] | None:
    """The inputs in the model's order, or None where the library must judge them (a name
    missing or unknown, a value that is not a tensor: its own error then)."""
    if len(inputs) != len(op.inputs) or not all(
            isinstance(inputs.get(n), torch.Tensor) for n in op.inputs):
        return None
    return [inputs[n] for n in op.inputs]


def _indexed(names: tuple[str, ...], given) -> tuple[list[int], list[torch.Tensor]] | None:
    if not all(isinstance(k, str) and k in names and isinstance(v, torch.Tensor)
               for k, v in given.items()):
        return None
    index = [names.index(k) for k in given]
    return index, list(given.values())


def forward(model, inputs):
    op = model._op
    ins = _ordered(op, inputs)
    if ins is None:
        return model._forward(inputs)
    outs = torch.ops.neml2_dispatch.forward(op.handle, ins, list(op.params.values()))
    return dict(zip(op.outputs, outs))


def jvp(model, inputs, tangents):
    op = model._op
    ins = _ordered(op, inputs)
    tan = _indexed(op.inputs, tangents)
    if ins is None or tan is None:
        return model._jvp(inputs, tangents)
    res = torch.ops.neml2_dispatch.jvp(op.handle, ins, tan[0], tan[1], list(op.params.values()))
    n = len(op.outputs)
    return dict(zip(op.outputs, res[:n])), dict(zip(op.outputs, res[n:]))


def jacobian(model, inputs):
    return _derivative_blocks(model, inputs, of_params=False)


def param_jacobian(model, inputs):
    return _derivative_blocks(model, inputs, of_params=True)


def _derivative_blocks(model, inputs, of_params):
    op = model._op
    ins = _ordered(op, inputs)
    if ins is None:
        return (model._param_jacobian if of_params else model._jacobian)(inputs)
    call = torch.ops.neml2_dispatch.param_jacobian if of_params else \
        torch.ops.neml2_dispatch.jacobian
    res = call(op.handle, ins, list(op.params.values()))
    pairs, names, _ = _layout(op, of_params)
    n = len(op.outputs)
    blocks = {name: {} for name in op.outputs}
    for (o, w), block in zip(pairs, res[n:]):
        blocks[op.outputs[o]][names[w]] = block
    return dict(zip(op.outputs, res[:n])), {k: v for k, v in blocks.items() if v}


def param_vjp(model, inputs, cotangents):
    op = model._op
    ins = _ordered(op, inputs)
    cot = _indexed(op.outputs, cotangents)
    if ins is None or cot is None:
        return model._param_vjp(inputs, cotangents)
    res = torch.ops.neml2_dispatch.param_vjp(op.handle, ins, cot[0], cot[1],
                                              list(op.params.values()))
    names = tuple(op.params)
    return {names[j]: g for j, g in zip(op.vjp_params, res)}


# ---- the operators --------------------------------------------------------------------


def _named(op: OpInfo, ins):
    return dict(zip(op.inputs, ins))


def _batched(block: torch.Tensor, batch: list, dims: int) -> torch.Tensor:
    """A block with the batch axes of the inputs (one the graph returned unbatched,
    expanded)."""
    return block if block.dim() > dims else block.expand(*batch, *block.shape)


def _dense(tensors) -> list[torch.Tensor]:
    """An operator's results as its fake implementation describes them: contiguous."""
    return [t.contiguous() for t in tensors]


def _batch_shape(op: OpInfo, ins) -> list:
    """The batch shape the inputs broadcast to (each input is (*batch, *base))."""
    shapes = [t.shape[: t.dim() - len(base)] for t, base in zip(ins, op.input_shapes)]
    return list(torch.broadcast_shapes(*shapes))


def _results(op: OpInfo, ins, shapes):
    """Fake results: each of `shapes` behind the batch shape, in the model's dtype."""
    batch = _batch_shape(op, ins)
    return [ins[0].new_empty([*batch, *s]) for s in shapes]


@torch.library.custom_op("neml2_dispatch::forward", mutates_args=())
def _forward_op(model: str, inputs: list[torch.Tensor],
                params: list[torch.Tensor]) -> list[torch.Tensor]:
    m = _model(model)
    return _dense(m._forward(_named(m._op, inputs)).values())


@_forward_op.register_fake
def _(model, inputs, params):
    op = _model(model)._op
    return _results(op, inputs, op.output_shapes)


@torch.library.custom_op("neml2_dispatch::jvp", mutates_args=())
def _jvp_op(model: str, inputs: list[torch.Tensor], tangent_index: list[int],
            tangents: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    m = _model(model)
    op = m._op
    out, d = m._jvp(_named(op, inputs), {op.inputs[i]: t for i, t in zip(tangent_index, tangents)})
    return _dense([*out.values(), *(d[name] for name in op.outputs)])


@_jvp_op.register_fake
def _(model, inputs, tangent_index, tangents, params):
    op = _model(model)._op
    return _results(op, inputs, op.output_shapes * 2)


def _layout(op: OpInfo, of_params: bool):
    """The blocks of a (parameter) Jacobian: their (output, of) index pairs, the names and
    base shapes of what they differentiate by."""
    if of_params:
        return op.param_pairs, tuple(op.params), op.parameter_shapes
    return op.jacobian_pairs, op.inputs, op.input_shapes


def _flat(op: OpInfo, inputs, out, blocks, of_params):
    """Outputs, then every block in the layout's order, each with the batch axis."""
    pairs, names, shapes = _layout(op, of_params)
    batch = _batch_shape(op, inputs)
    return _dense([*out.values(), *(
        _batched(blocks[op.outputs[o]][names[w]], batch, len(op.output_shapes[o]) + len(shapes[w]))
        for o, w in pairs)])


def _fake_flat(op: OpInfo, inputs, of_params):
    pairs, _, shapes = _layout(op, of_params)
    return _results(op, inputs, [*op.output_shapes,
                                 *(op.output_shapes[o] + shapes[w] for o, w in pairs)])


def _block_op(name: str, of_params: bool):
    """The operator of jacobian (of_params False) or param_jacobian (True)."""
    direct = "_param_jacobian" if of_params else "_jacobian"

    @torch.library.custom_op(f"neml2_dispatch::{name}", mutates_args=())
    def block_op(model: str, inputs: list[torch.Tensor],
                 params: list[torch.Tensor]) -> list[torch.Tensor]:
        m = _model(model)
        out, blocks = getattr(m, direct)(_named(m._op, inputs))
        return _flat(m._op, inputs, out, blocks, of_params)

    @block_op.register_fake
    def _(model, inputs, params):
        return _fake_flat(_model(model)._op, inputs, of_params)

    return block_op


_jacobian_op = _block_op("jacobian", of_params=False)
_param_jacobian_op = _block_op("param_jacobian", of_params=True)


@torch.library.custom_op("neml2_dispatch::param_vjp", mutates_args=())
def _param_vjp_op(model: str, inputs: list[torch.Tensor], cotangent_index: list[int],
                  cotangents: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    m = _model(model)
    op = m._op
    grads = m._param_vjp(_named(op, inputs),
                         {op.outputs[o]: c for o, c in zip(cotangent_index, cotangents)})
    names = tuple(op.params)
    # A parameter that none of the given cotangents reaches through a compiled pair: zero.
    return _dense(grads[names[j]] if names[j] in grads else torch.zeros_like(params[j])
                  for j in op.vjp_params)


@_param_vjp_op.register_fake
def _(model, inputs, cotangent_index, cotangents, params):
    return [torch.empty_like(params[j]) for j in _model(model)._op.vjp_params]


# ---- autograd -----------------------------------------------------------------------


def _setup(ctx, inputs, output):
    model, ins, params = inputs[0], inputs[1], inputs[-1]
    ctx.model = model
    ctx.n_inputs = len(ins)
    ctx.input_needs = [t.requires_grad for t in ins]
    ctx.param_needs = [p.requires_grad for p in params]
    ctx.save_for_backward(*ins, *params)
    ctx.set_materialize_grads(False)


def _through_outputs(ctx, out_grads):
    """Gradients of the inputs and parameters from those of the outputs: J^T g from the
    jacobian graph, param_vjp for the parameters."""
    saved = ctx.saved_tensors
    ins, params = list(saved[: ctx.n_inputs]), list(saved[ctx.n_inputs:])
    op = _model(ctx.model)._op
    in_grads = [None] * len(ins)
    param_grads = [None] * len(params)
    given = [k for k, g in enumerate(out_grads) if g is not None]
    if any(ctx.input_needs) and given:
        res = torch.ops.neml2_dispatch.jacobian(ctx.model, ins, params)
        blocks = dict(zip(op.jacobian_pairs, res[len(op.outputs):]))
        batch = _batch_shape(op, ins)  # (B,) or (B, *sub-batch), () unbatched
        rows = math.prod(batch)
        for i, x in enumerate(ins):
            if not ctx.input_needs[i]:
                continue
            for o in given:
                if (o, i) not in blocks:
                    raise _missing_pair(op.outputs[o], "input", op.inputs[i])
                n_out = math.prod(op.output_shapes[o])
                g = out_grads[o].expand(*batch, *op.output_shapes[o]).reshape(rows, 1, n_out)
                J = blocks[(o, i)].reshape(rows, n_out, -1)
                part = torch.bmm(g, J).reshape(*batch, *op.input_shapes[i]).sum_to_size(x.shape)
                in_grads[i] = part if in_grads[i] is None else in_grads[i] + part
    if any(ctx.param_needs) and given:
        names = tuple(op.params)
        for j, need in enumerate(ctx.param_needs):
            for o in given:
                if need and (o, j) not in op.param_pairs:
                    raise _missing_pair(op.outputs[o], "parameter", names[j])
        grads = torch.ops.neml2_dispatch.param_vjp(ctx.model, ins, given,
                                                  [out_grads[o] for o in given], params)
        for j, g in zip(op.vjp_params, grads):
            param_grads[j] = g if ctx.param_needs[j] else None
    return in_grads, param_grads


def _missing_pair(output: str, kind: str, name: str) -> Exception:
    return _core.FatalError(
        f"no gradient of '{output}' with respect to {kind} '{name}': the artifact has no "
        f"derivative graph for that pair; recompile it with neml2-compile -d {output}:{name}"
        + (f" -p {name}" if kind == "parameter" else ""))


def _no_second_derivatives(what: str, out_grads, n_outputs: int) -> None:
    if any(g is not None for g in out_grads[n_outputs:]):
        raise _core.FatalError(
            f"backward through the {what} of a dispatched model: that would need second "
            "derivatives, which compiled artifacts do not hold. Differentiate the outputs "
            "(forward, or the outputs of this call) instead, or detach these results")


def _forward_backward(ctx, out_grads):
    in_grads, param_grads = _through_outputs(ctx, out_grads)
    return None, in_grads, param_grads


def _derivative_backward(what: str, with_index: bool):
    def backward(ctx, out_grads):
        n = len(_model(ctx.model)._op.outputs)
        _no_second_derivatives(what, out_grads, n)
        in_grads, param_grads = _through_outputs(ctx, out_grads[:n])
        middle = (None, None) if with_index else ()
        return (None, in_grads, *middle, param_grads)
    return backward


def _param_vjp_backward(ctx, out_grads):
    _no_second_derivatives("parameter gradients (param_vjp)", out_grads, 0)
    return None, None, None, None, None


torch.library.register_autograd("neml2_dispatch::forward", _forward_backward,
                                setup_context=_setup)
torch.library.register_autograd("neml2_dispatch::jvp",
                                _derivative_backward("output tangents (jvp)", True),
                                setup_context=_setup)
torch.library.register_autograd("neml2_dispatch::jacobian",
                                _derivative_backward("Jacobian blocks", False),
                                setup_context=_setup)
torch.library.register_autograd("neml2_dispatch::param_jacobian",
                                _derivative_backward("parameter Jacobian blocks", False),
                                setup_context=_setup)
torch.library.register_autograd("neml2_dispatch::param_vjp", _param_vjp_backward,
                                setup_context=_setup)


# ---- the public calls ---------------------------------------------------------------


def install(model_type) -> None:
    """Makes the public calls of ``model_type`` (``_core.Model``) go through the operators
    when a graph is wanted; the library's own calls stay as ``_forward``, ``_jvp``, ..."""
    direct = {name: getattr(model_type, name) for name in
              ("forward", "jvp", "jacobian", "param_jacobian", "param_vjp", "set_parameter")}
    for name, call in direct.items():
        setattr(model_type, "_" + name, call)

    forward_direct, jvp_direct = direct["forward"], direct["jvp"]
    jacobian_direct, param_jacobian_direct = direct["jacobian"], direct["param_jacobian"]
    param_vjp_direct = direct["param_vjp"]

    def forward_(self, inputs):
        if wanted(self, inputs):
            return forward(self, inputs)
        return forward_direct(self, inputs)

    def jvp_(self, inputs, tangents):
        if wanted(self, inputs, tangents):
            return jvp(self, inputs, tangents)
        return jvp_direct(self, inputs, tangents)

    def jacobian_(self, inputs):
        if wanted(self, inputs):
            return jacobian(self, inputs)
        return jacobian_direct(self, inputs)

    def param_jacobian_(self, inputs):
        if wanted(self, inputs):
            return param_jacobian(self, inputs)
        return param_jacobian_direct(self, inputs)

    def param_vjp_(self, inputs, cotangents):
        if wanted(self, inputs, cotangents):
            return param_vjp(self, inputs, cotangents)
        return param_vjp_direct(self, inputs, cotangents)

    def set_parameter_(self, name, value):
        self._set_parameter(name, value)
        refresh_parameters(self)

    for name, call in (("forward", forward_), ("jvp", jvp_), ("jacobian", jacobian_),
                       ("param_jacobian", param_jacobian_), ("param_vjp", param_vjp_),
                       ("set_parameter", set_parameter_)):
        call.__name__ = call.__qualname__ = name
        call.__doc__ = direct[name].__doc__
        setattr(model_type, name, call)

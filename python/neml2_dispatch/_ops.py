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

Every Jacobian block has the batch axis, whatever the path (a block the graph returns
once for every row is expanded: a view on the direct path), so that its shape is known
before the call and does not depend on grad mode.

The operators find the model by a handle (a str, a constant of a traced graph): a uuid4
of the load, so that a program traced or exported with one model never reaches another
(in another process, or after a reload), but refuses. The model keeps what they read in
``model._op`` (names, shapes, its parameter tensors), a plain Python object that Dynamo
can trace. A call through an operator runs with the parameter values it was given (the
model's own, unless it is the backward of a call made before a ``set_parameter``), and
the graph of its results keeps the model alive.
"""

from __future__ import annotations

import math
import uuid
import weakref
from dataclasses import dataclass, field

import torch
from torch import is_grad_enabled
from torch.compiler import is_compiling

from . import _core

_models: "weakref.WeakValueDictionary[str, _core.Model]" = weakref.WeakValueDictionary()
_loaded: set[str] = set()  # every handle given out in this process


@dataclass
class OpInfo:
    """What the operators need of a model, kept on it as ``model._op``. Shapes are per
    row: a tensor is ``(B, *shape)``, or ``shape`` unbatched."""

    handle: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    # Each input's (*sub_batch, *base), each output's (*sub_batch, *base) and base.
    input_shapes: tuple[tuple[int, ...], ...]
    input_bases: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]
    output_bases: tuple[tuple[int, ...], ...]
    parameter_shapes: tuple[tuple[int, ...], ...]
    # The model's own parameter tensors by name (the ones its calls use).
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    # (output index, input index) of each Jacobian block, (output, parameter) of each
    # parameter Jacobian block: what the artifact compiled; each block's shape per row.
    jacobian_pairs: tuple[tuple[int, int], ...] = ()
    param_pairs: tuple[tuple[int, int], ...] = ()
    block_shapes: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    # The Jacobian blocks the library returns once for every row (unbatched).
    shared_blocks: tuple[tuple[int, int], ...] = ()

    @property
    def vjp_params(self) -> tuple[int, ...]:
        """The parameters param_vjp gives a gradient of: those of a compiled pair."""
        return tuple(sorted({p for _, p in self.param_pairs}))

    def param_block_shape(self, o: int, p: int) -> tuple[int, ...]:
        return self.output_bases[o] + self.parameter_shapes[p]


def register(model: "_core.Model") -> "_core.Model":
    """Gives a freshly loaded model its handle and ``model._op``."""
    # A str (a constant Dynamo never makes symbolic) that no other load, in this process or
    # any other, is given.
    handle = f"neml2_dispatch-{uuid.uuid4().hex}"
    input_pairs, parameter_pairs = model._derivative_pairs
    inputs = tuple(model.input_names)
    outputs = tuple(model.output_names)
    params = dict(model.named_parameters())
    pshapes = model.parameter_base_shapes
    blocks = {(outputs.index(o), inputs.index(i)): (tuple(shape), shared)
              for o, i, shape, shared in input_pairs}
    ppairs = tuple(sorted({(outputs.index(o), tuple(params).index(p))
                           for o, p in parameter_pairs}))
    model._op = OpInfo(
        handle=handle, inputs=inputs, outputs=outputs,
        input_shapes=tuple(tuple(sub) + tuple(base) for sub, base in
                           zip(model.input_sub_batch_shapes, model.input_base_shapes)),
        input_bases=tuple(map(tuple, model.input_base_shapes)),
        output_shapes=tuple(map(tuple, model.output_shapes)),
        output_bases=tuple(map(tuple, model.output_base_shapes)),
        parameter_shapes=tuple(tuple(pshapes[p]) for p in params), params=params,
        jacobian_pairs=tuple(sorted(blocks)), param_pairs=ppairs,
        block_shapes={pair: shape for pair, (shape, _) in blocks.items()},
        shared_blocks=tuple(sorted(pair for pair, (_, shared) in blocks.items() if shared)))
    _models[handle] = model
    _loaded.add(handle)
    return model


def _model(handle: str) -> "_core.Model":
    model = _models.get(handle)
    if model is None:
        if handle in _loaded:
            raise _core.FatalError(
                f"neml2_dispatch operator: the model of handle '{handle}' no longer exists "
                "(it was collected); keep the model alive while a graph that calls it can run")
        raise _core.FatalError(
            f"neml2_dispatch operator: no model of handle '{handle}' was loaded in this "
            "process. A traced or exported program (torch.export, a saved .pt2) names the "
            "one model it was traced with, which lives only in the process that loaded it; "
            "load the model here (nd.load_model) and trace or export the function again "
            "with it, in this process")
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


def _run(m, call: str, params, *args):
    """The library's `call` of model `m` with the parameter values `params` (an operator's
    argument, in ``m._op.params`` order). They are the model's own, but in the backward of
    a call made before a ``set_parameter`` (or a program traced before it): then the call
    runs with them, alone (``Model._with_parameters``), so that a backward uses its
    forward's values."""
    own = m._op.params
    if len(params) != len(own):
        raise _core.FatalError(
            f"neml2_dispatch::{call}: {len(params)} parameter values given, but the model "
            f"has {len(own)} promoted parameters ({', '.join(own) or 'none'})")
    if all(_same(p, q) for p, q in zip(params, own.values())):
        return getattr(m, "_" + call)(*args)
    return m._with_parameters(call, dict(zip(own, params)), *args)


def _same(given: torch.Tensor, own: torch.Tensor) -> bool:
    """Whether `given` is the model's `own` parameter tensor or a view of its memory with
    the same layout (what AOTAutograd's compiled backward passes): the same values."""
    return given is own or (
        given.data_ptr() == own.data_ptr() and given.shape == own.shape
        and given.stride() == own.stride() and given.dtype == own.dtype
        and given.device == own.device)


def _lead(t: torch.Tensor, shape) -> torch.Size:
    """The batch axes of `t`, a value of `shape` per row: (B,), or () unbatched."""
    return t.shape[: t.dim() - len(shape)]


def _batch_shape(op: OpInfo, ins, params, tangents=None, tangent_index=None) -> list:
    """The batch shape of a call: its inputs', parameters' (and tangents') batch axes
    broadcast together. Each is ``(B, *shape)`` or ``shape``, where an input's shape holds
    its sub-batch axes: inputs of different sub-batch shapes meet on their batch axis."""
    leads = [_lead(t, s) for t, s in zip(ins, op.input_shapes)]
    leads += [_lead(p, s) for p, s in zip(params, op.parameter_shapes)]
    if tangents:
        leads += [_lead(t, op.input_shapes[i]) for i, t in zip(tangent_index, tangents)]
    return list(torch.broadcast_shapes(*leads))


def _batched(block: torch.Tensor, batch: list, shape) -> torch.Tensor:
    """A block of `shape` per row with the call's batch axes (one the library returned once
    for every row, expanded: a view)."""
    return block if block.dim() > len(shape) else block.expand(*batch, *block.shape)


def _dense(tensors, arguments) -> list[torch.Tensor]:
    """An operator's results as its fake implementation describes them: contiguous, and
    (as torch.library requires) sharing memory with none of its tensor `arguments` nor with
    each other (the library may give an implicit model's unknowns as views of one
    buffer)."""
    taken = {t.untyped_storage().data_ptr() for t in arguments}
    results = []
    for t in tensors:
        t = t.contiguous()
        if t.untyped_storage().data_ptr() in taken:
            t = t.clone()
        taken.add(t.untyped_storage().data_ptr())
        results.append(t)
    return results


def _results(ins, batch: list, shapes):
    """Fake results: each of `shapes` behind the batch shape, in the model's dtype."""
    return [ins[0].new_empty([*batch, *s]) for s in shapes]


@torch.library.custom_op("neml2_dispatch::forward", mutates_args=())
def _forward_op(model: str, inputs: list[torch.Tensor],
                params: list[torch.Tensor]) -> list[torch.Tensor]:
    m = _model(model)
    return _dense(_run(m, "forward", params, _named(m._op, inputs)).values(), [*inputs, *params])


@_forward_op.register_fake
def _(model, inputs, params):
    op = _model(model)._op
    return _results(inputs, _batch_shape(op, inputs, params), op.output_shapes)


@torch.library.custom_op("neml2_dispatch::jvp", mutates_args=())
def _jvp_op(model: str, inputs: list[torch.Tensor], tangent_index: list[int],
            tangents: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    m = _model(model)
    op = m._op
    out, d = _run(m, "jvp", params, _named(op, inputs),
                  {op.inputs[i]: t for i, t in zip(tangent_index, tangents)})
    return _dense([*out.values(), *(d[name] for name in op.outputs)],
                  [*inputs, *tangents, *params])


@_jvp_op.register_fake
def _(model, inputs, tangent_index, tangents, params):
    op = _model(model)._op
    batch = _batch_shape(op, inputs, params, tangents, tangent_index)
    return _results(inputs, batch, op.output_shapes * 2)


def _layout(op: OpInfo, of_params: bool):
    """The blocks of a (parameter) Jacobian: their (output, of) index pairs, the names of
    what they differentiate by, and their shapes per row."""
    if of_params:
        return (op.param_pairs, tuple(op.params),
                [op.param_block_shape(o, p) for o, p in op.param_pairs])
    return op.jacobian_pairs, op.inputs, [op.block_shapes[pair] for pair in op.jacobian_pairs]


def _flat(op: OpInfo, batch, out, blocks, of_params, arguments):
    """Outputs, then every block in the layout's order, each with the batch axes."""
    pairs, names, shapes = _layout(op, of_params)
    return _dense([*out.values(), *(
        _batched(blocks[op.outputs[o]][names[w]], batch, shape)
        for (o, w), shape in zip(pairs, shapes))], arguments)


def _block_op(name: str, of_params: bool):
    """The operator of jacobian (of_params False) or param_jacobian (True)."""

    @torch.library.custom_op(f"neml2_dispatch::{name}", mutates_args=())
    def block_op(model: str, inputs: list[torch.Tensor],
                 params: list[torch.Tensor]) -> list[torch.Tensor]:
        m = _model(model)
        out, blocks = _run(m, name, params, _named(m._op, inputs))
        return _flat(m._op, _batch_shape(m._op, inputs, params), out, blocks, of_params,
                     [*inputs, *params])

    @block_op.register_fake
    def _(model, inputs, params):
        op = _model(model)._op
        _, _, shapes = _layout(op, of_params)
        return _results(inputs, _batch_shape(op, inputs, params), [*op.output_shapes, *shapes])

    return block_op


_jacobian_op = _block_op("jacobian", of_params=False)
_param_jacobian_op = _block_op("param_jacobian", of_params=True)


@torch.library.custom_op("neml2_dispatch::param_vjp", mutates_args=())
def _param_vjp_op(model: str, inputs: list[torch.Tensor], cotangent_index: list[int],
                  cotangents: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    m = _model(model)
    op = m._op
    grads = _run(m, "param_vjp", params, _named(op, inputs),
                 {op.outputs[o]: c for o, c in zip(cotangent_index, cotangents)})
    names = tuple(op.params)
    # A parameter that none of the given cotangents reaches through a compiled pair: zero.
    return _dense((grads[names[j]] if names[j] in grads else torch.zeros_like(params[j])
                   for j in op.vjp_params), [*inputs, *cotangents, *params])


@_param_vjp_op.register_fake
def _(model, inputs, cotangent_index, cotangents, params):
    return [torch.empty_like(params[j]) for j in _model(model)._op.vjp_params]


# ---- autograd -----------------------------------------------------------------------


def _setup(ctx, inputs, output):
    handle, ins, params = inputs[0], inputs[1], inputs[-1]
    ctx.model = handle
    # jvp and param_vjp: (model, inputs, index, tensors, params), a gradient (None) each.
    ctx.n_middle = len(inputs[3]) if len(inputs) == 5 else 0
    # The graph keeps its model alive: a backward after the model's last reference is gone
    # (a model loaded inside the function that made the outputs) still finds it.
    ctx.owner = _model(handle)
    ctx.n_inputs = len(ins)
    ctx.input_needs = [t.requires_grad for t in ins]
    ctx.param_needs = [p.requires_grad for p in params]
    # The parameters as the forward used them: a set_parameter before the backward changes
    # the model's, not these (and an in-place change of one is torch's in-place error).
    ctx.save_for_backward(*ins, *params)
    ctx.set_materialize_grads(False)


def _transposed_product(op: OpInfo, o: int, i: int, g: torch.Tensor,
                        block: torch.Tensor) -> torch.Tensor:
    """g^T J of output o's gradient and its block of input i, per point: ``(*batch,
    *in_sub_batch, *in_base)``. The block is ``(*batch, *in_sub, *out_base, *in_base)``;
    an output with the input's sub-batch axes pairs entry with entry, one without them
    (a plain output of a sub-batched input) reaches every entry, and an input without the
    output's (a plain input of a sub-batched output) gathers every entry's."""
    out_shape, out_base, in_base = op.output_shapes[o], op.output_bases[o], op.input_bases[i]
    shape = op.block_shapes[(o, i)]
    sub = shape[: len(shape) - len(out_base) - len(in_base)]
    out_sub = out_shape[: len(out_shape) - len(out_base)]
    batch = list(torch.broadcast_shapes(_lead(g, out_shape), _lead(block, shape)))
    rows = math.prod(batch)
    n_out, n_in = math.prod(out_base), math.prod(in_base)
    g = g.expand(*batch, *out_shape).reshape(rows, math.prod(out_sub), 1, n_out)
    J = block.expand(*batch, *shape).reshape(rows, math.prod(sub), n_out, n_in)
    part = torch.matmul(g, J)  # (rows, entries, 1, n_in)
    if part.shape[1] != J.shape[1]:
        part = part.sum(1, keepdim=True)
    return part.reshape(*batch, *sub, *in_base)


def _through_outputs(ctx, out_grads):
    """Gradients of the inputs and parameters from those of the outputs: J^T g from the
    jacobian graph, param_vjp for the parameters, both with the forward's parameters."""
    saved = ctx.saved_tensors
    ins, params = list(saved[: ctx.n_inputs]), list(saved[ctx.n_inputs:])
    op = ctx.owner._op
    in_grads = [None] * len(ins)
    param_grads = [None] * len(params)
    given = [k for k, g in enumerate(out_grads) if g is not None]
    if any(ctx.input_needs) and given:
        res = torch.ops.neml2_dispatch.jacobian(ctx.model, ins, params)
        blocks = dict(zip(op.jacobian_pairs, res[len(op.outputs):]))
        for i, x in enumerate(ins):
            if not ctx.input_needs[i]:
                continue
            for o in given:
                if (o, i) not in blocks:
                    raise _missing_pair(op.outputs[o], "input", op.inputs[i])
                part = _transposed_product(op, o, i, out_grads[o], blocks[(o, i)])
                part = part.sum_to_size(x.shape)
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
        n = len(ctx.owner._op.outputs)
        _no_second_derivatives(what, out_grads, n)
        in_grads, param_grads = _through_outputs(ctx, out_grads[:n])
        middle = (None, [None] * ctx.n_middle) if with_index else ()
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


def _expand_shared(op: OpInfo, out, J) -> None:
    """The blocks the library returns once for every row, as views with the batch axis of
    the call (that of its outputs), in place in `J`: a block's shape is the same whether the
    call went through its operator or not."""
    batch = _lead(out[op.outputs[0]], op.output_shapes[0])
    if not batch:
        return
    for o, i in op.shared_blocks:
        row = J.get(op.outputs[o])
        block = row.get(op.inputs[i]) if row is not None else None
        if block is not None:
            row[op.inputs[i]] = _batched(block, batch, op.block_shapes[(o, i)])


def _no_factors(call: str, factors) -> None:
    """The operators run NEML2's Newton: a chord's factors are refused with a graph."""
    if factors is not None:
        raise _core.FatalError(
            f"Model.{call}(): NewtonFactors (the chord) are not taken on a call that builds an "
            "autograd graph (an input or parameter requires grad); call it under "
            "torch.no_grad(), or without factors")


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

    def forward_(self, inputs, factors=None):
        if wanted(self, inputs):
            _no_factors("forward", factors)
            return forward(self, inputs)
        return forward_direct(self, inputs, factors)

    def jvp_(self, inputs, tangents):
        if wanted(self, inputs, tangents):
            return jvp(self, inputs, tangents)
        return jvp_direct(self, inputs, tangents)

    def jacobian_(self, inputs, factors=None):
        if wanted(self, inputs):
            _no_factors("jacobian", factors)
            return jacobian(self, inputs)
        out, J = jacobian_direct(self, inputs, factors)
        if self._op.shared_blocks:
            _expand_shared(self._op, out, J)
        return out, J

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

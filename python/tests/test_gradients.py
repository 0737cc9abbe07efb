"""Gradients through a dispatched model and torch.compile over it (neml2_dispatch/_ops.py):
results carry an autograd graph when an input or a parameter requires grad, checked
against eager NEML2's autograd (explicit), its Jacobians and parameter gradients
(implicit: J^T g by hand) and torch.autograd.gradcheck (finite differences of the
model itself); derivatives of derivatives refused; torch.compile(fullgraph=True) and
torch.export see one operator per call."""

import pytest
import torch

import neml2_dispatch as nd
from conftest import check_close, eager, eager_name, raw, scalar_inputs, stub

POLICIES = {
    "sync": lambda: nd.SyncChunking(batch_size=4),
    "greedy": lambda: nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[4]),
}


@pytest.fixture(params=POLICIES)
def policy(request):
    return POLICIES[request.param]()


def strains(rows, seed=0, scale=1e-3):
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(rows, 6, generator=gen)


def test_no_graph_unless_one_is_wanted():
    model = nd.load_model(stub("elasticity_params", "elasticity"))
    strain = strains(5)
    assert model.forward({"strain": strain})["stress"].grad_fn is None
    with torch.no_grad():
        leaf = strain.clone().requires_grad_()
        assert not model.forward({"strain": leaf})["stress"].requires_grad
    leaf = strain.clone().requires_grad_()
    assert model.forward({"strain": leaf})["stress"].grad_fn is not None
    # A parameter that requires grad is enough.
    model.named_parameters()["elasticity.E"].requires_grad_()
    assert model.forward({"strain": strain})["stress"].requires_grad


def test_explicit_gradients_match_eager_neml2(policy):
    model = nd.load_model(stub("elasticity_params", "elasticity"), "elasticity", policy)
    ref = eager("elasticity.i", "elasticity")
    weights = torch.randn(11, 6, generator=torch.Generator().manual_seed(3))
    ours_x = strains(11).requires_grad_()
    params = model.named_parameters()
    for p in params.values():
        p.requires_grad_()
    (model.forward({"strain": ours_x})["stress"] * weights).sum().backward()
    theirs_x = strains(11).requires_grad_()
    (raw(ref.call_by_name({"strain": theirs_x})["stress"]) * weights).sum().backward()
    check_close(ours_x.grad, theirs_x.grad, "d loss / d strain vs eager")
    named = dict(ref.named_parameters())
    for name, p in params.items():
        check_close(p.grad, named[eager_name(ref, name, "elasticity")].grad,
                    f"d loss / d {name} vs eager")


def test_explicit_gradcheck_inputs_and_parameters(policy):
    model = nd.load_model(stub("elasticity_params", "elasticity"), "elasticity", policy)
    E = model.named_parameters()["elasticity.E"].requires_grad_()
    x = strains(6).requires_grad_()
    # The parameter is the model's own tensor: gradcheck perturbs it in place.
    assert torch.autograd.gradcheck(lambda x, E: model.forward({"strain": x})["stress"], (x, E))


def implicit_inputs(model, rows):
    """A strain step past yield in most rows (perzyna viscoplasticity), old states 0."""
    inputs = {}
    for name, shape in zip(model.input_names, model.input_base_shapes):
        inputs[name] = torch.zeros(rows, *shape)
    inputs["E"] = 1e-3 * torch.linspace(0.05, 1.0, rows)[:, None] * \
        torch.tensor([1.0, -0.5, -0.5, 0.1, 0.0, 0.0])
    inputs["t"] = torch.full((rows,), 0.1)
    return inputs


def test_implicit_gradients_are_jacobian_transposed(policy):
    model = nd.load_model(stub("perzyna_viscoplasticity", "model"), "model", policy)
    ref = eager("perzyna_viscoplasticity.i", "model")
    inputs = implicit_inputs(model, 9)
    leaves = {n: (t.clone().requires_grad_() if n in ("E", "E~1", "stress~1") else t)
              for n, t in inputs.items()}
    out = model.forward(leaves)
    gen = torch.Generator().manual_seed(5)
    weights = {n: torch.randn(v.shape, generator=gen) for n, v in out.items()}
    sum((out[n] * weights[n]).sum() for n in out).backward()
    _, J = ref.jacobian(inputs)  # eager NEML2's implicit-function Jacobian
    for name in ("E", "E~1", "stress~1"):
        expected = sum(torch.einsum("bi,bij->bj", weights[o].reshape(9, -1),
                                    raw(J[o][name]).reshape(9, weights[o][0].numel(), -1))
                       for o in out)
        check_close(leaves[name].grad, expected.reshape(leaves[name].shape),
                    f"d loss / d {name} vs eager J^T w", rtol=1e-7)


def test_implicit_gradcheck():
    model = nd.load_model(stub("perzyna_viscoplasticity", "model"), "model",
                          nd.SyncChunking(batch_size=2))
    # Finite differences of a Newton solve are as good as its convergence: solve tightly.
    config = model.solver_config()
    config.rtol, config.atol = 1e-14, 1e-12
    model.set_solver_config(config)
    inputs = implicit_inputs(model, 3)
    x = inputs.pop("E").requires_grad_()
    # Row 0 sits just past yield, where the stress bends sharply: a central difference
    # needs a step of 1e-8 (1e-5 of the strain) to come within 1e-6 of the derivative.
    assert torch.autograd.gradcheck(
        lambda x: model.forward({**inputs, "E": x})["stress"], (x,), eps=1e-8, atol=1e-3,
        rtol=1e-6)


def test_implicit_parameter_gradient_matches_eager_param_vjp():
    model = nd.load_model(stub("scalar_backward_euler_params", "model"))
    scaling = model.named_parameters()["residual.square.scaling"].requires_grad_()
    inputs = scalar_inputs(torch.linspace(0.1, 2.0, 7))
    out = model.forward(inputs)
    cot = {"x": torch.linspace(1.0, 2.0, 7)}
    (out["x"] * cot["x"]).sum().backward()
    expected = model._param_vjp(inputs, cot)["residual.square.scaling"]
    check_close(scaling.grad, expected, "d loss / d scaling vs param_vjp")
    ref = eager("scalar_backward_euler.i", "model")
    name = eager_name(ref, "residual.square.scaling", "model")
    check_close(scaling.grad, ref.param_vjp(inputs, cot, [name])[name],
                "d loss / d scaling vs eager param_vjp", rtol=1e-8)
    assert torch.autograd.gradcheck(lambda s: model.forward(inputs)["x"], (scaling,))


def test_every_call_through_its_operator_gives_the_librarys_results():
    model = nd.load_model(stub("elasticity_params", "elasticity"), "elasticity",
                          nd.SyncChunking(batch_size=3))
    x = strains(7)
    leaf = x.clone().requires_grad_()
    cot = {"stress": torch.randn(7, 6, generator=torch.Generator().manual_seed(1))}
    tan = {"strain": torch.ones(7, 6)}
    for call, args, direct_args in [
            ("forward", ({"strain": leaf},), ({"strain": x},)),
            ("jvp", ({"strain": leaf}, tan), ({"strain": x}, tan)),
            ("jacobian", ({"strain": leaf},), ({"strain": x},)),
            ("param_jacobian", ({"strain": leaf},), ({"strain": x},)),
            ("param_vjp", ({"strain": leaf}, cot), ({"strain": x}, cot))]:
        through = _flatten(getattr(model, call)(*args))
        direct = _flatten(getattr(model, "_" + call)(*direct_args))
        assert through.keys() == direct.keys(), call
        assert any(t.grad_fn is not None for t in through.values()), call
        for key, value in direct.items():  # blocks the library gives unbatched: expanded
            check_close(through[key], value.expand_as(through[key]), f"{call} {key}", rtol=0)


def _flatten(value, prefix=""):
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return {k: v for key, item in items for k, v in _flatten(item, f"{prefix}/{key}").items()}


def test_derivative_results_refuse_second_derivatives():
    model = nd.load_model(stub("elasticity_params", "elasticity"))
    x = strains(4).requires_grad_()
    out, J = model.jacobian({"strain": x})
    # The outputs of a derivative call are differentiable...
    out["stress"].sum().backward()
    expected = strains(4).requires_grad_()
    model.forward({"strain": expected})["stress"].sum().backward()
    check_close(x.grad, expected.grad, "through jacobian()'s outputs")
    # ...its derivatives are not.
    with pytest.raises(nd.FatalError, match="second derivatives"):
        J["stress"]["strain"].sum().backward()
    _, d = model.jvp({"strain": x}, {"strain": torch.ones(4, 6)})
    with pytest.raises(nd.FatalError, match="second derivatives"):
        d["stress"].sum().backward()
    y = strains(4).requires_grad_()
    (g,) = torch.autograd.grad(model.forward({"strain": y})["stress"].pow(2).sum(), y,
                               create_graph=True)
    with pytest.raises(nd.FatalError, match="second derivatives"):
        g.sum().backward()


def test_torch_compile_traces_one_operator(policy):
    model = nd.load_model(stub("elasticity_params", "elasticity"), "elasticity", policy)
    calls = []

    def backend(graph, example_inputs):
        calls.append([str(n.target) for n in graph.graph.nodes if n.op == "call_function"])
        return graph.forward

    def f(x):
        return (2 * model.forward({"strain": x})["stress"]).sum(-1)

    compiled = torch.compile(f, backend=backend, fullgraph=True)
    x = strains(10)
    check_close(compiled(x), f(x), "compiled forward")
    assert any("neml2_dispatch.forward" in t for t in calls[0]), calls
    # Inductor, and gradients through the compiled function (AOTAutograd traces backward).
    full = torch.compile(f, fullgraph=True)
    y = strains(10).requires_grad_()
    full(y).sum().backward()
    expected = strains(10).requires_grad_()
    f(expected).sum().backward()
    check_close(y.grad, expected.grad, "gradient through torch.compile")


def test_torch_export_sees_the_operator():
    model = nd.load_model(stub("elasticity_params", "elasticity"))

    class Host(torch.nn.Module):
        def forward(self, x):
            return model.forward({"strain": x})["stress"] + 1

    x = strains(8)
    exported = torch.export.export(Host(), (x,), strict=False)
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert any("neml2_dispatch.forward" in t for t in targets), targets
    check_close(exported.module()(x), Host()(x), "exported forward")


@pytest.mark.parametrize("case, shape", [
    (("elasticity_params", "elasticity"), (5, 6)),
    (("elasticity_params", "elasticity"), (6,)),       # unbatched
    (("elasticity_subbatch", "elasticity"), (4, 3, 6)),  # a sub-batch axis
])
def test_operators_pass_torch_opcheck(case, shape):
    """torch's own check of a custom operator: schema, autograd registration, the fake
    implementation against the real one (shapes, strides), AOTAutograd."""
    model = nd.load_model(stub(*case))
    op = model._op
    x = 1e-3 * torch.randn(shape, generator=torch.Generator().manual_seed(2))
    params = list(op.params.values())
    ops = torch.ops.neml2_dispatch
    cot = [torch.ones(shape)]
    calls = [(ops.forward, (op.handle, [x], params)),
             (ops.jvp, (op.handle, [x], [0], [torch.ones(shape)], params)),
             (ops.jacobian, (op.handle, [x], params))]
    if params:  # (an artifact without parameters has no parameter graphs)
        calls += [(ops.param_jacobian, (op.handle, [x], params)),
                  (ops.param_vjp, (op.handle, [x], [0], cot, params))]
    for call, args in calls:
        torch.library.opcheck(call.default, args)


def test_sub_batch_gradients_and_compile():
    model = nd.load_model(stub("elasticity_subbatch", "elasticity"))
    x = (1e-3 * torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(4))).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: model.forward({"strain": x})["stress"], (x,))
    compiled = torch.compile(lambda x: model.jacobian({"strain": x})[1]["stress"]["strain"],
                             fullgraph=True)
    expected = model._jacobian({"strain": x.detach()})[1]["stress"]["strain"]
    check_close(compiled(x.detach()), expected, "compiled sub-batch Jacobian", rtol=0)


def test_a_parameter_without_its_derivative_graph_is_refused():
    """elasticity_renamed promotes E (as youngs_modulus) without -d sig:youngs_modulus:
    its gradient is an error that says how to compile it, never a silent zero."""
    from conftest import artifact_root

    model = nd.load_model(artifact_root("elasticity_renamed", "elasticity"))
    model.named_parameters()["youngs_modulus"].requires_grad_()
    out = model.forward({"eps": strains(3)})["sig"]
    with pytest.raises(nd.FatalError, match="-d sig:youngs_modulus -p youngs_modulus"):
        out.sum().backward()


def test_an_implicit_models_operators_pass_torch_opcheck():
    model = nd.load_model(stub("perzyna_viscoplasticity", "model"))
    op = model._op
    inputs = implicit_inputs(model, 4)
    ins = [inputs[n] for n in op.inputs]
    for call, args in [(torch.ops.neml2_dispatch.forward, (op.handle, ins, [])),
                       (torch.ops.neml2_dispatch.jacobian, (op.handle, ins, []))]:
        torch.library.opcheck(call.default, args)


def test_errors_through_an_operator_are_the_librarys():
    """A call through its operator fails as the library's call does: an observer's
    KeyboardInterrupt is still one, its other exceptions a FatalError; then it runs."""
    model = nd.load_model(stub("elasticity_params", "elasticity"), "elasticity",
                          nd.SyncChunking(batch_size=4))
    x = strains(16).requires_grad_()

    def interrupt(event):
        raise KeyboardInterrupt("stop")

    def fail(event):
        raise ValueError("bad")

    model.set_observer(interrupt)
    with pytest.raises(KeyboardInterrupt, match="stop"):
        model.forward({"strain": x})
    model.set_observer(fail)
    with pytest.raises(nd.FatalError, match="ValueError: bad"):
        model.forward({"strain": x})
    model.set_observer(None)
    model.forward({"strain": x})["stress"].sum().backward()
    assert x.grad is not None
    with pytest.raises(nd.FatalError, match="unknown input 'strains'"):
        model.forward({"strains": x})


@pytest.mark.parametrize("case", [("elasticity_params", "elasticity"),
                                  ("elasticity_renamed", "elasticity"),
                                  ("j2_radial_return", "model"),
                                  ("scalar_backward_euler_params", "model")])
def test_the_operators_blocks_are_the_librarys(case):
    """The blocks an operator's layout promises are the ones the library returns, by the
    names callers use (a renamed artifact included), and a gradient flows through them."""
    from conftest import artifact_root

    model = nd.load_model(artifact_root(*case))
    inputs = {n: 0.1 + 0.01 * torch.rand(3, *s, generator=torch.Generator().manual_seed(6))
              for n, s in zip(model.input_names, model.input_base_shapes)}
    for call in ("jacobian", "param_jacobian"):
        if call == "param_jacobian" and not model._op.param_pairs:
            continue  # (no parameter graphs: elasticity_renamed's E has none)
        direct = getattr(model, "_" + call)(inputs)[1]
        leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
        through = getattr(model, call)(leaves)[1]
        assert {o: set(b) for o, b in through.items()} == {o: set(b) for o, b in direct.items()}
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    sum(v.sum() for v in model.forward(leaves).values()).backward()
    assert all(t.grad is not None for t in leaves.values())


@pytest.mark.parametrize("case", [("elasticity", "elasticity"),
                                  ("elasticity_params", "elasticity")])
def test_derivative_shapes_do_not_depend_on_grad_mode(case):
    """jacobian(), param_jacobian() and jvp() give the same shapes (and numbers, eager
    NEML2's) whether the call goes through its operator (an input requires grad) or not:
    a block that is the same for every row (linear elasticity's) has the batch axis too."""
    model = nd.load_model(stub(*case))
    ref = eager("elasticity.i", "elasticity")
    names = {n: eager_name(ref, n, "elasticity") for n in model.named_parameters()}
    for x in (strains(20), strains(1)[0]):  # batched, and unbatched
        batch = tuple(x.shape[:-1])
        _, eager_J = ref.jacobian({"strain": x})
        _, eager_d = ref.jvp({"strain": x}, {"strain": torch.ones_like(x)})
        for leaf in (x, x.clone().requires_grad_()):
            mode = "operator" if leaf.requires_grad else "direct"
            _, J = model.jacobian({"strain": leaf})
            block = J["stress"]["strain"]
            assert block.shape == (*batch, 6, 6), (mode, block.shape)
            check_close(block, raw(eager_J["stress"]["strain"]).expand(*batch, 6, 6),
                        f"{mode} J vs eager")
            _, d = model.jvp({"strain": leaf}, {"strain": torch.ones_like(x)})
            check_close(d["stress"], eager_d["stress"], f"{mode} jvp vs eager")
            if names:
                _, P = model.param_jacobian({"strain": leaf})
                _, eager_P = ref.param_jacobian({"strain": x}, list(names.values()))
                for name, theirs in names.items():
                    check_close(P["stress"][name], raw(eager_P["stress"][theirs]),
                                f"{mode} P[{name}] vs eager")


def test_a_backward_uses_its_forwards_parameters():
    """set_parameter between a forward and its backward: the gradients are those of the
    parameter values the forward ran with (eager NEML2 with them), and the model keeps
    the new value."""
    model = nd.load_model(stub("elasticity_params", "elasticity"), "elasticity",
                          nd.SyncChunking(batch_size=3))
    E = model.named_parameters()["elasticity.E"].requires_grad_()
    weights = torch.randn(7, 6, generator=torch.Generator().manual_seed(8))
    x = strains(7).requires_grad_()
    before = model.forward({"strain": x})["stress"]
    loss = (before * weights).sum()
    model.set_parameter("elasticity.E", 3 * E.detach())  # a new tensor, three times E
    loss.backward()
    ref = eager("elasticity.i", "elasticity")
    theirs = strains(7).requires_grad_()
    (raw(ref.call_by_name({"strain": theirs})["stress"]) * weights).sum().backward()
    check_close(x.grad, theirs.grad, "d loss / d strain vs eager with the forward's E")
    named = dict(ref.named_parameters())
    check_close(E.grad, named[eager_name(ref, "elasticity.E", "elasticity")].grad,
                "d loss / d E vs eager with the forward's E")
    # The model's own value is the new one, for calls with and without a graph.
    assert model.named_parameters()["elasticity.E"].item() == pytest.approx(3 * E.item())
    scale = model.named_parameters()["elasticity.E"] / E.detach()
    for given in (x.detach(), x):
        check_close(model.forward({"strain": given})["stress"], scale * before.detach(),
                    "forward after set_parameter")


def test_a_call_with_other_parameter_values_fails_cleanly():
    """A backward that runs with its forward's values runs alone: the model called from its
    own observer meanwhile is refused (it would wait for ever), a value the library refuses
    fails the call; either way the model's own values are back and it runs."""
    model = nd.load_model(stub("elasticity_params", "elasticity"))
    E, nu = (model.named_parameters()[n] for n in ("elasticity.E", "elasticity.nu"))
    x = strains(4).requires_grad_()
    before = model.forward({"strain": x})["stress"]
    model.set_parameter("elasticity.E", 2 * E)
    doubled = model.named_parameters()["elasticity.E"]
    model.set_observer(lambda event: model.forward({"strain": strains(1)}))
    with pytest.raises(nd.FatalError, match="runs alone"):
        before.sum().backward(retain_graph=True)
    model.set_observer(None)
    with pytest.raises(nd.FatalError, match="elasticity.E"):
        torch.ops.neml2_dispatch.forward(model._op.handle, [x.detach()], [torch.ones(3, 2), nu])
    assert model.named_parameters()["elasticity.E"] is doubled
    check_close(model.forward({"strain": x.detach()})["stress"], 2 * before.detach(),
                "forward with the model's own value after the failures")
    before.sum().backward()
    expected = strains(4).requires_grad_()
    nd.load_model(stub("elasticity_params", "elasticity")).forward(
        {"strain": expected})["stress"].sum().backward()
    check_close(x.grad, expected.grad, "the backward, once nothing disturbs it")


def test_a_graph_keeps_its_model_alive():
    """A model loaded inside the function that made the outputs: its last reference gone
    and collected, backward still finds it (the graph holds it)."""
    import gc
    import weakref

    def stress(x):
        model = nd.load_model(stub("elasticity_params", "elasticity"))
        stress.model = weakref.ref(model)
        return model.forward({"strain": x})["stress"]

    x = strains(5).requires_grad_()
    y = stress(x)
    gc.collect()
    assert stress.model() is not None, "the graph does not hold its model"
    y.sum().backward()
    ref = eager("elasticity.i", "elasticity")
    theirs = strains(5).requires_grad_()
    raw(ref.call_by_name({"strain": theirs})["stress"]).sum().backward()
    check_close(x.grad, theirs.grad, "backward after the model's last reference went")
    del y
    gc.collect()
    assert stress.model() is None, "the model outlived the graph"


EXPORT = """
import sys, torch, neml2_dispatch as nd
torch.set_default_dtype(torch.float64)
model = nd.load_model(sys.argv[1])
x = 1e-3 * torch.arange(24.0).reshape(4, 6)
if sys.argv[2] == "save":
    class Host(torch.nn.Module):
        def forward(self, x):
            return model.forward({"strain": x})["stress"]
    torch.export.save(torch.export.export(Host(), (x,), strict=False), sys.argv[3])
else:  # this process's model has twice the Young's modulus
    model.set_parameter("elasticity.E", 2 * model.named_parameters()["elasticity.E"])
    try:
        print("ran", torch.export.load(sys.argv[3]).module()(x).sum().item())
    except nd.FatalError as e:
        print("refused:", e)
"""


def test_an_exported_program_never_calls_another_processs_model(tmp_path):
    """A program exported in one process and loaded in another, where a different model
    was loaded: it refuses (a FatalError that says what to do), never runs that model."""
    import subprocess
    import sys

    program, path = str(tmp_path / "program.pt2"), str(stub("elasticity_params", "elasticity"))

    def run(*args):
        done = subprocess.run([sys.executable, "-c", EXPORT, path, *args], capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return done.stdout

    run("save", program)
    said = run("load", program)
    assert said.startswith("refused:"), said
    assert "trace or export the function again" in said and "this process" in said
    # In this process, a reload is another model too: the handle of the collected one
    # names nothing.
    model = nd.load_model(path)
    handle = model._op.handle
    del model
    import gc

    gc.collect()
    with pytest.raises(nd.FatalError, match="no longer exists"):
        torch.ops.neml2_dispatch.forward(handle, [strains(2)], [torch.tensor(1.0)] * 2)
    assert nd.load_model(path)._op.handle != handle


def slip_inputs(model, rows):
    """slip_systems: 12 systems' hardening (B, 12) beside plain scalars (B,)."""
    inputs = {name: torch.zeros(rows, *shape) for name, shape in
              zip(model.input_names, model.input_sub_batch_shapes)}
    inputs["f"] = torch.linspace(1.5, 2.5, rows)
    inputs["t"] = torch.ones(rows)
    return inputs


def test_mixed_sub_batch_shapes_trace_and_compile():
    """Inputs of different sub-batch shapes ((B, 12) beside (B,)): the fake implementation
    gives the library's shapes (opcheck), torch.compile(fullgraph=True) traces and runs it,
    batched and unbatched, as the direct call; a backward is the library's refusal (the
    artifact has no derivative graphs), not a shape error."""
    model = nd.load_model(stub("slip_systems", "model"))
    assert model.input_sub_batch_shapes[model.input_names.index("hardening")] == [12]
    assert model.output_shapes[model.output_names.index("system_strength")] == [12]
    op = model._op
    for rows in (5, None):
        inputs = slip_inputs(model, rows or 1)
        if rows is None:
            inputs = {n: t[0] for n, t in inputs.items()}
        torch.library.opcheck(torch.ops.neml2_dispatch.forward.default,
                              (op.handle, [inputs[n] for n in op.inputs], []))

    def work(inputs):
        out = model.forward(inputs)
        return out["system_strength"].sum(-1) + out["work"], out["mean_hardening"]

    compiled = torch.compile(work, fullgraph=True)
    for rows in (5, 9):
        inputs = slip_inputs(model, rows)
        for ours, theirs in zip(compiled(inputs), work(inputs)):
            check_close(ours, theirs, f"compiled mixed sub-batch, {rows} rows", rtol=1e-12)
    leaves = {n: t.clone().requires_grad_() for n, t in slip_inputs(model, 3).items()}
    with pytest.raises(nd.FatalError, match="no derivative of a sub-batched implicit variable"):
        sum(v.sum() for v in model.forward(leaves).values()).backward()
    for case in (("grains", "model"), ("binned_precipitation", "model")):
        other = nd.load_model(stub(*case))
        inputs = {name: torch.full((4, *sub), 0.5) for name, sub in
                  zip(other.input_names, other.input_sub_batch_shapes)}
        inputs["t"], inputs["t~1"] = torch.full((4,), 1e-3), torch.zeros(4)
        torch.library.opcheck(torch.ops.neml2_dispatch.forward.default,
                              (other._op.handle, [inputs[n] for n in other._op.inputs], []))


def test_batch_axes_of_parameters_and_tangents():
    """A call's batch axis may come from a batched parameter or a batched tangent alone
    (the input unbatched): the fake implementation says so (opcheck), torch.compile runs
    it, and the gradient of the unbatched input sums over the rows (against finite
    differences and the Jacobian)."""
    model = nd.load_model(stub("elasticity_params", "elasticity"))
    model.set_parameter("elasticity.E", torch.linspace(50.0, 150.0, 8))
    op = model._op
    x = strains(1)[0]
    params = list(op.params.values())
    torch.library.opcheck(torch.ops.neml2_dispatch.forward.default, (op.handle, [x], params))
    torch.library.opcheck(torch.ops.neml2_dispatch.jacobian.default, (op.handle, [x], params))
    torch.library.opcheck(torch.ops.neml2_dispatch.jvp.default,
                          (op.handle, [x], [0], [torch.ones(8, 6)], params))
    compiled = torch.compile(lambda x: model.forward({"strain": x})["stress"], fullgraph=True)
    check_close(compiled(x), model.forward({"strain": x})["stress"], "compiled, batched E")
    leaf = x.clone().requires_grad_()
    out = model.forward({"strain": leaf})["stress"]
    assert out.shape == (8, 6)
    weights = torch.randn(8, 6, generator=torch.Generator().manual_seed(9))
    (out * weights).sum().backward()
    _, J = model.jacobian({"strain": x})
    check_close(leaf.grad, torch.einsum("bi,bij->j", weights, J["stress"]["strain"]),
                "d loss / d unbatched strain vs J^T w summed over rows")
    assert torch.autograd.gradcheck(lambda x: model.forward({"strain": x})["stress"],
                                    (x.clone().requires_grad_(),))
    # The jvp's batch from its tangent: outputs (8, 6), differentiable as forward's.
    leaf = x.clone().requires_grad_()
    model.set_parameter("elasticity.E", torch.tensor(100.0))
    out, d = model.jvp({"strain": leaf}, {"strain": torch.ones(8, 6)})
    assert out["stress"].shape == d["stress"].shape == (8, 6)
    out["stress"].sum().backward()
    expected = x.clone().requires_grad_()
    model.forward({"strain": expected})["stress"].sum().mul(8).backward()
    check_close(leaf.grad, expected.grad, "through jvp's outputs, batched by the tangent")


def test_backward_contracts_each_sub_batch_entry():
    """J^T g where outputs and inputs have different sub-batch shapes, which no artifact
    neml2-compile 3.1 writes has derivative graphs for (so it is checked on the contraction
    itself, against einsum): a sub-batched input a (8 entries) and a plain input b (6
    values), a sub-batched output y (6 values an entry) and a plain output z. Blocks:
    y/a entry by entry, y/b the same for every entry, z/a and z/b gathering the entries."""
    from neml2_dispatch import _ops

    op = _ops.OpInfo(handle="h", inputs=("a", "b"), outputs=("y", "z"),
                     input_shapes=((8,), (6,)), input_bases=((), (6,)),
                     output_shapes=((8, 6), ()), output_bases=((6,), ()), parameter_shapes=(),
                     block_shapes={(0, 0): (8, 6), (0, 1): (6, 6), (1, 0): (8,), (1, 1): (6,)})
    gen = torch.Generator().manual_seed(10)
    rows = 5
    g_y, g_z = torch.randn(rows, 8, 6, generator=gen), torch.randn(rows, generator=gen)
    blocks = {pair: torch.randn(rows, *shape, generator=gen)
              for pair, shape in op.block_shapes.items()}
    expected = {
        (0, 0): torch.einsum("rsk,rsk->rs", g_y, blocks[(0, 0)]),
        (0, 1): torch.einsum("rsk,rkj->rj", g_y, blocks[(0, 1)]),
        (1, 0): torch.einsum("r,rs->rs", g_z, blocks[(1, 0)]),
        (1, 1): torch.einsum("r,rj->rj", g_z, blocks[(1, 1)]),
    }
    for (o, i), value in expected.items():
        g = (g_y, g_z)[o]
        check_close(_ops._transposed_product(op, o, i, g, blocks[(o, i)]), value,
                    f"g^T J of {op.outputs[o]}/{op.inputs[i]}", rtol=1e-14)
        # A block given once for every row (unbatched) serves each row.
        shared = blocks[(o, i)][0]
        check_close(_ops._transposed_product(op, o, i, g, shared),
                    _ops._transposed_product(op, o, i, g, shared.expand_as(blocks[(o, i)])),
                    f"g^T J of an unbatched {op.outputs[o]}/{op.inputs[i]} block", rtol=0)

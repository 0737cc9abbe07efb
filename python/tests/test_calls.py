"""Every call of neml2_dispatch.Model against eager NEML2 (the Python model, not the
compiled graphs) and against NEML2's own binding of the compiled model (neml2.aoti.Model)
on the same artifact, under both built-in policies; tensors in and out without copies."""

import json

import pytest
import torch

import neml2_dispatch as nd
from conftest import (artifact_root, check_close, check_maps, eager, eager_name, random_inputs,
                      raw, scalar_inputs, stub)

POLICIES = {
    "sync_whole": lambda: nd.SyncChunking(),
    "sync_chunks_of_7": lambda: nd.SyncChunking(device="cpu", batch_size=7),
    "greedy_chunks_of_5": lambda: nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[5]),
}


@pytest.fixture(params=list(POLICIES))
def policy(request):
    return POLICIES[request.param]()


def eager_outputs(model, inputs):
    return {n: raw(v) for n, v in model.call_by_name(inputs).items()}


@pytest.mark.parametrize("batch", [1, 33])
def test_forward_matches_eager_and_neml2_binding(elasticity, eager_elasticity, policy, batch):
    model = nd.load_model(elasticity, "elasticity", policy)
    assert model.input_names == ["strain"] and model.output_names == ["stress"]
    assert model.input_base_shapes == [[6]] and model.dtype == torch.float64
    inputs = random_inputs(model, batch, seed=batch)
    out = model.forward(inputs)
    check_maps(out, eager_outputs(eager_elasticity, inputs), "forward vs eager")
    from neml2.aoti import Model as Neml2Compiled

    theirs = Neml2Compiled(str(artifact_root("elasticity", "elasticity")))
    check_maps(out, theirs.forward(inputs), "forward vs neml2.aoti", rtol=1e-13)


def test_jvp_and_jacobian_match_eager(elasticity, eager_elasticity, policy):
    model = nd.load_model(elasticity, "elasticity", policy)
    inputs = random_inputs(model, 33, seed=1)
    tangents = {"strain": torch.rand(33, 6, generator=torch.Generator().manual_seed(2)) - 0.5}
    out, d = model.jvp(inputs, tangents)
    _, eager_d = eager_elasticity.jvp(inputs, tangents)
    check_maps(out, eager_outputs(eager_elasticity, inputs), "jvp outputs")
    check_maps(d, {n: raw(v) for n, v in eager_d.items()}, "jvp vs eager")
    out, J = model.jacobian(inputs)
    _, eager_J = eager_elasticity.jacobian(inputs)
    assert set(J) == {"stress"} and set(J["stress"]) == {"strain"}
    # Linear elasticity's block does not depend on the row: computed once, expanded to the
    # batch (a view).
    assert J["stress"]["strain"].shape == (33, 6, 6) and J["stress"]["strain"].stride(0) == 0
    check_close(J["stress"]["strain"], eager_J["stress"]["strain"], "J vs eager", broadcast=True)
    from neml2.aoti import Model as Neml2Compiled

    _, their_J = Neml2Compiled(str(artifact_root("elasticity", "elasticity"))).jacobian(inputs)
    check_close(J["stress"]["strain"], raw(their_J["stress"]["strain"]).expand(33, 6, 6),
                "J vs neml2.aoti", 1e-13)


def test_parameters_param_jacobian_and_param_vjp_match_eager(policy):
    model = nd.load_model(stub("elasticity_params", "elasticity"), "elasticity", policy)
    ref = eager("elasticity.i", "elasticity")
    params = ["elasticity.E", "elasticity.nu"]
    names = {p: eager_name(ref, p, "elasticity") for p in params}
    assert sorted(model.named_parameters()) == params
    assert model.parameter_base_shapes == {"elasticity.E": [], "elasticity.nu": []}
    inputs = random_inputs(model, 7, seed=3)

    out, P = model.param_jacobian(inputs)
    _, eager_P = ref.param_jacobian(inputs, list(names.values()))
    for p, e in names.items():
        check_close(P["stress"][p], eager_P["stress"][e], f"P[stress][{p}] vs eager")
    cot = {"stress": torch.rand(7, 6, generator=torch.Generator().manual_seed(4)) - 0.5}
    grads = model.param_vjp(inputs, cot)
    eager_grads = ref.param_vjp(inputs, cot, list(names.values()))
    for p, e in names.items():
        check_close(grads[p], eager_grads[e], f"param_vjp[{p}] vs eager")

    # set_parameter, then forward: eager NEML2 with the same value.
    value = model.named_parameters()["elasticity.E"] * 1.5
    model.set_parameter("elasticity.E", value)
    ref.set_parameter(names["elasticity.E"], value.clone())
    check_maps(model.forward(inputs), eager_outputs(ref, inputs), "forward after set_parameter")
    # named_parameters() are the model's own tensors: an in-place change is seen.
    model.named_parameters()["elasticity.nu"].fill_(0.25)
    ref.set_parameter(names["elasticity.nu"], torch.tensor(0.25))
    check_maps(model.forward(inputs), eager_outputs(ref, inputs), "forward after an in-place change")


def test_into_forms_write_the_callers_tensors(policy):
    model = nd.load_model(stub("elasticity_params", "elasticity"), "elasticity", policy)
    ref = eager("elasticity.i", "elasticity")
    batch = 33
    inputs = random_inputs(model, batch, seed=5)
    nan = float("nan")
    stress = torch.full((batch, 6), nan)
    before = stress.data_ptr()
    model.forward_into(inputs, {"stress": stress})
    assert stress.data_ptr() == before
    check_close(stress, raw(ref.call_by_name(inputs)["stress"]), "forward_into")

    tangents = {"strain": torch.rand(batch, 6) - 0.5}
    out, d = torch.full((batch, 6), nan), torch.full((batch, 6), nan)
    model.jvp_into(inputs, tangents, {"stress": out}, {"stress": d})
    check_close(d, raw(ref.jvp(inputs, tangents)[1]["stress"]), "jvp_into")

    J = torch.full((batch, 6, 6), nan).transpose(1, 2)  # any strides
    model.jacobian_into(inputs, {"stress": torch.full((batch, 6), nan)}, {"stress": {"strain": J}})
    check_close(J, raw(ref.jacobian(inputs)[1]["stress"]["strain"]), "jacobian_into")

    eager_names = [eager_name(ref, p, "elasticity") for p in ("elasticity.E", "elasticity.nu")]
    P = {"stress": {"elasticity.E": torch.full((batch, 6), nan),
                    "elasticity.nu": torch.full((batch, 6), nan)}}
    model.param_jacobian_into(inputs, {"stress": torch.full((batch, 6), nan)}, P)
    eager_P = ref.param_jacobian(inputs, eager_names)[1]["stress"]
    check_close(P["stress"]["elasticity.E"], eager_P[eager_names[0]], "param_jacobian_into E")
    check_close(P["stress"]["elasticity.nu"], eager_P[eager_names[1]], "param_jacobian_into nu")

    cot = {"stress": torch.rand(batch, 6) - 0.5}
    grads = {"elasticity.E": torch.full((), nan), "elasticity.nu": torch.full((), nan)}
    model.param_vjp_into(inputs, cot, grads)
    eager_grads = ref.param_vjp(inputs, cot, eager_names)
    check_close(grads["elasticity.E"], eager_grads[eager_names[0]], "param_vjp_into E")


def test_memory_shared_through_numpy_views_or_a_buffer_is_overlap(elasticity, eager_elasticity,
                                                                  policy):
    # torch.from_numpy of two views of one array, torch.frombuffer twice over one bytearray:
    # separate storages over one memory. Results are those of the inputs as given.
    import numpy as np
    model = nd.load_model(elasticity, "elasticity", policy)
    batch = 33
    strain = torch.rand(batch, 6) * 1e-3
    expected = raw(eager_elasticity.call_by_name({"strain": strain})["stress"])
    buf = np.zeros((batch + 1, 6))
    for given, written in ((buf[:-1], buf[1:]), (buf[1:], buf[:-1])):
        source, target = torch.from_numpy(given), torch.from_numpy(written)
        source.copy_(strain)
        model.forward_into({"strain": source}, {"stress": target})
        check_close(target, expected, "numpy views shifted by a row")
    raw_bytes = bytearray(8 * 6 * (batch + 1))
    source = torch.frombuffer(raw_bytes, dtype=torch.float64, count=6 * batch).view(batch, 6)
    target = torch.frombuffer(raw_bytes, dtype=torch.float64, offset=48).view(batch, 6)
    source.copy_(strain)
    model.forward_into({"strain": source}, {"stress": target})
    check_close(target, expected, "frombuffer twice")
    # Two destinations over one array that meet are refused, naming both; nothing written.
    out = np.full((batch, 12), 7.0)
    with pytest.raises(nd.FatalError, match="share memory"):
        model.jvp_into({"strain": strain}, {"strain": strain},
                       {"stress": torch.from_numpy(out[:, :6])},
                       {"stress": torch.from_numpy(out[:, 5:11])})
    assert (out == 7.0).all()


def test_lazy_views_are_read_as_their_values(elasticity, eager_elasticity):
    model = nd.load_model(elasticity, "elasticity", nd.SyncChunking(batch_size=4))
    strain = torch.rand(9, 6) * 1e-3
    expected = raw(eager_elasticity.call_by_name({"strain": -strain})["stress"])
    negated = torch._neg_view(strain)
    assert negated.is_neg()
    check_close(model.forward({"strain": negated})["stress"], expected, "negated view")
    imag = torch.complex(strain.flip(0), strain).conj().imag  # -strain, the negative bit set
    assert imag.is_neg()
    check_close(model.forward({"strain": imag})["stress"], expected, "imag of a conjugate")


def test_writes_are_seen_by_autograd(elasticity):
    model = nd.load_model(elasticity)
    strain = torch.rand(9, 6)
    # A tensor autograd saved for backward (x * y saves y), then overwritten by a call.
    x = torch.ones(9, 6, requires_grad=True)
    y = torch.zeros(9, 6)
    loss = (x * y).sum()
    version = y._version
    model.forward_into({"strain": strain}, {"stress": y})
    assert y._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # A destination that requires grad: refused, as torch's out= refuses it.
    with pytest.raises(nd.FatalError, match="requires grad"):
        model.forward_into({"strain": strain}, {"stress": torch.zeros(9, 6, requires_grad=True)})
    with torch.no_grad():
        leaf = torch.zeros(9, 6, requires_grad=True)
        model.forward_into({"strain": strain}, {"stress": leaf})
    assert torch.equal(leaf.detach(), model.forward({"strain": strain})["stress"])


def test_calls_without_a_graph_refuse_arguments_that_require_grad():
    """The _into forms and prepared calls record no graph: with grad mode on, an input, a
    tangent, a cotangent or a parameter that requires grad is refused as torch refuses it
    for out= (a FatalError naming the call, the argument and the fix), before anything is
    written; detached or under no_grad, the numbers are forward()'s."""
    model = nd.load_model(stub("elasticity_params", "elasticity"))
    ref = eager("elasticity.i", "elasticity")
    strain = torch.rand(9, 6, generator=torch.Generator().manual_seed(4)) * 1e-3
    leaf = strain.clone().requires_grad_()
    nan = float("nan")

    def filled(*shape):
        return torch.full(shape, nan)

    outs = [filled(9, 6) for _ in range(2)]
    J, P = filled(9, 6, 6), {"elasticity.E": filled(9, 6), "elasticity.nu": filled(9, 6)}
    grads = {"elasticity.E": filled(), "elasticity.nu": filled()}
    step = model.prepare(["strain"])
    ones = torch.ones(9, 6)
    calls = [
        ("forward_into", "forward", lambda x, t: model.forward_into({"strain": x},
                                                                    {"stress": outs[0]})),
        ("jvp_into", "jvp", lambda x, t: model.jvp_into(
            {"strain": x}, {"strain": t}, {"stress": outs[0]}, {"stress": outs[1]})),
        ("jacobian_into", "jacobian", lambda x, t: model.jacobian_into(
            {"strain": x}, {"stress": outs[0]}, {"stress": {"strain": J}})),
        ("param_jacobian_into", "param_jacobian", lambda x, t: model.param_jacobian_into(
            {"strain": x}, {"stress": outs[0]}, {"stress": P})),
        ("param_vjp_into", "param_vjp", lambda x, t: model.param_vjp_into(
            {"strain": x}, {"stress": t}, grads)),
        ("PreparedCall.forward_into", "Model.forward", lambda x, t: step.forward_into(
            [x], [outs[0]])),
        ("PreparedCall.forward", "Model.forward", lambda x, t: step.forward([x])),
    ]
    written = [*outs, J, *P.values(), *grads.values()]
    for name, graph_call, call in calls:
        with pytest.raises(nd.FatalError, match=rf"{name}\(\): inputs(\['strain'\]|\[0\]) "
                           rf"requires grad.*out=.*call {graph_call}\(\).*torch.no_grad"):
            call(leaf, ones)
        if name in ("jvp_into", "param_vjp_into"):  # a tangent, a cotangent
            with pytest.raises(nd.FatalError, match=r"(tangents|cotangents)\['s.*requires grad"):
                call(strain, ones.clone().requires_grad_())
        assert all(t.isnan().all() for t in written), f"{name} wrote before refusing"
    # A parameter that requires grad (a calibration) is refused too.
    model.named_parameters()["elasticity.E"].requires_grad_()
    with pytest.raises(nd.FatalError, match=r"parameter 'elasticity.E' requires grad"):
        model.forward_into({"strain": strain}, {"stress": outs[0]})
    with pytest.raises(nd.FatalError, match=r"parameter 'elasticity.E' requires grad"):
        step.forward([strain])
    assert outs[0].isnan().all()
    # Under no_grad, or detached with no parameter requiring grad, they run.
    expected = raw(ref.call_by_name({"strain": strain})["stress"])
    with torch.no_grad():
        model.forward_into({"strain": leaf}, {"stress": outs[0]})
    check_close(outs[0], expected, "forward_into under no_grad")
    model.named_parameters()["elasticity.E"].requires_grad_(False)
    (stress,) = step.forward([leaf.detach()])
    check_close(stress, expected, "prepared forward of a detached input")
    # The model stays usable, with a graph where one is wanted.
    model.forward({"strain": leaf})["stress"].sum().backward()
    assert leaf.grad is not None


def test_prepared_call_gives_forwards_bits(elasticity, eager_elasticity, policy):
    model = nd.load_model(elasticity, "elasticity", policy)
    step = model.prepare(["strain"])
    assert step.input_names == ["strain"]
    inputs = random_inputs(model, 33, seed=6)
    (stress,) = step.forward([inputs["strain"]])
    assert torch.equal(stress, model.forward(inputs)["stress"])
    check_close(stress, raw(eager_elasticity.call_by_name(inputs)["stress"]), "prepared")
    out = torch.empty(33, 6)
    step.forward_into([inputs["strain"]], [out])
    assert torch.equal(out, stress)
    del model  # the prepared call keeps its model alive
    (again,) = step.forward([inputs["strain"]])
    assert torch.equal(again, stress)


def test_results_are_not_copied_and_inputs_broadcast(elasticity, eager_elasticity):
    model = nd.load_model(elasticity, "elasticity")
    inputs = random_inputs(model, 5, seed=7)
    # An unbatched input broadcasts to the batch, as in C++.
    one = {"strain": inputs["strain"][0]}
    check_close(model.forward(one)["stress"], raw(eager_elasticity.call_by_name(one)["stress"]),
                "unbatched")
    # The tensors the library returns are handed over as they are: writable, owned by the
    # caller, and a second call does not change the first call's results.
    first = model.forward(inputs)["stress"]
    kept = first.clone()
    model.forward(random_inputs(model, 5, seed=8))
    assert torch.equal(first, kept)


def test_implicit_model_and_solver_config_match_eager():
    model = nd.load_model(stub("perzyna_viscoplasticity", "model"), "model",
                          nd.SyncChunking(batch_size=3))
    ref = eager("perzyna_viscoplasticity.i", "model")
    config = model.solver_config()
    assert isinstance(config, nd.SolverConfig) and config.miters >= 2
    rows = 8
    inputs = {}
    for name, shape in zip(model.input_names, model.input_base_shapes):
        if name in model.output_names or name.endswith("~1"):  # guesses, old states: 0
            inputs[name] = torch.zeros(rows, *shape)
        elif len(shape) == 1 and shape[0] == 6:  # the strain: a step past yield in most rows
            inputs[name] = 1e-3 * torch.linspace(0.05, 1.0, rows)[:, None] * \
                torch.tensor([1.0, -0.5, -0.5, 0.1, 0.0, 0.0])
        elif name == "t":
            inputs[name] = torch.full((rows,), 0.1)
        else:
            inputs[name] = torch.zeros(rows, *shape)
    out = model.forward(inputs)
    expected = eager_outputs(ref, inputs)
    check_maps(out, {n: expected[n] for n in out}, "implicit forward vs eager", rtol=1e-8)
    _, J = model.jacobian(inputs)
    _, eager_J = ref.jacobian(inputs)
    for o, blocks in J.items():
        for i, block in blocks.items():
            check_close(block, eager_J[o][i], f"implicit J[{o}][{i}] vs eager", rtol=1e-7)

    # The tensor path (accelerators') from Python too: the same rows, against eager.
    assert config.row_pass
    config.row_pass = False
    model.set_solver_config(config)
    assert not model.solver_config().row_pass
    tensor_path = model.forward(inputs)
    check_maps(tensor_path, {n: expected[n] for n in out}, "tensor path vs eager", rtol=1e-8)
    config.row_pass = True

    config.miters = 0
    with pytest.raises(nd.FatalError, match="miters is 0; it must be >= 1"):
        model.set_solver_config(config)
    config.miters = 40
    config.atol = 1e-12
    model.set_solver_config(config)
    assert model.solver_config().miters == 40 and model.solver_config().atol == 1e-12


def test_observer_sees_the_policys_chunks(elasticity):
    for policy, rows in [(nd.SyncChunking(batch_size=7), 7),
                         (nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[5]), 5)]:
        model = nd.load_model(elasticity, "elasticity", policy)
        events = []
        model.set_observer(events.append)
        model.forward({"strain": torch.rand(33, 6)})
        expected = [(first, min(rows, 33 - first)) for first in range(0, 33, rows)]
        assert sorted((e.first, e.rows) for e in events) == expected, policy
        assert sorted(e.index for e in events) == list(range(len(expected)))
        assert all(e.device == "cpu" and e.device_index == 0 and e.seconds >= 0 for e in events)
        model.set_observer(None)
        events.clear()
        model.forward({"strain": torch.rand(33, 6)})
        assert events == []


def test_policies_load_model_forms_and_metadata(elasticity):
    p = nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[8], capacities=[16])
    assert p.devices == ["cpu"] and p.batch_sizes == [8] and p.capacities == [16]
    model = nd.load_model(elasticity, p)  # the name left out: the stub holds one model
    assert model.devices == ["cpu"] and model.device == "cpu"
    assert isinstance(model.policy, nd.GreedyPriorityCapacity)
    assert model.policy.capacities == [16]
    p.capacities = [32]  # the model keeps its own copy
    assert model.policy.capacities == [16]
    assert nd.load_model(elasticity).policy.batch_size == 0
    assert repr(nd.SyncChunking(batch_size=3)) == \
        "SyncChunking(device='cpu', batch_size=3, cpu_lanes=0)"

    info = nd.artifact_info(elasticity)
    assert [v["name"] for v in info["inputs"]] == ["strain"]
    assert "strain" in nd.artifact_info(elasticity, text=True)


def test_dtype_reaches_the_library():
    """dtype=torch.float32 selects the float32 folder; neml2-compile 3.1 writes float64
    graphs there, which the library refuses, saying so (docs/errors.md)."""
    root = artifact_root("elasticity_float32", "elasticity")  # compiled without a stub
    with pytest.raises(nd.FatalError, match=r"cpu/float32/elasticity.pt2' takes float64 inputs, "
                                            r"but it sits in a float32 folder"):
        nd.load_model(root, dtype=torch.float32)
    with pytest.raises(nd.FatalError, match=r"has no graphs for device cpu and dtype float64"):
        nd.load_model(root)  # float64, the default: no such folder
    assert nd.load_model(stub("elasticity", "elasticity")).dtype == torch.float64


def test_convergence_is_per_row_as_in_eager_neml2():
    """Rows solve independently: a row's result is eager NEML2's solve of that row alone,
    whatever its neighbours."""
    model = nd.load_model(stub("scalar_backward_euler", "model"), "model",
                          nd.SyncChunking(batch_size=2))
    ref = eager("scalar_backward_euler.i", "model")
    a = [1.0, 3.0, 0.2, 7.0, -1.0]
    inputs = scalar_inputs(a)
    x = model.forward(inputs)["x"]
    for r in range(len(a)):
        row = {n: v[r:r + 1] for n, v in inputs.items()}
        check_close(x[r:r + 1], raw(ref.call_by_name(row)["x"]), f"row {r}", rtol=1e-10)


def test_a_model_in_a_cycle_with_its_observer_or_policy_is_collected(elasticity):
    import gc
    import weakref

    class Rows:
        """A synchronous Python policy that refers to its model."""
        dispatch_mode = "synchronous"
        devices = ["cpu"]
        model = None

        def compute_device(self):
            return "cpu"

        def chunk_rows(self, batch):
            return 4

    strain = {"strain": torch.rand(9, 6)}
    # The observer refers to the model.
    model = nd.load_model(elasticity, "elasticity", nd.SyncChunking(batch_size=4))
    seen = []
    model.set_observer(lambda event: seen.append(model.input_names))
    model.forward(strain)
    assert len(seen) == 3
    observed = weakref.ref(model)
    # The policy refers to the model.
    policy = Rows()
    policy.model = nd.load_model(elasticity, "elasticity", policy)
    policy.model.forward(strain)
    held = weakref.ref(policy.model)
    # A prepared call of the model in its observer's closure: model -> observer -> prepared
    # call -> model.
    third = nd.load_model(elasticity, "elasticity", nd.SyncChunking(batch_size=4))
    step = third.prepare(["strain"])
    third.set_observer(lambda event: step.input_names)
    third.forward(strain)
    prepared = weakref.ref(third)
    del model, policy, third, step
    gc.collect()
    assert observed() is None, "a model whose observer refers to it was not collected"
    assert held() is None, "a model whose policy refers to it was not collected"
    assert prepared() is None, "a model in a cycle through a prepared call was not collected"


def test_results_come_in_the_artifacts_order():
    # j2 radial return lists its outputs as (equivalent_plastic_strain, stress,
    # plastic_strain): not by name, as NEML2's runtime returns them.
    root = artifact_root("j2_radial_return", "model")
    metadata = json.loads((root / "metadata.json").read_text())
    outputs = [v["name"] for v in metadata["outputs"]]
    inputs = [v["name"] for v in metadata["inputs"]]
    assert outputs != sorted(outputs)
    model = nd.load_model(stub("j2_radial_return", "model"), "model")
    given = {name: torch.zeros(3, *shape)
             for name, shape in zip(model.input_names, model.input_base_shapes)}
    given["E"], given["t"] = torch.full((3, 6), 1e-3), torch.ones(3)
    assert list(model.forward(given)) == outputs
    out, J = model.jacobian(given)
    assert list(out) == outputs and list(J) == outputs
    for row in J.values():
        assert list(row) == [name for name in inputs if name in row]
    out, d = model.jvp(given, {"E": torch.ones(3, 6)})
    assert list(out) == outputs and list(d) == outputs


def test_sub_batched_unknown_carries_its_bins_through_a_history():
    """A number density over 8 size bins solved per point: `(B, 8)` out, fed back as the
    next step's `~1` input, each step against eager NEML2 given the bins as a sub-batch."""
    from neml2.types import Scalar
    model = nd.load_model(stub("binned_precipitation", "model"), "model",
                          nd.SyncChunking(batch_size=3))
    ref = eager("binned_precipitation.i", "model")
    rows = 5
    T = torch.linspace(0.5, 1.5, rows)
    ours = theirs = torch.zeros(rows, 8)
    for step in range(1, 5):
        t, t_old = torch.full((rows,), 0.1 * step), torch.full((rows,), 0.1 * (step - 1))
        ours = model.forward({"T": T, "number_density~1": ours, "t": t,
                              "t~1": t_old})["number_density"]
        assert ours.shape == (rows, 8)
        (theirs,) = ref(Scalar(T), Scalar(theirs, sub_batch_ndim=1), Scalar(t), Scalar(t_old))
        theirs = raw(theirs)
        check_close(ours, theirs, f"step {step}", rtol=1e-8)
    assert ours.abs().max() > 0.1  # the bins filled: the history did something


def test_jacobian_into_takes_blocks_shaped_as_jacobian_returns_them():
    # Linear elasticity's block is the same for every row: jacobian() gives it batched, and
    # jacobian_into takes a destination of that shape (or the one block, unbatched).
    model = nd.load_model(stub("elasticity", "elasticity"), "elasticity")
    inputs = random_inputs(model, 9, seed=3)
    out, J = model.jacobian(inputs)
    assert J["stress"]["strain"].shape == (9, 6, 6)
    for block in (torch.full((9, 6, 6), float("nan")), torch.full((6, 6), float("nan"))):
        into = {"stress": {"strain": block}}
        model.jacobian_into(inputs, {"stress": torch.empty(9, 6)}, into)
        assert torch.equal(block.expand(9, 6, 6), J["stress"]["strain"])


def test_newton_factors_the_chord_from_call_to_call():
    model = nd.load_model(stub("chaboche_viscoplasticity", "model"), "model")
    rows = 16
    inputs = {}
    for name, shape in zip(model.input_names, model.input_base_shapes):
        inputs[name] = torch.zeros(rows, *shape)
    inputs["t"] = torch.full((rows,), 0.1)
    strain = 1e-2 * torch.linspace(0.5, 1.5, rows)[:, None] * \
        torch.tensor([1.0, -0.5, -0.5, 0.2, 0.0, 0.0])
    factors = nd.NewtonFactors()
    assert factors.points == 0 and factors.nbytes == 0
    state, plain = dict(inputs), dict(inputs)
    for step in range(1, 6):
        for given in (state, plain):
            given["E~1"], given["E"] = strain * (step - 1) / 5, strain * step / 5
            given["t~1"], given["t"] = torch.full((rows,), 0.1 * (step - 1)), \
                torch.full((rows,), 0.1 * step)
        chord_out, plain_out = model.forward(state, factors), model.forward(plain)
        check_maps(chord_out, plain_out, "the chord against Newton", rtol=1e-7)
        for name in chord_out:  # the step's state is the next one's old state and guess
            for given, out in ((state, chord_out), (plain, plain_out)):
                given[name + "~1"] = out[name]
                given[name] = out[name]
    assert factors.points == rows and factors.nbytes == rows * (1 + 19 + 19 * 19) * 8
    _, J = model.jacobian(state, factors)
    _, plain_J = model.jacobian(state)
    check_close(J["stress"]["E"], plain_J["stress"]["E"], "dstress/dE", rtol=1e-7)
    factors.clear()
    assert factors.points == 0

    # A call that records a graph runs NEML2's Newton through the operators: refused.
    with pytest.raises(nd.FatalError, match="NewtonFactors"):
        model.forward({**state, "E": state["E"].clone().requires_grad_()}, factors)
    config = model.solver_config()
    assert not config.chord and config.chord_rate == 0.1
    config.chord_rate = 0.0
    with pytest.raises(nd.FatalError, match="chord_rate is 0; it must be within"):
        model.set_solver_config(config)



def test_newton_factors_on_block_structured_unknowns():
    # grains: 4 grains' hardening and slip in a block group beside p, 9 unknowns a point:
    # the chord keeps each point's LU (1 + 9 + 81 values) across a history.
    model = nd.load_model(stub("grains", "model"), "model")
    rows = 8
    given = {"f": torch.linspace(1.5, 3.0, rows), "p": torch.zeros(rows),
             "hardening": torch.zeros(rows, 4), "slip": torch.zeros(rows, 4)}
    factors = nd.NewtonFactors()
    state, plain = dict(given), dict(given)
    for step in range(1, 11):
        for inputs in (state, plain):
            inputs["t~1"], inputs["t"] = torch.full((rows,), 0.1 * (step - 1)), \
                torch.full((rows,), 0.1 * step)
            for name in ("p", "hardening", "slip"):
                inputs[name + "~1"] = inputs[name]
        chord_out, plain_out = model.forward(state, factors), model.forward(plain)
        check_maps(chord_out, plain_out, "the chord against Newton", rtol=1e-7)
        for inputs, out in ((state, chord_out), (plain, plain_out)):
            for name in ("p", "hardening", "slip"):
                inputs[name] = out[name]
    assert factors.points == rows and factors.nbytes == rows * (1 + 9 + 9 * 9) * 8

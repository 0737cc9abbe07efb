"""NEML2's own workflows on the dispatcher (neml2_dispatch/drop_in.py): NEML2 input files
with [Tensors] and [Drivers] blocks, their model an explicit one (elasticity) and an
implicit one (J2 radial return), run through NEML2's own TransientDriver on eager NEML2,
on NEML2's AOTIModel and on DispatchedAOTIModel; TransientRegression against gold eager
NEML2 wrote; neml2-run, switched by --load."""

import subprocess
import sys
from pathlib import Path

import neml2
import pytest
import torch

import neml2_dispatch as nd
from conftest import MODELS, artifact_root

HISTORY = """
[Tensors]
  [times]
    type = Python
    expr = 'Scalar(torch.linspace(0, 1, {steps}).unsqueeze(-1).expand({steps}, {batch}).contiguous())'
  []
  [strains]
    type = Python
    expr = 'SR2(torch.linspace(0, 1, {steps}).view({steps}, 1, 1) * {peak} * torch.tensor([1.0, -0.4, -0.3, 0.2, 0.0, 0.1]) * torch.linspace(0.2, 1.0, {batch}).view(1, {batch}, 1))'
  []
[]
[Drivers]
  [driver]
    type = TransientDriver
    model = '{model}'
    prescribed_time = 'times'
    prescribed_SR2_names = '{strain}'
    prescribed_SR2_values = 'strains'
    save_as = '{save_as}'
  []
  [regression]
    type = TransientRegression
    driver = 'driver'
    reference = 'gold.pt'
    rtol = 1e-10
    atol = 1e-12
  []
[]
"""

# name: (NEML2 input file, artifact, model block, strain input, peak strain). J2 goes well
# past yield (yield strain 0.01), so most rows return to the yield surface.
CASES = {
    "elasticity": ("elasticity.i", ("elasticity", "elasticity"), "elasticity", "strain", 0.01),
    "j2_radial_return": ("j2_radial_return.i", ("j2_radial_return", "model"), "model", "E", 0.03),
}
STEPS, BATCH = 12, 40


def write_inputs(folder: Path, case: str, save_as: str = "", block: str = "") -> tuple[Path, Path]:
    """The case's input file twice: with NEML2's own model (eager) and with the compiled
    one (a [Models] block of type AOTIModel, or `block` as given)."""
    source, (name, model), model_block, strain, peak = CASES[case]
    history = HISTORY.format(steps=STEPS, batch=BATCH, peak=peak, model=model_block,
                             strain=strain, save_as=save_as)
    eager = folder / f"{case}_eager.i"
    eager.write_text((MODELS / source).read_text() + history)
    compiled = folder / f"{case}_compiled.i"
    block = block or "    type = AOTIModel\n"
    compiled.write_text(f"[Models]\n  [{model_block}]\n{block}"
                        f"    artifact_path = '{artifact_root(name, model)}'\n  []\n[]\n" + history)
    return eager, compiled


def history(path: Path) -> dict:
    driver = neml2.load_input(str(path)).get_driver("driver")
    driver.run()
    return driver.result()


def assert_same_history(actual: dict, expected: dict, rtol: float, what: str) -> None:
    outputs = [k for k in expected if k.startswith("output.")]
    assert outputs and set(outputs) <= set(actual), f"{what}: outputs {sorted(actual)}"
    for key in outputs:
        a, e = actual[key], expected[key]
        assert a.shape == e.shape, f"{what} {key}: shape {tuple(a.shape)} vs {tuple(e.shape)}"
        scale = max(e.abs().max().item(), 1e-300)
        error = (a - e).abs().max().item() / scale
        assert error <= rtol, f"{what} {key}: relative error {error:.3g}"


class Every16:
    """A synchronous policy written in Python."""
    dispatch_mode = "synchronous"
    devices = ["cpu"]

    def compute_device(self):
        return "cpu"

    def chunk_rows(self, batch):
        return 16


POLICIES = {
    "sync": lambda: nd.SyncChunking(batch_size=16),
    "greedy": lambda: nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[16]),
    "python": Every16,
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES)
def test_a_driver_runs_the_same_history_on_the_dispatcher(tmp_path, case, policy):
    eager, compiled = write_inputs(tmp_path, case)
    reference = history(eager)
    theirs = history(compiled)  # NEML2's own AOTIModel
    assert_same_history(theirs, reference, 1e-9, "NEML2's AOTIModel against eager NEML2")
    chunks = []
    with nd.dispatch_aoti_models(POLICIES[policy]()):
        factory = neml2.load_input(str(compiled))
        model = factory.get_model(CASES[case][2])
        assert isinstance(model, nd.DispatchedAOTIModel)
        model.model.set_observer(lambda event: chunks.append(event.rows))
        driver = factory.get_driver("driver")
        driver.run()
        ours = driver.result()
    # Every step of the history ran through the library, in chunks of 16 rows.
    assert chunks and max(chunks) == 16 and sum(chunks) == (STEPS - 1) * BATCH
    assert_same_history(ours, theirs, 1e-10, "DispatchedAOTIModel against NEML2's AOTIModel")
    assert_same_history(ours, reference, 1e-9, "DispatchedAOTIModel against eager NEML2")
    # Outside the block, AOTIModel is NEML2's own again.
    assert type(neml2.load_input(str(compiled)).get_model(CASES[case][2])).__name__ == "AOTIModel"


@pytest.mark.parametrize("case", CASES)
def test_transient_regression_passes_on_the_dispatcher_and_catches_a_change(tmp_path, case):
    eager, compiled = write_inputs(tmp_path, case)
    gold = tmp_path / "gold.pt"
    driver = neml2.load_input(str(eager)).get_driver("driver")
    driver.run()
    driver.save_result(gold)
    with nd.dispatch_aoti_models():
        assert neml2.load_input(str(compiled)).get_driver("regression").run()
        # The same gold with one stress changed by one part in a million fails.
        result = torch.load(gold, weights_only=True)
        key = next(k for k in result if k.startswith(f"output.{STEPS - 1}.stress"))
        result[key] = result[key] * (1 + 1e-6)
        torch.save(result, gold)
        with pytest.raises(Exception, match="TransientRegression"):
            neml2.load_input(str(compiled)).get_driver("regression").run()


def neml2_run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """neml2-run (its entry point, with this python: the environment under test)."""
    return subprocess.run([sys.executable, "-m", "neml2.cli.run", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=600)


def test_neml2_run_on_the_dispatcher(tmp_path):
    eager, compiled = write_inputs(tmp_path, "j2_radial_return", save_as="ours.pt")
    expected = history(eager)
    # An unchanged stub, switched by --load.
    done = neml2_run("--load", "neml2_dispatch.switch_aoti_models", str(compiled), "driver",
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert_same_history(torch.load(tmp_path / "ours.pt", weights_only=True), expected, 1e-9,
                        "neml2-run --load neml2_dispatch.switch_aoti_models")
    # A stub that names the type and its policy: NEML2 alone does not know the type.
    _, named = write_inputs(tmp_path, "j2_radial_return", save_as="named.pt",
                            block="    type = DispatchedAOTIModel\n    policy = SyncChunking\n"
                                  "    batch_sizes = '7'\n")
    refused = neml2_run(str(named), "driver", cwd=tmp_path)
    assert refused.returncode != 0 and "DispatchedAOTIModel" in refused.stderr
    done = neml2_run("--load", "neml2_dispatch", str(named), "driver", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert_same_history(torch.load(tmp_path / "named.pt", weights_only=True), expected, 1e-9,
                        "neml2-run of a DispatchedAOTIModel stub")


def test_switch_module_switches_and_a_stub_policy_is_used(tmp_path):
    _, compiled = write_inputs(tmp_path, "elasticity")
    code = ("import neml2, neml2_dispatch.switch_aoti_models; "
            f"m = neml2.load_input({str(compiled)!r}).get_model('elasticity'); "
            "print(type(m).__name__, type(m.model.policy).__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["DispatchedAOTIModel", "SyncChunking"]
    _, named = write_inputs(
        tmp_path, "elasticity",
        block="    type = DispatchedAOTIModel\n    policy = GreedyPriorityCapacity\n"
              "    devices = 'cpu'\n    batch_sizes = '5'\n    capacities = '10'\n")
    model = neml2.load_input(str(named)).get_model("elasticity")
    policy = model.model.policy
    assert isinstance(policy, nd.GreedyPriorityCapacity)
    assert (policy.devices, policy.batch_sizes, policy.capacities) == (["cpu"], [5], [10])


@pytest.mark.parametrize("block, error, message", [
    # NEML2's factory refuses an option the type does not list, in its own words.
    ("    type = DispatchedAOTIModel\n    batch_size = 4\n", ValueError,
     r"unknown option\(s\) \['batch_size'\]"),
    ("    type = DispatchedAOTIModel\n    devices = 'cpu cpu'\n", nd.FatalError,
     "takes one device"),
    ("    type = DispatchedAOTIModel\n    policy = Fastest\n", nd.FatalError,
     "'Fastest' is not a policy"),
    ("    type = DispatchedAOTIModel\n    policy = GreedyPriorityCapacity\n"
     "    batch_sizes = '0'\n", nd.FatalError, "batch"),
])
def test_a_stub_policy_that_is_wrong_is_refused(tmp_path, block, error, message):
    _, named = write_inputs(tmp_path, "elasticity", block=block)
    with pytest.raises(error, match=message):
        neml2.load_input(str(named)).get_model("elasticity")


def test_the_drop_in_has_aoti_models_surface_and_refuses_overrides(tmp_path):
    root = artifact_root("elasticity_params", "elasticity")
    theirs = neml2.aoti.AOTIModel(root)
    ours = nd.DispatchedAOTIModel(root, policy=nd.SyncChunking(batch_size=3))
    assert isinstance(ours, neml2.aoti.AOTIModel)
    assert ours.input_spec == theirs.input_spec and ours.output_spec == theirs.output_spec
    strain = torch.randn(10, 6) * 1e-3
    for call, args in [("jacobian", ({"strain": strain},)),
                       ("param_jacobian", ({"strain": strain},)),
                       ("jvp", ({"strain": strain}, {"strain": torch.ones(10, 6)})),
                       ("param_vjp", ({"strain": strain}, {"stress": torch.ones(10, 6)}))]:
        a, b = getattr(ours, call)(*args), getattr(theirs, call)(*args)
        flat_a, flat_b = _flatten(a), _flatten(b)
        assert flat_a.keys() == flat_b.keys(), call
        for key in flat_b:
            torch.testing.assert_close(flat_a[key].expand_as(flat_b[key]), flat_b[key],
                                       rtol=1e-12, atol=1e-12, msg=f"{call} {key}")
    (stress,) = ours(neml2.SR2(strain))
    torch.testing.assert_close(stress.data, theirs(neml2.SR2(strain))[0].data, rtol=1e-12,
                               atol=0)
    assert set(ours.named_parameters()) == {"elasticity.E", "elasticity.nu"}
    ours.set_parameter("elasticity.E", torch.tensor(200.0))
    (doubled,) = ours(neml2.SR2(strain))
    assert doubled.data.abs().max() > 1.5 * stress.data.abs().max()
    with pytest.raises(nd.FatalError, match="param_overrides"):
        ours.jacobian({"strain": strain}, {"elasticity.E": torch.tensor(1.0)})


def _flatten(value, prefix=""):
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value)
    out = {}
    for key, item in items:
        out.update(_flatten(item, f"{prefix}/{key}"))
    return out


def test_a_switch_kept_in_a_variable_switches_at_every_with(tmp_path):
    """dispatch_aoti_models(policy) kept in a variable: each `with` loads the dispatched
    type under its policy and puts NEML2's back on exit; nested blocks unwind in order."""
    _, compiled = write_inputs(tmp_path, "elasticity")

    def loaded():
        return neml2.load_input(str(compiled)).get_model("elasticity")

    assert type(loaded()) is neml2.aoti.AOTIModel
    switch = nd.dispatch_aoti_models(nd.SyncChunking(batch_size=5))
    for _ in range(3):
        with switch:
            model = loaded()
            assert isinstance(model, nd.DispatchedAOTIModel)
            assert model.model.policy.batch_size == 5
        assert type(loaded()) is neml2.aoti.AOTIModel
    other = nd.dispatch_aoti_models(nd.SyncChunking(batch_size=7))
    try:
        assert type(loaded()) is nd.DispatchedAOTIModel  # the call switches for good
        with switch:
            assert loaded().model.policy.batch_size == 5
            with other:
                assert loaded().model.policy.batch_size == 7
                with switch:
                    assert loaded().model.policy.batch_size == 5
                assert loaded().model.policy.batch_size == 7
            assert loaded().model.policy.batch_size == 5
        assert loaded().model.policy.batch_size == 7  # what `other`'s call switched to
        with other:  # finds its call's switch: takes it over, puts back what the call found
            assert loaded().model.policy.batch_size == 7
    finally:
        nd.drop_in._factory._registry["AOTIModel"] = neml2.aoti.AOTIModel
        nd.drop_in._default_policy[0] = None
    assert type(loaded()) is neml2.aoti.AOTIModel


def test_a_driver_with_the_chord_keeps_each_points_factor(tmp_path):
    # NEML2's TransientDriver over J2 with the solver config's chord: each point's Newton
    # factor kept from step to step (the drop-in's NewtonFactors), results within Newton's
    # tolerance of NEML2's own AOTIModel.
    _, compiled = write_inputs(tmp_path, "j2_radial_return")
    theirs = history(compiled)
    with nd.dispatch_aoti_models():
        factory = neml2.load_input(str(compiled))
        model = factory.get_model(CASES["j2_radial_return"][2])
        config = model.model.solver_config()
        config.chord = True
        model.model.set_solver_config(config)
        driver = factory.get_driver("driver")
        driver.run()
        ours = driver.result()
    assert model._inner.factors.points == BATCH
    assert_same_history(ours, theirs, 1e-7, "the chord against NEML2's AOTIModel")

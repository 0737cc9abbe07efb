"""Errors: the library's exceptions as one Python family (neml2_dispatch.Error, a
RuntimeError) with the library's messages; ConvergenceError's mask and the converged rows'
results against eager NEML2; bad input never crashes and leaves the model usable."""

import math
import os
import signal
import threading
import time

import pytest
import torch

import neml2_dispatch as nd
from conftest import check_close, check_maps, eager, raw, scalar_inputs, stub


def test_the_family():
    for leaf in (nd.FatalError, nd.ConvergenceError, nd.AggregateError):
        assert issubclass(leaf, nd.Error)
    assert issubclass(nd.Error, RuntimeError)
    assert nd.Error.__module__ == "neml2_dispatch"


@pytest.mark.parametrize("policy", [nd.SyncChunking(batch_size=2),
                                    nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[3])])
def test_convergence_error_mask_and_converged_rows_match_eager(policy):
    model = nd.load_model(stub("scalar_backward_euler", "model"), "model", policy)
    ref = eager("scalar_backward_euler.i", "model")
    from neml2.solvers import ConvergenceError as EagerConvergenceError

    a = [1.0, -50.0, 2.0, -60.0, 0.5, 3.0]
    inputs = scalar_inputs(a)
    with pytest.raises(nd.ConvergenceError) as caught:
        model.forward(inputs)
    e = caught.value
    assert isinstance(e, nd.Error) and isinstance(e, RuntimeError)
    assert e.recoverable and e.per_row
    assert "2 of 6 rows" in str(e)
    assert e.failed_rows == 2 and (math.isnan(e.worst_residual) or e.worst_residual > 0)
    # Eager NEML2, one row at a time: which rows converge, and their values.
    expected_mask = []
    for r in range(len(a)):
        row = {n: v[r:r + 1] for n, v in inputs.items()}
        try:
            x = raw(ref.call_by_name(row)["x"])
            expected_mask.append(True)
            check_close(e.outputs["x"][r:r + 1], x, f"converged row {r}")
        except EagerConvergenceError:
            expected_mask.append(False)
            assert torch.isnan(e.outputs["x"][r]), f"failed row {r} is not NaN"
    assert e.converged_mask.dtype == torch.bool
    assert e.converged_mask.tolist() == expected_mask == [True, False, True, False, True, True]
    assert len(e.results) == 1 and torch.equal(
        e.results[0][e.converged_mask], e.outputs["x"][e.converged_mask])
    # The model stays usable: the converged rows alone run.
    good = {n: v[e.converged_mask] for n, v in inputs.items()}
    check_close(model.forward(good)["x"], e.outputs["x"][e.converged_mask], "retry")


@pytest.mark.parametrize("policy", [nd.SyncChunking(batch_size=2, cpu_lanes=2),
                                    nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[3])])
def test_convergence_error_says_why_each_row_failed(policy):
    model = nd.load_model(stub("scalar_backward_euler", "model"), "model", policy)
    # converges; no real root (the iteration cap); NaN input; converges; a zero slope at the
    # guess x = -0.5 over dt = 1 (dr/dx = 1 + 2 x dt = 0) while r = -1.25
    inputs = scalar_inputs([1.0, -50.0, math.nan, 2.0, 1.0])
    inputs["x"][4], inputs["x~1"][4], inputs["t"][4] = -0.5, 0.0, 1.0
    with pytest.raises(nd.ConvergenceError) as caught:
        model.forward(inputs)
    e = caught.value
    assert e.reason_names == ("none", "not_converged", "non_finite", "singular")
    assert e.reasons.dtype == torch.int8 and e.residual_norms.dtype == torch.float64
    assert [e.reason_names[c] for c in e.reasons.tolist()] == [
        "none", "not_converged", "non_finite", "none", "singular"]
    norms = e.residual_norms
    assert norms[0] == 0 and norms[3] == 0
    assert math.isfinite(norms[1]) and norms[1] > 1e-10
    assert math.isnan(norms[2])
    assert norms[4] == 1.25  # the residual the row pass tested at the zero pivot
    # the class's defaults, for an error that is not per row
    assert nd.ConvergenceError.reasons is None and nd.ConvergenceError.residual_norms is None


def test_a_row_that_fails_spoils_a_sum_over_rows():
    model = nd.load_model(stub("scalar_backward_euler_params", "model"), "model")
    with pytest.raises(nd.ConvergenceError,
                       match=r"param_vjp\(\): Newton did not converge for 1 of 3 rows") as caught:
        model.param_vjp(scalar_inputs([1.0, -50.0, 2.0]), {"x": torch.ones(3)})
    assert caught.value.recoverable and not caught.value.per_row
    assert caught.value.converged_mask is None


def fatal(call, match):
    with pytest.raises(nd.FatalError, match=match) as caught:
        call()
    assert not caught.value.recoverable
    return caught.value


def test_bad_inputs_are_the_librarys_errors_and_the_model_stays_usable(elasticity):
    model = nd.load_model(elasticity, "elasticity", nd.SyncChunking(batch_size=4))
    good = {"strain": torch.rand(9, 6)}
    expected = model.forward(good)["stress"]
    fatal(lambda: model.forward({"strian": torch.rand(9, 6)}),
          r"unknown input 'strian'; this model takes: strain")
    fatal(lambda: model.forward({}), r"missing input 'strain'")
    fatal(lambda: model.forward({"strain": torch.rand(9, 5)}), r"input 'strain' has shape \[9, 5\]")
    fatal(lambda: model.forward({"strain": torch.rand(9, 6, dtype=torch.float32)}),
          r"input 'strain' has dtype Float.*convert it")
    fatal(lambda: model.forward({"strain": torch.rand(9, 6, device="meta")}), r"on meta")
    fatal(lambda: model.forward({"strain": [[0.0] * 6]}),
          r"inputs\['strain'\] is a list; it must be a torch.Tensor")
    fatal(lambda: model.forward([torch.rand(9, 6)]), r"inputs is a list; it must be a dict")
    fatal(lambda: model.forward({1: torch.rand(9, 6)}), r"key of type int")
    fatal(lambda: model.forward_into(good, {"stress": torch.empty(9, 5)}),
          r"output 'stress' has shape \[9, 5\], but this call's result has shape \[9, 6\]")
    stress = torch.empty(9, 6)
    fatal(lambda: model.jvp_into(good, {}, {"stress": stress}, {"stress": stress}),
          r"share memory")
    fatal(lambda: model.forward_into(good, {"stress": torch.empty(1, 6).expand(9, 6)}),
          r"elements that share memory")
    fatal(lambda: model.prepare(["strain", "strain"]),
          r"prepare\(\): 2 names given, but the model takes 1 inputs")
    fatal(lambda: model.prepare(["stress"]), r"'stress' is not an input of this model")
    fatal(lambda: model.prepare().forward([]), r"0 input tensors given")
    fatal(lambda: model.solver_config(), r"has no implicit segment")
    fatal(lambda: model.set_parameter("E", torch.tensor(1.0)), r"'E' is not a promoted parameter")
    assert torch.equal(model.forward(good)["stress"], expected)


def test_bad_loads_are_the_librarys_errors(elasticity, tmp_path):
    fatal(lambda: nd.load_model(tmp_path / "nope_aoti.i"), r"does not exist")
    fatal(lambda: nd.load_model(elasticity, "elastic"), r"no model 'elastic' under \[Models\]")
    fatal(lambda: nd.load_model(elasticity, "elasticity", nd.SyncChunking(batch_size=-2)),
          r"SyncChunking.batch_size is -2; it must be >= 0")
    fatal(lambda: nd.load_model(elasticity, "elasticity", nd.SyncChunking(device="gpu")),
          r"unknown device family 'gpu'")
    fatal(lambda: nd.GreedyPriorityCapacity(devices=["cuda:x"], batch_sizes=[1]),
          r"bad device index in 'cuda:x'")
    fatal(lambda: nd.load_model(elasticity, "elasticity",
                                nd.GreedyPriorityCapacity(devices=["cpu", "cpu:0"], batch_sizes=[4])),
          r"lists the CPU 2 times")
    fatal(lambda: nd.load_model(elasticity, "elasticity",
                                nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[8],
                                                          capacities=[4])),
          r"capacities is 4 for cpu \(device 0\), below its batch size 8")
    fatal(lambda: nd.load_model(elasticity, "elasticity", "not a policy"),
          r"policy is a str; give a neml2_dispatch.SyncChunking")
    fatal(lambda: nd.load_model(elasticity, "elasticity", dtype=torch.float16),
          r"dtype Half has no compiled artifacts")
    fatal(lambda: nd.load_model(stub("elasticity_forward", "elasticity")).jacobian(
        {"strain": torch.rand(2, 6)}), r"compiled without the graphs it needs")


def test_an_observer_that_raises_fails_the_call_with_its_message(elasticity):
    model = nd.load_model(elasticity, "elasticity", nd.SyncChunking(batch_size=4))

    def observer(event):
        raise ValueError(f"no chunk {event.index} please")

    model.set_observer(observer)
    e = fatal(lambda: model.forward({"strain": torch.rand(9, 6)}), r"observer")
    assert "no chunk 0 please" in str(e) + e.details
    model.set_observer(None)
    assert model.forward({"strain": torch.rand(9, 6)})["stress"].shape == (9, 6)


def test_several_failing_chunks_are_one_aggregate_error_in_chunk_order(elasticity):
    # Four chunks in flight at once (capacity 40 rows of 10), each failed by the observer.
    model = nd.load_model(elasticity, "elasticity", nd.GreedyPriorityCapacity(
        devices=["cpu"], batch_sizes=[10], capacities=[40]))

    def observer(event):
        raise ValueError(f"no chunk {event.index} please")

    model.set_observer(observer)
    with pytest.raises(nd.AggregateError) as caught:
        model.forward({"strain": torch.rand(100, 6, dtype=torch.float64)})
    e = caught.value
    assert isinstance(e, nd.Error) and not e.recoverable
    assert [type(part) for part in e.errors] == [nd.FatalError] * 4
    for k, part in enumerate(e.errors):
        assert f"no chunk {k} please" in str(part), f"part {k} is not chunk {k}: {part}"
    assert str(e).startswith("4 errors:")
    model.set_observer(None)
    assert model.forward({"strain": torch.rand(100, 6, dtype=torch.float64)})["stress"].shape \
        == (100, 6)


def test_an_aggregate_of_convergence_errors_is_recoverable():
    # param_vjp sums over rows: a failing row fails its chunk, not per row; two chunks fail.
    model = nd.load_model(stub("scalar_backward_euler_params", "model"), "model",
                          nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[2],
                                                    capacities=[6]))
    inputs = scalar_inputs([1.0, -50.0, 2.0, -60.0, 0.5, 3.0])
    with pytest.raises(nd.AggregateError) as caught:
        model.param_vjp(inputs, {"x": torch.ones(6)})
    e = caught.value
    assert e.recoverable
    assert [type(part) for part in e.errors] == [nd.ConvergenceError] * 2
    assert all("1 of 2 rows" in str(part) and part.recoverable for part in e.errors)
    # The model stays usable: the converged rows alone, against one whole-batch call.
    good, ones = scalar_inputs([1.0, 2.0, 0.5, 3.0]), {"x": torch.ones(4)}
    whole = nd.load_model(stub("scalar_backward_euler_params", "model"), "model")
    check_maps(model.param_vjp(good, ones), whole.param_vjp(good, ones), "after the failure")


def test_an_observer_that_reconfigures_its_model_is_refused_not_a_hang(elasticity):
    model = nd.load_model(stub("elasticity_params", "elasticity"), "elasticity",
                          nd.SyncChunking(batch_size=4))
    model.set_observer(lambda event: model.set_parameter("elasticity.E", torch.tensor(1.0)))
    e = fatal(lambda: model.forward({"strain": torch.rand(9, 6)}), r"observer")
    assert "changed its model's configuration" in str(e) + e.details
    model.set_observer(None)
    model.forward({"strain": torch.rand(9, 6)})


# The library defines the torch operator neml2::opaque_pow when it loads a graph and finds
# none; the neml2 package defines it unconditionally when imported. The module imports
# neml2 first, so that importing it after loading a model still works.
def test_import_neml2_after_loading_a_model(elasticity):
    import subprocess
    import sys

    script = ("import neml2_dispatch as nd, torch\n"
              f"nd.load_model({str(elasticity)!r}).forward({{'strain': torch.rand(2, 6, dtype=torch.float64)}})\n"
              "import neml2\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_observer_may_configure_another_model(elasticity):
    other = nd.load_model(stub("elasticity_params", "elasticity"), "elasticity")
    model = nd.load_model(elasticity, "elasticity", nd.SyncChunking(batch_size=4))
    model.set_observer(lambda event: other.set_parameter("elasticity.E", torch.tensor(2.0e5)))
    model.forward({"strain": torch.rand(9, 6)})
    assert float(other.named_parameters()["elasticity.E"]) == 2.0e5


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit, GeneratorExit])
@pytest.mark.parametrize("policy", [nd.SyncChunking(batch_size=4),
                                    nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[4],
                                                              capacities=[8])])
def test_a_base_exception_from_an_observer_leaves_the_call_unchanged(elasticity, raised, policy):
    # Not an Exception: `except Exception` must not swallow a Ctrl-C.
    model = nd.load_model(elasticity, "elasticity", policy)

    def observer(event):
        raise raised("stop")

    model.set_observer(observer)
    with pytest.raises(raised) as caught:
        model.forward({"strain": torch.rand(9, 6)})
    assert type(caught.value) is raised and str(caught.value) == "stop"
    # Nothing left behind: the next call runs, and one without an observer too.
    with pytest.raises(raised):
        model.forward_into({"strain": torch.rand(9, 6)}, {"stress": torch.empty(9, 6)})
    model.set_observer(None)
    strain = torch.rand(9, 6)
    check_maps(model.forward({"strain": strain}), nd.load_model(elasticity).forward(
        {"strain": strain}), "after the interrupt")


def test_set_observer_refuses_what_it_cannot_call(elasticity):
    model = nd.load_model(elasticity)
    fatal(lambda: model.set_observer(5),
          r"set_observer\(\): observer is a int; give a callable that takes a ChunkEvent, or None")
    model.forward({"strain": torch.rand(3, 6)})  # nothing was set


def test_a_key_that_is_not_valid_text_is_the_modules_error(elasticity):
    model = nd.load_model(elasticity)
    fatal(lambda: model.forward({"\udc80": torch.rand(2, 6)}),
          r"has a key, '\\udc80', that is not valid text")
    # Any value pybind11 cannot convert is the module's error too (a name that is no text).
    fatal(lambda: nd.load_model(elasticity, "\udc80"), r"a value of a type it does not take")
    model.forward({"strain": torch.rand(2, 6)})


# A Ctrl-C during a long call: SIGINT sent from another thread once the call's second chunk
# has started (16383 chunks of 64 rows follow). The call notices it between chunks. On one
# lane (a laned call: test_lanes.py): the chunks then run in order, and the calling thread
# asks its first question (which puts the SIGINT handler in front again) before the second.
ROWS, CHUNK = 1 << 20, 64
SIGNAL_POLICIES = [nd.SyncChunking(batch_size=CHUNK, cpu_lanes=1),
                   nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[CHUNK])]


def interrupted_call(model, strain, out):
    """model.forward_into(...) on this (the main) thread, with SIGINT sent meanwhile."""
    def send():
        give_up = time.monotonic() + 60  # the call failed before its second chunk: no signal
        while math.isnan(out[CHUNK, 0].item()) and time.monotonic() < give_up:
            time.sleep(0.0005)
        if not math.isnan(out[CHUNK, 0].item()):
            os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        model.forward_into({"strain": strain}, {"stress": out})
    finally:
        sender.join()


def stresses(strain):
    return nd.load_model(stub("elasticity", "elasticity")).forward({"strain": strain})["stress"]


def check_stopped_between_chunks(strain, out):
    """The rows that ran are right; those after them untouched."""
    written = int((~out.isnan().any(1)).sum())
    assert CHUNK < written < ROWS and written % CHUNK == 0
    assert torch.equal(out[:written], stresses(strain[:written]))
    assert out[written:].isnan().all()


@pytest.mark.parametrize("policy", SIGNAL_POLICIES)
def test_ctrl_c_stops_a_long_call_between_chunks(policy):
    model = nd.load_model(stub("elasticity", "elasticity"), "elasticity", policy)
    strain, out = torch.rand(ROWS, 6) * 1e-3, torch.full((ROWS, 6), math.nan)
    # Python's own Ctrl-C handler, even where the suite was started with SIGINT ignored (a
    # background job: Python then installs none, and the signal would be dropped).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            interrupted_call(model, strain, out)
    finally:
        signal.signal(signal.SIGINT, previous)
    check_stopped_between_chunks(strain, out)
    out = torch.empty(ROWS, 6)  # the model goes on
    model.forward_into({"strain": strain}, {"stress": out})
    assert torch.equal(out, stresses(strain))


@pytest.mark.parametrize("policy", SIGNAL_POLICIES)
def test_a_signal_handler_runs_between_chunks_and_what_it_raises_leaves_unchanged(policy):
    model = nd.load_model(stub("elasticity", "elasticity"), "elasticity", policy)
    strain = torch.rand(ROWS, 6) * 1e-3
    seen = []

    def note(signum, frame):  # run between chunks: the last rows are not written yet
        seen.append(bool(out[-1].isnan().all()))

    def stop(signum, frame):
        raise ValueError("the user's own")

    try:
        signal.signal(signal.SIGINT, note)
        out = torch.full((ROWS, 6), math.nan)
        interrupted_call(model, strain, out)  # a handler that raises nothing: the call goes on
        assert seen == [True]
        assert torch.equal(out, stresses(strain))

        signal.signal(signal.SIGINT, stop)
        out = torch.full((ROWS, 6), math.nan)
        with pytest.raises(ValueError, match="the user's own") as caught:
            interrupted_call(model, strain, out)
        assert type(caught.value) is ValueError
        check_stopped_between_chunks(strain, out)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)

"""CPU lanes from Python (`cpu_lanes` on the policies, `ChunkEvent.lane`): every call gives
the same bits on 1, 2 and 3 lanes, whole and in chunks; the observer sees each chunk with its
lane, called from that lane's thread; a failure and a Ctrl-C on a laned call reach the caller
as they do on one lane; NEML2's drop-in on lanes; bad lane counts refused. Where a test
needs a second lane to run a chunk, the first observer call waits for one (30 s at most,
then the test fails); but for the Ctrl-C test (its call must outlast the signal, as in
test_errors.py), nothing here depends on timing."""

import math
import os
import signal
import threading
import time

import neml2
import pytest
import torch

import neml2_dispatch as nd
from conftest import stub
from test_neml2_workflows import history, write_inputs

# artifact: (model, rows, the strain input, its peak). J2 goes well past yield (0.01),
# Chaboche into its viscoplastic range: the rows take different numbers of Newton steps.
CASES = {
    "elasticity": ("elasticity", 5000, "strain", 0.01),
    "elasticity_params": ("elasticity", 5000, "strain", 0.01),
    "j2_radial_return": ("model", 300, "E", 0.03),
    "chaboche_viscoplasticity": ("model", 300, "E", 0.005),
}

# The policy for a lane count: whole batches, chunks of 37 rows, and GreedyPriorityCapacity,
# whose CPU chunk (about half the batch) is cut into pieces over the lanes.
POLICIES = {
    "sync_whole": lambda lanes, rows: nd.SyncChunking(cpu_lanes=lanes),
    "sync_chunks_of_37": lambda lanes, rows: nd.SyncChunking(batch_size=37, cpu_lanes=lanes),
    "greedy_halves": lambda lanes, rows: nd.GreedyPriorityCapacity(
        devices=["cpu"], batch_sizes=[rows // 2 + 1], cpu_lanes=lanes),
}


def strain_steps(model, rows, strain, peak, seed=0):
    """A step from rest: old states and guesses 0, t = 0.1, and the strain up to `peak`,
    scaled and turned a little per row."""
    gen = torch.Generator().manual_seed(seed)
    inputs = {n: torch.zeros(rows, *s) for n, s in zip(model.input_names, model.input_base_shapes)}
    direction = torch.tensor([1.0, -0.5, -0.5, 0.1, 0.0, 0.0]) + 0.2 * torch.rand(rows, 6,
                                                                                 generator=gen)
    inputs[strain] = peak * torch.linspace(0.05, 1.0, rows)[:, None] * direction
    if "t" in inputs:
        inputs["t"] = torch.full((rows,), 0.1)
    return inputs


def every_call(model, inputs):
    """Every call's results by name ("forward stress", "jacobian d stress/E", ...)."""
    r = {}
    forward = model.forward(inputs)
    r.update({f"forward {n}": t for n, t in forward.items()})
    tangents = {n: torch.sin(torch.arange(t.numel(), dtype=t.dtype)).reshape(t.shape)
                for n, t in inputs.items()}
    out, d = model.jvp(inputs, tangents)
    r.update({f"jvp {n}": t for n, t in out.items()})
    r.update({f"jvp d {n}": t for n, t in d.items()})
    out, J = model.jacobian(inputs)
    r.update({f"jacobian {n}": t for n, t in out.items()})
    r.update({f"jacobian d {o}/{i}": t for o, row in J.items() for i, t in row.items()})

    filled = {n: torch.full_like(t, -7.0) for n, t in forward.items()}
    model.forward_into(inputs, filled)
    r.update({f"forward_into {n}": t for n, t in filled.items()})
    out, d = ({n: torch.full_like(t, -7.0) for n, t in forward.items()} for _ in range(2))
    model.jvp_into(inputs, tangents, out, d)
    r.update({f"jvp_into d {n}": t for n, t in d.items()})
    # A block jacobian() gives as an expanded view (one for every row), jacobian_into takes
    # once, unbatched.
    blocks = {o: {i: torch.full_like(t[0] if t.dim() and t.stride(0) == 0 else t, -7.0)
                  for i, t in row.items()} for o, row in J.items()}
    model.jacobian_into(inputs, {n: torch.full_like(t, -7.0) for n, t in forward.items()}, blocks)
    r.update({f"jacobian_into d {o}/{i}": t for o, row in blocks.items() for i, t in row.items()})

    step = model.prepare()
    prepared = step.forward([inputs[n] for n in step.input_names])
    r.update({f"prepared {n}": t for n, t in zip(model.output_names, prepared)})
    filled = [torch.full_like(t, -7.0) for t in prepared]
    step.forward_into([inputs[n] for n in step.input_names], filled)
    r.update({f"prepared_into {n}": t for n, t in zip(model.output_names, filled)})

    if model.named_parameters():
        _, P = model.param_jacobian(inputs)
        r.update({f"param_jacobian d {o}/{p}": t for o, row in P.items() for p, t in row.items()})
        cotangents = {n: torch.cos(torch.arange(t.numel(), dtype=t.dtype)).reshape(t.shape)
                      for n, t in forward.items()}
        r.update({f"param_vjp {p}": t for p, t in model.param_vjp(inputs, cotangents).items()})
    return r


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES)
def test_every_call_gives_the_same_bits_on_1_2_and_3_lanes(case, policy):
    model_name, rows, strain, peak = CASES[case]
    path = stub(case, model_name)
    inputs = strain_steps(nd.load_model(path, model_name), rows, strain, peak)
    one = every_call(nd.load_model(path, model_name, POLICIES[policy](1, rows)), inputs)
    assert any(name.startswith("jacobian d ") for name in one)
    for lanes in (2, 3):
        model = nd.load_model(path, model_name, POLICIES[policy](lanes, rows))
        assert model.policy.cpu_lanes == lanes
        results = every_call(model, inputs)
        assert sorted(results) == sorted(one)
        for name, expected in one.items():
            assert not expected.isnan().any(), f"{case} {name}: NaN on one lane"
            assert torch.equal(results[name], expected), f"{case} {name} on {lanes} lanes"


def laned_forward_into(model, strain, out):
    """model.forward_into over chunks with an observer that records every event and the
    thread that reported it. The first report waits until rows outside its chunk are
    written: its lane has run that one chunk only (a lane reports each chunk before it takes
    the next), so another lane ran them. Returns (events, the threads by lane, whether
    another lane's rows came)."""
    events, threads, came = [], {}, []
    rows = strain.shape[0]

    def observer(event):  # called one chunk at a time
        events.append(event)
        threads.setdefault(event.lane, set()).add(threading.get_ident())
        if not came:
            others = torch.ones(rows, dtype=torch.bool)
            others[event.first:event.first + event.rows] = False
            give_up = time.monotonic() + 30
            while out[others].isnan().all() and time.monotonic() < give_up:
                time.sleep(0.001)
            came.append(not out[others].isnan().all().item())

    model.set_observer(observer)
    try:
        model.forward_into({"strain": strain}, {"stress": out})
    finally:
        model.set_observer(None)
    return events, threads, came


class EveryTen:
    """A synchronous Python policy of 10-row chunks on two lanes (cpu_lanes an attribute)."""
    dispatch_mode = "synchronous"
    devices = ["cpu"]
    cpu_lanes = 2

    def compute_device(self):
        return "cpu"

    def chunk_rows(self, batch):
        return 10


class TorchThreads:
    """torch.get_num_threads() set to `n` while it lives."""

    def __init__(self, n):
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self):
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


LANED = {
    "sync_two_lanes": (lambda: nd.SyncChunking(batch_size=10, cpu_lanes=2), 1),
    # 0: torch's intra-op thread count, here 2 (a CPU model has a runner per core: at most
    # as many lanes as the machine has cores).
    "sync_torch_threads": (lambda: nd.SyncChunking(batch_size=10), 2),
    "python_policy": (EveryTen, 1),
}


@pytest.mark.parametrize("case", LANED)
def test_the_observer_sees_each_chunk_with_its_lane_from_its_thread(elasticity, case):
    make, torch_threads = LANED[case]
    if case == "sync_torch_threads" and (os.cpu_count() or 1) < 2:
        pytest.skip("one core: torch's thread count gives one lane")
    rows = 2000
    strain = 1e-3 * torch.rand(rows, 6, generator=torch.Generator().manual_seed(3))
    expected = nd.load_model(elasticity, nd.SyncChunking(cpu_lanes=1)).forward(
        {"strain": strain})["stress"]
    model = nd.load_model(elasticity, "elasticity", make())
    out = torch.full((rows, 6), math.nan)
    with TorchThreads(torch_threads):
        events, threads, came = laned_forward_into(model, strain, out)
    assert came == [True], "no other lane ran a chunk while the calling thread waited"
    assert {e.lane for e in events} == {0, 1}
    assert sorted(e.index for e in events) == list(range(rows // 10))
    assert sorted((e.first, e.rows) for e in events) == [(f, 10) for f in range(0, rows, 10)]
    # Lane 0 is the calling (main) thread; lane 1 one other thread.
    assert threads[0] == {threading.main_thread().ident}
    assert len(threads[1]) == 1 and threads[1] != threads[0]
    assert torch.equal(out, expected)


def test_a_cpu_chunk_cut_into_pieces_is_one_event_of_lane_0(elasticity):
    rows = 4000
    strain = 1e-3 * torch.rand(rows, 6, generator=torch.Generator().manual_seed(4))
    expected = nd.load_model(elasticity, nd.SyncChunking(cpu_lanes=1)).forward(
        {"strain": strain})["stress"]
    for policy in (nd.SyncChunking(cpu_lanes=2),
                   nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[2000], cpu_lanes=2)):
        model = nd.load_model(elasticity, policy)
        events = []
        model.set_observer(events.append)
        assert torch.equal(model.forward({"strain": strain})["stress"], expected)
        assert [e.lane for e in events] == [0] * len(events) and events, policy
        assert sum(e.rows for e in events) == rows
        assert "lane=0" in repr(events[0])


def test_the_policies_carry_cpu_lanes(elasticity):
    assert nd.SyncChunking().cpu_lanes == 0
    assert nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[8]).cpu_lanes == 0
    p = nd.SyncChunking(batch_size=4, cpu_lanes=3)
    assert p.cpu_lanes == 3
    assert repr(p) == "SyncChunking(device='cpu', batch_size=4, cpu_lanes=3)"
    g = nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[8], cpu_lanes=2)
    assert g.cpu_lanes == 2 and repr(g).endswith("cpu_lanes=2)")
    model = nd.load_model(elasticity, p)
    p.cpu_lanes = 1  # the model keeps its own copy
    assert model.policy.cpu_lanes == 3 and p.cpu_lanes == 1
    g.cpu_lanes = 1024
    assert nd.load_model(elasticity, g).policy.cpu_lanes == 1024


@pytest.mark.parametrize("make", [
    lambda **kw: nd.SyncChunking(**kw),
    lambda **kw: nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[8], **kw),
])
def test_a_cpu_lanes_of_the_wrong_type_or_range_is_refused(elasticity, make):
    # A wrong Python type: pybind11's TypeError, as for every other field.
    for value in ("2", 2.0, None, 2 ** 70):
        with pytest.raises(TypeError):
            make(cpu_lanes=value)
        policy = make()
        with pytest.raises(TypeError):
            policy.cpu_lanes = value
        assert policy.cpu_lanes == 0
    # Out of range: the library's check, when the model is loaded.
    for value in (-1, 1025, -2 ** 63):
        with pytest.raises(nd.FatalError, match=rf"the dispatch policy's cpu_lanes is {value}; "
                                                r"it must be 0"):
            nd.load_model(elasticity, make(cpu_lanes=value))


class Lanes(EveryTen):
    def __init__(self, lanes):
        self.lanes = lanes

    def cpu_lanes(self):  # a method answers as an attribute does
        return self.lanes


def test_a_python_policys_cpu_lanes_is_read_and_checked(elasticity):
    strain = torch.rand(300, 6)
    assert torch.equal(nd.load_model(elasticity, Lanes(3)).forward({"strain": strain})["stress"],
                       nd.load_model(elasticity, Lanes(1)).forward({"strain": strain})["stress"])
    with pytest.raises(nd.FatalError, match=r"cpu_lanes is 2000; it must be 0"):
        nd.load_model(elasticity, Lanes(2000))
    with pytest.raises(nd.FatalError, match=r"cpu_lanes\(\) returned a str; it must return an int"):
        nd.load_model(elasticity, Lanes("2"))


@pytest.mark.parametrize("raised", [ValueError, KeyboardInterrupt])
def test_an_observer_that_raises_on_another_lane_fails_the_call_as_on_one(elasticity, raised):
    rows = 2000
    model = nd.load_model(elasticity, "elasticity", nd.SyncChunking(batch_size=10, cpu_lanes=2))
    strain = 1e-3 * torch.rand(rows, 6, generator=torch.Generator().manual_seed(5))
    out = torch.full((rows, 6), math.nan)
    waited = []

    def observer(event):
        if event.lane == 1:
            raise raised("on lane 1")
        if not waited:  # lane 0's first report: it waits for rows the other lane wrote
            give_up = time.monotonic() + 30
            while out[event.first + event.rows:].isnan().all() and \
                    out[:event.first].isnan().all() and time.monotonic() < give_up:
                time.sleep(0.001)
            waited.append(True)

    model.set_observer(observer)
    expected_type = nd.FatalError if raised is ValueError else KeyboardInterrupt
    with pytest.raises(expected_type, match="on lane 1") as caught:
        model.forward_into({"strain": strain}, {"stress": out})
    assert type(caught.value) is expected_type
    if raised is ValueError:
        assert "the observer raised ValueError" in str(caught.value)
    model.set_observer(None)
    assert torch.equal(model.forward({"strain": strain})["stress"],
                       nd.load_model(elasticity).forward({"strain": strain})["stress"])


def test_ctrl_c_stops_a_laned_call_and_the_model_goes_on(elasticity):
    """SIGINT sent from another thread once the call's second chunk is written (16384 chunks
    of 64 rows on two lanes): the call raises KeyboardInterrupt. The calling thread (lane 0)
    asks before it takes a chunk; the other lane takes chunks until the handler has raised:
    the chunks that ran are the first k, each whole and exact, and no other."""
    rows, chunk = 1 << 20, 64
    strain, out = torch.rand(rows, 6) * 1e-3, torch.full((rows, 6), math.nan)
    expected = nd.load_model(elasticity, nd.SyncChunking(cpu_lanes=1)).forward(
        {"strain": strain})["stress"]
    # Python's handler first: loading the model then puts the module's in front of it (the
    # call's own first question, which would too, may come after lane 1's second chunk).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def send():
        give_up = time.monotonic() + 60  # the call failed early: no signal
        while math.isnan(out[chunk, 0].item()) and time.monotonic() < give_up:
            time.sleep(0.0005)
        if not math.isnan(out[chunk, 0].item()):
            os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=send)
    try:
        model = nd.load_model(elasticity, "elasticity",
                              nd.SyncChunking(batch_size=chunk, cpu_lanes=2))
        sender.start()
        with pytest.raises(KeyboardInterrupt) as caught:
            model.forward_into({"strain": strain}, {"stress": out})
    finally:
        if sender.ident is not None:
            sender.join()
        signal.signal(signal.SIGINT, previous)
    assert type(caught.value) is KeyboardInterrupt
    chunks = out.view(rows // chunk, chunk, 6)
    ran = ~chunks.isnan().any(2).any(1)
    assert bool(ran[0]) and bool(ran[1])
    assert not ran.all(), "the call did not stop between chunks"
    assert ran[:int(ran.sum())].all(), "a chunk was skipped before the stop"
    assert torch.equal(chunks[ran], expected.view(rows // chunk, chunk, 6)[ran])
    assert chunks[~ran].isnan().all()  # no chunk half-written
    out = torch.empty(rows, 6)  # the model goes on
    model.forward_into({"strain": strain}, {"stress": out})
    assert torch.equal(out, expected)


def test_neml2s_driver_through_the_drop_in_gives_the_same_bits_on_two_lanes(tmp_path):
    """NEML2's TransientDriver over a J2 history (40 points) on DispatchedAOTIModel in chunks
    of 8 (every AOTIModel switched, and a stub naming the type with its cpu_lanes): the same
    bits on 2 lanes as on 1."""
    chunks = 8
    _, compiled = write_inputs(tmp_path, "j2_radial_return")
    runs = {}
    for lanes in (1, 2):
        with nd.dispatch_aoti_models(nd.SyncChunking(batch_size=chunks, cpu_lanes=lanes)):
            factory = neml2.load_input(str(compiled))
            assert factory.get_model("model").model.policy.cpu_lanes == lanes
            runs[lanes] = history(compiled)
        block = (f"    type = DispatchedAOTIModel\n    batch_sizes = '{chunks}'\n"
                 f"    cpu_lanes = {lanes}\n")
        (tmp_path / f"stub{lanes}").mkdir()
        _, named = write_inputs(tmp_path / f"stub{lanes}", "j2_radial_return", block=block)
        assert neml2.load_input(str(named)).get_model("model").model.policy.cpu_lanes == lanes
        runs[f"stub {lanes}"] = history(named)
    outputs = [k for k in runs[1] if k.startswith("output.")]
    assert outputs
    for run in (2, "stub 1", "stub 2"):
        for key in outputs:
            assert torch.equal(runs[run][key], runs[1][key]), f"{run}: {key}"

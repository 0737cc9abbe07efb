"""Policies written in Python: an object with the concept's methods, run through the
library's run-time policy model, the GIL taken per decision. Obeyed chunk by chunk (the
observer), the eager results, and every bad answer a FatalError that says what it did."""

import pytest
import torch

import neml2_dispatch as nd
from conftest import check_close, random_inputs, raw


class EveryN:
    """Synchronous: chunks of n rows on the CPU."""
    dispatch_mode = "synchronous"
    devices = ["cpu"]

    def __init__(self, n):
        self.n, self.asked = n, []

    def compute_device(self):
        return "cpu"

    def chunk_rows(self, batch):
        self.asked.append(batch)
        return self.n


class Shrinking:
    """Asynchronous: halves its chunk each time, down to `smallest`, one chunk in flight;
    keeps what it was told (its own state: the hooks are called one at a time)."""
    dispatch_mode = "asynchronous"

    def __init__(self, first=16, smallest=2):
        self.next, self.smallest = first, smallest
        self.dispatched, self.completed = [], []

    def devices(self):
        return ["cpu"]

    def next_chunk(self, rows_in_flight, remaining):
        if rows_in_flight[0] > 0:
            return None
        rows = min(remaining, self.next)
        self.next = max(self.smallest, self.next // 2)
        return (0, rows)

    def on_dispatched(self, device, rows):
        self.dispatched.append((device, rows))

    def on_completed(self, device, rows, seconds):
        assert seconds >= 0
        self.completed.append((device, rows))


def chunks(model, inputs):
    events = []
    model.set_observer(events.append)
    out = model.forward(inputs)
    model.set_observer(None)
    return out, sorted((e.first, e.rows) for e in events)


def test_a_synchronous_python_policy_is_obeyed(elasticity, eager_elasticity):
    policy = EveryN(7)
    model = nd.load_model(elasticity, "elasticity", policy)
    assert model.policy is policy and model.devices == ["cpu"]
    inputs = random_inputs(model, 33, seed=11)
    out, seen = chunks(model, inputs)
    assert seen == [(0, 7), (7, 7), (14, 7), (21, 7), (28, 5)]
    assert policy.asked == [33]  # once per call
    check_close(out["stress"], raw(eager_elasticity.call_by_name(inputs)["stress"]), "sync policy")
    _, J = model.jacobian(inputs)
    _, eager_J = eager_elasticity.jacobian(inputs)
    check_close(J["stress"]["strain"], eager_J["stress"]["strain"], "J", broadcast=True)


def test_an_asynchronous_python_policy_is_obeyed_and_keeps_its_state(elasticity, eager_elasticity):
    policy = Shrinking(first=16, smallest=2)
    model = nd.load_model(elasticity, policy)
    inputs = random_inputs(model, 33, seed=12)
    out, seen = chunks(model, inputs)
    # 16, 8, 4, 2, 2, 1 (the rest)
    assert seen == [(0, 16), (16, 8), (24, 4), (28, 2), (30, 2), (32, 1)]
    assert policy.dispatched == [(0, r) for _, r in seen]
    assert sorted(policy.completed) == sorted(policy.dispatched)
    check_close(out["stress"], raw(eager_elasticity.call_by_name(inputs)["stress"]), "async policy")


class Answers(EveryN):
    def __init__(self, answer):
        super().__init__(0)
        self.answer = answer

    def chunk_rows(self, batch):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class Chooses(Shrinking):
    def __init__(self, answer):
        super().__init__()
        self.answer = answer

    def next_chunk(self, rows_in_flight, remaining):
        return self.answer


@pytest.mark.parametrize("policy, message", [
    (Answers("many"), r"chunk_rows\(\) returned a str; it must return an int"),
    (Answers(-1), r"chunk_rows\(3\) returned -1; chunk_rows\(\) must return >= 0"),
    (Answers(ValueError("no idea")), r"chunk_rows\(\) raised ValueError: no idea"),
    (Chooses((5, 1)), r"next_chunk\(\) chose device index 5"),
    (Chooses((-1, 1)), r"next_chunk\(\) chose device index -1, but the policy lists 1 device"),
    (Chooses((0, 0)), r"next_chunk\(\) chose 0 rows for cpu with 3 rows remaining"),
    (Chooses(None), r"next_chunk\(\) gave no chunk while every device was idle"),
    (Chooses([0, 1]), r"must return \(device index, rows\) or None"),
])
def test_a_python_policys_bad_answers_are_fatal_errors_never_a_hang(elasticity, policy, message):
    model = nd.load_model(elasticity, policy)
    with pytest.raises(nd.FatalError) as caught:
        model.forward({"strain": torch.rand(3, 6)})
    import re

    assert re.search(message, str(caught.value) + "\n" + caught.value.details), str(caught.value)


class Counting(EveryN):
    """Synchronous, counting both questions."""

    def __init__(self, n):
        super().__init__(n)
        self.devices_asked = 0

    def compute_device(self):
        self.devices_asked += 1
        return "cpu"


@pytest.mark.parametrize("rows", [0, 7])
def test_a_synchronous_python_policy_is_asked_once_a_call(elasticity, eager_elasticity, rows):
    # No observer: a small dense forward() may go straight to the graph, and the policy is
    # still asked each question once (as a C++ policy is, and as the simulator asks it).
    policy = Counting(rows)
    model = nd.load_model(elasticity, "elasticity", policy)
    policy.devices_asked, policy.asked = 0, []
    inputs = random_inputs(model, 33, seed=13)
    out = model.forward(inputs)
    assert (policy.devices_asked, policy.asked) == (1, [33])
    check_close(out["stress"], raw(eager_elasticity.call_by_name(inputs)["stress"]), "once")
    model.jacobian(inputs)
    assert (policy.devices_asked, policy.asked) == (2, [33, 33])
    nd.simulate(policy, [{"curve": [(1, 1e6)]}], 33, calls=2)
    assert (policy.devices_asked, policy.asked) == (4, [33, 33, 33, 33])


class InFlight(Shrinking):
    """Asynchronous over the CPU and a GPU, with a bad number of chunks in flight (asked
    when a model is made, before any session loads: no GPU needed to see the refusal)."""

    def __init__(self, answer):
        super().__init__()
        self.answer = answer

    def devices(self):
        return ["cpu", "cuda:0"]

    def chunks_in_flight(self, device):
        return self.answer


class SyncInFlight(EveryN):
    """Synchronous, with chunks in flight as a C++ synchronous policy may have: read too."""
    devices = ["cpu", "cuda:0"]

    def __init__(self, answer):
        super().__init__(0)
        self.answer = answer

    def chunks_in_flight(self, device):
        return self.answer


@pytest.mark.parametrize("policy", [
    Answers(-1), Answers("many"), Answers(2**70), Chooses((5, 1)), Chooses((-1, 1)),
    Chooses((0, 0)), Chooses((0, 4)), Chooses(None), InFlight(0), InFlight(-1), InFlight(2000),
    InFlight("two"), SyncInFlight(0), SyncInFlight(1025),
], ids=repr)
def test_a_model_and_the_simulator_refuse_a_python_policys_bad_answer_alike(elasticity, policy):
    with pytest.raises(nd.FatalError) as by_model:
        nd.load_model(elasticity, policy).forward(
            {"strain": torch.rand(3, 6, dtype=torch.float64)})
    devices = policy.devices() if callable(policy.devices) else policy.devices
    with pytest.raises(nd.FatalError) as by_simulator:
        nd.simulate(policy, [{"curve": [(1, 1e6)]}] * len(devices), 3)
    said = str(by_simulator.value)
    assert "the dispatch policy's" in said or "the Python policy's" in said, said
    assert said in str(by_model.value) + "\n" + by_model.value.details


class Validates(EveryN):
    def __init__(self, raises):
        super().__init__(0)
        self.raises = raises

    def validate(self):
        raise self.raises


def test_a_python_policys_validate_is_asked_at_load_and_in_a_simulation(elasticity):
    for run in (lambda p: nd.load_model(elasticity, p),
                lambda p: nd.simulate(p, [{"curve": [(1, 1e6)]}], 3)):
        with pytest.raises(nd.FatalError, match=r"the Python policy's validate\(\) raised "
                                                 r"ValueError: no such device"):
            run(Validates(ValueError("no such device")))
        # Ctrl-C is Python's, not the library's.
        with pytest.raises(KeyboardInterrupt):
            run(Validates(KeyboardInterrupt()))


def test_a_python_policy_missing_a_method_is_refused_at_load(elasticity):
    class NoChunkRows:
        dispatch_mode = "synchronous"
        devices = ["cpu"]

        def compute_device(self):
            return "cpu"

    with pytest.raises(nd.FatalError, match=r"must provide chunk_rows\(\)"):
        nd.load_model(elasticity, NoChunkRows())

    class BadMode(EveryN):
        dispatch_mode = "sometimes"

    with pytest.raises(nd.FatalError, match=r"dispatch_mode is 'sometimes'"):
        nd.load_model(elasticity, BadMode(3))


class Interrupting(EveryN):
    """Synchronous: raises `raised` from chunk_rows."""

    def __init__(self, raised):
        super().__init__(4)
        self.raised = raised

    def chunk_rows(self, batch):
        raise self.raised


def test_a_base_exception_from_a_python_policy_leaves_the_call_unchanged(elasticity):
    for raised in (KeyboardInterrupt("stop"), SystemExit(3)):
        model = nd.load_model(elasticity, "elasticity", Interrupting(raised))
        with pytest.raises(type(raised)) as caught:
            model.forward({"strain": torch.rand(9, 6)})
        assert caught.value is raised


def test_a_torch_device_is_taken_wherever_a_device_is(elasticity):
    cpu = torch.device("cpu")
    sync = nd.SyncChunking(device=cpu, batch_size=4)
    greedy = nd.GreedyPriorityCapacity(devices=[cpu], batch_sizes=[4])
    assert sync.device == "cpu" and greedy.devices == ["cpu"]
    sync.device, greedy.devices = torch.device("cpu"), [torch.device("cpu")]
    strain = torch.rand(9, 6)
    expected = nd.load_model(elasticity).forward({"strain": strain})
    for policy in (sync, greedy):
        assert torch.equal(nd.load_model(elasticity, policy).forward({"strain": strain})["stress"],
                           expected["stress"])
    tuned = nd.tune(elasticity, devices=cpu, max_rows=64, budget_seconds=0.2, repeats=1,
                    overlap_test=False, lane_test=False)
    assert [d["device"] for d in tuned["devices"]] == ["cpu"]
    # A device the library does not know is still its error, by name.
    with pytest.raises(nd.FatalError, match="cuda:99|not available|no such"):
        nd.load_model(elasticity, nd.SyncChunking(device=torch.device("cuda", 99)))

"""The GIL is released for the whole of every call: another Python thread makes progress
while a long call runs, and calls from several threads run at the same time (their
intervals overlap) with each thread getting its own, correct results."""

import threading
import time

import pytest
import torch

import neml2_dispatch as nd
from conftest import random_inputs


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    # One core for the call, one for the other Python thread (the machine may have two).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def long_call(model, make_call, seconds=0.3):
    """A call of the model that takes at least `seconds`: rows doubled until it does."""
    rows = 1024
    while True:
        call = make_call(model, rows)
        start = time.perf_counter()
        call()
        if time.perf_counter() - start >= seconds or rows >= 1 << 22:
            return call
        rows *= 2


def forward(model, rows):
    inputs = {"strain": torch.rand(rows, 6)}
    return lambda: model.forward(inputs)


def jacobian(model, rows):
    inputs = {"strain": torch.rand(rows, 6)}
    return lambda: model.jacobian(inputs)


def forward_into(model, rows):
    inputs, out = {"strain": torch.rand(rows, 6)}, {"stress": torch.empty(rows, 6)}
    return lambda: model.forward_into(inputs, out)


def prepared(model, rows):
    step, strain = model.prepare(), torch.rand(rows, 6)
    return lambda: step.forward([strain])


class Spinner:
    """Counts in pure Python on its own thread (it needs the GIL for every increment)."""

    def __init__(self):
        self.count, self.stop = 0, False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop:
            self.count += 1

    def rate(self, action):
        before, start = self.count, time.perf_counter()
        action()
        return (self.count - before) / (time.perf_counter() - start)

    def close(self):
        self.stop = True
        self.thread.join()


@pytest.mark.parametrize("make_call", [forward, jacobian, forward_into, prepared])
@pytest.mark.parametrize("policy", ["sync", "greedy"])
def test_another_thread_progresses_during_a_call(elasticity, make_call, policy):
    # Chunks of one row: a long call made of many short graph calls, all in C++.
    p = (nd.SyncChunking(batch_size=1) if policy == "sync"
         else nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[1]))
    model = nd.load_model(elasticity, "elasticity", p)
    call = long_call(model, make_call)
    spinner = Spinner()
    try:
        seconds = time.perf_counter()
        during = spinner.rate(call)
        seconds = time.perf_counter() - seconds
        free = spinner.rate(lambda: time.sleep(seconds))
    finally:
        spinner.close()
    # Holding the GIL, the spinner would count only in the switch interval (5 ms) before
    # the call took it: under 2 % of a 0.3 s call.
    assert during >= 0.2 * free, f"{during:.3g} counts/s during the call, {free:.3g} free"


def test_calls_from_several_threads_overlap_and_get_their_own_results(elasticity):
    model = nd.load_model(elasticity, "elasticity", nd.SyncChunking(batch_size=1))
    threads, calls = 4, 3
    inputs = [random_inputs(model, 4096, seed=k) for k in range(threads)]
    expected = [model.forward(x)["stress"] for x in inputs]
    intervals, results, errors = [[] for _ in range(threads)], [None] * threads, []
    barrier = threading.Barrier(threads)

    def work(k):
        try:
            barrier.wait()
            for _ in range(calls):
                start = time.perf_counter()
                results[k] = model.forward(inputs[k])["stress"]
                intervals[k].append((start, time.perf_counter()))
        except Exception as e:  # reported below
            errors.append(e)

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors
    for k in range(threads):
        assert torch.equal(results[k], expected[k]), f"thread {k} got another thread's results"
    # Time during which at least two calls ran at once: a call that held the GIL would let
    # no other call start, leaving none.
    events = sorted([(s, 1) for iv in intervals for s, _ in iv] +
                    [(e, -1) for iv in intervals for _, e in iv])
    running, last, overlapped, busy = 0, events[0][0], 0.0, 0.0
    for t, step in events:
        if running >= 2:
            overlapped += t - last
        if running >= 1:
            busy += t - last
        running, last = running + step, t
    assert overlapped >= 0.5 * busy, f"calls overlapped {overlapped:.3f} s of {busy:.3f} s"

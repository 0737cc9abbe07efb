"""The GIL is released for the whole of every call: while a call runs, this thread holds
the GIL and never hands it over (a switch interval of 1000 s), and watches the call's
results being written into the caller's tensors. A call that kept the GIL could neither
run nor return while this thread holds it; one that released it writes every row and then
waits, unreturned, for the GIL. No clock decides anything: what is seen is rows written
while the calling threads have not returned.

A caller that releases the GIL may, on a busy machine, finish its whole call and take the
GIL back before this thread is scheduled to take it: such a try shows nothing and is run
again. A call that kept the GIL is never seen in flight, so every try shows nothing and
the test fails.

The garbage collector is off while this thread keeps the GIL: torch releases the GIL to
free a tensor, so a collection that freed one would hand the GIL to a caller waiting for
it."""

import ctypes
import gc
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch

import neml2_dispatch as nd
from conftest import random_inputs

ROWS = 4096  # chunks of one row: a call of thousands of short graph calls, all in C++
# Samples of progress before giving up (seconds; a call of ROWS chunks takes a thousand or
# so): a call that waits for the GIL must not hang the suite.
MAX_SAMPLES = 200_000


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextmanager
def gil_kept_by_this_thread():
    before, collecting = sys.getswitchinterval(), gc.isenabled()
    gc.collect()
    gc.disable()
    sys.setswitchinterval(1000.0)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
        if collecting:
            gc.enable()


class Caller:
    """Runs `call` once on its own thread; `entered` and `returned` as seen from Python."""

    def __init__(self, call):
        self.entered = self.returned = False
        self.error = None
        self.thread = threading.Thread(target=self.run, args=(call,), daemon=True)

    def run(self, call):
        self.entered = True
        try:
            call()
        except Exception as e:  # reported by the test
            self.error = e
        self.returned = True


TRIES = 5  # tries that may show nothing before a test fails


def watch(callers, progress):
    """Starts the callers, lets each into its call, then keeps the GIL until every
    progress() reaches 1 or a caller returns. Returns the progress seen together, or None
    when this thread first held the GIL after a call had finished (the try shows nothing)."""
    samples = []
    with gil_kept_by_this_thread():
        for c in callers:
            c.thread.start()
        while not all(c.entered for c in callers):
            time.sleep(0)  # the one hand-over: a caller takes the GIL, enters, releases it
        for _ in range(MAX_SAMPLES):  # from here this thread holds the GIL
            done = [p() for p in progress]
            returned = any(c.returned for c in callers)
            samples.append((done, returned))
            if all(d == 1 for d in done) or returned:
                break
    for c in callers:
        c.thread.join()
        assert c.error is None, c.error
    first_done, first_returned = samples[0]
    if first_returned or any(d == 1 for d in first_done):
        return None
    return samples


def watch_in_flight(make_try):
    """watch() over the (callers, progress) of make_try() until a try sees the calls in
    flight; fails when none of TRIES does."""
    for _ in range(TRIES):
        samples = watch(*make_try())
        if samples is not None:
            return samples
    pytest.fail(f"in {TRIES} tries a call always returned, or finished its rows, before "
                "this thread first held the GIL: the call kept the GIL")


def written_unreturned(samples):
    """Whether every row was written while no caller had returned, with this thread
    holding the GIL throughout."""
    done, returned = samples[-1]
    return all(d == 1 for d in done) and not returned


def rows_written(tensor):
    """The fraction of rows of `tensor` (zeros before the call, rows written in order) that
    hold results. Read in pure Python (ctypes), keeping the GIL: a torch operation would
    release it."""
    assert tensor.is_contiguous() and tensor.dtype == torch.float64
    per_row, rows = tensor[0].numel(), tensor.shape[0]
    cells = (ctypes.c_double * tensor.numel()).from_address(tensor.data_ptr())

    def written(r):
        return any(cells[r * per_row + k] != 0 for k in range(per_row))

    def progress():
        low, high = 0, rows  # rows below `low` are written, `high` and above are not
        while low < high:
            mid = (low + high) // 2
            low, high = (mid + 1, high) if written(mid) else (low, mid)
        return low / rows

    return progress


# Each makes its tensors first: the caller thread must run no torch operation of its own
# (it would release the GIL, and this thread would keep it).

def forward_into(model):
    x, out = {"strain": torch.rand(ROWS, 6)}, {"stress": torch.zeros(ROWS, 6)}
    return lambda: model.forward_into(x, out), out["stress"]


def jacobian_into(model):
    x = {"strain": torch.rand(ROWS, 6)}
    out, J = {"stress": torch.zeros(ROWS, 6)}, {"stress": {"strain": torch.zeros(6, 6)}}
    return lambda: model.jacobian_into(x, out, J), out["stress"]  # J is (6, 6): elastic


def jvp_into(model):
    x, dx = {"strain": torch.rand(ROWS, 6)}, {"strain": torch.rand(ROWS, 6)}
    out, tangent = {"stress": torch.zeros(ROWS, 6)}, {"stress": torch.zeros(ROWS, 6)}
    return lambda: model.jvp_into(x, dx, out, tangent), tangent["stress"]


def prepared_forward_into(model):
    step, x, out = model.prepare(), torch.rand(ROWS, 6), torch.zeros(ROWS, 6)
    return lambda: step.forward_into([x], [out]), out


@pytest.mark.parametrize("make_call", [forward_into, jacobian_into, jvp_into,
                                       prepared_forward_into])
@pytest.mark.parametrize("policy", ["sync", "greedy"])
def test_a_call_runs_while_another_thread_holds_the_gil(elasticity, make_call, policy):
    p = (nd.SyncChunking(batch_size=1) if policy == "sync"
         else nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[1]))
    model = nd.load_model(elasticity, "elasticity", p)

    def make_try():
        call, target = make_call(model)
        return [Caller(call)], [rows_written(target)]

    samples = watch_in_flight(make_try)
    assert written_unreturned(samples), (
        f"the call wrote {samples[-1][0][0]:.0%} of its rows before it returned, with this "
        "thread holding the GIL: it kept the GIL")


def test_calls_from_several_threads_run_at_once_and_get_their_own_results(elasticity):
    model = nd.load_model(elasticity, "elasticity", nd.SyncChunking(batch_size=1))
    threads = 3
    inputs = [random_inputs(model, ROWS, seed=k) for k in range(threads)]
    expected = [model.forward(x)["stress"] for x in inputs]

    def make_try():
        outs = [torch.zeros(ROWS, 6) for _ in range(threads)]
        callers = [Caller(lambda k=k: model.forward_into(inputs[k], {"stress": outs[k]}))
                   for k in range(threads)]
        make_try.outs = outs
        return callers, [rows_written(o) for o in outs]

    samples = watch_in_flight(make_try)
    assert written_unreturned(samples), f"rows written before the calls returned: {samples[-1]}"
    # At some moment every call was part-way: they ran at the same time, not one by one.
    assert any(all(0 < d < 1 for d in done) for done, _ in samples), (
        "no moment found with every call part-way through its rows")
    for k in range(threads):
        assert torch.equal(make_try.outs[k], expected[k]), (
            f"thread {k} got another thread's results")

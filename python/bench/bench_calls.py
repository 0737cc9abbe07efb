#!/usr/bin/env python3
"""What a call through the Python module costs against the same call in C++ (and against
NEML2's own binding of the compiled model), on linear elasticity (elasticity_forward,
float64, cpu), as bench/bench_sync_chunking.cpp measures the C++ side:

    bench_calls.py ARTIFACTS [BENCH_SYNC_CHUNKING] [--rounds 3]

ARTIFACTS is a main build's artifacts/ folder; BENCH_SYNC_CHUNKING the C++ benchmark
(build/bench/bench_sync_chunking), run between the Python rounds so both see the same
machine. Each figure of a round is the mean time per call over at least 0.5 s of calls (the
statistic Google Benchmark reports); the table gives the least and the median over the
rounds, and the ratios Python / C++ of both. Policies written in Python against the built-in
ones give the cost of one decision taken under the GIL (a synchronous policy decides twice
per call, an asynchronous one three times per chunk and once more to finish). Then 1 to
--threads Python threads calling one model at once: the calls per second of all of them
against one thread's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from neml2.aoti import Model as Neml2Compiled  # before a graph is loaded: see docs/python.md

import neml2_dispatch as nd


def per_call(fn, min_time):
    """Seconds per call: the mean over calls for at least min_time (after one untimed
    call), as Google Benchmark reports the C++ side's real time."""
    fn()
    n, calls, elapsed = 1, 0, 0.0
    while elapsed < min_time:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed += time.perf_counter() - start
        calls += n
        n *= 2
    return elapsed / calls


def python_round(root, results):
    torch.manual_seed(0)
    x1 = 1e-3 * torch.rand(1, 6, dtype=torch.float64)
    whole = nd.load_model(root, "elasticity", nd.SyncChunking())
    step = whole.prepare()
    out1 = {"stress": torch.empty(1, 6, dtype=torch.float64)}
    cases = {
        "py forward/1": lambda: whole.forward({"strain": x1}),
        "py prepared/1": lambda: step.forward([x1]),
        "py forward_into/1": lambda: whole.forward_into({"strain": x1}, out1),
    }
    theirs = Neml2Compiled(str(root))
    cases["neml2.aoti forward/1"] = lambda: theirs.forward({"strain": x1})
    for name, fn in cases.items():
        results.setdefault(name, []).append(per_call(fn, 0.5))

    big = 1 << 20
    xb = 1e-3 * torch.rand(big, 6, dtype=torch.float64)
    chunked = nd.load_model(root, "elasticity", nd.SyncChunking(batch_size=1 << 14))
    outb = {"stress": torch.empty(big, 6, dtype=torch.float64)}
    for name, fn in {"py forward/2^20/whole": lambda: whole.forward({"strain": xb}),
                     "py forward/2^20/16384": lambda: chunked.forward({"strain": xb}),
                     "py forward_into/2^20/16384":
                         lambda: chunked.forward_into({"strain": xb}, outb)}.items():
        results.setdefault(name, []).append(per_call(fn, 1.0))


class PyEveryN:
    """A synchronous policy written in Python: chunks of n rows (0: whole)."""
    dispatch_mode = "synchronous"
    devices = ["cpu"]

    def __init__(self, n):
        self.n = n

    def compute_device(self):
        return "cpu"

    def chunk_rows(self, batch):
        return self.n


class PyFixed:
    """An asynchronous policy written in Python: chunks of n rows, one in flight."""
    dispatch_mode = "asynchronous"
    devices = ["cpu"]

    def __init__(self, n):
        self.n = n

    def next_chunk(self, rows_in_flight, remaining):
        return None if rows_in_flight[0] else (0, min(remaining, self.n))

    def on_dispatched(self, device, rows):
        pass

    def on_completed(self, device, rows, seconds):
        pass


def policy_round(root, results):
    """What the GIL per decision costs: Python policies against the built-in ones."""
    x1 = 1e-3 * torch.rand(1, 6, dtype=torch.float64)
    rows, chunk = 1 << 16, 256
    xc = 1e-3 * torch.rand(rows, 6, dtype=torch.float64)
    cases = {
        "policy SyncChunking/1": (nd.SyncChunking(), x1),
        "policy python sync/1": (PyEveryN(0), x1),
        f"policy SyncChunking/2^16/{chunk}": (nd.SyncChunking(batch_size=chunk), xc),
        f"policy python sync/2^16/{chunk}": (PyEveryN(chunk), xc),
        f"policy Greedy/2^16/{chunk}":
            (nd.GreedyPriorityCapacity(devices=["cpu"], batch_sizes=[chunk]), xc),
        f"policy python async/2^16/{chunk}": (PyFixed(chunk), xc),
    }
    for name, (policy, x) in cases.items():
        model = nd.load_model(root, "elasticity", policy)
        results.setdefault(name, []).append(per_call(lambda: model.forward({"strain": x}), 0.5))


def threads_round(root, results, max_threads):
    """Several Python threads calling one model at once (one intra-op thread each): the
    time per call of all threads together, batch 1 (the binding and the GIL) and 16384."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    model = nd.load_model(root, "elasticity", nd.SyncChunking())
    for batch in (1, 1 << 14):
        x = {"strain": 1e-3 * torch.rand(batch, 6, dtype=torch.float64)}
        calls = max(1, int(0.5 / per_call(lambda: model.forward(x), 0.2)))
        for n in range(1, max_threads + 1):
            barrier = threading.Barrier(n + 1)

            def work():
                barrier.wait()
                for _ in range(calls):
                    model.forward(x)

            pool = [threading.Thread(target=work) for _ in range(n)]
            for t in pool:
                t.start()
            barrier.wait()
            start = time.perf_counter()
            for t in pool:
                t.join()
            results.setdefault(f"threads {n}/{batch}", []).append(
                (time.perf_counter() - start) / (n * calls))
    torch.set_num_threads(before)


def cpp_round(program, results):
    done = subprocess.run(
        [program, "--benchmark_filter=^(dispatched|prepared)/(1|1048576)/(0|16384)/",
         "--benchmark_format=json", "--benchmark_min_time=0.5s"],
        capture_output=True, text=True, check=True)
    for b in json.loads(done.stdout)["benchmarks"]:
        name, batch, chunk = b["name"].split("/")[:3]
        seconds = b["real_time"] * {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b["time_unit"]]
        label = {"1": "1", "1048576": "2^20"}[batch]
        if label == "2^20":
            label += "/whole" if chunk == "0" else "/16384"
        results.setdefault(f"c++ {name}/{label}", []).append(seconds)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("artifacts", type=Path)
    parser.add_argument("cpp_bench", nargs="?")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="the most Python threads calling one model at once")
    args = parser.parse_args()
    root = args.artifacts / "elasticity_forward" / "elasticity"
    torch.set_num_threads(torch.get_num_threads())
    results = {}
    for r in range(args.rounds):
        python_round(root, results)
        policy_round(root, results)
        threads_round(root, results, args.threads)
        if args.cpp_bench:
            cpp_round(args.cpp_bench, results)
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)

    def least(name):
        return min(results[name])

    def median(name):
        return statistics.median(results[name])

    print(f"{'case':32} {'least':>12} {'median':>12}")
    for name in results:
        scale, unit = (1e6, "us") if "/1" == name[-2:] else (1e3, "ms")
        print(f"{name:32} {least(name) * scale:9.2f} {unit} {median(name) * scale:9.2f} {unit}")
    if args.cpp_bench:
        print()
        for py, cpp in [("py forward/1", "c++ dispatched/1"), ("py prepared/1", "c++ prepared/1"),
                        ("py forward/2^20/whole", "c++ dispatched/2^20/whole"),
                        ("py forward/2^20/16384", "c++ dispatched/2^20/16384")]:
            if py in results and cpp in results:
                extra = (least(py) - least(cpp)) * 1e6
                paired = statistics.median(a / b for a, b in zip(results[py], results[cpp]))
                print(f"{py} / {cpp}: {paired:.3f} (median of the rounds' ratios), "
                      f"{median(py) / median(cpp):.3f} (medians), {least(py) / least(cpp):.3f} "
                      f"(least), +{extra:.2f} us (least)")
    chunks = (1 << 16) // 256
    for py, builtin, per in [("policy python sync/1", "policy SyncChunking/1", 2),
                             ("policy python async/2^16/256", "policy Greedy/2^16/256",
                              3 * chunks + 1)]:
        extra = median(py) - median(builtin)
        print(f"{py}: {median(py) / median(builtin):.3f} x {builtin} (median), "
              f"+{extra * 1e6:.1f} us per call, {extra / per * 1e6:.2f} us per decision")
    for batch in (1, 1 << 14):
        one = median(f"threads 1/{batch}")
        print(f"threads calling one model, batch {batch}: " + ", ".join(
            f"{n}: {one / median(f'threads {n}/{batch}'):.2f}x"
            for n in range(1, args.threads + 1)) + " the calls per second of one thread")
    print(f"py forward/1 / neml2.aoti forward/1: "
          f"{median('py forward/1') / median('neml2.aoti forward/1'):.3f} (median)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Ratios from one run of bench/bench_hybrid (Google Benchmark JSON, with repetitions).

    bench_hybrid.py results.json

Prints, from medians of interleaved repetitions: GreedyPriorityCapacity's throughput
against the sum of its devices' throughputs alone (SyncChunking on each, same run), its
time against NEML2's StaticHybridScheduler, ThroughputBalancing's time against the greedy
policy's, and on a GPU the time with capacity 1, 2 and 4 chunks against SyncChunking.
"""

import json
import statistics
import sys
from collections import defaultdict


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    times = defaultdict(list)  # (name, *args) -> real times in ms
    for r in json.load(open(sys.argv[1]))["benchmarks"]:
        if r.get("run_type") != "iteration":
            continue
        name, *args = r["run_name"].split("/")
        args = tuple(int(a) for a in args if a.isdigit())
        scale = {"ns": 1e-6, "us": 1e-3, "ms": 1, "s": 1e3}[r["time_unit"]]
        times[(name, *args)].append(r["real_time"] * scale)
    t = {k: statistics.median(v) for k, v in times.items()}
    reps = min(len(v) for v in times.values())
    print(f"medians of {reps} interleaved repetitions, milliseconds per batch")

    for (name, batch, chunk), greedy in sorted((k, v) for k, v in t.items() if k[0] == "greedy"):
        singles = [t[("sync_cpu", batch, chunk)]]
        if ("sync_cuda", batch, 0) in t:
            singles.append(t[("sync_cuda", batch, 0)])
        summed = 1 / sum(1 / s for s in singles)  # the time if throughputs simply added
        print(f"batch {batch} cpu chunk {chunk}: greedy {greedy:.2f}, single devices "
              f"{', '.join(f'{s:.2f}' for s in singles)}; throughput against their sum "
              f"{summed / greedy:.3f}")
        queued = t.get(("greedy_queued", batch, chunk))
        if queued:
            print(f"  with capacity for two chunks per device {queued:.2f}: throughput against "
                  f"their sum {summed / queued:.3f}")
        into, sync_into = t.get(("greedy_into", batch, chunk)), t.get(("sync_cpu_into", batch, chunk))
        if into and sync_into:
            print(f"  into an output allocated once: greedy {into:.2f}, SyncChunking "
                  f"{sync_into:.2f}: throughput ratio {sync_into / into:.3f}")
        peer = t.get(("neml2_hybrid", batch, chunk))
        if peer:
            print(f"  NEML2 StaticHybridScheduler {peer:.2f}: time ratio greedy/NEML2 "
                  f"{greedy / peer:.3f}")
    balanced = t.get(("balanced", 1 << 20, 0))
    greedy = t.get(("greedy", 1 << 20, 1 << 14))
    if balanced and greedy:
        print(f"ThroughputBalancing {balanced:.2f} against greedy (chunks 16384) {greedy:.2f}: "
              f"time ratio {balanced / greedy:.3f}")
    for k in (1, 2, 4):
        capacity = t.get(("greedy_cuda_capacity", 1 << 22, 0, k))
        sync = t.get(("sync_cuda", 1 << 22, 0))
        if capacity and sync:
            print(f"one GPU, capacity {k} chunk(s): {capacity:.2f} against SyncChunking "
                  f"{sync:.2f}: time ratio {capacity / sync:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

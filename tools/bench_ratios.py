#!/usr/bin/env python3
"""Ratios from one run of bench_sync_chunking (Google Benchmark JSON with repetitions).

    bench_ratios.py results.json

Prints, per batch, the median time of DispatchedModel<SyncChunking>::forward and of the
torch loader's run() on the same graph, their ratio and difference, then the throughput
of 2^20 points in chunks of 2^14 relative to one call on the whole batch.
"""

import json
import statistics
import sys
from collections import defaultdict


def main() -> int:
    runs = json.load(open(sys.argv[1]))["benchmarks"]
    times = defaultdict(list)  # (name, batch, chunk) -> real times in ns
    for r in runs:
        if r.get("run_type") != "iteration":
            continue
        name, batch, chunk = r["run_name"].split("/")[:3]
        scale = {"ns": 1, "us": 1e3, "ms": 1e6, "s": 1e9}[r["time_unit"]]
        times[(name, int(batch), int(chunk))].append(r["real_time"] * scale)
    median = {k: statistics.median(v) for k, v in times.items()}
    reps = min(len(v) for v in times.values())

    print(f"medians of {reps} interleaved repetitions; times in microseconds\n")
    print(f"{'batch':>8} {'loader.run()':>13} {'dispatched':>11} {'ratio':>7} {'overhead':>9}")
    for (name, batch, chunk), t in sorted(median.items(), key=lambda kv: kv[0][1]):
        if name != "loader_run":
            continue
        d = median[("dispatched", batch, 0)]
        print(f"{batch:>8} {t / 1e3:>13.3f} {d / 1e3:>11.3f} {d / t:>7.3f} {(d - t) / 1e3:>+9.3f}")

    big = 1 << 20
    chunked = median[("dispatched", big, 1 << 14)]
    print(f"\n2^20 points in chunks of 2^14: {chunked / 1e6:.2f} ms; throughput relative to "
          f"one call on the whole batch:")
    print(f"  vs loader.run(2^20):          {median[('loader_run', big, 0)] / chunked:.3f}")
    print(f"  vs dispatched, one chunk:     {median[('dispatched', big, 0)] / chunked:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Ratios from one run of a benchmark (Google Benchmark JSON, with repetitions).

    bench_ratios.py results.json BASELINE CANDIDATE

Benchmarks are named NAME/BATCH/CHUNK. For every CANDIDATE case, prints the median real
time of it and of BASELINE on the same batch (same chunk size if BASELINE has one, else
its whole-batch case), their ratio and their difference.
"""

import json
import statistics
import sys
from collections import defaultdict


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    path, baseline, candidate = sys.argv[1:]
    times = defaultdict(list)  # (name, batch, chunk) -> real times in ns
    for r in json.load(open(path))["benchmarks"]:
        if r.get("run_type") != "iteration":
            continue
        parts = r["run_name"].split("/")
        if parts[0] not in (baseline, candidate):  # other benchmarks may be named otherwise
            continue
        name, batch, chunk = parts[:3]
        scale = {"ns": 1, "us": 1e3, "ms": 1e6, "s": 1e9}[r["time_unit"]]
        times[(name, int(batch), int(chunk))].append(r["real_time"] * scale)
    median = {k: statistics.median(v) for k, v in times.items()}
    reps = min(len(v) for v in times.values())

    print(f"{candidate} against {baseline}: medians of {reps} interleaved repetitions, "
          f"microseconds")
    print(f"{'batch':>8} {'chunk':>6} {baseline:>14} {candidate:>14} {'ratio':>7} "
          f"{'difference':>11}")
    for (name, batch, chunk), t in sorted(median.items(), key=lambda kv: kv[0][1:]):
        if name != candidate:
            continue
        base = median.get((baseline, batch, chunk), median.get((baseline, batch, 0)))
        if base is None:
            continue
        print(f"{batch:>8} {chunk:>6} {base / 1e3:>14.3f} {t / 1e3:>14.3f} {t / base:>7.3f} "
              f"{(t - base) / 1e3:>+11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

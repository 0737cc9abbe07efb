#!/usr/bin/env python3
"""`neml2-dispatch tune` on a model with a tiny budget: its tune file parses and holds the
sweep, its plot is a real PNG of the expected size, one progress line per point; then
`run --policy tuned` and `simulate` (text, JSON, timeline PNG) from that file.

  check_cli_tune.py PROGRAM STUB WORKDIR
"""

import json
import os
import struct
import subprocess
import sys


def run(*args):
    done = subprocess.run(args, capture_output=True, text=True, timeout=150)
    if done.returncode != 0:
        sys.exit(f"FAILED ({done.returncode}): {' '.join(args)}\n{done.stdout}\n{done.stderr}")
    return done


def png_size(path):
    """Width and height from the IHDR chunk, after checking the signature."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert head[12:16] == b"IHDR", f"{path} has no IHDR chunk first"
    return struct.unpack(">II", head[16:24])


def main():
    program, stub, work = sys.argv[1:4]
    os.makedirs(work, exist_ok=True)
    tune_file = os.path.join(work, "elasticity.tune.json")
    curves = os.path.join(work, "curves.png")
    for f in (tune_file, curves):
        if os.path.exists(f):
            os.remove(f)
    done = run(program, "tune", stub, "--device", "cpu", "--budget", "3", "--max-rows", "4096",
               "--repeats", "2", "--batch", "4096", "--out", tune_file, "--plot", curves)
    data = json.load(open(tune_file))
    assert data["format"] == "neml2-dispatch tune file" and data["version"] == 2
    assert data["model"] == "elasticity" and data["dtype"] == "float64"
    device = data["devices"][0]
    assert device["device"] == "cpu" and len(device["artifact_hash"]) == 40
    rows = [p["rows"] for p in device["points"]]
    # From --batch / 1024 chunks (4 rows) up to --max-rows.
    assert rows[0] == 4 and max(rows) <= 4096 and rows == sorted(rows), rows
    for p in device["points"]:
        assert p["low"] <= p["median"] <= p["high"] and p["repeats"] == 2, p
    # SyncChunking: the smallest size within 3 % of the best median.
    top = max(p["median"] for p in device["points"])
    best = min(p["rows"] for p in device["points"] if p["median"] >= 0.97 * top)
    assert data["recommendations"]["sync"][0]["batch_size"] == best
    assert device["chunk_overhead"] >= 0
    # Not a terminal: one progress line per point, on stderr.
    lines = [l for l in done.stderr.splitlines() if l.startswith("tune cpu: ")]
    assert len(lines) == len(rows), done.stderr
    assert "recommended policies (C++):" in done.stdout and "neml2::SyncChunking{" in done.stdout
    assert png_size(curves) == (800, 500), png_size(curves)

    done = run(program, "run", stub, "--policy", "tuned", "--tune-file", tune_file, "--batch",
               "5000", "--repeats", "1")
    assert "neml2::GreedyPriorityCapacity{" in done.stdout and "rows/s median" in done.stdout

    timeline = os.path.join(work, "timeline.png")
    sim_json = os.path.join(work, "sim.json")
    done = run(program, "simulate", tune_file, "--pool", "cpu,2xcuda", "--curve",
               "cuda=1024:2e6,65536:6e7", "--batch", "1000000", "--json", sim_json, "--plot",
               timeline)
    sim = json.load(open(sim_json))
    assert [d["name"] for d in sim["devices"]] == ["cpu", "cuda:0", "cuda:1"]
    assert sum(c["rows"] for c in sim["timeline"]) == 1000000
    assert 0 < sim["efficiency"] <= 1
    assert png_size(timeline) == (800, 500)

    # The lane test's overhead from the file goes into every simulated CPU chunk, unless
    # --overhead overrides it: a millisecond per chunk adds chunks x 1 ms to the makespan.
    data["devices"][0]["chunk_overhead"] = 1e-3
    with_overhead = os.path.join(work, "overhead.tune.json")
    json.dump(data, open(with_overhead, "w"))
    makespans = []
    for extra in ([], ["--overhead", "cpu=0"]):
        done = run(program, "simulate", with_overhead, "--pool", "cpu", "--batch", "100000",
                   "--json", sim_json, *extra)
        sim = json.load(open(sim_json))
        makespans.append((sim["makespan"], len(sim["timeline"])))
    (loaded, chunks), (bare, _) = makespans
    assert abs(loaded - bare - chunks * 1e-3) < 1e-9 * chunks, makespans
    print("tune, run and simulate: tune file, plots and timeline check out")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""`neml2-dispatch tune` on a model with a tiny budget, the CPU on 2 lanes: its tune file
parses and holds the sweep and the lanes, its plot is a real PNG of the expected size, one
progress line per point; then `run --policy tuned` (on the file's lanes; other lanes
refused) and `simulate` (text, JSON, timeline PNG, the CPU's lanes) from that file.

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
               "--repeats", "2", "--batch", "4096", "--cpu-lanes", "2", "--out", tune_file,
               "--plot", curves)
    data = json.load(open(tune_file))
    assert data["format"] == "neml2-dispatch tune file" and data["version"] == 3
    assert data["cpu_lanes"] == 2, data["cpu_lanes"]
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
    # On the lanes measured: SyncChunking's size is one lane's, the pool's CPU chunk shared.
    assert data["recommendations"]["sync"][0]["cpu_lanes"] == 2
    pool = data["recommendations"]["pool"]
    assert pool["cpu_lanes"] == 2 and pool["batch_sizes"][0] % 2 == 0, pool
    assert device["chunk_overhead"] >= 0
    # Not a terminal: one progress line per point, on stderr.
    lines = [l for l in done.stderr.splitlines() if l.startswith("tune cpu: ")]
    assert len(lines) == len(rows), done.stderr
    assert "recommended policies (C++):" in done.stdout and "neml2::SyncChunking{" in done.stdout
    assert png_size(curves) == (800, 500), png_size(curves)

    done = run(program, "run", stub, "--policy", "tuned", "--tune-file", tune_file, "--batch",
               "5000", "--repeats", "1")
    assert "neml2::GreedyPriorityCapacity{" in done.stdout and "rows/s median" in done.stdout
    assert ".cpu_lanes = 2}" in done.stdout, done.stdout
    refused = subprocess.run([program, "run", stub, "--policy", "tuned", "--tune-file", tune_file,
                              "--batch", "5000", "--cpu-lanes", "1"],
                             capture_output=True, text=True, timeout=150)
    assert refused.returncode == 1, (refused.returncode, refused.stderr)
    assert ("its cpu_lanes (the lanes its CPU sizes were measured on) is '2', but here it is "
            "'1'" in refused.stderr and "--cpu-lanes 1" in refused.stderr), refused.stderr

    timeline = os.path.join(work, "timeline.png")
    sim_json = os.path.join(work, "sim.json")
    done = run(program, "simulate", tune_file, "--pool", "cpu,2xcuda", "--curve",
               "cuda=1024:2e6,65536:6e7", "--batch", "1000000", "--json", sim_json, "--plot",
               timeline)
    sim = json.load(open(sim_json))
    assert [d["name"] for d in sim["devices"]] == ["cpu", "cuda:0", "cuda:1"]
    assert [d["lanes"] for d in sim["devices"]] == [2, 1, 1]  # the file's CPU lanes
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

    # Other lanes than measured: the curve is one lane's, the pool's CPU chunk shared by 4.
    run(program, "simulate", tune_file, "--pool", "cpu", "--batch", "100000", "--cpu-lanes", "4",
        "--overhead", "cpu=0", "--json", sim_json)
    four = json.load(open(sim_json))
    assert four["devices"][0]["lanes"] == 4
    assert four["makespan"] < bare, (four["makespan"], bare)

    # Lanes out of range: refused before any measurement or simulation.
    for args, status, message in (
            (("tune", stub, "--device", "cpu", "--cpu-lanes", "2000"), 1,
             "tune(): cpu_lanes is 2000; give 0 (torch's intra-op thread count) to 1024"),
            (("simulate", tune_file, "--pool", "cpu", "--batch", "10", "--cpu-lanes", "2000"), 2,
             "--cpu-lanes 2000 is more than 1024, the most a policy asks for")):
        done = subprocess.run([program, *args], capture_output=True, text=True, timeout=150)
        assert done.returncode == status and message in done.stderr, (args, done.returncode,
                                                                      done.stderr)
    print("tune, run and simulate: tune file, plots and timeline check out")


if __name__ == "__main__":
    main()

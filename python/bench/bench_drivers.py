"""NEML2's own driver over a whole strain history, on NEML2's AOTIModel and on the drop-in
(DispatchedAOTIModel), beside the same history through nd.load_model called directly:
nanoseconds per point-step. Each (model, batch) in a process of its own, the runtimes
interleaved within it, the best of --repeats runs each (the JSON has their medians too).

    python python/bench/bench_drivers.py [--artifacts build/artifacts] [--steps 100]
        [--batches 1024 16384 65536] [--threads 1] [--cpu-lanes L] [--repeats 3]
        [--runtimes neml2 drop_in direct] [--chord] [--json out.json]

--chord runs the drop-in and the direct calls with the chord (the solver config's `chord`;
the direct calls pass a NewtonFactors). --threads sets torch's intra-op thread count (NEML2's runtime's, and the lanes of the
drop-in and of the direct calls by default); --cpu-lanes L runs those two on
SyncChunking(cpu_lanes=L) instead.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# name: (artifact, model block, strain input, peak strain): an explicit model, the
# rate-independent J2 radial return, Perzyna and Chaboche viscoplasticity (implicit; Chaboche
# with four unknowns, its peak bench_history's).
CASES = {
    "elasticity": (("elasticity", "elasticity"), "elasticity", "strain", 0.01),
    "j2_radial_return": (("j2_radial_return", "model"), "model", "E", 0.03),
    "perzyna_viscoplasticity": (("perzyna_viscoplasticity", "model"), "model", "E", 0.005),
    "chaboche_viscoplasticity": (("chaboche_viscoplasticity", "model"), "model", "E", 0.02),
}

# The input file (model, strain history, TransientDriver): the example's.
sys.path.insert(0, str(ROOT / "python" / "examples"))
from run_neml2_driver import INPUT  # noqa: E402


RUNTIMES = ("neml2", "drop_in", "direct")


def measure(case, batch, steps, repeats, artifacts, cpu_lanes=None, runtimes=RUNTIMES,
            chord=False):
    """In this process: seconds of each runtime's best run."""
    import neml2
    import torch

    import neml2_dispatch as nd

    torch.set_default_dtype(torch.float64)
    # The drop-in's and the direct calls' (None: SyncChunking() on the load's device).
    policy = None if cpu_lanes is None else nd.SyncChunking(cpu_lanes=cpu_lanes)
    (name, model), block, strain, peak = CASES[case]
    root = Path(artifacts) / name / model
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "history.i"
        path.write_text(INPUT.format(block=block, root=root, steps=steps, batch=batch,
                                     peak=peak, strain=strain))

        def driver_run(switch):
            def run():
                if switch:
                    with nd.dispatch_aoti_models(policy):
                        factory = neml2.load_input(str(path))
                        if chord:
                            model = factory.get_model(block).model
                            config = model.solver_config()
                            config.chord = True
                            model.set_solver_config(config)
                        driver = factory.get_driver("driver")
                else:
                    driver = neml2.load_input(str(path)).get_driver("driver")
                start = time.perf_counter()
                driver.run()
                return time.perf_counter() - start, driver.result()
            return run

        def direct():
            """The same history through nd.load_model's model, by hand: prescribed forces,
            state from the previous step's outputs, zeros for the rest, every step's
            outputs kept."""
            m = nd.load_model(root, policy=policy)
            factors = nd.NewtonFactors() if chord else None
            factory = neml2.load_input(str(path))
            times = factory.get_tensor("times").data
            forces = factory.get_tensor("strains").data
            shapes = dict(zip(m.input_names, m.input_base_shapes))
            state = {n: torch.zeros(batch, *s) for n, s in shapes.items()}
            start = time.perf_counter()
            out, kept = {}, []
            for step in range(1, steps):
                inputs = dict(state)
                for n in shapes:  # old states from the previous step's outputs
                    if n.endswith("~1") and n[:-2] in out:
                        inputs[n] = out[n[:-2]]
                if "t" in shapes:
                    inputs["t"], inputs["t~1"] = times[step], times[step - 1]
                inputs[strain] = forces[step]
                if strain + "~1" in shapes:
                    inputs[strain + "~1"] = forces[step - 1]
                out = m.forward(inputs, factors)
                kept.append(out)  # the history, as a driver keeps it
            return time.perf_counter() - start, None

        runs = {"neml2": driver_run(False), "drop_in": driver_run(True), "direct": direct}
        runs = {k: run for k, run in runs.items() if k in runtimes}
        times = {k: [] for k in runs}
        results = {}
        for repeat in range(repeats + 1):  # interleaved; the first round warms up
            for key, run in runs.items():
                seconds, result = run()
                if repeat:
                    times[key].append(seconds)
                if result is not None:
                    results[key] = result
        best = {k: min(t) for k, t in times.items()}
        final = f"output.{steps - 1}.stress"
        difference = (results["drop_in"][final] - results["neml2"][final]).abs().max().item() \
            if {"neml2", "drop_in"} <= set(results) else None
        return {"case": case, "batch": batch, "steps": steps, "cpu_lanes": cpu_lanes,
                "difference": difference,
                "seconds": best, "median_seconds": {k: statistics.median(t)
                                                    for k, t in times.items()},
                "ns_per_point_step": {k: 1e9 * s / (batch * (steps - 1)) for k, s in best.items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", default=str(ROOT / "build" / "artifacts"))
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1024, 16384, 65536])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpu-lanes", type=int, help="the drop-in's and the direct calls' "
                        "lanes (default: the policy's default, torch's thread count)")
    parser.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=RUNTIMES)
    parser.add_argument("--chord", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # CASE BATCH, in-process
    args = parser.parse_args()
    if args.one:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.steps, args.repeats,
                                 args.artifacts, args.cpu_lanes, args.runtimes, args.chord)))
        return 0
    rows = []
    print(f"{'model':26}{'batch':>8}  {'NEML2 AOTIModel':>16}{'drop-in':>10}{'direct':>10}"
          f"{'NEML2/drop-in':>15}{'drop-in/direct':>16}   (ns per point-step, "
          f"{args.threads} thread(s), {args.steps} steps"
          + (f", ours on {args.cpu_lanes} lane(s)" if args.cpu_lanes is not None else "")
          + (", ours with the chord)" if args.chord else ")"))
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    for case in args.cases:
        for batch in args.batches:
            done = subprocess.run([sys.executable, __file__, "--one", case, str(batch),
                                   "--steps", str(args.steps), "--repeats", str(args.repeats),
                                   "--threads", str(args.threads), "--artifacts", args.artifacts,
                                   "--runtimes", *args.runtimes]
                                  + (["--chord"] if args.chord else [])
                                  + ([] if args.cpu_lanes is None
                                     else ["--cpu-lanes", str(args.cpu_lanes)]),
                                  capture_output=True, text=True, env=env)
            if done.returncode != 0:
                print(f"bench_drivers: {case} at {batch} failed:\n{done.stderr[-3000:]}",
                      file=sys.stderr)
                return 1
            row = json.loads(done.stdout.strip().splitlines()[-1])
            ns = row["ns_per_point_step"]

            def shown(value, width, digits):  # "-" for a runtime not run
                return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

            def ratio(a, b):
                return ns[a] / ns[b] if a in ns and b in ns else None

            difference = row["difference"]
            print(f"{case:26}{batch:>8}  {shown(ns.get('neml2'), 16, 1)}"
                  f"{shown(ns.get('drop_in'), 10, 1)}{shown(ns.get('direct'), 10, 1)}"
                  f"{shown(ratio('neml2', 'drop_in'), 15, 2)}"
                  f"{shown(ratio('drop_in', 'direct'), 16, 2)}"
                  + (f"   (max |diff| {difference:.1e})" if difference is not None else ""))
            rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Load a compiled model, dispatch a batch, tune the chunk size, and plot what happened.

    python dispatch_and_tune.py STUB [--name MODEL] [--batch 262144] [--out figure.png]

STUB is a `<name>_aoti.i` that neml2-compile wrote (build/artifacts/elasticity/
elasticity_aoti.i after the main build). The tuning step sweeps chunk sizes with
neml2_dispatch.tune, saves the tune file and loads its recommendation with
neml2_dispatch.tuned_policy; neml2_dispatch.simulate then plans a node with GPUs from the
CPU's curve. The figure: throughput against chunk size from the sweep, and the chunks of
one call on a timeline, as the observer saw them.
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch

import neml2_dispatch as nd


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stub", type=Path)
    parser.add_argument("--name", default=None, help="the model (optional for one-model stubs)")
    parser.add_argument("--batch", type=int, default=1 << 18)
    parser.add_argument("--out", type=Path, default=Path("dispatch_and_tune.png"))
    args = parser.parse_args()

    # 1. Load and dispatch: chunks of 16384 rows on the CPU.
    model = nd.load_model(args.stub, args.name, nd.SyncChunking(device="cpu", batch_size=16384))
    inputs = {name: 1e-3 * torch.rand(args.batch, *shape, dtype=torch.float64)
              for name, shape in zip(model.input_names, model.input_base_shapes)}
    fixed = []
    model.set_observer(fixed.append)  # each chunk: where, which rows, how long
    start = time.perf_counter()
    outputs = model.forward(inputs)
    print(f"forward of {args.batch} rows: {time.perf_counter() - start:.3f} s in {len(fixed)} "
          "chunks; outputs " + ", ".join(f"{n} {tuple(t.shape)}" for n, t in outputs.items()))

    # 2. Tune: a sweep of chunk sizes (as `neml2-dispatch tune` does), saved as a tune file;
    #    then a node of this CPU and two GPUs like none here, simulated from its curve.
    tune_file = Path(tempfile.mkdtemp()) / "model.tune.json"
    def show(device, point):
        print(f"  {point['rows']:>8} rows: {point['median']:.3g} rows/s")

    result = nd.tune(args.stub, args.name, ["cpu"], batch_rows=args.batch, budget_seconds=10,
                     on_point=show, out=tune_file)
    tuned = nd.tuned_policy(nd.SyncChunking, tune_file, args.stub, args.name)
    print(f"tuned: {tuned}")
    lanes = result["cpu_lanes"]  # the CPU's rates are all its lanes'
    cpu = dict(result["devices"][0], cpu_lanes=lanes)
    gpu = {"curve": [(1024, 1e6), (65536, 2e8), (1 << 20, 1e9)], "chunk_overhead": 20e-6}
    pool = nd.GreedyPriorityCapacity(devices=["cpu", "cuda:0", "cuda:1"],
                                     batch_sizes=[tuned.batch_size * lanes, 65536, 65536],
                                     cpu_lanes=lanes)
    sim = nd.simulate(pool, [cpu, gpu, gpu], 1 << 24)
    print(f"simulated cpu + 2 GPUs, 2^24 rows: {sim['makespan'] * 1e3:.1f} ms, "
          f"{sim['efficiency']:.0%} of ideal")

    # 3. Dispatch with the tuned policy, watching each chunk.
    model = nd.load_model(args.stub, args.name, tuned)
    events = []
    model.set_observer(events.append)
    start = time.perf_counter()
    model.forward(inputs)
    print(f"tuned forward: {time.perf_counter() - start:.3f} s in {len(events)} chunks")

    # 4. Plot: the sweep, and the chunks of the tuned call.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = cpu["points"]  # by increasing rows
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.semilogx([p["rows"] for p in sweep], [p["median"] for p in sweep], "o-")
    left.axvline(tuned.batch_size, color="gray", ls="--", label=f"tuned: {tuned.batch_size}")
    left.set(xlabel="rows per chunk", ylabel="rows per second", title="tune sweep (cpu)")
    left.legend()
    for label, chunks in [("chunks of 16384", fixed), (f"tuned ({tuned.batch_size})", events)]:
        t = 0.0
        for e in sorted(chunks, key=lambda e: e.index):
            right.barh(label, e.seconds * 1e3, left=t * 1e3, edgecolor="white")
            t += e.seconds
    right.set(xlabel="ms (chunks one after another, as the observer saw them)",
              title=f"one call of {args.batch} rows on {tuned.device}")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""NEML2's Kampmann-Wagner example (Al-Cu, a number density over 300 size bins) through
NEML2's compiled runtime, eager NEML2 and ours, a batch pairing two temperatures over a
time history, each step's bins carried into the next:

    kwn_mixed_batch.py KWN.i STUB [--steps 500] [--temperatures 300,360]

KWN.i is the example's input file (doc/content/modules/kwn/ in NEML2's repository; not
shipped here), STUB what `neml2-compile KWN.i --model model_scaled --example-batch-shape
"number_density~1=(2;300)"` writes. Prints, per runtime, the steps that failed, the time
per step, and the largest difference from each temperature run alone; for ours also the
tensor path's time (row_pass = false is what systems over 64 unknowns take anyway).
"""

import argparse
import time

import torch

import neml2
import neml2_dispatch as nd
from neml2.types import Scalar


def history(step, temperatures, steps):
    """Bins after `steps` steps from empty ones, log-spaced times (hours) from 1e-3 to 100;
    the steps whose call failed (their state kept)."""
    rows = len(temperatures)
    T = torch.tensor(temperatures)
    times = torch.cat([torch.zeros(1), torch.logspace(-3, 2, steps)])
    bins, failed, seconds = torch.zeros(rows, 300), [], 0.0
    for k in range(1, steps + 1):
        start = time.perf_counter()
        try:
            bins = step(T, bins, times[k].expand(rows).clone(), times[k - 1].expand(rows).clone())
        except Exception:  # noqa: BLE001 - each runtime's own error type
            failed.append(k)
        seconds += time.perf_counter() - start
    return bins, failed, seconds / steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("input")
    parser.add_argument("stub")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--temperatures", default="300,360")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    temperatures = [float(t) for t in args.temperatures.split(",")]

    ours = nd.load_model(args.stub, "model_scaled", nd.SyncChunking())
    peer = neml2.load_model(args.stub, "model_scaled")._inner
    eager = neml2.load_model(args.input, "model_scaled")

    def named(model):
        return lambda T, n, t, t_old: model.forward(
            {"T": T, "number_density~1": n, "t": t, "t~1": t_old})["number_density"]

    def typed(T, n, t, t_old):
        return eager(Scalar(T), Scalar(n, sub_batch_ndim=1), Scalar(t), Scalar(t_old))[0].data

    for name, step in (("ours", named(ours)), ("peer", named(peer)), ("eager", typed)):
        bins, failed, per_step = history(step, temperatures, args.steps)
        alone = [history(step, [t], args.steps)[0][0] for t in temperatures]
        worst = max((bins[r] - alone[r]).abs().max().item() for r in range(len(temperatures)))
        first = f" from step {failed[0]}" if failed else ""
        print(f"{name:6s} {len(failed):4d} of {args.steps} steps failed{first}; "
              f"{per_step * 1e3:.2f} ms/step; max |mixed - alone| {worst:.2e}")
    config = ours.solver_config()
    config.row_pass = False
    ours.set_solver_config(config)
    print(f"ours, tensor path: {history(named(ours), temperatures, args.steps)[2] * 1e3:.2f} ms/step")


if __name__ == "__main__":
    main()

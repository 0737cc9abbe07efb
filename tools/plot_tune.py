#!/usr/bin/env python3
"""Plots for neml2-dispatch's tuner and simulator.

  plot_tune.py tune FILE.tune.json [FILE2.tune.json ...] --out curves.png
      throughput against batch size, one curve per device (and file), its spread as a
      band, log axes; the recommended sizes marked (best: circle, knee: triangle)
  plot_tune.py timeline SIMULATION.json --out timeline.png
      a simulated pool: one row per device, each chunk a bar (what `neml2-dispatch
      simulate --json` writes)

Images are 8 x 5 inches at 100 dpi (800 x 500 pixels) unless --width/--height say otherwise.
"""

import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def figure(args):
    return plt.figure(figsize=(args.width / args.dpi, args.height / args.dpi), dpi=args.dpi)


def plot_tune(args):
    fig = figure(args)
    ax = fig.add_subplot(1, 1, 1)
    for path in args.files:
        with open(path) as f:
            data = json.load(f)
        recommended = data.get("recommendations", {})
        pool = recommended.get("pool", {})
        for d, device in enumerate(data["devices"]):
            points = [p for p in device["points"] if not p["out_of_memory"]]
            if not points:
                continue
            rows = [p["rows"] for p in points]
            label = f"{data['model']} on {device['device']}" if len(args.files) > 1 else device["device"]
            (line,) = ax.plot(rows, [p["median"] for p in points], "-", marker=".", label=label)
            ax.fill_between(rows, [p["low"] for p in points], [p["high"] for p in points],
                            color=line.get_color(), alpha=0.2, linewidth=0)
            by_rows = {p["rows"]: p["median"] for p in points}
            best = max(points, key=lambda p: p["median"])
            ax.plot([best["rows"]], [best["median"]], "o", color=line.get_color(), markersize=9,
                    markerfacecolor="none", markeredgewidth=2)
            sizes = pool.get("batch_sizes", [])
            if d < len(sizes) and sizes[d] in by_rows:
                ax.plot([sizes[d]], [by_rows[sizes[d]]], "^", color=line.get_color(), markersize=9)
            walls = [p["rows"] for p in device["points"] if p["out_of_memory"]]
            if walls:
                ax.axvline(min(walls), color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows per call (batch size)")
    ax.set_ylabel("rows per second (median, band: lowest to highest)")
    ax.set_title(args.title or "throughput against batch size (o best, ^ knee for a pool)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.savefig(args.out, dpi=args.dpi)


def plot_timeline(args):
    with open(args.files[0]) as f:
        sim = json.load(f)
    fig = figure(args)
    ax = fig.add_subplot(1, 1, 1)
    names = [d["name"] for d in sim["devices"]]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for c in sim["timeline"]:
        y = len(names) - 1 - c["device"]
        if c["compute_start"] > c["start"]:  # copying its rows
            ax.barh(y, c["compute_start"] - c["start"], left=c["start"], height=0.35,
                    color="lightgray", edgecolor="none")
        ax.barh(y, c["end"] - c["compute_start"], left=c["compute_start"], height=0.7,
                color=colors[c["call"] % len(colors)], edgecolor="black", linewidth=0.3)
    ax.axvline(sim["ideal"], color="black", linestyle="--", linewidth=1, label="ideal")
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(list(reversed(names)))
    ax.set_xlabel("seconds (virtual clock)")
    ax.set_title(args.title or f"simulated pool: makespan {sim['makespan']:.3g} s, "
                 f"{100 * sim['efficiency']:.1f} % of ideal ({sim['batch']} rows x {sim['calls']})")
    ax.legend(loc="lower right")
    fig.savefig(args.out, dpi=args.dpi)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["tune", "timeline"])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--title")
    parser.add_argument("--width", type=int, default=800)
    parser.add_argument("--height", type=int, default=500)
    parser.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args()
    try:
        (plot_tune if args.kind == "tune" else plot_timeline)(args)
    except (OSError, KeyError, ValueError, json.JSONDecodeError) as e:
        print(f"plot_tune.py: cannot plot {args.files}: {e!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A NEML2 input file with a driver, run by NEML2 itself on its AOTIModel and then on the
dispatcher by one line (nd.dispatch_aoti_models): the same history, the time of each.

    python python/examples/run_neml2_driver.py build/artifacts/j2_radial_return/model \
        [--strain E] [--steps 50] [--batch 20000]

The input file, written to a temporary folder, holds a [Models] block naming the compiled
model (type = AOTIModel, as neml2-compile's stubs do), a strain history in [Tensors] and a
TransientDriver in [Drivers].
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import neml2
import torch

import neml2_dispatch as nd

# The input file: {block} the model's name in it, {peak} the largest strain of the history.
INPUT = """
[Models]
  [{block}]
    type = AOTIModel
    artifact_path = '{root}'
  []
[]
[Tensors]
  [times]
    type = Python
    expr = 'Scalar(torch.linspace(0, 1, {steps}).unsqueeze(-1).expand({steps}, {batch}).contiguous())'
  []
  [strains]
    type = Python
    expr = 'SR2(torch.linspace(0, 1, {steps}).view({steps}, 1, 1) * {peak} * torch.tensor([1.0, -0.4, -0.3, 0.2, 0.0, 0.1]) * torch.linspace(0.2, 1.0, {batch}).view(1, {batch}, 1))'
  []
[]
[Drivers]
  [driver]
    type = TransientDriver
    model = '{block}'
    prescribed_time = 'times'
    prescribed_SR2_names = '{strain}'
    prescribed_SR2_values = 'strains'
  []
[]
"""


def run(path: Path) -> tuple[float, dict]:
    driver = neml2.load_input(str(path)).get_driver("driver")
    start = time.perf_counter()
    driver.run()
    return time.perf_counter() - start, driver.result()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, help="an artifact root neml2-compile wrote")
    parser.add_argument("--strain", default="E", help="the model's strain input (default E)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=20000)
    args = parser.parse_args()
    if not (args.artifact / "metadata.json").is_file():
        print(f"run_neml2_driver: {args.artifact} is not an artifact root (no metadata.json)",
              file=sys.stderr)
        return 1
    torch.set_default_dtype(torch.float64)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "history.i"
        path.write_text(INPUT.format(block="model", root=args.artifact.resolve(), peak=0.03,
                                     steps=args.steps, batch=args.batch, strain=args.strain))
        run(path)  # once untimed: the first run of a process imports what torch lazily needs
        theirs_seconds, theirs = run(path)
        with nd.dispatch_aoti_models(nd.SyncChunking(batch_size=16384)):  # the one line
            ours_seconds, ours = run(path)
    last = f"output.{args.steps - 1}.stress"
    difference = (ours[last] - theirs[last]).abs().max().item()
    scale = theirs[last].abs().max().item()
    print(f"{args.steps} steps of {args.batch} points: NEML2's AOTIModel {theirs_seconds:.2f} s, "
          f"on the dispatcher {ours_seconds:.2f} s ({theirs_seconds / ours_seconds:.2f}x); "
          f"final stress differs by {difference / scale:.1e} (relative)")
    return 0 if difference <= 1e-9 * scale else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Reference values from eager NEML2 (the Python model, not the compiled graphs).

    make_reference.py INPUT.i --model NAME --out DIR [--derivatives] [--param QNAME ...]
    make_reference.py INPUT.i --model NAME --out DIR --batch N [--batch M ...]

Writes DIR/reference.json (name -> offset, shape, dtype) and DIR/reference.bin (the raw
little-endian values), which tests/support/reference.hpp reads. Tensors are named
"<case>/<kind>/<variable>":

  b<N>/in/<x>, b<N>/out/<y>            forward at batch N (1, 2, 7, 33)
  b<N>/tangent/<x>, b<N>/jvp/<y>       jvp along random tangents   (--derivatives)
  b<N>/jac/<y>/<x>                     Jacobian blocks (B, *y, *x) (--derivatives)
  bcast/...                            the first input batched (B=5), the rest unbatched
  b<N>/pjac/<y>/<p>, b<N>/cot/<y>,     parameter Jacobian, cotangents and the parameter
  b<N>/pvjp/<p>                        VJP summed over the batch    (--param)
  set/...                              forward after set_parameter (--param)
  pbatch/...                           the first parameter batched (B=7): forward and the
                                       per-row VJP (from the eager parameter Jacobian)

    make_reference.py INPUT.i --model NAME --out DIR --history STEPS [--derivatives]

For implicit models: a strain-driven history of STEPS steps over HISTORY_ROWS rows whose
loads range from elastic to far past yield. Each row is solved by eager NEML2 on its own
(batch 1), so its Newton iterations are its own, as they are in a per-row solver:

  s<n>/in/<x>, s<n>/out/<y>, s<n>/jac/<y>/<x>   step n = 0, 1, ...
"""

import argparse
import json
import sys
from pathlib import Path

import torch

import neml2

BATCHES = [1, 2, 7, 33]


def raw(x):
    return x.data if hasattr(x, "data") and not isinstance(x, torch.Tensor) else x


class Store:
    def __init__(self):
        self.index, self.blobs, self.offset = {}, [], 0

    def put(self, name, t):
        t = raw(t).detach().to(torch.float64).contiguous().cpu()
        data = t.numpy().tobytes()
        self.index[name] = {"offset": self.offset, "shape": list(t.shape), "dtype": "float64"}
        self.blobs.append(data)
        self.offset += len(data)

    def write(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        (out / "reference.bin").write_bytes(b"".join(self.blobs))
        (out / "reference.json").write_text(json.dumps(self.index, indent=1))


SUB_BATCH = {}  # input name -> sub-batch shape (--sub-batch)


def random_inputs(model, batch, gen, unbatched=()):
    """One value per input: `(batch, *sub, *base)`, or `(*sub, *base)` for names in
    `unbatched`. Old-state inputs (`x~1`) are drawn lower than current ones, so rates stay
    finite."""
    values = {}
    for name, typ in model.input_spec.items():
        base = [*SUB_BATCH.get(name, []), *typ.BASE_SHAPE]
        shape = base if name in unbatched else [batch, *base]
        low, high = (0.0, 0.4) if name.endswith("~1") else (0.6, 1.6)
        values[name] = low + (high - low) * torch.rand(shape, generator=gen)
    return values


def expanded(values, batch):
    """Unbatched values broadcast to the batch, for the eager model (which takes the
    sub-batch axes as more batch axes)."""
    return {n: v if v.dim() > 0 and v.shape[0] == batch else v.expand(batch, *v.shape)
            for n, v in values.items()}


def eager_name(model, qualified, model_name):
    names = dict(model.named_parameters())
    if qualified in names:
        return qualified
    prefix = model_name + "."
    if qualified.startswith(prefix) and qualified[len(prefix):] in names:
        return qualified[len(prefix):]
    sys.exit(f"parameter {qualified} not found in the eager model ({', '.join(names)})")


def forward_case(store, model, case, inputs, batch):
    for name, v in inputs.items():
        store.put(f"{case}/in/{name}", v)
    outputs = model.call_by_name(expanded(inputs, batch))
    for name, v in outputs.items():
        store.put(f"{case}/out/{name}", v)


def derivative_case(store, model, case, inputs, batch, gen):
    full = expanded(inputs, batch)
    _, jac = model.jacobian(full)
    for out, blocks in jac.items():
        for inp, block in blocks.items():
            store.put(f"{case}/jac/{out}/{inp}", block)
    # Tangents for all inputs but the last (a missing tangent counts as zero).
    names = list(inputs)
    tangents = {n: torch.rand(full[n].shape, generator=gen) - 0.5 for n in names[:-1] or names}
    _, jvp = model.jvp(full, tangents)
    for name, v in tangents.items():
        store.put(f"{case}/tangent/{name}", v)
    for name, v in jvp.items():
        store.put(f"{case}/jvp/{name}", v)


def parameter_case(store, model, case, inputs, batch, params, gen, model_name):
    eager = [eager_name(model, p, model_name) for p in params]
    _, pjac = model.param_jacobian(inputs, eager)
    cot = {}
    for out, blocks in pjac.items():
        for p, e in zip(params, eager):
            store.put(f"{case}/pjac/{out}/{p}", blocks[e])
    outputs = model.call_by_name(inputs)
    for name, v in outputs.items():
        cot[name] = torch.rand(raw(v).shape, generator=gen) - 0.5
        store.put(f"{case}/cot/{name}", cot[name])
    grads = model.param_vjp(inputs, cot, eager)
    for p, e in zip(params, eager):
        store.put(f"{case}/pvjp/{p}", grads[e])
    return pjac, cot


HISTORY_ROWS = 20


STRAIN_PER_STEP = 0.008  # the largest row's strain increment (--strain-per-step)


def history_force(name, shape, step, rows):
    """The prescribed value of a force at a step: a strain ramp whose size grows across
    rows (the first rows stay elastic, the last go far past yield), the time, or a per-row
    constant for anything else."""
    frac = torch.linspace(0.0, 1.0, rows).reshape(rows, *([1] * len(shape)))
    if name == "t":
        return torch.full((rows,), 0.1 * step)
    if len(shape) == 1 and shape[0] == 6:  # a strain: uniaxial-ish, rotating per row
        direction = torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0]).expand(rows, 6).clone()
        direction[:, 3] = 0.3 * frac[:, 0]
        return STRAIN_PER_STEP / 1.05 * step * (0.05 + frac) * direction
    return (0.5 + frac).reshape(rows, *shape).expand(rows, *shape).clone()


def history_case(store, model, steps, derivatives):
    rows = HISTORY_ROWS
    spec = {name: list(typ.BASE_SHAPE) for name, typ in model.input_spec.items()}
    outputs = set(model.output_spec)
    previous = {}
    for step in range(steps):
        inputs = {}
        for name, shape in spec.items():
            base = name[:-2] if name.endswith("~1") else name
            if name.endswith("~1") and base in outputs:
                inputs[name] = previous.get(base, torch.zeros(rows, *shape))
            elif name.endswith("~1") and base in spec:
                inputs[name] = history_force(base, spec[base], step, rows)
            elif name.endswith("~1") or name in outputs:  # old unknowns, initial guesses
                inputs[name] = previous.get(base, torch.zeros(rows, *shape))
            else:
                inputs[name] = history_force(name, shape, step + 1, rows)
        case = f"s{step}"
        for name, v in inputs.items():
            store.put(f"{case}/in/{name}", v)
        results, jacobians = {}, {}
        for r in range(rows):  # one row per solve: its own Newton iterations
            row = {n: v[r : r + 1] for n, v in inputs.items()}
            for name, v in model.call_by_name(row).items():
                results.setdefault(name, []).append(raw(v).detach())
            if derivatives:
                _, jac = model.jacobian(row)
                for out, blocks in jac.items():
                    for inp, block in blocks.items():
                        jacobians.setdefault((out, inp), []).append(raw(block).detach())
        for name, parts in results.items():
            previous[name] = torch.cat(parts)
            store.put(f"{case}/out/{name}", previous[name])
        for (out, inp), parts in jacobians.items():
            store.put(f"{case}/jac/{out}/{inp}", torch.cat(parts))


def main():
    global STRAIN_PER_STEP
    parser = argparse.ArgumentParser()
    parser.add_argument("input")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--derivatives", action="store_true")
    parser.add_argument("--param", action="append", default=[])
    parser.add_argument("--sub-batch", action="append", default=[], metavar="NAME=N",
                        help="give input NAME a sub-batch axis of size N")
    parser.add_argument("--batch", type=int, action="append",
                        help="forward cases at these batch sizes only (default: "
                             "all the cases above)")
    parser.add_argument("--history", type=int, metavar="STEPS",
                        help="a load history of STEPS steps (implicit models)")
    parser.add_argument("--strain-per-step", type=float, default=STRAIN_PER_STEP,
                        help="the largest strain increment of a --history")
    args = parser.parse_args()

    for spec in args.sub_batch:
        name, size = spec.split("=")
        SUB_BATCH[name] = [int(size)]
    torch.set_default_dtype(torch.float64)
    gen = torch.Generator().manual_seed(20261129)
    model = neml2.load_model(args.input, args.model)
    store = Store()

    if args.history:
        STRAIN_PER_STEP = args.strain_per_step
        history_case(store, model, args.history, args.derivatives)
        store.write(Path(args.out))
        return 0

    if args.batch:
        for batch in args.batch:
            forward_case(store, model, f"b{batch}", random_inputs(model, batch, gen), batch)
        store.write(Path(args.out))
        return 0

    for batch in BATCHES:
        case = f"b{batch}"
        inputs = random_inputs(model, batch, gen)
        forward_case(store, model, case, inputs, batch)
        if args.derivatives:
            derivative_case(store, model, case, inputs, batch, gen)
        if args.param:
            parameter_case(store, model, case, inputs, batch, args.param, gen, args.model)

    names = list(model.input_spec)
    inputs = random_inputs(model, 5, gen, unbatched=names[1:])
    forward_case(store, model, "bcast", inputs, 5)
    if args.derivatives:
        derivative_case(store, model, "bcast", inputs, 5, gen)

    if args.param:
        # New values for every parameter, then forward.
        for p in args.param:
            e = eager_name(model, p, args.model)
            value = dict(model.named_parameters())[e].detach() * 1.5
            store.put(f"set/param/{p}", value)
            model.set_parameter(e, value)
        forward_case(store, model, "set", random_inputs(model, 7, gen), 7)

        # The first parameter batched: one value per row.
        batch, p0 = 7, args.param[0]
        e0 = eager_name(model, p0, args.model)
        base = dict(model.named_parameters())[e0].detach()
        per_row = base * (1 + torch.arange(batch, dtype=torch.float64).reshape(
            batch, *([1] * base.dim())) / 10)
        model.set_parameter(e0, per_row)
        for p in args.param:
            store.put(f"pbatch/param/{p}", dict(model.named_parameters())[eager_name(model, p, args.model)])
        inputs = random_inputs(model, batch, gen)
        forward_case(store, model, "pbatch", inputs, batch)
        pjac, cot = parameter_case(store, model, "pbatch", inputs, batch, args.param, gen,
                                   args.model)
        # Per-row gradient of the batched parameter: sum over outputs of cot . dy/dp.
        grad = 0
        for out, blocks in pjac.items():
            block = raw(blocks[e0])
            c = cot[out].reshape(batch, -1, *([1] * base.dim()))
            grad = grad + (c * block.reshape(batch, c.shape[1], *base.shape)).sum(1)
        store.put(f"pbatch/pvjp_rows/{p0}", grad)

    store.write(Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

--strain-direction gives the strain's direction (default uniaxial-ish), --initial NAME=VALUE
a state's start (default zero: models/gtn_viscoplasticity.i's voids grow only from a
nonzero void fraction).

With --sub-batch NAME=N, the old state NAME has N sub-batch entries (bins) per row, given
to eager NEML2 as such; the solved state carries them into the next step.

    make_reference.py binned_dissolution.i --model model --out DIR --mixed-batch ...

After the history, for models/binned_dissolution.i: a point frozen where its Jacobian is
NaN (T = 0.001, every bin at 0.125) beside a point of the history's last row, solved by
eager NEML2 each alone and then together (NEML2's Newton shares one convergence test):

  mixed/in/<x>, mixed/out/<y> (each point alone), mixed/eager_batched_failed (1 or 0)

    make_reference.py INPUT.i --model NAME --out DIR --line-search

For the scalar backward-Euler model (x + dt x^2 = x~1 + dt a, dt = 10, from initial
guesses around the turning point x = -1/(2 dt), where full Newton steps overshoot): each
row solved on its own by eager NEML2 with each line search of LINE_SEARCHES, its
settings stored beside it; a row that fails is NaN:

  <case>/in/<x>, <case>/out/<y>, <case>/config   config: miters, ls_max_iters, cutback, c

and NEML2's own Newton loop (neml2.aoti newton_solve_eager, which eager NEML2 and its
runtime share) on r(u) = atan(u) from each start of NEWTON_STARTS, one row at a time, with
each setting of NEWTON_PATHS, recording every residual evaluation after the first (the
line-search trial points) and the end:

  newton/starts, newton/<case>/config   atol, miters, ls_max_iters, cutback, c, strong
                                        Wolfe (1) or not
  newton/<case>/<start>/trials, newton/<case>/<start>/u (NaN if it failed)

    make_reference.py INPUT.i --model NAME --out DIR --substeps

For an implicit model compiled with max_substepping_level = L (eager NEML2 refuses to
substep): each row's step solved by eager NEML2 with substepping off, driven by NEML2's
adaptive bisection written out here (a span that fails is halved, down to 2^-L of the step;
after a span converges the next is the rest of its parent span), forces ramped from their
`~1` value, old states chained from span to span. A row failing at depth L is NaN:

  sub/in/<x>, sub/out/<y>, sub/spans (the number of spans each row took; 0 if it failed)
"""

import argparse
import json
import os
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
STRAIN_DIRECTION = [1.0, -0.5, -0.5, 0.0, 0.0, 0.0]  # uniaxial-ish (--strain-direction)
INITIAL = {}  # the start of a state other than zero (--initial NAME=VALUE)


def history_force(name, shape, step, rows):
    """The prescribed value of a force at a step: a strain ramp whose size grows across
    rows (the first rows stay elastic, the last go far past yield), the time, or a per-row
    constant for anything else."""
    frac = torch.linspace(0.0, 1.0, rows).reshape(rows, *([1] * len(shape)))
    if name == "t":
        return torch.full((rows,), 0.1 * step)
    if len(shape) == 1 and shape[0] == 6:  # a strain along STRAIN_DIRECTION, rotating per row
        direction = torch.tensor(STRAIN_DIRECTION).expand(rows, 6).clone()
        direction[:, 3] = 0.3 * frac[:, 0]
        return STRAIN_PER_STEP / 1.05 * step * (0.05 + frac) * direction
    return (0.5 + frac).reshape(rows, *shape).expand(rows, *shape).clone()


def with_sub_batch(model, values):
    """Values of sub-batched inputs (--sub-batch) as typed wrappers that say so: eager NEML2
    takes the axes of a raw tensor as batch axes, which a model that sums over its bins
    must not see."""
    return {n: model.input_spec[n](v, sub_batch_ndim=len(SUB_BATCH[n])) if n in SUB_BATCH else v
            for n, v in values.items()}


def history_case(store, model, steps, derivatives):
    rows = HISTORY_ROWS
    spec = {name: [*SUB_BATCH.get(name, []), *typ.BASE_SHAPE]
            for name, typ in model.input_spec.items()}
    outputs = set(model.output_spec)
    previous = {name: torch.full((rows, *spec[name + "~1"]), value)
                for name, value in INITIAL.items()}
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
            for name, v in model.call_by_name(with_sub_batch(model, row)).items():
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
    return previous


FROZEN_DENSITY = 0.125  # where binned_dissolution.i's dissolution term has no derivative


def mixed_batch_case(store, model, previous):
    """A frozen point beside a moving one: each alone, then the two in one eager call."""
    moving = previous["number_density"][-1:]
    inputs = {"T": torch.tensor([0.001, 1.0]),
              "number_density~1": torch.cat([torch.full_like(moving, FROZEN_DENSITY), moving]),
              "t": torch.full((2,), 1.0), "t~1": torch.full((2,), 0.9)}
    for name, v in inputs.items():
        store.put(f"mixed/in/{name}", v)
    alone = [model.call_by_name(with_sub_batch(model, {n: v[r:r + 1] for n, v in inputs.items()}))
             for r in range(2)]
    for name in alone[0]:
        store.put(f"mixed/out/{name}", torch.cat([raw(a[name]).detach() for a in alone]))
    try:
        model.call_by_name(with_sub_batch(model, inputs))
        failed = 0.0
    except Exception:  # noqa: BLE001 - eager NEML2's solver error, whatever its type
        failed = 1.0
    store.put("mixed/eager_batched_failed", torch.tensor([failed]))


# name -> (NEML2 linesearch_type or None, miters, max_linesearch_iterations, cutback, c)
LINE_SEARCHES = {
    "ls_none": (None, 6, 1, 2.0, 1e-3),
    "ls_backtracking": ("BACKTRACKING", 6, 20, 2.0, 0.3),
    "ls_strong_wolfe": ("STRONG_WOLFE", 6, 20, 2.0, 0.3),
    "ls_strong_wolfe_short": ("STRONG_WOLFE", 6, 3, 3.0, 0.5),
}


def solve_rows(model, inputs):
    """Each row on its own (its own Newton iterations); NaN where eager NEML2 fails."""
    rows = next(iter(inputs.values())).shape[0]
    results = {}
    for r in range(rows):
        row = {n: v[r : r + 1] for n, v in inputs.items()}
        try:
            out = {n: raw(v).detach() for n, v in model.call_by_name(row).items()}
        except neml2.solvers.ConvergenceError:
            out = {n: torch.full((1, *typ.BASE_SHAPE), float("nan"))
                   for n, typ in model.output_spec.items()}
        for n, v in out.items():
            results.setdefault(n, []).append(v)
    return {n: torch.cat(parts) for n, parts in results.items()}


def line_search_cases(store, model):
    from neml2.solvers import DenseLU, Newton, NewtonWithLineSearch

    guesses = torch.linspace(-0.3, 0.1, 41)
    rows = guesses.shape[0]
    inputs = {"x": guesses, "a": torch.ones(rows), "x~1": torch.full((rows,), 0.5),
              "t": torch.full((rows,), 10.0), "t~1": torch.zeros(rows)}
    for case, (ls_type, miters, ls_iters, cutback, c) in LINE_SEARCHES.items():
        if ls_type is None:
            model.solver = Newton(linear_solver=DenseLU(), miters=miters)
        else:
            model.solver = NewtonWithLineSearch(
                linear_solver=DenseLU(), miters=miters, linesearch_type=ls_type,
                max_linesearch_iterations=ls_iters, linesearch_cutback=cutback,
                linesearch_stopping_criteria=c)
        store.put(f"{case}/config", torch.tensor([miters, ls_iters, cutback, c]))
        for name, v in inputs.items():
            store.put(f"{case}/in/{name}", v)
        for name, v in solve_rows(model, inputs).items():
            store.put(f"{case}/out/{name}", v)


# name -> (ls_type, atol, miters, ls_max_iters, cutback, c)
NEWTON_PATHS = {
    "bt": ("BACKTRACKING", 1e-10, 30, 10, 2.0, 1e-3),
    "sw": ("STRONG_WOLFE", 1e-10, 30, 10, 2.0, 1e-3),
    "bt_short": ("BACKTRACKING", 1e-10, 8, 3, 2.0, 1e-3),
    "sw_steep": ("STRONG_WOLFE", 1e-10, 30, 6, 3.0, 0.5),
    "bt_steep": ("BACKTRACKING", 1e-10, 30, 6, 3.0, 0.5),
    "sw_atol": ("STRONG_WOLFE", 1e-3, 30, 4, 2.0, 2.0),
}
NEWTON_STARTS = [20.0, 3.0, 1.5, -2.0, 0.5, 0.1]


def newton_paths(store):
    from neml2.aoti._aoti import newton_solve_eager

    store.put("newton/starts", torch.tensor(NEWTON_STARTS))
    for case, (ls_type, atol, miters, ls_iters, cutback, c) in NEWTON_PATHS.items():
        store.put(f"newton/{case}/config",
                  torch.tensor([atol, miters, ls_iters, cutback, c, ls_type == "STRONG_WOLFE"]))
        for k, start in enumerate(NEWTON_STARTS):
            trials = []

            def residual_fn(u):
                trials.append(u[0].flatten().clone())
                return [-torch.atan(u[0])]

            def step_fn(u):
                b = -torch.atan(u[0])
                return [b * (1 + u[0] * u[0])], [b]

            try:
                u, converged, _, _ = newton_solve_eager(
                    residual_fn=residual_fn, step_fn=step_fn, unknown_layout=[("dense", [])],
                    residual_layout=[("dense", [])], u0=[torch.tensor([[start]])], atol=atol,
                    rtol=1e-8, miters=miters, ls_type=ls_type, ls_max_iters=ls_iters,
                    ls_cutback=cutback, ls_c=c)
                end = u[0].flatten() if converged else torch.tensor([float("nan")])
            except neml2.solvers.ConvergenceError:
                end = torch.tensor([float("nan")])
            store.put(f"newton/{case}/{k}/trials", torch.cat(trials[1:]) if len(trials) > 1
                      else torch.zeros(0))
            store.put(f"newton/{case}/{k}/u", end)


def substep_roles(model):
    """NEML2's substepping roles by name: u~1 of an output chains (old state), f~1 of an
    input and that input ramp over the step (old / current force), the rest stay."""
    inputs, outputs = list(model.input_spec), set(model.output_spec)
    roles = {}
    for name in inputs:
        base = name[:-2] if name.endswith("~1") else name
        if name.endswith("~1") and base in outputs:
            roles[name] = ("old_state", base)
        elif name.endswith("~1") and base in inputs:
            roles[name] = ("old_force", base)
        elif name in outputs:
            roles[name] = ("guess", None)
        elif base + "~1" in inputs:
            roles[name] = ("cur_force", base + "~1")
        else:
            roles[name] = ("static", None)
    return roles


def substep_cases(store, model):
    from neml2.models.common.ImplicitUpdate import ImplicitUpdate

    levels = [m.max_substepping_level for m in model.modules() if isinstance(m, ImplicitUpdate)]
    if not levels or max(levels) <= 0:
        sys.exit("--substeps needs a model with an ImplicitUpdate with max_substepping_level > 0")
    depth_max = max(levels)
    for m in model.modules():  # eager NEML2 refuses to substep: the spans are driven here
        if isinstance(m, ImplicitUpdate):
            m.max_substepping_level = 0
    roles = substep_roles(model)

    # The scalar model: a from converging in one step to failing at every depth, from two
    # old states, with and without a time offset (so t~1 ramps too).
    a = torch.tensor([1.0, -12.0, -45.0, -50.0, -55.0, -60.0, -70.0, -80.0, -90.0, -100.0,
                      -150.0, -1000.0])
    cases = [(ai, x_old, t_old) for ai in a.tolist() for x_old in (0.5, 1.0) for t_old in (0.0, 0.3)]
    inputs = {"a": torch.tensor([c[0] for c in cases]), "x~1": torch.tensor([c[1] for c in cases]),
              "t~1": torch.tensor([c[2] for c in cases])}
    inputs["t"] = inputs["t~1"] + 0.1
    inputs["x"] = inputs["x~1"].clone()  # the initial guess
    rows = len(cases)
    units = 2**depth_max

    outputs, spans = {}, []
    for r in range(rows):
        full = {n: v[r : r + 1] for n, v in inputs.items()}
        state = dict(full)  # old states and the guess carried from span to span
        pos, size, depth, count, failed = 0, units // 2, 1, 0, False
        attempt = {n: full[n] for n in full}
        try:  # the whole step first
            solution = {n: raw(v).detach() for n, v in model.call_by_name(attempt).items()}
            pos, count = units, 1
        except neml2.solvers.ConvergenceError:
            solution = None
        while pos < units:
            begin, end = pos / units, (pos + size) / units
            attempt = {}
            for n, (role, pair) in roles.items():
                if role == "cur_force":
                    attempt[n] = torch.lerp(full[pair], full[n], end)
                elif role == "old_force":
                    attempt[n] = torch.lerp(full[n], full[pair], begin)
                else:
                    attempt[n] = state[n]
            try:
                solution = {n: raw(v).detach() for n, v in model.call_by_name(attempt).items()}
            except neml2.solvers.ConvergenceError:
                if depth == depth_max:
                    failed = True
                    break
                size, depth = size // 2, depth + 1
                continue
            for n, (role, pair) in roles.items():
                if role == "old_state":
                    state[n] = solution[pair]
                elif role == "guess":
                    state[n] = solution[n]
            pos, count = pos + size, count + 1
            while depth > 0 and pos % (2 * size) == 0:
                size, depth = size * 2, depth - 1
        if failed:
            solution = {n: torch.full((1, *typ.BASE_SHAPE), float("nan"))
                        for n, typ in model.output_spec.items()}
            count = 0
        for n, v in solution.items():
            outputs.setdefault(n, []).append(v)
        spans.append(count)
    for name, v in inputs.items():
        store.put(f"sub/in/{name}", v)
    for name, parts in outputs.items():
        store.put(f"sub/out/{name}", torch.cat(parts))
    store.put("sub/spans", torch.tensor(spans, dtype=torch.float64))


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
    parser.add_argument("--mixed-batch", action="store_true",
                        help="after the history, a frozen point beside a moving one "
                             "(binned_dissolution.i)")
    parser.add_argument("--strain-per-step", type=float, default=STRAIN_PER_STEP,
                        help="the largest strain increment of a --history")
    parser.add_argument("--strain-direction", default=None, metavar="A,B,C,D,E,F",
                        help="the strain's direction in a --history (Mandel components)")
    parser.add_argument("--initial", action="append", default=[], metavar="NAME=VALUE",
                        help="the state NAME starts a --history at VALUE (default zero)")
    parser.add_argument("--line-search", action="store_true",
                        help="the line-search cases (the scalar backward-Euler model)")
    parser.add_argument("--substeps", action="store_true",
                        help="the substepping cases (the scalar model, substepping on)")
    args = parser.parse_args()

    for spec in args.sub_batch:
        name, size = spec.split("=")
        SUB_BATCH[name] = [int(size)]
    torch.set_default_dtype(torch.float64)
    gen = torch.Generator().manual_seed(20261129)
    model = neml2.load_model(args.input, args.model)
    store = Store()

    if args.history or args.line_search or args.substeps:
        STRAIN_PER_STEP = args.strain_per_step
        if args.strain_direction:
            STRAIN_DIRECTION[:] = [float(c) for c in args.strain_direction.split(",")]
        for spec in args.initial:
            name, value = spec.split("=")
            INITIAL[name] = float(value)
        if args.history:
            previous = history_case(store, model, args.history, args.derivatives)
            if args.mixed_batch:
                mixed_batch_case(store, model, previous)
        if args.substeps:
            substep_cases(store, model)
        if args.line_search:
            line_search_cases(store, model)
            newton_paths(store)
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


def cached_main():
    """main(), its result cached beside the compiled artifacts (keyed by the input, the
    options, this script and the neml2/torch versions): every build folder of a machine,
    sanitizer builds included, reuses it."""
    import hashlib
    import shutil
    from importlib import metadata
    argv = sys.argv[1:]
    if "--out" not in argv or not argv:
        return main()
    i = argv.index("--out")
    out = Path(argv[i + 1])
    options = argv[:i] + argv[i + 2:]
    h = hashlib.sha256()
    for part in [Path(options[0]).read_bytes(), "\0".join(options[1:]).encode(),
                 Path(__file__).read_bytes(), metadata.version("neml2").encode(),
                 metadata.version("torch").encode()]:
        h.update(part)
        h.update(b"\0")
    root = Path(os.environ.get("NEML2_DISPATCH_CACHE",
                               Path.home() / ".cache" / "neml2-dispatch")) / "references"
    entry = root / h.hexdigest()[:20]
    if not entry.is_dir():
        import time
        start = time.monotonic()
        result = main()
        if result:
            return result
        print(f"eager NEML2 references for {out.name} took {time.monotonic() - start:.0f} s",
              flush=True)
        tmp = root / f"{entry.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(out, tmp)
        try:
            tmp.rename(entry)
        except OSError:  # another process finished the same entry first
            shutil.rmtree(tmp, ignore_errors=True)
        return 0
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(entry, out)
    return 0


if __name__ == "__main__":
    sys.exit(cached_main())

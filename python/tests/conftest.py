"""Shared by the Python suites: the module under test, the compiled models a main build
made (NEML2_DISPATCH_ARTIFACTS, default build/artifacts), eager NEML2 (the reference) and
comparisons. Nothing here skips: a missing module or artifact is a failure."""

import os
from pathlib import Path

import pytest
import torch

import neml2  # noqa: F401  (eager NEML2: the reference)

import neml2_dispatch as nd

torch.set_default_dtype(torch.float64)

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("NEML2_DISPATCH_ARTIFACTS", ROOT / "build" / "artifacts"))
MODELS = ROOT / "models"


def pytest_report_header(config):
    return [f"neml2_dispatch {nd.__version__} from {nd._core.__file__}", f"artifacts: {ARTIFACTS}"]


def pytest_sessionstart(session):
    expected = os.environ.get("NEML2_DISPATCH_EXPECT_MODULE_UNDER")
    if expected and not Path(nd._core.__file__).resolve().is_relative_to(Path(expected).resolve()):
        raise RuntimeError(f"testing {nd._core.__file__}, not the module under {expected}")


def stub(name, model):
    path = ARTIFACTS / name / f"{model}_aoti.i"
    assert path.is_file(), f"{path} is missing: build the main project's artifacts first"
    return path


def artifact_root(name, model):
    return ARTIFACTS / name / model


def raw(x):
    """A tensor from whatever eager NEML2 returns (its typed wrappers hold .data)."""
    return x if isinstance(x, torch.Tensor) else x.data


def eager(input_file, model):
    import neml2

    return neml2.load_model(str(MODELS / input_file), model)


def eager_name(model, qualified, model_name):
    names = dict(model.named_parameters())
    if qualified in names:
        return qualified
    short = qualified[len(model_name) + 1:]
    assert short in names, f"{qualified} not in the eager model ({list(names)})"
    return short


def check_close(actual, expected, what, rtol=1e-10, broadcast=False):
    """|actual - expected| <= rtol * max|expected|, same shape unless `broadcast` (a
    batch-independent Jacobian block is returned unbatched), as the C++ suites check."""
    expected = raw(expected).detach().to(torch.float64)
    assert isinstance(actual, torch.Tensor), f"{what}: {type(actual).__name__}, not a tensor"
    if broadcast:
        actual = actual.expand_as(expected)
    assert tuple(actual.shape) == tuple(expected.shape), \
        f"{what}: shape {tuple(actual.shape)} vs reference {tuple(expected.shape)}"
    scale = max(expected.abs().max().item(), 1e-300) if expected.numel() else 1.0
    error = (actual.to(torch.float64) - expected).abs().max().item() / scale if expected.numel() else 0.0
    assert error <= rtol, f"{what}: relative error {error:.3g} > {rtol:.3g}"


def check_maps(actual, expected, what, rtol=1e-10):
    assert set(actual) == set(expected), f"{what}: names {sorted(actual)} vs {sorted(expected)}"
    for name, value in expected.items():
        check_close(actual[name], value, f"{what} '{name}'", rtol)


def random_inputs(model, batch, seed=0, low=0.6, high=1.6):
    gen = torch.Generator().manual_seed(seed)
    return {name: low + (high - low) * torch.rand(batch, *shape, generator=gen)
            for name, shape in zip(model.input_names, model.input_base_shapes)}


def scalar_inputs(a):
    """The scalar backward-Euler model (x + 0.1 (x^2 - a) = 0.5): no real root for a <= -2."""
    a = torch.as_tensor(a, dtype=torch.float64)
    rows = a.shape[0]
    return {"a": a, "x": torch.full((rows,), 0.5), "x~1": torch.full((rows,), 0.5),
            "t": torch.full((rows,), 0.1), "t~1": torch.zeros(rows)}


@pytest.fixture(scope="session")
def elasticity():
    return stub("elasticity", "elasticity")


@pytest.fixture(scope="session")
def eager_elasticity():
    return eager("elasticity.i", "elasticity")

"""Tuned policies from a tune file written by the neml2-dispatch program (the console
script of the wheel, or NEML2_DISPATCH_PROGRAM), checked against the artifact; artifact
info as the program prints it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import neml2_dispatch as nd
from conftest import check_close, stub


def program():
    given = os.environ.get("NEML2_DISPATCH_PROGRAM")
    if given:
        return [given]
    script = Path(sys.executable).parent / "neml2-dispatch"  # the wheel's console script
    assert script.exists() or shutil.which("neml2-dispatch"), \
        "no neml2-dispatch program: set NEML2_DISPATCH_PROGRAM or install the wheel"
    return [str(script) if script.exists() else shutil.which("neml2-dispatch")]


@pytest.fixture(scope="module")
def tune_file(tmp_path_factory, elasticity):
    out = tmp_path_factory.mktemp("tune") / "elasticity.tune.json"
    done = subprocess.run([*program(), "tune", str(elasticity), "--device", "cpu", "--budget", "3",
                           "--max-rows", "4096", "--repeats", "2", "--batch", "4096",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_tuned_policies_are_the_files_recommendations(tune_file, elasticity):
    data = json.loads(tune_file.read_text())
    sync = nd.tuned_policy(nd.SyncChunking, tune_file, elasticity, "elasticity")
    assert isinstance(sync, nd.SyncChunking)
    assert sync.device == "cpu"
    assert sync.batch_size == data["recommendations"]["sync"][0]["batch_size"]
    pool = nd.tuned_policy(nd.GreedyPriorityCapacity, tune_file, elasticity)
    assert pool.devices == ["cpu"] and pool.batch_sizes[0] >= 1
    model = nd.load_model(elasticity, pool)
    strain = torch.rand(50, 6)
    check_close(model.forward({"strain": strain})["stress"],
                nd.load_model(elasticity).forward({"strain": strain})["stress"], "tuned", 1e-14)


def test_a_tune_file_of_another_artifact_is_refused(tune_file):
    with pytest.raises(nd.FatalError, match="tune"):
        nd.tuned_policy(nd.SyncChunking, tune_file, stub("rates", "eq"))
    with pytest.raises(nd.FatalError, match="kind must be"):
        nd.tuned_policy(dict, tune_file, stub("rates", "eq"))


def test_artifact_info_is_the_programs(elasticity):
    done = subprocess.run([*program(), "info", str(elasticity), "--json"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert nd.artifact_info(elasticity) == json.loads(done.stdout)
    info = nd.artifact_info(stub("perzyna_viscoplasticity", "model"))
    assert any(s["kind"] == "implicit" for s in info["segments"])

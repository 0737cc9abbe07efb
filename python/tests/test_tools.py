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


# ------------------------------------------------------------ the tuner from Python

@pytest.fixture(scope="module")
def tuned(tmp_path_factory, elasticity):
    """nd.tune on the CPU (a short sweep), its points as on_point saw them, its file."""
    out = tmp_path_factory.mktemp("pytune") / "elasticity.tune.json"
    seen = []
    result = nd.tune(elasticity, "elasticity", ["cpu"], operation="jacobian", budget_seconds=3,
                     max_rows=2048, batch_rows=2048, repeats=2, lane_test=False,
                     on_point=lambda device, point: seen.append((device, point)), out=out)
    return result, seen, out


def test_tune_returns_the_tune_file_it_writes(tuned, tune_file, elasticity):
    result, seen, out = tuned
    assert json.loads(out.read_text()) == result
    # The program's tune file has the same fields: one format, whichever wrote it.
    program_made = json.loads(tune_file.read_text())
    assert set(result) == set(program_made)
    assert set(result["devices"][0]) == set(program_made["devices"][0])
    assert result["operation"] == "jacobian" and result["dtype"] == "float64"
    assert result["intra_op_threads"] == torch.get_num_threads()
    points = result["devices"][0]["points"]
    assert [p["rows"] for p in points] == sorted(p["rows"] for p in points)
    assert max(p["rows"] for p in points) <= 2048, "max_rows was not followed"
    assert all(p["repeats"] == 2 and p["low"] <= p["median"] <= p["high"] for p in points)
    # on_point saw each point as it was measured: the same sizes and rates.
    assert all(device == 0 for device, _ in seen)
    assert sorted(seen, key=lambda s: s[1]["rows"]) == [(0, p) for p in points]
    # The file loads back as a policy: the recommendation the result holds.
    sync = nd.tuned_policy(nd.SyncChunking, out, elasticity, "elasticity")
    assert sync.batch_size == result["recommendations"]["sync"][0]["batch_size"]


def test_tune_failures_write_nothing(elasticity, tmp_path):
    out = tmp_path / "never.json"

    def stop(device, point):
        raise ValueError("enough measuring")

    with pytest.raises(nd.FatalError, match="on_point callback raised ValueError: enough"):
        nd.tune(elasticity, "elasticity", ["cpu"], budget_seconds=2, on_point=stop, out=out)
    with pytest.raises(nd.FatalError, match="operation 'hessian'"):
        nd.tune(elasticity, "elasticity", ["cpu"], operation="hessian", out=out)
    with pytest.raises(nd.FatalError, match="folder .* does not exist"):
        nd.tune(elasticity, "elasticity", ["cpu"], out=tmp_path / "missing" / "t.json")
    with pytest.raises(nd.FatalError, match="devices is empty"):
        nd.tune(elasticity, "elasticity", [], out=out)
    with pytest.raises(nd.FatalError, match="sample is a int"):
        nd.tune(elasticity, "elasticity", ["cpu"], sample=3, out=out)
    with pytest.raises(nd.FatalError, match=r"'strain' would be drawn from \[1, 0\]"):
        nd.tune(elasticity, "elasticity", "cpu", low=1.0, high=0.0, out=out)
    with pytest.raises(nd.FatalError, match="max_rows is 0"):
        nd.tune(elasticity, "elasticity", "cpu", max_rows=0, out=out)
    with pytest.raises(TypeError, match="budget"):
        nd.tune(elasticity, "elasticity", "cpu", budget=1, out=out)
    assert not out.exists(), "a failed tune wrote its file"


# ------------------------------------------------------------ the simulator from Python

def flat(rate, overhead=0.0):
    return {"curve": rate, "chunk_overhead": overhead}


class PythonSync:
    """SyncChunking written in Python."""
    dispatch_mode, devices = "synchronous", ["cpu"]

    def __init__(self, rows):
        self.rows = rows

    def compute_device(self):
        return "cpu"

    def chunk_rows(self, batch):
        return self.rows


class RoundRobin:
    """One chunk of `rows` per device in turn, one in flight per device."""
    dispatch_mode = "asynchronous"

    def __init__(self, devices, rows):
        self.devices, self.rows, self.turn, self.completed = devices, rows, 0, []

    def next_chunk(self, rows_in_flight, remaining):
        d = self.turn % len(self.devices)
        if rows_in_flight[d]:
            return None
        self.turn += 1
        return d, min(self.rows, remaining)

    def on_dispatched(self, device, rows):
        pass

    def on_completed(self, device, rows, seconds):
        self.completed.append((device, rows, seconds))


def test_simulate_sync_chunking_is_the_sum_of_its_chunks():
    # 10 chunks of 1000 rows at 1e6 rows/s plus 1 ms each, twice: 40 ms; ideal 20 ms.
    sim = nd.simulate(nd.SyncChunking(batch_size=1000), [flat(1e6, 1e-3)], 10000, calls=2)
    assert sim["makespan"] == pytest.approx(0.04, rel=1e-12)
    assert sim["ideal"] == pytest.approx(0.02, rel=1e-12)
    assert sim["efficiency"] == pytest.approx(0.5, rel=1e-12)
    assert len(sim["timeline"]) == 20 and {c["rows"] for c in sim["timeline"]} == {1000}
    assert all(c["end"] - c["start"] == pytest.approx(2e-3) for c in sim["timeline"])
    assert sim["devices"] == [{"name": "cpu", "lanes": 1, "busy": pytest.approx(0.04),
                               "idle": pytest.approx(0, abs=1e-15)}]
    # The same policy written in Python: the same timeline.
    assert nd.simulate(PythonSync(1000), [flat(1e6, 1e-3)], 10000, calls=2) == sim


def test_simulate_interpolates_curves_log_log():
    # 2000 rows is the geometric midpoint of 1000 and 4000: the rate is 2e6 there.
    curve = {"curve": [(1000, 1e6), (4000, 4e6)]}
    sim = nd.simulate(nd.SyncChunking(batch_size=2000), [curve], 8000)
    assert sim["makespan"] == pytest.approx(4 * 2000 / 2e6, rel=1e-12)


def test_simulate_a_pool_and_a_python_policy():
    # Two equal devices: each gets half of the rows, and the call takes half the time.
    pool = nd.GreedyPriorityCapacity(devices=["cpu", "cuda:0"], batch_sizes=[1000])
    sim = nd.simulate(pool, [flat(1e6), flat(1e6)], 100000)
    rows = [sum(c["rows"] for c in sim["timeline"] if c["device"] == d) for d in (0, 1)]
    assert rows == [50000, 50000]
    assert sim["makespan"] == pytest.approx(0.05, rel=1e-12)
    # A Python policy round-robin over a device twice as fast: the slow one sets the pace,
    # and the policy saw every chunk complete with its own seconds.
    policy = RoundRobin(["cpu", "cuda:0"], 1000)
    sim = nd.simulate(policy, [flat(1e6), flat(2e6)], 10000)
    assert [(c["device"], c["rows"]) for c in sim["timeline"]] == [(k % 2, 1000) for k in range(10)]
    assert sim["makespan"] == pytest.approx(5 * 1e-3, rel=1e-12)
    assert sorted(policy.completed) == sorted(
        [(0, 1000, pytest.approx(1e-3))] * 5 + [(1, 1000, pytest.approx(5e-4))] * 5)


def test_simulate_from_a_tune_result_as_the_program_does(tune_file, elasticity, tmp_path):
    data = json.loads(tune_file.read_text())
    lanes = data["cpu_lanes"]
    device = dict(data["devices"][0], cpu_lanes=lanes)
    point = next(p for p in device["points"] if p["repeats"] > 0)
    # A device of a tune result: its medians (all lanes' rows per second) and its lane
    # test's overhead per chunk; chunks of the measured size, one per lane.
    sim = nd.simulate(nd.SyncChunking(batch_size=point["rows"], cpu_lanes=lanes), [device],
                      4 * lanes * point["rows"])
    expected = 4 * (device["chunk_overhead"] + lanes * point["rows"] / point["median"])
    assert sim["makespan"] == pytest.approx(expected, rel=1e-12)
    with pytest.raises(nd.FatalError, match="add the result's cpu_lanes"):
        nd.simulate(nd.SyncChunking(batch_size=point["rows"]), [data["devices"][0]], 100)
    # The program's simulate of the same file: the recommended pool, the same timeline.
    out = tmp_path / "sim.json"
    done = subprocess.run([*program(), "simulate", str(tune_file), "--pool", "cpu", "--batch",
                           "100000", "--json", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    pool = nd.tuned_policy(nd.GreedyPriorityCapacity, tune_file, elasticity)
    assert nd.simulate(pool, [device], 100000) == json.loads(out.read_text())


def test_simulate_bad_input_is_the_librarys_error():
    sync = nd.SyncChunking(batch_size=10)
    for devices, match in [
        ([], "lists 1 devices but 0 simulated devices"),
        ([{"curve": [(5, 1.0), (2, 1.0)]}], r"devices\[0\]\['curve'\]: .* increasing rows"),
        ([{"curve": [(5, -1.0)]}], "rate finite and > 0"),
        ([{"curve": "fast"}], "give rows per second"),
        ([{"curve": None}], "give rows per second"),
        ([{"curve": {"rows": 1}}], "give rows per second"),
        ([{"curv": 1e6}], "has the key 'curv'"),
        ([{"curve": 1e6, "chunk_overhead": -1}], "finite seconds >= 0"),
        ([3], r"devices\[0\] is a int"),
        (3, "devices is a int"),
    ]:
        with pytest.raises(nd.FatalError, match=match):
            nd.simulate(sync, devices, 100)
    with pytest.raises(nd.FatalError, match="policy is a str"):
        nd.simulate("sync", [flat(1.0)], 100)
    with pytest.raises(nd.FatalError, match="batch_size is -1"):
        nd.simulate(nd.SyncChunking(batch_size=-1), [flat(1.0)], 100)
    with pytest.raises(nd.FatalError, match="batch >= 0 and calls >= 1"):
        nd.simulate(sync, [flat(1.0)], -5)
    with pytest.raises(nd.FatalError, match="chunk_rows"):
        nd.simulate(PythonSync(-3), [flat(1.0)], 100)

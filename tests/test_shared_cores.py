"""Devices that share one compute resource (virtual CPUs of one process): no speed-up predicted.

`--xla_force_host_platform_device_count=4` gives JAX four CPU devices that all
run on the same host cores. A pipeline over two of them was predicted faster
than one CPU and measured several times slower than `jax.jit`; the cost table
now puts them in one `compute_group`, and the planner serialises their work.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

import hetpar
from hetpar import cost_models, zoo
from hetpar.core import CostTable, Device, Edge, GraphFormatError, Layer, Link
from hetpar.planner import (
    Arrays,
    evaluate,
    evaluate_data_parallel,
    exhaustive,
    plan,
    replica_groups,
    simulate,
)
from tests.random_tables import random_cost_table

LAYERS = 4
ONE_DEVICE_S = LAYERS * 1e-3  # the chain's step on one device


def two_device_chain(group: str | None) -> CostTable:
    """A 4-layer chain on two equally fast devices with cheap links; `group` shared or not."""
    devices = tuple(Device(f"cpu:{j}", "cpu", 1e12, compute_group=group) for j in range(2))
    links = (Link("cpu:0", "cpu:1", 1e12, 1e-7), Link("cpu:1", "cpu:0", 1e12, 1e-7))
    layers = tuple(Layer(f"l{i}", dict.fromkeys(("cpu:0", "cpu:1"), 1e-3),
                         dict.fromkeys(("cpu:0", "cpu:1"), 1e6)) for i in range(LAYERS))
    edges = tuple(Edge(f"l{i}", f"l{i + 1}", 1e3, 1e3) for i in range(LAYERS - 1))
    return CostTable(devices, links, layers, edges)


SPLIT = {f"l{i}": "cpu:0" if i < LAYERS // 2 else "cpu:1" for i in range(LAYERS)}


def test_pipeline_over_independent_devices_is_predicted_faster():
    # The control: without a shared resource, two devices of one speed do pay off.
    table = two_device_chain(None)
    p = plan(table, mode="pipelined", microbatches=4)
    assert set(p.assignment.values()) == {"cpu:0", "cpu:1"}
    assert p.predicted.step_time_s < 0.8 * ONE_DEVICE_S
    assert simulate(table, SPLIT, 4).step_time_s < 0.8 * ONE_DEVICE_S


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_over_one_compute_group_is_never_predicted_faster(schedule):
    table = two_device_chain("host")
    # Forced split: the closed form and the replay both add up the two devices' work.
    closed = evaluate(table, SPLIT, "pipelined", 4)
    assert closed.step_time_s >= ONE_DEVICE_S
    assert closed.bottleneck == "devices cpu:0+cpu:1"
    replay = simulate(table, SPLIT, 4, schedule)
    assert replay.step_time_s >= ONE_DEVICE_S
    # No two stages of the group overlap in time.
    spans = sorted((s.start_s, s.end_s) for s in replay.stages)
    assert all(b[0] >= a[1] - 1e-15 for a, b in zip(spans, spans[1:]))
    # The planner keeps everything on one device (a split only adds transfers).
    p = plan(table, mode="pipelined", microbatches=4, schedule=schedule)
    assert len(set(p.assignment.values())) == 1
    assert p.predicted.step_time_s == pytest.approx(ONE_DEVICE_S)
    # The baselines on the same terms: none beats one device.
    assert all(b.predicted.step_time_s >= ONE_DEVICE_S * (1 - 1e-9)
               for b in p.baselines.values() if b.feasible)


@pytest.mark.parametrize("seed", range(3))
def test_ilp_matches_exhaustive_with_a_compute_group(seed):
    # Devices 1 and 3 (two accelerators) share one resource, 0 and 2 stay apart:
    # the ILP's bottleneck sums per resource as the evaluator does.
    table = random_cost_table(seed, layers=7, devices=4)
    devices = tuple(dataclasses.replace(d, compute_group="shared" if j % 2 else None)
                    for j, d in enumerate(table.devices))
    table = dataclasses.replace(table, devices=devices)
    p = plan(table, mode="pipelined", microbatches=4, contiguous=True, gap=1e-9)
    oracle = exhaustive(table, "time", "pipelined", 4, contiguous=True)
    assert p.solver["objective"] == pytest.approx(oracle.predicted.step_time_s, rel=1e-6)
    again = evaluate(table, p.assignment, "pipelined", 4)
    assert p.solver["objective"] == pytest.approx(again.step_time_s, rel=1e-6)


def test_data_parallel_over_one_compute_group_gains_nothing():
    table = two_device_chain("host")
    layers = tuple(dataclasses.replace(layer, param_bytes=1e3) for layer in table.layers)
    table = dataclasses.replace(table, layers=layers)
    assert evaluate_data_parallel(table, ["cpu:0", "cpu:1"]).step_time_s >= ONE_DEVICE_S
    gpus = tuple(dataclasses.replace(d, kind="h100") for d in table.devices)
    assert replica_groups(dataclasses.replace(table, devices=gpus)) == []
    apart = tuple(dataclasses.replace(d, compute_group=None) for d in gpus)
    assert replica_groups(dataclasses.replace(table, devices=apart)) == [("cpu:0", "cpu:1")]


def test_graph_json_without_compute_group_loads_with_independent_devices():
    old = two_device_chain(None).to_json()
    assert all("compute_group" not in d for d in old["devices"])  # not written when unset
    table = CostTable.from_json(old)
    assert [d.compute_group for d in table.devices] == [None, None]
    np.testing.assert_array_equal(Arrays(table).resource, [0, 1])
    shared = two_device_chain("host").to_json()
    assert [d["compute_group"] for d in shared["devices"]] == ["host", "host"]
    np.testing.assert_array_equal(Arrays(CostTable.from_json(shared)).resource, [0, 0])
    for bad in ("", 3):
        shared["devices"][0]["compute_group"] = bad
        with pytest.raises(GraphFormatError, match=r"devices\[0\]\.compute_group"):
            CostTable.from_json(shared)


@functools.cache
def _mlp_graph():
    return zoo.trace_model("mlp", small=True)[1]


def test_present_virtual_cpus_share_one_compute_group(tmp_path, monkeypatch):
    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path / "cache"))
    assert len(jax.devices("cpu")) >= 4  # conftest forces four
    table = cost_models.cost_table(_mlp_graph(), ["cpu:0", "cpu:1", "cpu:3", "cpu", "h100"])
    group = {d.name: d.compute_group for d in table.devices}
    assert group["cpu:0"] is not None
    assert group["cpu:0"] == group["cpu:1"] == group["cpu:3"]
    # Spec-sheet devices (a what-if CPU, an H100) have no JAX device behind them.
    assert group["cpu:4"] is None and group["h100:0"] is None
    path = tmp_path / "graph.json"
    table.save(path)
    assert CostTable.load(path).devices == table.devices
    # One present CPU alone shares with nothing: nothing written.
    alone = cost_models.cost_table(_mlp_graph(), ["cpu:0", "h100"])
    assert [d.compute_group for d in alone.devices] == [None, None, None]  # + h100's place


@pytest.mark.parametrize("name", ["mlp", pytest.param("transformer", marks=pytest.mark.slow)])
def test_auto_over_four_virtual_cpus_predicts_no_speed_up(name):
    w = zoo.get(name, small=True)
    step = hetpar.auto(w.train_step, microbatches=2)  # every present device: cpu:0..cpu:3
    compiled = step.lower(*w.example_args())
    p = compiled.plan
    assert {d.name for d in compiled.table.devices} >= {f"cpu:{i}" for i in range(4)}
    one_cpu = min(b.predicted.step_time_s for k, b in p.baselines.items()
                  if k.startswith("only cpu:") and b.feasible)
    used = set(p.assignment.values()) | set(p.replicas)
    assert len(used) == 1 or p.predicted.step_time_s >= one_cpu, p.summary(compiled.table)
    assert p.predicted.step_time_s >= one_cpu * (1 - 1e-9)

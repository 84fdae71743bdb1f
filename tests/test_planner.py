"""Tests of hetpar.planner: the ILP against exhaustive search, baselines, errors, files, CLI."""

import copy
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cost_models import scale_to_step
from hetpar.core import GraphFormatError, InfeasibleError, PlanError
from hetpar.planner import (
    CostTable,
    Device,
    Edge,
    Layer,
    Link,
    Plan,
    evaluate,
    evaluate_replayed,
    exhaustive,
    plan,
    simulate,
    violations,
)
from tests.random_tables import random_cost_table

EXACT = 1e-9  # solver gap for oracle comparisons
ROOT = Path(__file__).resolve().parents[1]

CASES = [
    dict(shape=shape, memory=memory, missing_links=missing, restrict=restrict)
    for shape, memory, missing, restrict in [
        ("chain", "loose", False, False), ("dag", "loose", False, False),
        ("chain", "tight", False, False), ("dag", "tight", False, True),
        ("dag", "loose", True, False), ("dag", "tight", True, True),
    ]
]


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-300)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("objective", ["time", "cost", "energy"])
def test_sequential_matches_exhaustive_and_beats_baselines(seed, case, objective):
    table = random_cost_table(seed, layers=8 + seed % 3, devices=3, **case)
    try:
        p = plan(table, objective=objective, gap=EXACT)
    except InfeasibleError:
        assert exhaustive(table, objective).predicted is None
        return
    value = p.predicted.objective(objective)
    oracle = p.baselines["exhaustive"].predicted.objective(objective)
    assert _rel(value, oracle) < 1e-6
    assert _rel(p.solver["objective"], value) < 1e-6  # reported == evaluated
    assert evaluate(table, p.assignment).objective(objective) == pytest.approx(value, rel=1e-12)
    assert violations(table, p.assignment) == []
    for name, r in p.baselines.items():
        if r.predicted is not None:
            assert value <= r.predicted.objective(objective) * (1 + 1e-6), name


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("objective", ["time", "cost"])
@pytest.mark.parametrize("contiguous", [False, True])
def test_pipelined_matches_exhaustive(seed, objective, contiguous):
    table = random_cost_table(seed, layers=8, devices=3, memory="tight" if seed else "loose")
    p = plan(table, objective=objective, mode="pipelined", microbatches=4,
             contiguous=contiguous, gap=EXACT)
    oracle = exhaustive(table, objective, "pipelined", 4, contiguous=contiguous)
    # The ILP is optimal for its closed form (the first solve, free or contiguous as asked).
    first = p.solver.get("free_objective", p.solver["objective"])
    assert _rel(first, oracle.predicted.objective(objective)) < 1e-6
    assert violations(table, p.assignment, contiguous=p.contiguous) == []
    assert p.contiguous or not contiguous
    again = evaluate(table, p.assignment, "pipelined", 4)
    assert _rel(p.solver["objective"], again.objective(objective)) < 1e-6
    assert again.bottleneck_s == pytest.approx(p.predicted.bottleneck_s)
    assert p.predicted.activation_bytes_in_flight is not None
    # The plan's prediction replays its schedule; of the candidates tried, the best won.
    assert p.predicted.schedule == "gpipe"
    replayed = evaluate_replayed(table, p.assignment, 4, "gpipe")
    assert p.predicted.objective(objective) == pytest.approx(replayed.objective(objective))
    tried = [v for v in p.solver.get("replayed", {}).values() if isinstance(v, float)]
    if tried:
        assert p.predicted.objective(objective) == pytest.approx(min(tried))


def _two_device_chain(price_b=3.0, speed_b=1.0, cap_b=1e12, n=4, price_a=0.5):
    devices = (Device("a", "cpu", 1e12, price_a, 100.0, 50.0),
               Device("b", "gpu", cap_b, price_b, 300.0, 50.0))
    links = (Link("a", "b", 1e10, 1e-6), Link("b", "a", 1e10, 1e-6))
    layers = tuple(Layer(f"l{i}", {"a": 1.0, "b": speed_b}, {"a": 1e9, "b": 1e9})
                   for i in range(n))
    edges = tuple(Edge(f"l{i}", f"l{i + 1}", 1e6, 1e6) for i in range(n - 1))
    return CostTable(devices, links, layers, edges)


def test_pipelining_beats_sequential_on_two_devices():
    table = _two_device_chain()
    seq = plan(table, gap=EXACT)
    pipe = plan(table, mode="pipelined", microbatches=8, gap=EXACT)
    assert pipe.predicted.step_time_s < 0.7 * seq.predicted.step_time_s
    assert set(pipe.assignment.values()) == {"a", "b"}
    assert pipe.predicted.bottleneck_s == pytest.approx(0.25, rel=1e-3)


def test_cost_and_energy_choose_the_cheaper_device():
    # b is 10% faster but 6x dearer and hungrier: time picks b, cost and energy pick a.
    table = _two_device_chain(price_b=3.0, speed_b=0.9)
    assert set(plan(table, objective="time").assignment.values()) == {"b"}
    assert set(plan(table, objective="cost").assignment.values()) == {"a"}
    assert set(plan(table, objective="energy").assignment.values()) == {"a"}


@pytest.mark.parametrize("mode", ["sequential", "pipelined"])
@pytest.mark.parametrize("seed", range(4))
def test_host_cpu_free_beside_its_gpu_but_priced_alone(seed, mode):
    # The host CPU costs 0 beside the GPU but 2.0/h as a machine of its own:
    # the cost optimum must never call all-CPU free, and must equal exhaustive search.
    base = random_cost_table(seed, layers=7, devices=3)
    devices = tuple(dataclasses.replace(d, price_per_hour=0.0, price_alone_per_hour=2.0)
                    if d.kind == "cpu" else d for d in base.devices)
    table = dataclasses.replace(base, devices=devices)
    m = 4 if mode == "pipelined" else 1
    p = plan(table, objective="cost", mode=mode, microbatches=m, gap=EXACT)
    oracle = exhaustive(table, "cost", mode, m)
    assert _rel(p.predicted.cost_usd_per_step, oracle.predicted.cost_usd_per_step) < 1e-6
    assert _rel(p.solver["objective"], p.predicted.cost_usd_per_step) < 1e-6
    cpu = next(d.name for d in devices if d.kind == "cpu")
    alone = evaluate(table, {layer: cpu for layer in table.layer_names}, mode, m)
    assert alone.cost_usd_per_step == pytest.approx(alone.step_time_s * 2.0 / 3600)
    assert CostTable.from_json(table.to_json()).devices == table.devices


def test_budgets():
    table = _two_device_chain(price_b=3.0, speed_b=0.9)
    cheap = plan(table, objective="cost").predicted
    assert set(plan(table, max_cost=cheap.cost_usd_per_step * 1.0001).assignment.values()) == {"a"}
    assert set(plan(table, objective="cost", max_step_time=3.7).assignment.values()) == {"b"}
    with pytest.raises(InfeasibleError, match="fastest takes"):
        plan(table, max_step_time=1.0)
    with pytest.raises(InfeasibleError, match="cheapest costs"):
        plan(table, max_cost=cheap.cost_usd_per_step / 2)


def test_memory_pins_and_allowed_hold():
    table = random_cost_table(3, layers=30, devices=3, memory="tight", restrict=True)
    p = plan(table)
    assert violations(table, p.assignment) == []
    for layer in table.layers:
        if layer.pinned:
            assert p.assignment[layer.name] == layer.pinned
        if layer.allowed is not None:
            assert p.assignment[layer.name] in layer.allowed
    pinned = plan(table, pins={"l0": "cpu:0", "l1": "cpu:0"})
    assert pinned.assignment["l0"] == pinned.assignment["l1"] == "cpu:0"
    assert pinned.fingerprint == p.fingerprint


def test_infeasible_memory_names_the_device():
    table = _two_device_chain(cap_b=2.5e9)
    tight = CostTable(
        (Device("a", "cpu", 1e9, 0.5), table.devices[1]), table.links, table.layers, table.edges)
    with pytest.raises(InfeasibleError, match=r"need at least 4 GB but a \+ b hold 3.5 GB \(500 MB "
                                              r"missing\); raise memory_bytes of a by 500 MB"):
        plan(tight)
    pinned = tight.with_pins({f"l{i}": "b" for i in range(3)})
    with pytest.raises(InfeasibleError, match=r"only run on b need at least 3 GB but b holds"):
        plan(pinned)


def test_missing_link_between_pinned_neighbours():
    t = _two_device_chain()
    table = CostTable(t.devices, (t.links[0],), t.layers, t.edges).with_pins({"l0": "a",
                                                                              "l1": "b"})
    with pytest.raises(InfeasibleError, match="l0 -> l1 cannot be placed"):
        plan(table)


def test_exhaustive_refuses_large_graphs():
    with pytest.raises(PlanError, match="exhaustive search would try"):
        exhaustive(random_cost_table(0, layers=14, devices=3))
    p = plan(random_cost_table(0, layers=14, devices=3), gap=1e-3)
    assert p.baselines["exhaustive"].reason.startswith("skipped")


GOOD = {
    "format": "hetpar.graph", "version": 1,
    "devices": [{"name": "cpu:0", "kind": "cpu", "memory_bytes": 1e11, "price_per_hour": 0.8,
                 "watts_busy": 200, "watts_idle": 60},
                {"name": "gpu:0", "kind": "h100", "memory_bytes": 8e10, "price_per_hour": 3.0,
                 "watts_busy": 700, "watts_idle": 80}],
    "links": [{"src": "cpu:0", "dst": "gpu:0", "bandwidth_bytes_per_s": 8e9, "latency_s": 2e-5},
              {"src": "gpu:0", "dst": "cpu:0", "bandwidth_bytes_per_s": 8e9, "latency_s": 2e-5}],
    "layers": [{"name": "conv1", "time_s": {"cpu:0": 1.2e-3, "gpu:0": 9e-5},
                "memory_bytes": {"cpu:0": 4e6, "gpu:0": 4e6}},
               {"name": "conv2", "time_s": {"cpu:0": 2e-3, "gpu:0": 1e-4},
                "memory_bytes": {"cpu:0": 4e6, "gpu:0": 4e6}}],
    "edges": [{"src": "conv1", "dst": "conv2", "bytes": 3.2e6, "bytes_backward": 3.2e6}],
}


def _bad(edit):
    data = copy.deepcopy(GOOD)
    edit(data)
    return data


BAD_GRAPHS = {
    "format": (lambda d: d.update(format="hetpar.plan"), "format"),
    "version": (lambda d: d.update(version=7), "version 7"),
    "missing layers": (lambda d: d.pop("layers"),
                       r"missing field 'layers' \(a list\); see docs/formats.md"),
    "missing device field": (lambda d: d["devices"][0].pop("memory_bytes"),
                             r"devices\[0\] is missing field 'memory_bytes'"),
    "missing edge bytes": (lambda d: d["edges"][0].pop("bytes"), r"edges\[0\].*'bytes'"),
    "unknown device": (lambda d: d["layers"][0]["time_s"].update({"tpu:9": 1.0}),
                       r"layers\[0\] \(conv1\)\.time_s names unknown device 'tpu:9'"),
    "negative time": (lambda d: d["layers"][1]["time_s"].update({"gpu:0": -1.0}),
                      r"layers\[1\] \(conv2\)\.time_s\['gpu:0'\].*non-negative"),
    "negative memory": (lambda d: d["devices"][1].update(memory_bytes=-5),
                        r"devices\[1\]\.memory_bytes"),
    "negative bytes": (lambda d: d["edges"][0].update(bytes=-1), r"edges\[0\]\.bytes"),
    "unknown layer": (lambda d: d["edges"][0].update(dst="conv9"),
                      r"edges\[0\]\.dst names unknown layer 'conv9'"),
    "cycle": (lambda d: d["edges"].append({"src": "conv2", "dst": "conv1", "bytes": 1}),
              "cycle"),
    "duplicate layer": (lambda d: d["layers"].append(copy.deepcopy(d["layers"][0])),
                        r"layers\[2\]\.name 'conv1' duplicates layers\[0\]"),
    "duplicate device": (lambda d: d["devices"].append(copy.deepcopy(d["devices"][0])),
                         r"devices\[2\]\.name 'cpu:0' duplicates"),
    "string number": (lambda d: d["devices"][0].update(memory_bytes="lots"),
                      r"devices\[0\]\.memory_bytes must be a number"),
    "pinned unknown": (lambda d: d["layers"][0].update(pinned="gpu:7"), r"pinned.*'gpu:7'"),
    "recompute share": (lambda d: d["layers"][0].update(recompute_fraction=1.5),
                        r"layers\[0\] \(conv1\)\.recompute_fraction is 1.5.*between 0 and 1"),
}


@pytest.mark.parametrize("name", BAD_GRAPHS)
def test_malformed_graph_names_the_field(name, tmp_path):
    edit, pattern = BAD_GRAPHS[name]
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(_bad(edit)))
    with pytest.raises(GraphFormatError, match=pattern):
        CostTable.load(path)


def test_graph_round_trip_and_fingerprint(tmp_path):
    table = CostTable.from_json(GOOD)
    table.save(tmp_path / "g.json")
    again = CostTable.load(tmp_path / "g.json")
    assert again == table
    shared = _bad(lambda d: d["layers"][0].update(recompute_fraction=0.25))
    assert CostTable.from_json(shared).layers[0].recompute_fraction == 0.25
    assert CostTable.from_json(CostTable.from_json(shared).to_json()) == CostTable.from_json(shared)
    retimed = _bad(lambda d: d["layers"][0]["time_s"].update({"gpu:0": 5.0}))
    assert CostTable.from_json(retimed).fingerprint() == table.fingerprint()
    renamed = _bad(lambda d: d["devices"][1].update(name="gpu:1"))
    renamed["layers"] = [dict(la, time_s={"cpu:0": 1.0}, memory_bytes={"cpu:0": 1.0})
                         for la in renamed["layers"]]
    renamed["links"] = []
    assert CostTable.from_json(renamed).fingerprint() != table.fingerprint()


def test_layer_without_time_cannot_run_there():
    data = _bad(lambda d: d["layers"][1]["time_s"].pop("gpu:0"))
    p = plan(CostTable.from_json(data), gap=EXACT)
    assert p.assignment["conv2"] == "cpu:0"


def test_plan_save_load_check(tmp_path):
    table = random_cost_table(1, layers=6, devices=3)
    p = plan(table, mode="pipelined", microbatches=4)
    p.save(tmp_path / "plan.json")
    q = Plan.load(tmp_path / "plan.json")
    assert q == p
    q.check(table)
    assert "l0 ->" in q.explain(table)
    assert "baselines" in q.summary(table)
    other = random_cost_table(1, layers=7, devices=3)
    with pytest.raises(PlanError, match="different model"):
        q.check(other)
    fewer = random_cost_table(1, layers=6, devices=2)
    if set(p.assignment.values()) - set(fewer.device_names):
        with pytest.raises(PlanError, match="not among the devices present"):
            q.check(fewer)
    data = p.to_json()
    del data["assignment"]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="missing field 'assignment'"):
        Plan.load(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(tmp_path / "bad.json")


def _pipelined_plan_json() -> dict:
    """A pipelined plan's file form: every optional `predicted` field is present."""
    return plan(random_cost_table(1, layers=6, devices=3), mode="pipelined",
                microbatches=4).to_json()


# (a path into plan.json, a bad value, the field the message names): every
# field type of `predicted` (number, {device: number}, {schedule: {device:
# number}}, string, schedule name), a baseline's, the solver's and the rest.
MALFORMED_PLAN = [
    (("predicted", "step_time_s"), "x", "predicted.step_time_s"),
    (("predicted", "step_time_s"), -1, "predicted.step_time_s"),
    (("predicted", "step_time_s"), float("nan"), "predicted.step_time_s"),
    (("predicted", "step_time_s"), True, "predicted.step_time_s"),
    (("predicted", "cost_usd_per_step"), None, "predicted.cost_usd_per_step"),
    (("predicted", "energy_j_per_step"), [1], "predicted.energy_j_per_step"),
    (("predicted", "compute_s"), "1", "predicted.compute_s"),
    (("predicted", "transfer_s"), -0.5, "predicted.transfer_s"),
    (("predicted", "bottleneck_s"), {}, "predicted.bottleneck_s"),
    (("predicted", "closed_form_s"), "x", "predicted.closed_form_s"),
    (("predicted", "busy_s"), "x", "predicted.busy_s"),
    (("predicted", "busy_s"), {"cpu:0": "x"}, "predicted.busy_s['cpu:0']"),
    (("predicted", "memory_bytes"), [], "predicted.memory_bytes"),
    (("predicted", "peak_memory_bytes"), {"cpu:0": -1}, "predicted.peak_memory_bytes['cpu:0']"),
    (("predicted", "activation_bytes_in_flight"), 3, "predicted.activation_bytes_in_flight"),
    (("predicted", "activation_bytes_in_flight"), {"gpipe": {"cpu:0": "x"}},
     "predicted.activation_bytes_in_flight['gpipe']['cpu:0']"),
    (("predicted", "bottleneck"), 7, "predicted.bottleneck"),
    (("predicted", "schedule"), "zigzag", "predicted.schedule"),
    (("predicted",), "x", "predicted must be an object"),
    (("baselines", "heft", "predicted", "step_time_s"), "x",
     "baselines['heft'].predicted.step_time_s"),
    (("solver", "solve_time_s"), "x", "solver.solve_time_s"),
    (("solver", "gap"), -1, "solver.gap"),
    (("solver", "status"), 0, "solver.status"),
    (("solver",), [], "solver must be an object"),
    (("fingerprint",), 3, "fingerprint"),
    (("contiguous",), "no", "contiguous"),
    (("constraints", "max_cost"), "x", "constraints.max_cost"),
    (("constraints",), 1, "constraints must be an object"),
]


@pytest.mark.parametrize("path,value,field", MALFORMED_PLAN, ids=lambda x: str(x))
def test_malformed_plan_names_the_file_and_field(path, value, field, tmp_path):
    data = _pipelined_plan_json()
    assert {"activation_bytes_in_flight", "schedule", "closed_form_s",
            "bottleneck"} <= set(data["predicted"])
    where = data
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(PlanError) as e:
        Plan.load(bad)
    assert str(e.value).startswith(f"{bad}: {field}"), str(e.value)


def test_every_predicted_field_is_checked():
    from hetpar.planner._evaluate import _PREDICTED_FIELDS, Predicted

    assert set(_PREDICTED_FIELDS) == {f.name for f in dataclasses.fields(Predicted)}


def test_plan_writes_its_file_before_printing_and_survives_a_closed_pipe(tmp_path):
    graph = tmp_path / "graph.json"
    random_cost_table(4, layers=6, devices=3).save(graph)
    out = tmp_path / "plan.json"
    # As `| head -3` once it has its lines, `true` goes away; at once, so
    # that the first line printed meets a closed pipe every time.
    run = subprocess.run(f"{sys.executable} -m hetpar plan --graph {graph} --explain "
                         f"--out {out} | true", shell=True, capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert "Traceback" not in run.stderr and "BrokenPipeError" not in run.stderr, run.stderr
    Plan.load(out).check(CostTable.load(graph))


def test_layer_listing_is_not_a_graph():
    listing = {"format": "hetpar.layers", "version": 1, "layers": [], "edges": []}
    with pytest.raises(GraphFormatError) as e:
        CostTable.from_json(listing)
    assert ("that file is a layer listing from `hetpar trace`, not the planner's input; write "
            "graph.json with `hetpar costs MODEL --devices LIST --out graph.json`") in str(e.value)


HIGHS = pytest.mark.skipif(not __import__("hetpar.planner").planner.highs_available(),
                           reason="highspy not installed")
SOLVERS = ["cbc", pytest.param("highs", marks=HIGHS)]


@pytest.mark.parametrize("solver", SOLVERS)
def test_solvers_print_nothing(solver, capfd):
    p = plan(random_cost_table(5, layers=9, devices=3, memory="tight"), gap=EXACT, solver=solver,
             baselines=False)
    assert (p.solver["name"], p.solver["status"]) == (solver, "optimal")
    assert capfd.readouterr().out == ""


@pytest.mark.parametrize("solver", SOLVERS)
def test_solvers_print_nothing_in_a_fresh_process(solver, capfd):
    # HiGHS prints its banner once per process, on the first model it creates:
    # only a fresh interpreter shows whether that one stays quiet too.
    code = ("from hetpar.planner import plan\n"
            "from tests.random_tables import random_cost_table\n"
            f"p = plan(random_cost_table(5, layers=9, devices=3), solver={solver!r}, "
            "baselines=False)\n"
            f"assert p.solver['name'] == {solver!r}, p.solver\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120)
    assert run.returncode == 0
    assert capfd.readouterr().out == ""


@HIGHS
def test_highs_agrees_with_cbc():
    table = random_cost_table(2, layers=10, devices=3, memory="tight")
    a = plan(table, gap=EXACT, baselines=False)
    b = plan(table, gap=EXACT, solver="highs", baselines=False)
    assert b.solver["name"] == "highs" and b.solver["status"] == "optimal"
    assert _rel(a.predicted.step_time_s, b.predicted.step_time_s) < 1e-6


def test_cli_end_to_end(tmp_path):
    graph = tmp_path / "graph.json"
    random_cost_table(4, layers=6, devices=3).save(graph)
    out = tmp_path / "plan.json"
    run = subprocess.run([sys.executable, "-m", "hetpar", "plan", "--graph", str(graph),
                          "--objective", "cost", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "exhaustive" in run.stdout and "optimal" in run.stdout
    assert "Running HiGHS" not in run.stdout  # the solver's banner stays out of the report
    p = Plan.load(out)
    assert p.objective == "cost"
    p.check(CostTable.load(graph))
    bad = subprocess.run([sys.executable, "-m", "hetpar", "plan", "--graph",
                          str(tmp_path / "missing.json")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2
    assert "no graph file" in bad.stderr and "Traceback" not in bad.stderr


def _with_fixed(table, frac, seed=0):
    rng = np.random.default_rng(seed)
    layers = tuple(dataclasses.replace(layer, fixed_s={
        d: float(t * frac * rng.random()) for d, t in layer.time_s.items()})
        for layer in table.layers)
    return dataclasses.replace(table, layers=layers)


@pytest.mark.parametrize("seed", range(3))
def test_pipelined_with_fixed_per_microbatch_time_matches_exhaustive(seed):
    table = _with_fixed(random_cost_table(seed, layers=8, devices=3), 0.8, seed)
    p = plan(table, mode="pipelined", microbatches=4, gap=EXACT)
    oracle = exhaustive(table, "time", "pipelined", 4)
    first = p.solver.get("free_objective", p.solver["objective"])
    assert _rel(first, oracle.predicted.step_time_s) < 1e-6
    assert _rel(p.solver["objective"], p.predicted.closed_form_s) < 1e-6
    assert CostTable.from_json(table.to_json()).layers == table.layers


def test_fixed_time_is_paid_by_every_microbatch():
    # Two equal layers on two devices; all of a layer's time fixed: pipelining
    # M microbatches cannot beat running the whole batch once per device.
    table = _two_device_chain(n=2, speed_b=1.0)
    whole = dataclasses.replace(table, layers=tuple(
        dataclasses.replace(layer, fixed_s=dict(layer.time_s)) for layer in table.layers))
    split = {"l0": "a", "l1": "b"}
    ideal = evaluate(table, split, "pipelined", 4).step_time_s
    bound = evaluate(whole, split, "pipelined", 4).step_time_s
    assert ideal == pytest.approx(0.5 + 3 * 0.25, rel=1e-3)  # (M + S - 1) x t / M
    assert bound == pytest.approx(2 + 3 * 1, rel=1e-3)  # every microbatch pays t whole
    assert evaluate(whole, split).step_time_s == evaluate(table, split).step_time_s
    with pytest.raises(GraphFormatError, match="exceeds its time_s"):
        CostTable.from_json({**table.to_json(), "layers": [
            {**table.to_json()["layers"][0], "fixed_s": {"a": 5.0}},
            table.to_json()["layers"][1]]})


def test_price_alone_holds_when_only_one_device_can_run_anything():
    table = _two_device_chain(price_a=0.0)
    devices = (dataclasses.replace(table.devices[0], price_alone_per_hour=2.0), table.devices[1])
    table = dataclasses.replace(table, devices=devices)
    pinned = {layer: "a" for layer in table.layer_names}
    p = plan(table, objective="cost", pins=pinned, gap=EXACT)
    assert p.predicted.cost_usd_per_step == pytest.approx(p.predicted.step_time_s * 2.0 / 3600)
    assert _rel(p.solver["objective"], p.predicted.cost_usd_per_step) < 1e-6
    with pytest.raises(InfeasibleError):
        plan(table, objective="time", pins=pinned, max_cost=p.predicted.cost_usd_per_step / 2)


# -- data parallel --------------------------------------------------------------


def _two_gpus(link_bw=100e9, cap=1e12, param=4e8, fixed=0.0, update=None, latency=1e-5):
    """Two equal GPUs and a host CPU; three layers, 1 s of GPU time in all
    (`update` of each layer's time its optimizer update, when given; `latency`
    the links')."""
    devices = (Device("cpu:0", "cpu", 1e12, 0.0, 200.0, 60.0, price_alone_per_hour=1.0),
               Device("gpu:0", "h100", cap, 3.0, 700.0, 80.0),
               Device("gpu:1", "h100", cap, 3.0, 700.0, 80.0))
    links = tuple(Link(a, b, link_bw if "cpu:0" not in (a, b) else 1e10, latency)
                  for a in ("cpu:0", "gpu:0", "gpu:1") for b in ("cpu:0", "gpu:0", "gpu:1")
                  if a != b)
    times = (0.2, 0.5, 0.3)
    layers = tuple(Layer(f"l{i}", {"cpu:0": 50 * t, "gpu:0": t, "gpu:1": t},
                         dict.fromkeys(("cpu:0", "gpu:0", "gpu:1"), 3e9),
                         activation_bytes=1e9, param_bytes=param / 3,
                         fixed_s={"gpu:0": fixed * t, "gpu:1": fixed * t},
                         update_s=None if update is None else {
                             "cpu:0": 50 * update * t, "gpu:0": update * t,
                             "gpu:1": update * t})
                   for i, t in enumerate(times))
    edges = (Edge("l0", "l1", 1e8, 1e8), Edge("l1", "l2", 1e8, 1e8))
    return CostTable(devices, links, layers, edges)


def test_data_parallel_prediction_by_hand():
    from hetpar.planner import evaluate_data_parallel

    p = evaluate_data_parallel(_two_gpus(fixed=0.1), ["gpu:0", "gpu:1"])
    busy = 0.1 * 1.0 + 0.9 * 1.0 / 2  # fixed part whole, the rest halved
    allreduce = 2 * (2 - 1) * (1e-5 + 4e8 / 2 / 100e9)  # ring, 2 (N-1) steps of grads / N
    assert p.step_time_s == pytest.approx(busy + allreduce)
    assert p.transfer_s == pytest.approx(allreduce)
    assert p.busy_s == {"gpu:0": pytest.approx(busy), "gpu:1": pytest.approx(busy)}
    # Each replica holds all state (2e9 per layer) and half the activations (1e9 per
    # layer), and, as nothing is donated, the new parameters (4e8 in all) and new
    # optimizer state (memory_bytes less 2 x parameters and activations: 6e9 - 8e8),
    # less what the backward frees as it makes the gradients: per layer the
    # smaller of its half of the activations and its gradient (4e8 in all).
    assert p.memory_bytes["gpu:0"] == pytest.approx(
        3 * (2e9 + 0.5e9) + 4e8 + (6e9 - 8e8) - 4e8)
    assert p.cost_usd_per_step == pytest.approx(p.step_time_s * 6.0 / 3600)


def test_data_parallel_replicas_each_run_the_whole_update():
    # Every replica updates all of its parameters: the update does not shrink with
    # the batch share (it looked nearly free at large N before).
    from hetpar.planner import evaluate_data_parallel

    p = evaluate_data_parallel(_two_gpus(fixed=0.1, update=0.3), ["gpu:0", "gpu:1"])
    busy = 0.1 + 0.3 + 0.6 / 2  # fixed and update whole, the rest halved
    assert p.busy_s["gpu:0"] == pytest.approx(busy)


def test_planner_chooses_data_parallel_only_when_it_is_faster():
    # (replicated state: sharded state's candidates are tested in test_sharded)
    fast = plan(_two_gpus(), gap=EXACT, sharded=False)
    assert fast.replicas == ("gpu:0", "gpu:1")
    assert set(fast.assignment.values()) == {"gpu:0"}
    assert fast.predicted.step_time_s == pytest.approx(0.5 + 2 * (1e-5 + 2e8 / 100e9))
    assert fast.baselines["data parallel gpu:0+gpu:1"].predicted == fast.predicted
    assert fast.solver["layer_plan_predicted"]["step_time_s"] == pytest.approx(1.0)
    # Over a slow peer link the all-reduce costs more than it saves.
    slow = plan(_two_gpus(link_bw=1e8), gap=EXACT, sharded=False)
    assert slow.replicas == () and slow.predicted.step_time_s == pytest.approx(1.0)
    assert slow.baselines["data parallel gpu:0+gpu:1"].feasible
    assert plan(_two_gpus(), data_parallel=False).replicas == ()


@pytest.mark.parametrize("edit,reason", [
    (dict(cap=7e9), r"gpu:0 memory: a replica holds .*12.7 GB.*holds 7 GB"),  # with new state
    (dict(param=None), "lacks param_bytes"),
])
def test_data_parallel_obstacles_are_named(edit, reason):
    table = _two_gpus(**{k: v for k, v in edit.items() if k != "param"})
    if "param" in edit:
        table = dataclasses.replace(table, layers=tuple(
            dataclasses.replace(la, param_bytes=None) for la in table.layers))
    p = plan(table, gap=EXACT)
    assert p.replicas == ()
    assert re.search(reason, p.baselines["data parallel gpu:0+gpu:1"].reason)


def test_data_parallel_respects_pins_and_budgets():
    table = _two_gpus().with_pins({"l0": "cpu:0"})
    assert "cannot run on" in plan(table).baselines["data parallel gpu:0+gpu:1"].reason
    capped = plan(_two_gpus(), max_step_time=0.9)  # DP (0.504 s) meets it, alone
    assert capped.replicas == ("gpu:0", "gpu:1")


def test_plan_file_keeps_replicas_and_rejects_bad_ones(tmp_path):
    p = plan(_two_gpus())
    p.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").replicas == ("gpu:0", "gpu:1")
    data = p.to_json()
    data["replicas"] = ["gpu:0"]
    with pytest.raises(PlanError, match="replicas must list two or more"):
        Plan.from_json(data)
    data["replicas"] = ["gpu:0", "gpu:7"]
    with pytest.raises(PlanError, match=r"\['gpu:7'\], which are not among"):
        Plan.from_json(data).check(_two_gpus())
    table = _two_gpus()
    again = CostTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again.layers[0].param_bytes == pytest.approx(4e8 / 3)
    bad = table.to_json()
    bad["layers"][0]["param_bytes"] = -1
    with pytest.raises(GraphFormatError, match=r"layers\[0\].*param_bytes"):
        CostTable.from_json(bad)


# -- replaying the schedule ---------------------------------------------------


def _chain(times, devices=("a", "b"), edge_bytes=1.0, bw=1e15, lat=0.0):
    devs = tuple(Device(d, "gpu", 1e12) for d in devices)
    links = tuple(Link(x, y, bw, lat) for x in devices for y in devices if x != y)
    layers = tuple(Layer(f"l{i}", dict.fromkeys(devices, t), dict.fromkeys(devices, 1.0))
                   for i, t in enumerate(times))
    edges = tuple(Edge(f"l{i}", f"l{i + 1}", edge_bytes, edge_bytes)
                  for i in range(len(times) - 1))
    return CostTable(devs, links, layers, edges)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_replay_of_two_equal_stages_is_the_textbook_pipeline(schedule, m):
    # Two stages of t per microbatch (forward t/3, backward 2t/3): the last
    # backward ends at (M + S - 1) t, which is also the closed form.
    t = 0.012
    table = _chain([t * m, t * m])
    r = simulate(table, {"l0": "a", "l1": "b"}, m, schedule)
    assert r.step_time_s == pytest.approx((m + 1) * t, rel=1e-6)
    closed = evaluate(table, {"l0": "a", "l1": "b"}, "pipelined", m)
    assert closed.step_time_s == pytest.approx(r.step_time_s, rel=1e-6)
    assert r.schedule == schedule
    assert r.busy_s == pytest.approx({"a": t * m, "b": t * m})
    assert len(r.stages) == (4 * m if m > 1 else 3)  # a fwd, b fwd+bwd, a bwd when M = 1


def test_replay_prices_transfers_on_the_link():
    # One microbatch, a -> b: forward a, send, forward+backward b, send back, backward a.
    table = _chain([3.0, 3.0], edge_bytes=2e9, bw=1e9, lat=0.5)
    r = simulate(table, {"l0": "a", "l1": "b"}, 1)
    assert r.step_time_s == pytest.approx(3.0 + 2 * (0.5 + 2.0) + 2 * 0.0 + 3.0 - 0.0)


def test_a_measured_link_curve_prices_copies_by_size():
    # Copies at 3 GB/s up to 32 MB, 1 GB/s beyond (an H100 host's CPU device
    # -> GPU): the curve's seconds beyond a small copy, plus the latency.
    curve = ((32e6, 32e6 / 3e9), (256e6, 32e6 / 3e9 + 224e6 / 1e9))
    link = Link("a", "b", 2e9, 1e-3, curve=curve)
    assert link.seconds(16e6) == pytest.approx(1e-3 + 16e6 / 3e9)
    assert link.seconds(128e6) == pytest.approx(1e-3 + 32e6 / 3e9 + 96e6 / 1e9)
    assert link.seconds(512e6) == pytest.approx(1e-3 + 32e6 / 3e9 + 480e6 / 1e9)  # last slope
    assert Link("a", "b", 2e9, 1e-3).seconds(16e6) == pytest.approx(1e-3 + 8e-3)
    assert link.seconds(0.0) == pytest.approx(1e-3)
    # A flat or dipping last segment extends at the curve's average rate.
    flat = Link("a", "b", 2e9, 0.0, curve=((1e6, 1e-3), (2e6, 1e-3)))
    assert flat.seconds(4e6) == pytest.approx(1e-3 + 2e6 * (1e-3 / 2e6))
    # The replay, the closed form and the ILP's edge costs all read it, each
    # direction its own: a -> b by the curve, b -> a (the gradient) at its
    # bandwidth. l0 may run only on a, l1 only on b, so the edge crosses.
    base = _chain([3.0, 3.0], edge_bytes=128e6, bw=2e9, lat=1e-3)
    base = dataclasses.replace(base, layers=(
        dataclasses.replace(base.layers[0], allowed=("a",)),
        dataclasses.replace(base.layers[1], allowed=("b",))))
    curved = dataclasses.replace(base, links=tuple(
        dataclasses.replace(k, curve=curve) if k.src == "a" else k for k in base.links))
    there, back = link.seconds(128e6), 1e-3 + 128e6 / 2e9
    asg = {"l0": "a", "l1": "b"}
    r0, r = simulate(base, asg, 1), simulate(curved, asg, 1)
    assert r.transfer_s == pytest.approx(there + back)
    assert r0.transfer_s == pytest.approx(2 * back)
    assert evaluate(curved, asg).step_time_s == pytest.approx(6.0 + there + back)
    p = plan(curved, gap=EXACT)
    assert p.assignment == asg
    assert p.predicted.step_time_s == pytest.approx(6.0 + there + back)
    flipped = dataclasses.replace(base, links=tuple(
        dataclasses.replace(k, curve=curve) if k.src == "b" else k for k in base.links))
    assert plan(flipped, gap=EXACT).predicted.step_time_s == pytest.approx(
        6.0 + back + there)  # the same sum: now the gradient goes by the curve
    assert simulate(flipped, asg, 1).transfer_s == pytest.approx(there + back)
    from hetpar.planner._evaluate import Arrays

    for table, fwd, grad in ((curved, there, back), (flipped, back, there)):
        f, b = Arrays(table).edge_parts(1)  # edge 0 placed (a, b): f on a -> b, b on b -> a
        assert (f[0, 0, 1], b[0, 0, 1]) == (pytest.approx(fwd), pytest.approx(grad))
    # Written with the table and read back; a table without curves has none.
    again = CostTable.from_json(json.loads(json.dumps(curved.to_json())))
    assert again.links == curved.links
    assert "curve" not in json.dumps(base.to_json())
    bad = curved.to_json()
    bad["links"][0]["curve"] = [[64e6, 0.1], [32e6, 0.2]]
    with pytest.raises(GraphFormatError, match=r"links\[0\].curve's bytes must rise"):
        CostTable.from_json(bad)
    bad["links"][0]["curve"] = [[64e6]]
    with pytest.raises(GraphFormatError, match=r"links\[0\].curve\[0\] must be \[bytes, seconds\]"):
        CostTable.from_json(bad)
    bad["links"][0]["curve"] = [[64e6, -1.0]]
    with pytest.raises(GraphFormatError, match="curve.0. seconds"):
        CostTable.from_json(bad)


def test_stage_overhead_is_paid_per_stage_and_per_crossing():
    # A calibrated table's devices carry the runtime's cost per stage
    # (measured by profile="measure"): the replay charges it once per stage,
    # the closed form (and so the ILP) once per crossing, on the receiver.
    base = _chain([3.0, 3.0], edge_bytes=2e9, bw=1e9, lat=0.5)
    over = {"a": 0.25, "b": 0.125}
    table = dataclasses.replace(base, devices=tuple(
        dataclasses.replace(d, stage_overhead_s=over[d.name]) for d in base.devices))
    asg = {"l0": "a", "l1": "b"}
    r0, r = simulate(base, asg, 1), simulate(table, asg, 1)
    # Stages: a fwd, b fwd+bwd, a bwd (a chain: nothing overlaps).
    assert [s.device for s in r.stages] == ["a", "b", "a"]
    assert r.step_time_s == pytest.approx(r0.step_time_s + 2 * 0.25 + 0.125)
    seq0, seq = evaluate(base, asg), evaluate(table, asg)
    assert seq.step_time_s == pytest.approx(seq0.step_time_s + 0.125 + 0.25)  # a->b, b->a
    assert plan(table, gap=EXACT).predicted.step_time_s == pytest.approx(
        evaluate(table, plan(table, gap=EXACT).assignment).step_time_s)
    # Written with the table; a table without it reads as 0.
    again = CostTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again.device("b").stage_overhead_s == 0.125
    assert "stage_overhead_s" not in json.dumps(base.to_json())


def test_replay_prices_a_stage_with_the_fusion_its_layers_can_have():
    # Five layers of 1 s alone; the whole step on `a` took 4 s (f = 0.8: what
    # one executable gains across the layers' 4 boundaries). A stage holding
    # all five runs at the scaled 4 s; a stage of one layer gains nothing
    # (its 1 s alone), of k layers 1 - 0.2 (k - 1) / 4 of its time alone.
    base = _chain([1.0] * 5, edge_bytes=0.0)
    table = scale_to_step(base, {"a": 4.0})
    assert table.meta["step_scale"]["a"] == pytest.approx(0.8)
    every = dict.fromkeys(base.layer_names, "a")
    assert simulate(table, every, 1).busy_s["a"] == pytest.approx(4.0)
    # l2 alone on `b` (unscaled: its step was not timed); `a` holds l0-l1
    # and l3-l4, two stages of two layers each side of it (fwd and bwd).
    split = {**every, "l2": "b"}
    r = simulate(table, split, 1)
    two = 2 * 1.0 * (1 - 0.2 * 1 / 4)
    assert r.busy_s == pytest.approx({"a": 2 * two, "b": 1.0})
    assert r.step_time_s == pytest.approx(2 * two + 1.0)
    # A factor >= 1 (the step slower than its layers) stays on every stage.
    slow = scale_to_step(base, {"a": 6.0, "b": 6.0})
    assert simulate(slow, split, 1).busy_s == pytest.approx({"a": 4.8, "b": 1.2})
    # An unscaled table replays its layers' times as they are.
    assert simulate(base, split, 1).busy_s == pytest.approx({"a": 4.0, "b": 1.0})


def test_replay_sees_a_device_visited_twice_wait():
    # a -> b -> a: the closed form balances 2t against 2t and expects a
    # pipeline; GPipe's per-device order makes `a` finish each microbatch's
    # last layer before it starts the next microbatch's first, so the replay
    # is far slower. A contiguous split (3t against t) replays faster.
    m, t = 8, 1.0
    table = _chain([t * m, 2 * t * m, t * m])
    pingpong = {"l0": "a", "l1": "b", "l2": "a"}
    closed = evaluate(table, pingpong, "pipelined", m).step_time_s
    replay = simulate(table, pingpong, m).step_time_s
    assert replay > 1.5 * closed
    contiguous = {"l0": "a", "l1": "b", "l2": "b"}
    assert simulate(table, contiguous, m).step_time_s < replay
    # The planner tries both and keeps the contiguous plan.
    p = plan(table, mode="pipelined", microbatches=m, gap=EXACT)
    assert p.contiguous and not violations(table, p.assignment, contiguous=True)
    assert set(p.solver["replayed"]) == {"free", "contiguous"}
    assert p.predicted.step_time_s == pytest.approx(p.solver["replayed"]["contiguous"])
    assert p.predicted.closed_form_s is not None
    assert "replays the gpipe schedule" in p.summary()
    again = Plan.from_json(json.loads(json.dumps(p.to_json())))
    assert again.predicted == p.predicted


def test_replayed_cost_and_energy_use_the_replayed_step():
    devices = (Device("a", "gpu", 1e12, 3.6, 100.0, 10.0), Device("b", "gpu", 1e12, 7.2, 100.0,
                                                                    10.0))
    base = _chain([8.0, 16.0, 8.0])
    table = dataclasses.replace(base, devices=devices)
    asg = {"l0": "a", "l1": "b", "l2": "a"}
    p = evaluate_replayed(table, asg, 8, "gpipe")
    assert p.schedule == "gpipe" and p.step_time_s > p.closed_form_s
    assert p.cost_usd_per_step == pytest.approx(p.step_time_s * (3.6 + 7.2) / 3600)
    busy = p.busy_s
    assert p.energy_j_per_step == pytest.approx(
        sum(100.0 * busy[d] + 10.0 * (p.step_time_s - busy[d]) for d in "ab"))


def test_replay_rejects_bad_input():
    table = _chain([1.0, 1.0])
    with pytest.raises(PlanError, match="microbatches"):
        simulate(table, {"l0": "a", "l1": "b"}, 0)
    with pytest.raises(PlanError, match="lacks layers"):
        simulate(table, {"l0": "a"}, 2)
    with pytest.raises(ValueError, match="schedule"):
        simulate(table, {"l0": "a", "l1": "b"}, 2, "zigzag")
    with pytest.raises(PlanError, match="schedule"):
        plan(table, mode="pipelined", microbatches=2, schedule="zigzag")


@pytest.mark.parametrize("seed", range(6))
def test_working_sets_ilp_matches_exhaustive_and_baselines_respect_them(seed):
    """Layers with working sets (`Layer.workspace_bytes`: held one at a time
    on a device, on top of what its layers hold) on tight devices: the ILP's
    `ws_j` finds the exhaustive optimum, and every plan and baseline fits
    memory as `violations` counts it (with the largest working set)."""
    table = random_cost_table(seed, layers=8, devices=3, shape="dag", memory="tight")
    rng = np.random.default_rng(seed)
    caps = {d.name: d.memory_bytes for d in table.devices}
    table = dataclasses.replace(table, layers=tuple(
        dataclasses.replace(layer, workspace_bytes=float(
            rng.uniform(0, 0.3) * min(caps.values())))
        for layer in table.layers))
    try:
        p = plan(table, objective="time", gap=EXACT)
    except InfeasibleError:
        assert exhaustive(table, "time").predicted is None
        return
    assert violations(table, p.assignment) == []
    oracle = p.baselines["exhaustive"]
    assert oracle.predicted is not None and violations(table, oracle.assignment) == []
    assert _rel(p.predicted.step_time_s, oracle.predicted.step_time_s) < 1e-6
    for name, r in p.baselines.items():
        if r.predicted is not None:
            assert violations(table, r.assignment) == [], name


def test_explain_counts_a_working_set_in_memory_full():
    """Layer b would run faster on the GPU but its 6 GB working set does not
    fit beside a's 5 GB in 10 GB: the plan puts it on the CPU, and the
    explanation says why (memory, its working set included)."""
    gb = 1e9
    devices = (Device("cpu:0", "cpu", 100 * gb, 0.0, 100.0, 50.0),
               Device("gpu:0", "h100", 10 * gb, 1.0, 700.0, 70.0))
    links = (Link("cpu:0", "gpu:0", 10e9, 1e-5), Link("gpu:0", "cpu:0", 10e9, 1e-5))
    layers = (Layer("a", time_s={"cpu:0": 1.0, "gpu:0": 0.01},
                    memory_bytes={"cpu:0": 5 * gb, "gpu:0": 5 * gb}),
              Layer("b", time_s={"cpu:0": 0.02, "gpu:0": 0.01},
                    memory_bytes={"cpu:0": 1 * gb, "gpu:0": 1 * gb}, workspace_bytes=6 * gb))
    table = CostTable(devices, links, layers, (Edge("a", "b", 1e3, 1e3),))
    p = plan(table, gap=EXACT)
    assert p.assignment == {"a": "gpu:0", "b": "cpu:0"}
    text = p.explain(table)
    b_lines = text[text.index("b -> cpu:0"):]
    assert "memory full: would exceed gpu:0 by 2 GB" in b_lines


# Issue 45, item 5: large M ran for minutes with no output.
def test_the_order_of_work_is_not_quadratic_in_microbatches():
    from hetpar.core import device_aware_order

    # M microbatches' forwards on one device, all ready at once, each its own
    # stage key, then their backwards: a scan of every ready key at each
    # switch took ~15 s at M=4096 (12.7 s at M=1024). Counted, not timed (a
    # ratio of timings flaked on a loaded 2-core machine): every look at a
    # key's parts (its microbatch and phase, for its priority) is counted;
    # the scan looked at every ready key at every switch, about M^2 / 2 =
    # 8.4 million times here, a priority queue a few times per item.
    looks = [0]

    class Key(tuple):
        def __getitem__(self, i):
            looks[0] += 1
            return tuple.__getitem__(self, i)

        def __iter__(self):
            looks[0] += 1
            return tuple.__iter__(self)

    M = 4096
    keys = [Key(("a", m, "forward")) for m in range(M)] + [
        Key(("a", m, "backward")) for m in range(M)]
    deps = [set() for _ in range(M)] + [{m} for m in range(M)]
    assert device_aware_order(deps, keys) == list(range(2 * M))
    assert looks[0] <= 4 * len(keys)


def test_too_many_microbatches_are_refused_at_once(tmp_path, capsys):
    from hetpar import cli
    from hetpar.planner._solve import MAX_REPLAYED_WORK

    table = random_cost_table(3, layers=7, devices=2)
    with pytest.raises(PlanError, match=r"1000000 microbatches x 7 layers .* pass "
                                        rf"microbatches={MAX_REPLAYED_WORK // 7} or fewer"):
        plan(table, mode="pipelined", microbatches=1_000_000)
    graph = tmp_path / "graph.json"
    table.save(graph)
    argv = ["plan", "--graph", str(graph), "--mode", "pipelined", "--microbatches"]
    assert cli._main(cli._parser().parse_args([*argv, "1000000"])) == 2
    assert f"pass --microbatches {MAX_REPLAYED_WORK // 7} or fewer" in capsys.readouterr().err
    # Long replays (microbatches x layers over REPLAY_PROGRESS_WORK) say so as they go.
    assert cli._main(cli._parser().parse_args([*argv, "1024", "--no-offload"])) == 0
    out = capsys.readouterr().out
    assert "replaying the gpipe schedule of 1024 microbatches over 7 layers" in out, out

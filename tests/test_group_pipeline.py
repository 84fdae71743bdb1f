"""Pipelines whose stages are sharded device groups (issue 43) on the four
virtual CPU devices: each equals `jax.jit` on one device, leaf by leaf;
the state stays sharded on its layer's group (or in its members' pinned
host memory) from step to step; the planner prices groups as devices and
picks a pipeline of groups where it wins; plan.json records the groups."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetpar
from hetpar import zoo
from hetpar.core import CostTable, Device, Edge, Layer, Link, PlanError
from hetpar.planner import Group, Plan, group_table, groups_of, plan
from hetpar.planner._sharded import FSDP_HIDDEN
from hetpar.runtime import shard_axis

from . import oracle
from .test_multi_accelerator import two_gpu_profiles
from .test_sharded import _flax_step

GROUPS = [["cpu:0", "cpu:1"], ["cpu:2", "cpu:3"]]
A, B = "cpu:0+cpu:1", "cpu:2+cpu:3"


def _pinned(step, args, where: dict):
    """The step's plan with layers placed as `where` says ({layer: group}),
    through plan.json: a given plan with groups runs as planned."""
    p = step.lower(*args).plan
    return Plan.from_json(json.loads(json.dumps(
        dataclasses.replace(p, assignment={**p.assignment, **where}).to_json())))


def _check_on_groups(state_out, step, args, sharded_params: bool):
    """Every state leaf lives on its layer's group, split on its largest
    axis the group divides (parameters only when `sharded_params`)."""
    groups = step.lower(*args).plan.groups
    meshes = {frozenset(str(d) for d in g.devices) for g in groups.values()}
    params, opt_state = state_out
    for x in jax.tree.leaves(params):
        assert len(x.sharding.device_set) == 2
        axis = shard_axis(x.shape, 2) if sharded_params else None
        assert tuple(x.sharding.spec) == (() if axis is None else (*[None] * axis, "replica"))
    for x in jax.tree.leaves(opt_state):
        axis = shard_axis(x.shape, 2)
        assert tuple(x.sharding.spec) == (() if axis is None else (*[None] * axis, "replica"))
    assert len(meshes) == 2


# -- runtime ----------------------------------------------------------------------


@pytest.mark.parametrize("schedule", [  # zero1 groups run 1F1B in the fast tier
    pytest.param("gpipe", marks=pytest.mark.slow), pytest.param("1f1b", marks=pytest.mark.slow)])
def test_pipeline_of_two_fsdp_groups_equals_jit(schedule):
    w = zoo.get("mlp", small=True, batch=8)
    args = w.example_args()
    step = hetpar.auto(w.train_step, groups=GROUPS, microbatches=2, schedule=schedule,
                       profile="spec")
    given = _pinned(step, args, {"fc1": A, "fc2": B, "fc3": B})
    assert set(given.groups) == {A, B} and given.groups[A].sharding == "fsdp"
    step = hetpar.auto(w.train_step, plan=given, microbatches=2, schedule=schedule,
                       profile="spec")
    out = oracle.check_steps_equal_jit(step, w.train_step, args)
    _check_on_groups(out[:2], step, args, sharded_params=True)
    fc1 = out[0]["params"]["fc1"]["kernel"]
    fc2 = out[0]["params"]["fc2"]["kernel"]
    assert {d.id for d in fc1.sharding.device_set} == {0, 1}
    assert {d.id for d in fc2.sharding.device_set} == {2, 3}
    assert fc1.addressable_shards[0].data.shape == (32, 32)  # (64, 32) split in two


def test_zero1_groups_replicate_parameters_and_split_optimizer_state():
    w = zoo.get("mlp", small=True, batch=8)
    args = w.example_args()
    step = hetpar.auto(w.train_step, groups=GROUPS, microbatches=2, data_parallel="zero1",
                       schedule="1f1b", profile="spec")
    out = oracle.check_steps_equal_jit(step, w.train_step, args)
    assert {g.sharding for g in step.plan.groups.values()} == {"zero1"}
    _check_on_groups(out[:2], step, args, sharded_params=False)


def test_offloaded_group_state_rests_in_pinned_host_memory_and_equals_jit():
    w = zoo.get("mlp", small=True, batch=8)
    args = w.example_args()
    step = hetpar.auto(w.train_step, groups=GROUPS, microbatches=2,
                       group_state="pinned_host", profile="spec")
    out = oracle.check_steps_equal_jit(step, w.train_step, args)
    assert {g.state for g in step.plan.groups.values()} == {"pinned_host"}
    leaves = jax.tree.leaves(out[:2])
    assert {x.sharding.memory_kind for x in leaves} == {"pinned_host"}
    assert any("replica" in tuple(x.sharding.spec) for x in leaves)  # each member its shard
    assert "state resting in each member's pinned host memory" in step.explain()


@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_a_step_with_jax_value_and_grad_runs_on_groups_and_is_told_about_microbatches():
    train_step, args = _flax_step()
    step = hetpar.auto(train_step, groups=GROUPS, profile="spec")
    oracle.check_steps_equal_jit(step, train_step, args)
    assert set(step.plan.assignment.values()) <= {A, B}
    # Its layers on both groups one after another: explain() and report() say
    # how to overlap them.
    given = _pinned(step, args, {"Dense_0": A, "LayerNorm_0": B, "Dense_1": B})
    step = hetpar.auto(train_step, plan=given, profile="spec")
    oracle.check_steps_equal_jit(step, train_step, args)
    hint = ("microbatches: the layers run on 2 groups (cpu:0+cpu:1, cpu:2+cpu:3) one after "
            "another; with microbatches they overlap as a pipeline: take the gradient with "
            "hetpar.value_and_grad")
    assert hint in step.explain() and hint in str(step.report())
    with pytest.raises(hetpar.HetparError, match="hetpar.value_and_grad"):
        hetpar.auto(train_step, groups=GROUPS, microbatches=2, profile="spec")(*args)


@pytest.mark.slow  # 3-4 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_auto_chooses_a_group_plan_itself_and_runs_it_equal_to_jit():
    import itertools

    from hetpar.cost_models import LinkProfile, ProfileSet, spec

    # The four CPU devices priced as H100s, paired by fast links, slow across.
    cpus = [f"cpu:{i}" for i in range(4)]
    links = tuple(LinkProfile(a, b, "device_put", 1e-8,
                              300e9 if int(a[-1]) // 2 == int(b[-1]) // 2 else 1e6, "test")
                  for a, b in itertools.permutations(cpus, 2))
    profiles = ProfileSet({n: spec("h100").replace(name=n, origin="measured") for n in cpus},
                          links)
    w = zoo.get("mlp", small=True, batch=8)
    step = hetpar.auto(w.train_step, microbatches=2, profile=profiles)
    oracle.check_steps_equal_jit(step, w.train_step, w.example_args())
    assert step.plan.groups and " groups cpu:0+cpu:1 | cpu:2+cpu:3" in step.plan.solver["chosen"]
    base = step.plan.baselines
    assert base["fsdp cpu:0+cpu:1+cpu:2+cpu:3"].predicted.step_time_s > (
        10 * step.plan.predicted.step_time_s)  # whole-step FSDP gathers across slow links


# -- bad input --------------------------------------------------------------------


def test_a_group_naming_absent_devices_is_refused_naming_them():
    w = zoo.get("mlp", small=True, batch=8)
    step = hetpar.auto(w.train_step, groups=[["cpu:0", "cpu:1"], ["cpu:2", "cpu:7"]],
                       profile="spec")
    with pytest.raises(PlanError, match=r"group cpu:2\+cpu:7 names cpu:7, which is not present"):
        step(*w.example_args())


def test_a_group_of_mixed_kinds_is_refused_naming_them():
    w = zoo.get("mlp", small=True, batch=8)  # cpu:2 is an h100 in these profiles
    step = hetpar.auto(w.train_step, groups=[["cpu:0", "cpu:2"]], profile=two_gpu_profiles())
    with pytest.raises(PlanError, match=r"mixes kinds: cpu:0 \(cpu\), cpu:2 \(h100\)"):
        step(*w.example_args())


@pytest.mark.parametrize("groups,match", [
    ([["cpu:0", "cpu:1"], ["cpu:1", "cpu:2"]], "name cpu:1 more than once"),
    ([["cpu:0"], []], "groups must be a list of device lists"),
    ("cpu:0", "groups must be a list of device lists"),
])
def test_bad_groups_are_refused_when_decorating(groups, match):
    with pytest.raises(PlanError, match=match):
        hetpar.auto(lambda p, b: p, groups=groups)


# -- planner ----------------------------------------------------------------------

GPUS = [f"gpu:{i}" for i in range(4)]
PAIRS = [["gpu:0", "gpu:1"], ["gpu:2", "gpu:3"]]


def _four_gpus(cap=1e12, cross_bw=1e9, param=1e8):
    """Four equal GPUs, fast links within the pairs (0, 1) and (2, 3), slow
    across; four layers of 0.25 s, each holding 3 GB (1 GB activations)."""
    devices = tuple(Device(d, "h100", cap, 3.0, 700.0, 80.0) for d in GPUS)

    def bw(a, b):
        return 100e9 if int(a[-1]) // 2 == int(b[-1]) // 2 else cross_bw

    links = tuple(Link(a, b, bw(a, b), 1e-5) for a in GPUS for b in GPUS if a != b)
    opt = 3e9 - 2 * param - 1e9
    layers = tuple(Layer(f"l{i}", dict.fromkeys(GPUS, 0.25), dict.fromkeys(GPUS, 3e9),
                         activation_bytes=1e9, param_bytes=param,
                         state_leaves=(("param", (1024, 8), param),
                                       ("opt_state", (1024, 8), opt)))
                   for i in range(4))
    edges = tuple(Edge(f"l{i}", f"l{i + 1}", 1e8, 1e8) for i in range(3))
    return CostTable(devices, links, layers, edges)


def test_a_layer_on_a_group_is_priced_by_hand():
    table = group_table(_four_gpus(), groups_of(PAIRS, "fsdp"))
    assert table.device_names == ("gpu:0+gpu:1", "gpu:2+gpu:3")
    layer = table.layers[0]
    # three ring all-gathers of 1e8 over two, half hidden behind compute
    gather = (1 - FSDP_HIDDEN) * 3 * (1e-5 + 1e8 / 2 / 100e9)
    assert layer.time_s["gpu:0+gpu:1"] == pytest.approx(0.25 / 2 + gather)
    assert layer.fixed_s["gpu:0+gpu:1"] == pytest.approx(gather)  # per microbatch
    # A member's share: parameters and gradient, activations, optimizer state.
    assert layer.memory_bytes["gpu:0+gpu:1"] == pytest.approx(2 * 0.5e8 + 0.5e9 + 0.9e9)
    assert layer.workspace_bytes == pytest.approx(2 * 0.5e8)  # gathered, unreduced
    assert table.edges[0].bytes == pytest.approx(0.5e8)  # member to member, in parallel
    assert table.link("gpu:0+gpu:1", "gpu:2+gpu:3").bandwidth_bytes_per_s == 1e9


def test_planner_picks_a_pipeline_of_fsdp_groups_when_no_group_holds_the_model():
    # 5 GB a device: one pair cannot hold the model sharded (10 GB a member),
    # nor replicas; the whole step sharded over all four fits (4.95 GB) but
    # gathers every layer over the slow links between the pairs.
    p = plan(_four_gpus(cap=5e9), mode="pipelined", microbatches=4)
    base = p.baselines
    assert "fsdp groups gpu:0+gpu:1 | gpu:2+gpu:3" == p.solver["chosen"]
    assert set(p.groups) == {"gpu:0+gpu:1", "gpu:2+gpu:3"}
    assert set(p.assignment.values()) == set(p.groups)  # both groups hold layers
    assert (base["fsdp gpu:0+gpu:1+gpu:2+gpu:3"].predicted.step_time_s
            > 1.5 * p.predicted.step_time_s)
    assert not base["data parallel gpu:0+gpu:1+gpu:2+gpu:3"].feasible
    layers_alone = base["exhaustive"].predicted.step_time_s  # one layer a GPU
    assert p.predicted.step_time_s < 0.75 * layers_alone
    assert max(p.predicted.peak_memory_bytes.values()) <= 5e9
    # Without sharded state (data_parallel="replicated") only layer placements remain.
    assert not plan(_four_gpus(cap=5e9), mode="pipelined", microbatches=4,
                    sharded=False).groups


def test_planner_prefers_groups_where_the_cross_pair_links_are_slow():
    # Memory to spare: whole-step FSDP over four gathers across the slow links.
    p = plan(_four_gpus(), mode="pipelined", microbatches=4)
    assert p.groups and p.solver["chosen"].endswith("groups gpu:0+gpu:1 | gpu:2+gpu:3")
    assert p.baselines["fsdp gpu:0+gpu:1+gpu:2+gpu:3"].predicted.step_time_s > (
        2 * p.predicted.step_time_s)
    # Fast links everywhere: the whole step data parallel over four wins.
    assert not plan(_four_gpus(cross_bw=100e9), mode="pipelined", microbatches=4).groups


def test_explain_says_why_the_groups_were_chosen_over_the_alternatives():
    table = _four_gpus(cap=5e9)
    p = plan(table, mode="pipelined", microbatches=4)
    text = p.explain(table)
    assert text.startswith("group gpu:0+gpu:1: 2 layers data parallel over 2 devices, "
                           "parameters and optimizer state sharded")
    assert "chosen: fsdp groups gpu:0+gpu:1 | gpu:2+gpu:3, predicted" in text
    assert "    exhaustive: 501 ms (1.45x)" in text
    assert "    data parallel gpu:0+gpu:1+gpu:2+gpu:3: infeasible: gpu:0 memory" in text
    assert re.search(r"    fsdp gpu:0\+gpu:1\+gpu:2\+gpu:3: [\d.]+ (ms|s) \([\d.]+x\)", text)
    # A layer no group size divides keeps its state whole, and explain says so.
    odd = dataclasses.replace(table, layers=tuple(
        dataclasses.replace(la, state_leaves=(("param", (3, 5), 1e8),
                                              ("opt_state", (3, 5), 1.8e9)))
        if la.name == "l3" else la for la in table.layers))
    p = dataclasses.replace(p, fingerprint=odd.fingerprint())
    where = p.assignment["l3"]
    assert (f"group {where}" in p.explain(odd) and "    l3: 2 state leaves stay replicated: "
            "no axis of theirs is a multiple of 2" in p.explain(odd))


def test_group_plans_round_trip_and_old_plans_load(tmp_path):
    p = plan(_four_gpus(cap=5e9), mode="pipelined", microbatches=4)
    p.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == p and loaded.groups["gpu:0+gpu:1"] == Group(("gpu:0", "gpu:1"), "fsdp")
    data = p.to_json()
    old = plan(_four_gpus(cap=5e9), mode="pipelined", microbatches=4, sharded=False).to_json()
    assert "groups" not in old and Plan.from_json(old).groups == {}  # a plan from before
    lost = {k: v for k, v in data.items() if k != "groups"}  # layers on groups it lacks
    with pytest.raises(PlanError, match=r"places layers on \['gpu:0\+gpu:1'"):
        Plan.from_json(lost)
    bad = {**data, "groups": {"gpu:0+gpu:9": {"devices": ["gpu:0", "gpu:1"]}}}
    with pytest.raises(PlanError, match=r"groups.gpu:0\+gpu:9 lists devices.*joined by '\+'"):
        Plan.from_json(bad)
    bad = {**data, "groups": {"gpu:0+gpu:1": {"devices": ["gpu:0", "gpu:1"],
                                               "sharding": "zero3"}}}
    with pytest.raises(PlanError, match=r"groups.gpu:0\+gpu:1: a group's sharding.*'zero3'"):
        Plan.from_json(bad)
    with pytest.raises(PlanError, match="replicas.*or groups.*not both"):
        Plan.from_json({**data, "replicas": ["gpu:0", "gpu:1"]})


@pytest.mark.slow  # 4 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_a_group_plans_compiled_stages_are_checked_before_it_runs(monkeypatch):
    # Each member's peak comes from its stages' compiled memory, replayed in
    # the order the runner dispatches them: it holds at least its share of
    # the state resting on its group (the caller's copy: nothing donated),
    # and less where that state rests in pinned host memory.
    import hetpar._memory_check as check
    from hetpar.core import InfeasibleError

    w = zoo.get("mlp", small=True, batch=8)
    args = w.example_args()
    peaks, held = {}, {}
    for state in ("device", "pinned_host"):
        step = hetpar.auto(w.train_step, groups=GROUPS, microbatches=2, group_state=state,
                           profile="spec")
        compiled = step.lower(*args)
        figures, where = compiled.compiled_memory
        assert set(figures) == {"cpu:0", "cpu:1", "cpu:2", "cpu:3"}
        assert figures["cpu:0"] == figures["cpu:1"] and "group cpu:0+cpu:1, stage" in where["cpu:0"]
        peaks[state] = figures
        amount, unit = re.search(r"held ([\d.]+) (k?B|MB)", where["cpu:0"]).groups()
        held[state] = float(amount) * {"B": 1, "kB": 1e3, "MB": 1e6}[unit]
    whole = sum(x.nbytes for x in jax.tree.leaves(args[:2]))
    assert sum(peaks["device"].values()) >= whole  # every member its share, at least
    # Offloaded, what rests on the members between stages is less; a stage
    # still brings its layers' state in while it runs.
    assert held["pinned_host"] < held["device"]
    assert all(peaks["pinned_host"][d] <= peaks["device"][d] for d in peaks["device"])
    # A stage whose working set no member holds: one line before anything runs,
    # the caller's state untouched.
    monkeypatch.setattr(check, "stage_working_bytes", lambda m: 1e15)
    before = [np.array(x) for x in jax.tree.leaves(args)]
    step = hetpar.auto(w.train_step, groups=GROUPS, microbatches=2, profile="spec")
    with pytest.raises(InfeasibleError) as info:
        step(*args)
    assert "\n" not in str(info.value) and "Nothing ran" in str(info.value)
    for a, b in zip(jax.tree.leaves(args), before):
        np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.slow  # 5 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_a_group_plan_donates_the_state_it_replaces():
    # donate_argnums on a group plan, as jax.jit has it: the caller's state
    # ends the step deleted, the batch not; the results equal jit's on a
    # copy, and the compiled check counts the old state once.
    w = zoo.get("mlp", small=True, batch=8)
    args = w.example_args()
    copies = jax.tree.map(lambda x: jnp.array(x, copy=True), args)
    kept = hetpar.auto(w.train_step, groups=GROUPS, microbatches=2, profile="spec")
    step = hetpar.auto(w.train_step, groups=GROUPS, microbatches=2, profile="spec",
                       donate_argnums=(0, 1))
    placed = step.place(*args)
    out = step(*placed)
    oracle.assert_equals_jit(out, w.train_step, copies)
    assert all(x.is_deleted() for x in jax.tree.leaves(placed[:2]))
    assert not any(x.is_deleted() for x in jax.tree.leaves(placed[2]))
    out = step(*out[:-1], placed[2])  # the next step takes what the last returned
    assert step._last.compiled_memory[0]["cpu:0"] < kept.lower(*copies).compiled_memory[0]["cpu:0"]


@pytest.mark.slow  # 3 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_state_donated_to_an_earlier_step_is_one_line_not_a_crash():
    # Passing again the state a donating group plan gave up: the error
    # jax.jit gives, explained, before any stage runs (it crashed the
    # process when a stage's executable got the deleted buffer).
    w = zoo.get("mlp", small=True, batch=8)
    step = hetpar.auto(w.train_step, groups=GROUPS, microbatches=2, profile="spec",
                       donate_argnums=(0, 1))
    placed = step.place(*w.example_args())
    step(*placed)
    with pytest.raises(hetpar.HetparError, match=r"an argument was deleted: donate_argnums"):
        step(*placed)

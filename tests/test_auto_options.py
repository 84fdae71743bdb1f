"""`hetpar.auto`'s options: checked when `auto(...)` is called, not after tracing.

Every bad option raises at once with a message naming the option and what it
accepts; the step function is never called.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetpar

from . import oracle

CPU = jax.devices("cpu")


def step(w, x):
    with hetpar.layer("first"):
        h = jnp.tanh(x @ w[0])
    with hetpar.layer("second"):
        h = h @ w[1]
    return jnp.mean(h**2)


def never_called(*args):
    raise AssertionError("the step must not be traced for a bad option")


W = [jnp.ones((3, 4)) * 0.1, jnp.ones((4, 2)) * 0.1]
X = np.ones((5, 3), np.float32)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(objective="speed"), hetpar.HetparError,
     r"objective must be one of \('time', 'cost', 'energy'\), got 'speed'"),
    (dict(microbatches=0), hetpar.HetparError, "microbatches must be a positive int, got 0"),
    (dict(microbatches=2.0), hetpar.HetparError, "microbatches must be a positive int, got 2.0"),
    (dict(microbatches=True), hetpar.HetparError, "microbatches must be a positive int"),
    (dict(schedule="zigzag"), hetpar.HetparError,
     r"schedule must be one of \('gpipe', '1f1b'\), got 'zigzag'"),
    (dict(batch_argnums="1"), hetpar.HetparError, "batch_argnums must be an int, a sequence"),
    (dict(batch_argnums=[0, 1.5]), hetpar.HetparError,
     r"batch_argnums must be an int, a sequence of ints or None, got \(0, 1.5\)"),
    (dict(on_missing_device="ignore"), hetpar.HetparError,
     r"on_missing_device must be one of \('error', 'replan'\), got 'ignore'"),
    (dict(depth=0), hetpar.HetparError, "depth must be a positive int or None, got 0"),
    (dict(profile=3), hetpar.HetparError,
     "profile must be 'auto', 'measure', 'spec', a path .* got int"),
    (dict(plan=42), hetpar.PlanError,
     r"plan must be a path to plan.json, a hetpar.Plan or a dict \{layer: device\}, got int"),
    (dict(plan={"first": 1}), hetpar.PlanError,
     r"a plan dict maps layer names to device names .* not: \{'first': 1\}"),
    (dict(devices=[0, 1]), hetpar.PlanError,
     r"devices must be a device name \('cpu:0'\) or a sequence of them, got \(0, 1\)"),
    (dict(devices={"cpu:0"}), hetpar.PlanError,
     "devices must be a device name or a sequence of them, got set"),
    (dict(devices=["cpu:0", "cpu:0"]), hetpar.PlanError,
     r"devices \['cpu:0', 'cpu:0'\] name a device twice"),
])
def test_bad_option_raises_when_auto_is_called(kwargs, error, message):
    with pytest.raises(error, match=message):
        hetpar.auto(never_called, **kwargs)
    with pytest.raises(error, match=message):  # the decorator form too
        hetpar.auto(**kwargs)


@pytest.mark.parametrize("devices, message", [
    (["cpu:0", "tpu:9"],
     r"devices \['tpu:9'\] are not present \(present: \['cpu:0', 'cpu:1', 'cpu:2', 'cpu:3'\]\)"),
    # A comma-separated string is one (unknown) name: the message says to pass a list.
    ("cpu:0,cpu:1", r"devices \['cpu:0,cpu:1'\] are not present .*pass several devices as a list"),
])
def test_absent_devices_fail_at_the_first_call(devices, message):
    # Not at auto(...): asking JAX for devices starts its backends, and a program
    # decorating at import time may not have run jax.distributed.initialize yet.
    auto = hetpar.auto(never_called, devices=devices)
    with pytest.raises(hetpar.PlanError, match=message):
        auto(W, X)


def test_options_are_keyword_only_and_checked():
    Options = type(hetpar.auto(step).options)
    with pytest.raises(TypeError):
        Options(("cpu:0",))  # positional arguments fail
    with pytest.raises(hetpar.HetparError,
                       match=r"data_parallel must be True, False or one of \(.*'fsdp'\), got 1"):
        Options(data_parallel=1)
    with pytest.raises(hetpar.HetparError,
                       match="hierarchical must be True, False or 'auto', got 'yes'"):
        Options(hierarchical="yes")
    opts = Options(devices=("cpu:1",), microbatches=np.int64(2))
    assert dataclasses.replace(opts, devices=None).devices is None


def test_a_device_name_string_is_one_device():
    auto = hetpar.auto(step, devices="cpu:1")
    assert auto.options.devices == ("cpu:1",)
    out = auto(W, X)
    assert out.devices() == {CPU[1]}
    oracle.assert_equals_jit(out, step, (W, X))


def test_one_device_plan_naming_an_unknown_layer_is_a_clear_error():
    # Before, this ran everything on cpu:1 and ignored the misspelt layer.
    auto = hetpar.auto(step, plan={"nosuch": "cpu:1"})
    with pytest.raises(hetpar.PlanError,
                       match=r"does not fit this step's layers: unknown \['nosuch'\]; missing "
                             r"\['first', 'second'\]; the step's layers are \['first', 'second'\]"):
        auto(W, X)


def test_one_device_plan_must_name_every_layer():
    auto = hetpar.auto(step, plan={"first": "cpu:1"})
    with pytest.raises(hetpar.PlanError, match=r"missing \['second'\]"):
        auto(W, X)
    out = hetpar.auto(step, plan={"first": "cpu:1", "second": "cpu:1"})(W, X)
    assert out.devices() == {CPU[1]}


def test_batch_argnums_out_of_range_is_a_clear_error_at_the_first_call():
    auto = hetpar.auto(step, devices=["cpu:0"], batch_argnums=5)
    with pytest.raises(hetpar.HetparError,
                       match=r"batch_argnums \[5\] name arguments \[5\] the step was not given: "
                             "it was called with 2 arguments"):
        auto(W, X)


def test_negative_batch_argnums_name_arguments_from_the_end():
    auto = hetpar.auto(step, devices=["cpu:1"], batch_argnums=-1)
    x0 = jax.device_put(X, CPU[0])  # a batch committed elsewhere is moved to the plan's device
    oracle.assert_equals_jit(auto(W, x0), step, (W, X))
    assert auto.lower(W, x0)._batch_here((W, x0))[1].devices() == {CPU[1]}


def test_a_compiled_step_predicts_its_step_time():
    # `hetpar run` prints this beside the measured step.
    one = hetpar.auto(step, devices="cpu:1").lower(W, X)
    assert one.plan is None  # nothing to plan on one device: costed when asked
    assert 0 < one.predicted().step_time_s < float("inf")
    assert one.predicted() is one.predicted()
    planned = hetpar.auto(step, devices=["cpu:0", "cpu:1"]).lower(W, X)
    assert planned.predicted() is planned.plan.predicted
    # A plan dict is costed too: replayed on its devices, as the planner prices plans.
    from hetpar.cost_models import cost_table
    from hetpar.planner import simulate

    plan = {"first": "cpu:0", "second": "cpu:1"}
    given = hetpar.auto(step, plan=plan).lower(W, X)
    table = cost_table(given.graph, ["cpu:0", "cpu:1"])
    assert given.predicted().step_time_s == pytest.approx(simulate(table, plan).step_time_s)
    # Calibrated at the first call with profile="measure" (the step timed on cpu:0):
    # not the spec sheets' figure.
    timed = hetpar.auto(step, plan=plan, profile="measure").lower(W, X)
    assert timed.predicted().step_time_s != pytest.approx(given.predicted().step_time_s,
                                                          rel=0.01)


def test_report_sets_the_measured_step_beside_the_predicted(monkeypatch):
    from hetpar._step_clock import StepClock

    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1"])  # planned: the warning fires
    auto(W, X)
    early = auto.report()
    assert early.step["measured_s"] is None and early.step["predicted_s"] > 0
    assert "measured: not yet" in str(early)
    monkeypatch.setattr(StepClock, "TOLERANCE", 0.0)  # any difference warns
    with pytest.warns(hetpar.PredictionWarning, match="the planner's prediction"):
        for _ in range(StepClock.SETTLE + StepClock.STEPS):
            auto(W, X)
    rep = auto.report()
    assert rep.step["steps"] == StepClock.STEPS and rep.step["measured_s"] > 0
    assert rep.step["ratio"] == pytest.approx(rep.step["measured_s"] / rep.step["predicted_s"])
    assert "hetpar profile" in rep.step["warning"]
    assert rep.to_json()["step"]["measured_s"] == auto.measured_step_s
    assert "WARNING:" in str(rep)


def test_prediction_warning_names_what_measure_left_untimed(monkeypatch):
    # A host CPU beside a GPU is left untimed on a large model (TimingBudget):
    # a gap then points there, not at the stages' overlap.
    from hetpar._step_clock import StepClock

    monkeypatch.setattr(StepClock, "TOLERANCE", 0.0)
    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1"], profile="measure")
    # (A plan of one device, or data parallel over the pair timed, is predicted
    # its own calibration, and the warning says so instead: issue 42.)
    with pytest.warns(hetpar.PredictionWarning, match="overlap|calibration's own timing"):
        for _ in range(StepClock.SETTLE + StepClock.STEPS + 1):
            auto(W, X)
    compiled = auto.lower(W, X)
    layer = compiled.table.layer_names[0]
    compiled.table = dataclasses.replace(compiled.table, meta={
        **compiled.table.meta, "kept_predicted": {layer: ["cpu:1"]}, "untimed_kinds": ["t4"]})
    warning = compiled.clock.summary(compiled)["warning"]
    assert "left cpu:1, t4 untimed" in warning and "--measure-all" in warning


def _train_step(w, x):
    def loss(w):
        with hetpar.layer("first"):
            h = jnp.tanh(x @ w[0])
        with hetpar.layer("second"):
            h = h @ w[1]
        return jnp.mean(h**2)

    val, g = jax.value_and_grad(loss)(w)
    return [a - 0.1 * b for a, b in zip(w, g)], val


def test_measure_times_what_the_plan_computes_on_an_untimed_device(monkeypatch, tmp_path):
    # cpu:1 profiled as a far slower kind (the host CPU beside a GPU, inverted):
    # profile="measure" leaves its layers predicted. A memory cap on cpu:0
    # makes the plan compute there all the same (the offload case, where a
    # plan made on the CPU's spec sheet predicted 3x its step): hetpar then
    # times those layers there and plans again on the measured figures.
    from hetpar.cost_models import ProfileSet, save_profiles, spec, spec_kinds

    base = spec("cpu")
    save_profiles(tmp_path / "far.json", ProfileSet({
        **{k: spec(k) for k in spec_kinds()},
        "cpu:0": base.replace(name="cpu:0", origin="measured"),
        "cpu:1": base.replace(name="cpu:1", kind="t4", origin="measured",
                              launch_overhead_s=1.0)}))  # over the budget's floors
    monkeypatch.setenv("HETPAR_PROFILES", str(tmp_path / "far.json"))
    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path / "cache"))
    graph = hetpar.trace(_train_step, W, X)
    roomy = hetpar.auto(_train_step, devices=["cpu:0", "cpu:1"], profile="measure").lower(W, X)
    assert set(roomy.table.meta["kept_predicted"]) == set(graph.layers)  # cpu:1 untimed
    from hetpar import _auto, _step_planning

    timed_steps = []
    real = _auto.whole_step_s
    monkeypatch.setattr(_step_planning, "whole_step_s",
                        lambda *a, **kw: timed_steps.append(a[2]) or real(*a, **kw))
    auto = hetpar.auto(_train_step, devices=["cpu:0", "cpu:1"], profile="measure",
                       memory={"cpu:0": graph["first"].memory_bytes})
    compiled = auto.lower(W, X)
    assert len(timed_steps) == len(set(timed_steps))  # once a device, across the rounds
    on_1 = [n for n, p in compiled.placements.items() if p.compute == "cpu:1"]
    assert on_1  # the cap moved work there
    kept = compiled.table.meta.get("kept_predicted", {})
    rows = {layer.name: layer for layer in compiled.table.layers}
    for n in on_1:
        assert "cpu:1" not in kept.get(n, ())
        assert "cpu:1" in compiled.table.meta["measured_s"][n]
        assert rows[n].time_s["cpu:1"] < 0.1  # not the profile's 1 s launch
    # The updates were timed alone on both (a present CPU beside another class).
    updates = compiled.table.meta["measured_update_s"]
    assert set(updates) == set(graph.layers)
    for layer in compiled.table.layers:  # run apart as timed: not scaled to the step
        assert layer.update_s == updates[layer.name]
    oracle.assert_equals_jit(auto(W, X), _train_step, (W, X))


def test_measure_times_the_whole_step_where_the_plan_spends_most_of_it(monkeypatch, tmp_path):
    # As above, with no room on cpu:0 at all: the plan computes everything on
    # the untimed kind. Its layers timed alone are then scaled to its whole
    # step, timed there too (GPT-2 at batch 16 on an H100 host's CPU: layers
    # alone summed to 2.42 s, the plan ran in 2.02 s), as the fastest device's are.
    from hetpar import _auto, _step_planning
    from hetpar.cost_models import ProfileSet, save_profiles, spec, spec_kinds

    base = spec("cpu")
    save_profiles(tmp_path / "far.json", ProfileSet({
        **{k: spec(k) for k in spec_kinds()},
        "cpu:0": base.replace(name="cpu:0", origin="measured"),
        "cpu:1": base.replace(name="cpu:1", kind="t4", origin="measured",
                              launch_overhead_s=1.0)}))
    monkeypatch.setenv("HETPAR_PROFILES", str(tmp_path / "far.json"))
    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path / "cache"))
    # cpu:0's layers timed at 0.1 us and no floor under a step: cpu:1's
    # whole step is always over the budget, as the CPU's beside a GPU.
    import functools

    from hetpar import cost_models
    from hetpar.cost_models import _measure, _table

    monkeypatch.setattr(cost_models, "TimingBudget",
                        functools.partial(cost_models.TimingBudget, step_floor_s=0.0))
    real_layer = _table.measure_layer
    monkeypatch.setattr(_table, "measure_layer", lambda g, name, dev, **kw: (
        _measure.Timing.of([1e-7]) if dev.id == 0 else real_layer(g, name, dev, **kw)))
    timed_steps = []
    real = _auto.whole_step_s
    monkeypatch.setattr(_step_planning, "whole_step_s",
                        lambda *a, **kw: timed_steps.append(a[2]) or real(*a, **kw))
    auto = hetpar.auto(_train_step, devices=["cpu:0", "cpu:1"], profile="measure",
                       memory={"cpu:0": 1})
    compiled = auto.lower(W, X)
    assert {p.compute for p in compiled.placements.values()} == {"cpu:1"}
    assert sorted(map(str, timed_steps)) == sorted(map(str, set(timed_steps)))  # once each
    assert "cpu:1" in compiled.table.meta["step_s"]
    assert "t4" not in compiled.table.meta.get("untimed_kinds", ())
    # every layer timed there, so that the step scales measured figures only
    assert not compiled.table.meta.get("kept_predicted")
    assert all("cpu:1" in m for m in compiled.table.meta["measured_s"].values())
    total = sum(layer.time_s["cpu:1"] for layer in compiled.table.layers)
    assert total == pytest.approx(compiled.table.meta["step_s"]["cpu:1"])
    oracle.assert_equals_jit(auto(W, X), _train_step, (W, X))


def test_no_prediction_warning_within_tolerance(monkeypatch, recwarn):
    from hetpar._step_clock import StepClock

    monkeypatch.setattr(StepClock, "TOLERANCE", float("inf"))
    auto = hetpar.auto(step)
    for _ in range(StepClock.SETTLE + StepClock.STEPS + 2):
        auto(W, X)
    assert auto.report().step["warning"] is None
    assert not [w for w in recwarn if issubclass(w.category, hetpar.PredictionWarning)]


def test_profile_measure_scales_layers_to_the_step_measured_here():
    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1"], profile="measure")
    compiled = auto.lower(W, X)
    timed = compiled.table.meta["step_s"]
    assert set(timed) == {"cpu:0", "cpu:1"}
    assert timed["cpu:0"] > 0 and timed["cpu:1"] == timed["cpu:0"]  # one kind: timed once
    total = sum(layer.time_s["cpu:0"] for layer in compiled.table.layers)
    assert total == pytest.approx(timed["cpu:0"])
    # Each layer's share is measured, not predicted, and the runtime's own
    # costs (per stage, per crossing) are measured for the split plans.
    assert compiled.table.meta["timing"] == "measured"
    assert compiled.table.device("cpu:1").stage_overhead_s > 0
    # (the crossing beyond both stages' overhead: measured, and at least 0;
    # on a loaded 2-core machine the noise in the overhead can leave none)
    crossing = compiled.table.meta["crossing_s"]["cpu/cpu"]
    assert crossing >= 0
    assert compiled.table.link("cpu:0", "cpu:1").latency_s >= crossing
    with pytest.raises(hetpar.HetparError, match="profile must be 'auto', 'measure'"):
        hetpar.auto(step, profile=3)
    with pytest.raises(hetpar.HetparError, match="profile='mesure' is not a file; pass 'auto'"):
        hetpar.auto(step, devices=["cpu:0", "cpu:1"], profile="mesure")(W, X)


def test_a_malformed_profile_file_fails_at_the_first_call_on_one_device_too(tmp_path,
                                                                          monkeypatch):
    # One device (nothing planned) and a plan dict build no cost table at the
    # first call; a broken profile file still fails there, naming the file,
    # not at report() after training.
    bad = tmp_path / "profiles.json"
    bad.write_text('{"bad": 1}')
    for kwargs in (dict(devices="cpu:0"), dict(plan={"first": "cpu:0", "second": "cpu:1"})):
        with pytest.raises(hetpar.HetparError, match="profiles.json.*hetpar profile"):
            hetpar.auto(_train_step, profile=bad, **kwargs)(W, X)
    # Named by the environment (profile="auto", the default): the error says so.
    monkeypatch.setenv("HETPAR_PROFILES", str(bad))
    with pytest.raises(hetpar.HetparError, match=r"the file \$HETPAR_PROFILES names"):
        hetpar.auto(_train_step, devices="cpu:0")(W, X)


def test_profile_measure_measures_a_replicas_fixed_part_where_data_parallel_may_run(
        monkeypatch):
    # Two devices of one kind and a batch that splits: the step is timed data
    # parallel over them too, and layers carry the part a replica pays whole.
    from hetpar import _auto, _step_planning

    rows, real = [], _auto.whole_step_s

    def timed(fn, args, dev, batch_argnums=(-1,), **kwargs):
        rows.append(len(dev) if isinstance(dev, list) else 1)
        return real(fn, args, dev, batch_argnums, **kwargs)

    monkeypatch.setattr(_step_planning, "whole_step_s", timed)
    even = np.ones((6, 3), np.float32)
    compiled = hetpar.auto(step, devices=["cpu:0", "cpu:1"], profile="measure").lower(W, even)
    assert rows == [1, 2]  # one device, then data parallel over both
    frac = compiled.table.meta["fixed_fraction"]
    assert set(frac) == {"cpu:0", "cpu:1"} and 0.0 <= frac["cpu:0"] == frac["cpu:1"] <= 1.0
    assert set(compiled.table.meta["replicated_step_s"]) == {"cpu:0 cpu:1"}
    for layer in compiled.table.layers:  # the update, in the measured part, is charged apart
        update = (layer.update_s or {}).get("cpu:0", 0.0)
        assert layer.fixed_s["cpu:0"] == pytest.approx(
            max(0.0, frac["cpu:0"] * layer.time_s["cpu:0"] - update))
    # No data parallel possible (a plan given as a dict, or data_parallel=False):
    # nothing more is timed.
    for kwargs in ({"plan": {"first": "cpu:0", "second": "cpu:1"}},
                   {"devices": ["cpu:0", "cpu:1"], "data_parallel": False}):
        rows.clear()
        compiled = hetpar.auto(step, profile="measure", **kwargs).lower(W, even)
        compiled.predicted()
        assert rows == [1]
        assert compiled.table.meta["step_s"]  # the table the prediction was costed on
    # A batch that does not split: no figure, planning goes on.
    odd = hetpar.auto(step, devices=["cpu:0", "cpu:1"], profile="measure").lower(W, X)
    assert "fixed_fraction" not in odd.table.meta


def test_calibration_times_a_short_step_more_than_three_times(monkeypatch):
    # A millisecond step's 3-run median on a busy CPU was off by 3x: short steps
    # get more runs, up to 20 (about 1 s in all).
    from hetpar import _auto, cost_models

    runs, real = [], cost_models.measure_step

    def counting(*args, **kwargs):
        timing = real(*args, **kwargs)
        runs.append(len(timing.samples))
        return timing

    monkeypatch.setattr(cost_models, "measure_step", counting)
    assert _auto.whole_step_s(step, (W, X), CPU[0]) > 0
    assert len(runs) == 1 and 3 < runs[0] <= 20  # one call: one compile, one warm-up
    # A step longer than the budget: three runs.
    runs.clear()
    assert _auto.whole_step_s(step, (W, X), CPU[0], budget_s=0.0) > 0
    assert runs == [3]


def test_a_step_that_computes_nothing_is_one_clear_error():
    """Its results are its inputs: no layer to place (was an IndexError)."""
    from hetpar.core import PlanError

    with pytest.raises(PlanError, match="no layers to place"):
        hetpar.auto(lambda p, x: (p, x), devices="cpu:0")(jnp.ones(3), jnp.ones(2))

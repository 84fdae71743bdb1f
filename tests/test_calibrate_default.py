"""`hetpar.auto` calibrates at its first call by default (issue 41, item 5).

The rest of the suite plans from spec sheets (conftest sets
HETPAR_CALIBRATE=0); these tests take that away and check the default:
the layers and the whole step are timed here, cached on disk for the next
process, the user sees progress, and a one-device plan runs the executable
its calibration compiled instead of compiling the step twice.
"""

import logging

import jax
import numpy as np
import pytest

import hetpar
from hetpar import cost_models, zoo
from tests.oracle import assert_equals_jit, check_steps_equal_jit


@pytest.fixture
def calibrating(monkeypatch, tmp_path):
    """The default as a user meets it: no HETPAR_CALIBRATE, no profile file,
    a cache of its own; counts the whole steps timed."""
    monkeypatch.delenv("HETPAR_CALIBRATE", raising=False)
    monkeypatch.delenv("HETPAR_PROFILES", raising=False)
    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path / "cache"))
    timed = []
    real = cost_models.measure_step

    def counting(*args, **kwargs):
        timed.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(cost_models, "measure_step", counting)
    return timed


def test_the_default_calibrates_once_and_the_next_process_reads_the_cache(calibrating,
                                                                          capfd, caplog):
    w = zoo.get("mlp", small=True)
    args = w.example_args()
    step = hetpar.auto(w.train_step, devices=["cpu:0"])
    assert step.options.calibrates()
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        out = step(*args)
    # The calibration's jit is the run's: the whole step compiled once for both.
    compiles = [r for r in caplog.records if "Compiling jit(train_step)" in r.getMessage()]
    assert len(compiles) == 1, [r.getMessage()[:80] for r in compiles]
    compiled = step.lower(*args)
    assert compiled._jit is compiled._one_device_jits[compiled._device]
    assert compiled.table.meta["step_s"]["cpu:0"] > 0  # the whole step was timed
    assert len(calibrating) == 1
    err = capfd.readouterr().err
    assert "hetpar: calibrating on cpu:0 at the first call" in err
    assert "hetpar: calibrated in" in err
    # One device holds the step and no other can take a layer: its layers'
    # shares could move no plan, so only the whole step was timed.
    assert "timing the whole step only" in err
    assert not compiled.table.meta.get("measured_s")
    check_steps_equal_jit(step, w.train_step, (*out[:-1], args[-1]), steps=2)

    # Another step object of the same program (as a later process): the
    # whole step's time comes from the disk cache, nothing is timed again.
    again = hetpar.auto(w.train_step, devices=["cpu:0"]).lower(*args)
    assert again.table.meta["step_s"] == compiled.table.meta["step_s"]
    assert len(calibrating) == 1


def test_layers_are_timed_where_the_step_fits_donated_but_not_timed_whole(
        calibrating, capfd, monkeypatch):
    """Where the step fits its device only donated, a timed run (which keeps
    the caller's state beside its own) does not fit: the calibration times
    the layers instead of nothing (a 2.9B HF Llama at 84 GB of an H200 was
    planned from the spec sheet, 360.5 ms predicted against 179.1 run)."""
    from hetpar import _step_planning

    w = zoo.get("mlp", small=True)
    args = w.example_args()
    monkeypatch.setattr(_step_planning, "_fits_alone", lambda table, name, memory=None: False)
    step = hetpar.auto(w.train_step, devices=["cpu:0"], donate_argnums=(0, 1))
    compiled = step.lower(*args)
    err = capfd.readouterr().err
    assert "timing the whole step only" not in err
    assert "fits cpu:0 donated, but not beside the copy" in err
    assert not calibrating  # no whole step timed
    assert compiled.table.meta.get("measured_s")  # its layers were


@pytest.mark.parametrize("how", ["spec", "0", "false"])
def test_spec_sheets_when_asked(calibrating, monkeypatch, how):
    w = zoo.get("mlp", small=True)
    if how != "spec":
        monkeypatch.setenv("HETPAR_CALIBRATE", how)
    step = hetpar.auto(w.train_step, devices=["cpu:0"],
                       profile="spec" if how == "spec" else "auto")
    assert not step.options.calibrates()
    args = w.example_args()
    step(*args)
    compiled = step.lower(*args)
    assert compiled.predicted() is not None  # priced from spec sheets, on asking
    assert "step_s" not in compiled.table.meta
    assert calibrating == []


@pytest.mark.parametrize("where", ["device", "host"])
def test_a_donating_step_is_timed_on_copies_of_its_own_and_compiles_once(calibrating, where,
                                                                         caplog):
    # The calibration times the very executable the run donates with, on
    # copies of the state of its own (the caller's arrays are never given
    # up, wherever they are), and the run compiles nothing more: before,
    # a donating step compiled once for the timing and once for the run.
    w = zoo.get("mlp", small=True)
    args = w.example_args()
    if where == "host":  # built apart from the device the step runs on
        args = jax.device_put(args, jax.devices("cpu")[1])
    params, opt_state, batch = args
    keep = jax.tree_util.tree_map(lambda x: x.copy(), (params, opt_state))
    step = hetpar.auto(w.train_step, devices=["cpu:0"], donate_argnums=(0, 1))
    compiled = step.lower(params, opt_state, batch)
    shared = compiled.shared_jit(compiled._device)
    assert shared is not None and shared.donated == (0, 1)
    assert len(calibrating) == 1
    assert all(not x.is_deleted() for x in jax.tree_util.tree_leaves((params, opt_state)))
    for a, b in zip(jax.tree_util.tree_leaves(keep),
                    jax.tree_util.tree_leaves((params, opt_state))):
        np.testing.assert_array_equal(a, b)
    placed = step.place(params, opt_state, batch)
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        out = step(*placed)
    compiles = [r for r in caplog.records if "Compiling jit(train_step)" in r.getMessage()]
    assert compiles == []  # the run took the calibration's executable
    assert_equals_jit(out, w.train_step, (*keep, batch))


def _table(cpu_slower=50.0, cap=1e12, gpus=1):
    from hetpar.core import CostTable, Device, Edge, Layer, Link

    names = ["cpu:0"] + [f"gpu:{i}" for i in range(gpus)]
    devices = (Device("cpu:0", "cpu", 1e12, 0.0, 200.0, 60.0, price_alone_per_hour=1.0),
               *(Device(f"gpu:{i}", "h100", cap, 3.0, 700.0, 80.0) for i in range(gpus)))
    links = tuple(Link(a, b, 1e10, 1e-5) for a in names for b in names if a != b)
    layers = tuple(Layer(f"l{i}", {"cpu:0": cpu_slower * t, **{g: t for g in names[1:]}},
                         dict.fromkeys(names, 3e9), activation_bytes=1e9, param_bytes=1e8)
                   for i, t in enumerate((0.2, 0.5, 0.3)))
    return CostTable(devices, links, layers, (Edge("l0", "l1", 1e8, 1e8),
                                              Edge("l1", "l2", 1e8, 1e8)))


@pytest.mark.parametrize("table, alone", [
    (_table(), "gpu:0"),                       # a GPU that holds it, its CPU 50x slower
    (_table(cpu_slower=5.0), None),            # a CPU close enough to take layers
    (_table(cap=5e9), None),                   # the step does not fit the GPU: offload
    (_table(gpus=2), None),                    # a peer: data parallel, pipelines
])
def test_layers_are_timed_only_where_they_can_change_the_plan(table, alone):
    from hetpar._options import Options
    from hetpar._step_planning import device_alone

    names = list(table.device_names)
    assert device_alone(table, names, set(names), Options()) == alone
    # Planning for a device that is not here (a spec sheet): layer shares matter.
    assert device_alone(table, names, {"cpu:0"}, Options()) is None
    assert device_alone(table, names, set(names), Options(memory={"gpu:0": 1e12})) is None


@pytest.mark.slow  # 3-5 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_the_calibration_does_not_time_the_whole_step_where_it_does_not_fit(calibrating):
    """A device that cannot hold the step alone does not run it whole: the
    run would only run out of memory (a 15 GB H200 spent 130 s of a first
    call there). Its layers keep their figures and the plan still runs."""
    w = zoo.get("mlp", small=True, batch=8)
    args = w.example_args()
    spec = hetpar.auto(w.train_step, devices=["cpu:0", "cpu:1"], profile="spec")
    alone = spec.lower(*args).table
    from hetpar.planner import evaluate

    need = evaluate(alone, dict.fromkeys(alone.layer_names, "cpu:0")).memory_bytes["cpu:0"]
    cap = {"cpu:0": 0.7 * need, "cpu:1": 0.7 * need}  # neither alone; both together
    step = hetpar.auto(w.train_step, devices=["cpu:0", "cpu:1"], memory=cap)
    check_steps_equal_jit(step, w.train_step, args, steps=2)
    compiled = step.lower(*args)
    assert not calibrating  # no whole step timed on a device it does not fit
    assert "cpu" in compiled.table.meta.get("untimed_kinds", ())
    assert len({p.compute for p in compiled.placements.values()}) == 2
    # ... and no later round tries to time it there again.
    from hetpar._step_planning import _untimed_steps

    assert "cpu" in compiled.table.meta["untimable_kinds"]
    assert not _untimed_steps(compiled.plan, compiled.table)


def test_a_device_that_only_updates_state_has_no_whole_step_timed():
    """A plan whose host CPU only updates the state kept there (its compute
    all on the GPU) gets no round timing the CPU's layers: each update was
    timed alone already (a 0.54B model at 7.5 GB of an H200 spent 72 s
    timing forwards and backwards on the CPU that its plan never ran). The
    same busy CPU computing a layer does get the round."""
    import dataclasses
    import types

    from hetpar._step_planning import _untimed_steps
    from hetpar.core import Placement
    from hetpar.planner import evaluate

    table = _table()
    table = dataclasses.replace(table, layers=tuple(
        dataclasses.replace(layer, update_s={"cpu:0": 10.0, "gpu:0": 1e-3})
        for layer in table.layers), meta={"untimed_kinds": ["cpu", "h100"]})
    updates_only = {n: Placement("gpu:0", state="cpu:0", update="cpu:0") for n in table.layer_names}
    computing = {**updates_only, "l0": "cpu:0"}
    for assignment, busy in ((updates_only, frozenset()), (computing, {"cpu"})):
        plan = types.SimpleNamespace(
            placements={n: p if isinstance(p, Placement) else Placement(p)
                        for n, p in assignment.items()},
            predicted=evaluate(table, assignment))
        cpu = plan.predicted.busy_s["cpu:0"]
        assert cpu >= 0.5 * plan.predicted.step_time_s  # the CPU is the step's bulk
        assert _untimed_steps(plan, table) == busy


def test_a_step_the_planner_overcounts_is_planned_on_its_device_by_its_compiled_figure():
    """Where only the planner's memory figures keep the whole step off the
    fastest device, and they put it under COMPILE_WITHIN x its capacity, the
    step is compiled for that device alone and, if its executable fits, the
    plan is that device alone (as under jax.jit), not recomputation or
    offload (a 0.54B Llama-style model on a 15 GB H200: five layers
    recomputed, 1.64x jit's step, where jit fitted)."""
    import dataclasses

    from hetpar._memory_check import COMPILE_WITHIN
    from hetpar._options import Options
    from hetpar._step_planning import _planning_table, device_alone, fits_compiled
    from hetpar.planner import evaluate
    from hetpar.runtime import executable_peak

    w = zoo.get("mlp", small=True)
    args = w.example_args()
    compiled = hetpar.auto(w.train_step, devices=["cpu:0"]).lower(*args)
    peak = executable_peak(jax.jit(w.train_step).lower(*args).compile().memory_analysis())
    base = cost_models.cost_table(compiled.graph, ["cpu:0", "h100"], memory_places=False)
    # The spec-sheet H100 (absent) made 100x slower than the present CPU:
    # only memory can keep the step off cpu:0.
    everything = dict.fromkeys(base.layer_names, "cpu:0")

    def inflated(f):  # the planner's memory figures x f, and its need then
        t = dataclasses.replace(base, layers=tuple(dataclasses.replace(
            layer, time_s={**layer.time_s, "h100:0": 100 * layer.time_s["cpu:0"]},
            memory_bytes={d: f * b for d, b in layer.memory_bytes.items()})
            for layer in base.layers))
        p = evaluate(t, everything)
        return t, (p.peak_memory_bytes or p.memory_bytes)["cpu:0"]

    # Inflated to 1.25x the compiled peak (as the planner's figures ran
    # 1.12-1.27x XLA's on an H200): need is linear in f.
    one, two = inflated(1.0)[1], inflated(2.0)[1]
    roomy, need = inflated(1.0 + (1.25 * peak - one) / (two - one))
    assert need == pytest.approx(1.25 * peak, rel=1e-3)

    def table(cap):
        return dataclasses.replace(roomy, devices=tuple(
            dataclasses.replace(d, memory_bytes=cap) if d.name == "cpu:0" else d
            for d in roomy.devices))

    def fresh():
        compiled._calibration_args, compiled._fits_compiled = args, {}
        return compiled

    names, options = ["cpu:0", "h100:0"], Options()
    fits = table(need / 1.2)  # over by the planner's figure, within COMPILE_WITHIN
    assert device_alone(fits, names, {"cpu:0"}, options) is None
    assert device_alone(fits, names, {"cpu:0"}, options, compiled=fresh()) == "cpu:0"
    assert compiled._jit_peaks[compiled.devices["cpu:0"]] == pytest.approx(peak)
    compiled.table = fits
    assert _planning_table(compiled, names, options).device("cpu:0").memory_bytes > need
    # Under its compiled peak: it does not fit, and the planner plans with
    # the device's own capacity (not one scaled by its overcount).
    tight = table(peak)
    assert not fits_compiled(fresh(), tight, "cpu:0")
    compiled.table = tight
    assert _planning_table(compiled, names, options) is tight
    # Far over by the planner's figure: not even compiled.
    far = table(need / (COMPILE_WITHIN * 1.1))
    fresh()
    compiled.one_device_peak = None  # a compile would call it
    assert not fits_compiled(compiled, far, "cpu:0")
    del compiled.one_device_peak
    # A memory cap is the user's: no compile overrides it.
    assert device_alone(fits, names, {"cpu:0"}, Options(memory={"cpu:0": need / 1.2}),
                        compiled=fresh()) is None


def test_the_first_call_tells_when_it_compiles_a_split_plan(calibrating, capfd):
    """Progress on stderr, as the calibration's: a split plan's stages compile
    for tens of seconds on a large model, which the first call spent silent."""
    w = zoo.get("mlp", small=True)
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    plan = {n: "cpu:0" if i < len(layers) // 2 else "cpu:1" for i, n in enumerate(layers)}
    step = hetpar.auto(w.train_step, plan=plan)
    step(*args)
    err = capfd.readouterr().err
    stages = len(step.lower(*args).stages.stages)
    assert stages > 1
    assert f"hetpar: compiling the plan's {stages} stages on cpu:0, cpu:1" in err
    assert "hetpar: compiled in" in err
    # Asked for spec sheets, the first call is quiet, as before.
    quiet = hetpar.auto(w.train_step, plan=plan, profile="spec")
    quiet(*args)
    assert "compiling the plan" not in capfd.readouterr().err

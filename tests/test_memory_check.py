"""The compiled stages are checked against the devices' memory before the
first step runs (hetpar/_memory_check.py), and `step.report()` shows each
device's memory predicted beside compiled, and where the first call's time
went (hetpar/_first_call.py)."""

import logging
import re
import types

import jax
import numpy as np
import pytest

import hetpar
from hetpar import _memory_check
from hetpar._memory_check import MARGIN, SPLIT_MARGIN, MemoryCheckWarning, margin_of
from hetpar._report import step_line
from hetpar.core import InfeasibleError

from . import oracle
from .flax_mlp import mlp_step as _mlp_step


def _copy(tree):
    return jax.tree_util.tree_map(lambda a: np.array(a, copy=True), tree)


def _assert_unchanged(args, before):
    """The caller's arguments are what `_copy` saw: nothing was donated or lost."""
    for a, b in zip(jax.tree_util.tree_leaves(args), jax.tree_util.tree_leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)


def _split_plan(step, args):
    layers = hetpar.trace(step, *args).layers
    return {name: ("cpu:0" if i < 3 else "cpu:1") for i, name in enumerate(layers)}


class _Compiler:
    """XLA made to need `extra(device)` more bytes of temporaries in each
    stage it compiles for a device (as a GPU's workspace the planner does not
    count), and a log of executors built and run: the check must plan again
    before any executor runs."""

    def __init__(self, monkeypatch, extra):
        from hetpar.runtime import _executor

        self.log: list[str] = []
        compile_stage, run = _executor._compile, _executor.Executor.__call__

        def compile_more(stage, device):
            fn, m = compile_stage(stage, device)
            more = extra(stage.device)
            fields = {k: getattr(m, k) for k in dir(m) if k.endswith("_in_bytes")}
            fields["temp_size_in_bytes"] += more
            fields["peak_memory_in_bytes"] += more
            return fn, types.SimpleNamespace(**fields)

        def logged_run(executor, flat_args):
            self.log.append("ran")
            return run(executor, flat_args)

        original_init = _executor.Executor.__init__

        def logged_init(executor, *a, **k):
            original_init(executor, *a, **k)
            self.log.append("built")

        monkeypatch.setattr(_executor, "_compile", compile_more)
        monkeypatch.setattr(_executor.Executor, "__call__", logged_run)
        monkeypatch.setattr(_executor.Executor, "__init__", logged_init)


DEVICES = ["cpu:0", "cpu:1", "cpu:2"]


def _capped(args):
    # Capped so that the step needs two devices of three (as tests/test_capacity.py).
    held = sum(x.nbytes for x in jax.tree_util.tree_leaves(args[:2]))
    return 0.6 * 3 * held


def test_a_plan_whose_compiled_stages_exceed_a_cap_is_replanned_before_it_runs(monkeypatch):
    step, args = _mlp_step()
    before = _copy(args)
    cap = _capped(args)
    # The first plan's busiest device is found once; XLA then needs half the
    # cap more there, in every plan compiled: only a plan that keeps less
    # there (or nothing) fits.
    probe = hetpar.auto(step, devices=DEVICES, profile=None,
                        memory=dict.fromkeys(DEVICES, cap))
    first = probe.lower(*args)
    bad = max(first.compiled_memory[0], key=first.compiled_memory[0].get)
    # Where the peak falls says what it is made of, largest first.
    parts = re.findall(r"(inputs|made|brought|working|code) ([\d.]+) (k?B|[kMG]B)",
                       first.compiled_memory[1][bad])
    assert parts and parts[0][0] in ("inputs", "made", "working"), first.compiled_memory[1]
    compiler = _Compiler(monkeypatch, lambda d: 0.5 * cap if d == bad else 0)
    auto = hetpar.auto(step, devices=DEVICES, profile=None, memory=dict.fromkeys(DEVICES, cap))
    out = auto(*args)
    # Planned again (a second executor built) before any executor ran.
    assert compiler.log.count("built") >= 2
    assert compiler.log.index("ran") > max(i for i, e in enumerate(compiler.log)
                                           if e == "built")
    assert auto.options.memory[bad] < cap
    # The plan that ran fits its compiled stages (the extra included).
    last = auto._last
    peaks = last.compiled_memory[0]
    # A split plan's replayed peak keeps SPLIT_MARGIN back (measured 10% under
    # the allocator's on an H200 offload plan) from what a device holds, one
    # executable MARGIN; a cap (here the caller's, far under the host's RAM)
    # is what the plan may use. The caps the replan set to steer the planner
    # (`auto.options.memory`, lower) are not what the peaks answer to.
    assert len(last.stages.stages) > 1 and margin_of(last) == SPLIT_MARGIN > MARGIN
    limits = dict.fromkeys(DEVICES, cap)
    usable = _memory_check.usable_capacities(last, list(peaks), limits=limits)
    assert all(peaks[d] <= usable[d] <= cap for d in peaks)
    assert _memory_check.misfits(last, limits=limits) == []
    # The report gives the capacity the peaks answer to, the steering cap apart.
    memory = auto.report().step["memory"]
    assert memory[bad]["capacity"] == pytest.approx(cap)
    assert memory[bad]["planned_under"] == pytest.approx(auto.options.memory[bad])
    assert "planned under" in str(auto.report())
    _assert_unchanged(args, before)
    oracle.assert_equals_jit(out, step, args)


def test_a_cap_no_plan_meets_is_one_line_before_anything_runs(monkeypatch):
    step, args = _mlp_step()
    before = _copy(args)
    cap = _capped(args)
    compiler = _Compiler(monkeypatch, lambda d: 10 * cap)  # no device fits any stage
    auto = hetpar.auto(step, devices=DEVICES, profile=None, memory=dict.fromkeys(DEVICES, cap))
    with pytest.raises(InfeasibleError) as info:
        auto(*args)
    message = str(info.value)
    assert "\n" not in message
    assert "the compiled stages need" in message and "Nothing ran" in message
    assert any(f"on {d} at their peak" in message for d in DEVICES)
    assert "out of memory" not in message  # not mistaken for a step that ran out
    assert compiler.log and "ran" not in compiler.log
    _assert_unchanged(args, before)


@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_plans_tried_in_vain_name_the_smallest_footprint_found(monkeypatch):
    step, args = _mlp_step()
    cap = _capped(args)
    # Every stage, every device: nearly the whole cap of temporaries, so no
    # share of the state fits beside them on any of the three.
    compiler = _Compiler(monkeypatch, lambda d: 0.95 * cap)
    auto = hetpar.auto(step, devices=DEVICES, profile=None, memory=dict.fromkeys(DEVICES, cap))
    with pytest.raises(InfeasibleError, match=r"planned again|plans tried") as info:
        auto(*args)
    assert re.search(r"the smallest footprint found needs [\d.]+ [kMG]?B on cpu:\d, over its",
                     str(info.value))
    assert "ran" not in compiler.log


def test_a_given_plan_that_does_not_fit_runs_with_a_warning(monkeypatch):
    step, args = _mlp_step()
    cap = _capped(args)
    _Compiler(monkeypatch, lambda d: 10 * cap if d == "cpu:1" else 0)
    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1"], plan=_split_plan(step, args),
                       profile=None, memory={"cpu:1": cap})
    with pytest.warns(MemoryCheckWarning, match="on cpu:1 at their peak.*was given"):
        out = auto(*args)
    oracle.assert_equals_jit(out, step, args)


def _compiled(width: int) -> dict:
    step, args = _mlp_step(width)
    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1"], plan=_split_plan(step, args),
                       profile=None)
    out = auto(*args)
    oracle.assert_equals_jit(out, step, args)
    return {d: m["compiled"] for d, m in auto.report().step["memory"].items()}


@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_compiled_figures_are_positive_and_grow_with_the_model():
    small, large = _compiled(64), _compiled(256)
    assert set(small) == set(large) == {"cpu:0", "cpu:1"}
    for d in small:
        assert 0 < small[d] < large[d]
    # At least the parameters, gradients and Adam's moments, old and new: 16x
    # the width^2 weights of the three dense layers on cpu:0 (f32).
    assert large["cpu:0"] > 3 * 256 * 256 * 4 * 4


def test_a_one_device_step_reports_its_executables_memory():
    step, args = _mlp_step()
    auto = hetpar.auto(step, devices="cpu:0")
    auto(*args)
    memory = auto.report().step["memory"]
    params = sum(x.nbytes for x in jax.tree_util.tree_leaves(args[:2]))
    assert memory["cpu:0"]["compiled"] > 2 * params  # the old state and the new
    assert memory["cpu:0"]["measured"] is None  # a CPU keeps no allocator statistics


def test_the_report_says_where_the_first_call_went():
    step, args = _mlp_step()
    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1"], plan=_split_plan(step, args),
                       profile=None)
    placed = auto.place(*args)
    auto(*placed)
    first = auto.report().step["first_call"]
    phases = first["phases"]
    assert {"trace", "compile", "memory check", "run"} <= set(phases)
    assert all(s >= 0 for s in phases.values())
    assert first["place_s"] > 0
    # The parts are exclusive: they add up to no more than the whole.
    assert sum(phases.values()) + first["place_s"] <= first["total_s"] + 1e-6
    text = step_line(auto.report().step)
    assert "first call" in text and "trace" in text and "place()" in text
    assert "memory per device (predicted / compiled / measured peak" in text


def test_first_call_phases_nest_exclusively():
    import time

    from hetpar._first_call import FirstCall

    clock = FirstCall()
    with clock.phase("plan"):
        with clock.phase("costs"):
            time.sleep(0.02)
    assert clock.seconds["costs"] >= 0.02 > clock.seconds["plan"]


# -- one-device and data-parallel plans: their one executable checked too ------


class _JitCompiler:
    """XLA made to need `extra` more bytes in the one executable of a
    one-device or data-parallel step, and a log of those steps run."""

    def __init__(self, monkeypatch, extra):
        from hetpar import _compiled_step
        from hetpar.runtime import _replicated

        self.ran = 0
        for module in (_compiled_step, _replicated):
            peak = module.executable_peak
            monkeypatch.setattr(module, "executable_peak",
                                lambda m, peak=peak: None if m is None else peak(m) + extra)
        call_jit, call_dp = _compiled_step.CompiledStep._call_jit, _replicated.Replicated.__call__

        def logged_jit(step, args):
            self.ran += 1
            return call_jit(step, args)

        def logged_dp(replicated, *args):
            self.ran += 1
            return call_dp(replicated, *args)

        monkeypatch.setattr(_compiled_step.CompiledStep, "_call_jit", logged_jit)
        monkeypatch.setattr(_replicated.Replicated, "__call__", logged_dp)


def _xla_compiles_of(name: str):
    """A list that collects jax's log lines of compiling jit(`name`) (a
    compile the persistent cache serves logs one too), and its handler."""
    import logging

    seen: list[str] = []

    class Seen(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if text.startswith(f"Compiling jit({name})"):
                seen.append(text)

    return seen, Seen()


def test_a_one_device_plan_compiles_once_and_is_checked_before_it_runs(monkeypatch):
    import logging

    step, args = _mlp_step()
    monkeypatch.setattr(_memory_check, "CHECK_FROM", 0.0)  # checked however far from full
    seen, handler = _xla_compiles_of("step")
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        jax.config.update("jax_log_compiles", True)
        auto = hetpar.auto(step, devices="cpu:0", profile=None)
        first = auto.lower(*args)
        # Compiled (and its memory known) before any call ...
        assert first.compiled_memory[0]["cpu:0"] > 2 * sum(
            x.nbytes for x in jax.tree_util.tree_leaves(args[:2]))
        out = auto(*args)
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(handler)
    # ... by the one compile the first call then runs (jit's cache serves it).
    assert len(seen) == 1, seen
    oracle.assert_equals_jit(out, step, args)


@pytest.mark.slow  # 3-5 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_a_one_device_plan_that_does_not_fit_is_replanned_before_it_runs(monkeypatch):
    step, args = _mlp_step()
    before = _copy(args)
    cap = _capped(args) / 0.6  # the whole state fits one device, on the planner's figures
    devices = ["cpu:0", "cpu:1"]
    probe = hetpar.auto(step, devices=devices, profile=None, data_parallel=False,
                        memory=dict.fromkeys(devices, cap)).lower(*args)
    assert probe._jit is not None  # the planner's first choice: one device
    # Its executable needs the cap and more: only a plan over both devices fits.
    jitted = _JitCompiler(monkeypatch, 0.4 * cap)
    auto = hetpar.auto(step, devices=devices, profile=None, data_parallel=False,
                       memory=dict.fromkeys(devices, cap))
    out = auto(*args)
    assert jitted.ran == 0  # the one-device plan never ran
    last = auto._last
    assert last._jit is None and last._executor is not None
    assert set(last.assignment.values()) == set(devices)
    _assert_unchanged(args, before)
    oracle.assert_equals_jit(out, step, args)


def test_a_one_device_step_with_nowhere_else_to_go_warns_before_it_runs(monkeypatch):
    step, args = _mlp_step()
    cap = _capped(args)
    _JitCompiler(monkeypatch, 10 * cap)
    auto = hetpar.auto(step, devices="cpu:0", profile=None, memory={"cpu:0": cap})
    with pytest.warns(MemoryCheckWarning, match="on cpu:0 at their peak.*one device to run on"):
        auto.lower(*args)


def test_a_step_predicted_far_from_full_compiles_at_its_first_call_alone(caplog):
    """Under CHECK_FROM of the device's capacity the check is not worth a
    compile ahead: `lower()` compiles nothing, the first call compiles once."""
    step, args = _mlp_step()
    auto = hetpar.auto(step, devices="cpu:0", profile=None)
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        compiled = auto.lower(*args)
        assert compiled.compiled_memory is None
        assert not [r for r in caplog.records if "Compiling jit(" in r.getMessage()
                    and "step" in r.getMessage()]
        auto(*args)
    compiles = [r.getMessage()[:60] for r in caplog.records
                if "Compiling jit(" in r.getMessage() and "step" in r.getMessage()]
    assert len(compiles) == 1, compiles


def test_a_data_parallel_plan_is_checked_per_replica_before_it_runs(monkeypatch):
    step, args = _mlp_step()
    devices = ["cpu:0", "cpu:1"]
    # Checked wherever the prediction is (CHECK_FROM 0).
    monkeypatch.setattr(_memory_check, "CHECK_FROM", 0.0)
    auto = hetpar.auto(step, devices=devices, profile=None, data_parallel="always")
    out = auto(*args)
    memory = auto.report().step["memory"]
    assert {d: m["compiled"] is not None for d, m in memory.items()} == dict.fromkeys(
        devices, True)
    oracle.assert_equals_jit(out, step, args)
    # Forced to data parallel, a replica over its cap has no other plan: one
    # line before anything runs.
    jitted = _JitCompiler(monkeypatch, 10 * _capped(args))
    auto = hetpar.auto(step, devices=devices, profile=None, data_parallel="always",
                       memory=dict.fromkeys(devices, _capped(args)))
    with pytest.raises(InfeasibleError, match="the compiled stages need .* on cpu:[01]"):
        auto(*args)
    assert jitted.ran == 0


# -- donated state counted once; state holders and the host's RAM counted ------


def _zoo_mlp():
    from hetpar import zoo

    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    return w.train_step, args, hetpar.trace(w.train_step, *args).layers


@pytest.mark.parametrize("how", ["split", "streamed"])
def test_donated_state_is_counted_once_by_the_memory_check(how):
    step, args, layers = _zoo_mlp()
    plan = ({n: "cpu:0" if k < len(layers) // 2 else "cpu:1" for k, n in enumerate(layers)}
            if how == "split" else
            dict.fromkeys(layers, {"compute": "cpu:0", "state": "cpu:1", "update": "cpu:0"}))
    held = sum(x.nbytes for x in jax.tree_util.tree_leaves(args[:2]))

    def peaks(donate):
        return hetpar.auto(step, plan=plan, profile=None,
                           donate_argnums=donate).lower(*args).compiled_memory[0]

    kept, given = peaks(()), peaks((0, 1))
    assert set(kept) == set(given) == {"cpu:0", "cpu:1"}
    # Where the whole state lives apart from compute (streamed: cpu:1 runs no
    # stage), it holds the old and the new state without donation, one copy with.
    if how == "streamed":
        assert kept["cpu:1"] >= 1.99 * held and 0.99 * held <= given["cpu:1"] <= 1.01 * held
    # The split plan's devices hold their share of the state once less.
    assert sum(given.values()) <= sum(kept.values()) - 0.5 * held


@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_cpu_devices_sharing_the_host_ram_are_checked_against_the_os_figure(monkeypatch):
    from hetpar import _memory_check

    step, args = _mlp_step()
    plan = _split_plan(step, args)
    peaks = hetpar.auto(step, plan=plan, profile=None).lower(*args).compiled_memory[0]
    # Each CPU device's peak fits the host; both together do not.
    monkeypatch.setattr(_memory_check, "host_ram",
                        lambda: 0.9 * sum(peaks.values()) / (1 - MARGIN))
    auto = hetpar.auto(step, plan=plan, profile=None)
    with pytest.warns(MemoryCheckWarning, match="of the host's RAM .*cpu:0 .* cpu:1 .*was given"):
        out = auto(*args)
    oracle.assert_equals_jit(out, step, args)
    # Planned by hetpar, every CPU device draws on the one RAM: no plan fits.
    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1"], profile=None, data_parallel=False)
    monkeypatch.setattr(_memory_check, "host_ram", lambda: 1.0)
    auto.lower(*args)  # one device: nothing shares the host with it
    monkeypatch.setattr(_memory_check, "host_ram", lambda: 0.9 * max(peaks.values()))
    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1"], profile=None,
                       memory=dict.fromkeys(["cpu:0", "cpu:1"], 0.8 * _capped(args) / 0.6))
    with pytest.raises(InfeasibleError, match="host's RAM|no plan fits"):
        auto(*args)


def test_an_allocator_peak_reached_before_the_first_step_is_said_so(monkeypatch):
    """The allocator's peak cannot be reset: where it was reached before the
    first step ran (the calibration timed the step on its own copy of the
    state: a 2.9B FlaxLlama showed 106 GB for a 50 GB step on an H200),
    step.report() says so instead of passing it off as the step's."""
    from hetpar import _memory_check
    from hetpar._report import memory_lines

    step, args = _mlp_step()
    auto = hetpar.auto(step, devices=["cpu:0"], profile=None)
    compiled = auto.lower(*args)
    monkeypatch.setattr(_memory_check, "allocator_peak", lambda step, d: 7e9)
    compiled.peaks_before_run = {"cpu:0": 7e9}
    summary = _memory_check.memory_summary(compiled)
    assert summary["cpu:0"]["measured_before_step"] is True
    assert "reached before the first step" in memory_lines(summary)
    compiled.peaks_before_run = {"cpu:0": 5e9}  # the step went higher
    assert "measured_before_step" not in _memory_check.memory_summary(compiled)["cpu:0"]


def test_a_replanned_plan_far_slower_is_said_so():
    """Under a cap, the planner may move layers to a far slower host CPU (a
    2.9B Llama at 45 GB of an H200 was replanned with 16 of its 27 layers
    there): the warning says how much slower, and where the layers went."""
    from hetpar._memory_check import Misfit, slower_replan
    from hetpar.planner import plan
    from tests.test_memory_places import GB, table

    t = table(cpu_compute=True, place=False)
    roomy = plan(t, memory={"gpu:0": 100 * GB})
    tight = plan(t, memory={"gpu:0": 20 * GB})
    assert tight.predicted.step_time_s > 2 * roomy.predicted.step_time_s
    misfit = Misfit("gpu:0", 30 * GB, 100 * GB, 88 * GB, 42 * GB, "stage 3 (main)")
    msg = slower_replan(roomy, tight, misfit, 20 * GB)
    on_cpu = sum(p.compute == "cpu:0" for p in tight.placements.values())
    assert msg and "capped at 20 GB" in msg and "x slower" in msg
    assert (f"{on_cpu} on cpu:0" in msg) == (on_cpu > 0)
    apart = sum(p.state != p.compute for p in tight.placements.values())
    assert apart and f"their state {apart} on cpu:0" in msg
    assert slower_replan(roomy, roomy, misfit, 20 * GB) is None  # no slower
    assert slower_replan(None, tight, misfit, 20 * GB) is None  # nothing planned before


def test_split_plans_are_planned_within_the_margin_the_check_keeps():
    """The planner plans a present accelerator (and its memory place) to its
    capacity less SPLIT_MARGIN (what the compiled check lets a split plan
    use there); the CPU keeps the host's RAM; a memory= cap (the caller's, or the check's own
    replanning cap) stands as given; the plan found fits the smaller figure."""
    from hetpar import cost_models
    from hetpar._step_planning import within_split_margin
    from hetpar.planner import plan
    from hetpar.planner._solve import with_memory

    step, args = _mlp_step(width=256)
    graph = hetpar.trace(step, *args)
    table = cost_models.cost_table(graph, ["cpu:0", "h100"])
    narrowed = within_split_margin(table, ["h100:0"])
    gpu, cpu = table.device("h100:0"), table.device("cpu:0")
    assert narrowed.device("h100:0").memory_bytes == pytest.approx(
        (1 - SPLIT_MARGIN) * gpu.memory_bytes)
    assert narrowed.device("cpu:0").memory_bytes == cpu.memory_bytes
    # Its memory place too, which the check holds to the same margin.
    place = table.device("h100:0:pinned_host")
    assert narrowed.device("h100:0:pinned_host").memory_bytes == pytest.approx(
        (1 - SPLIT_MARGIN) * place.memory_bytes)
    assert narrowed.fingerprint() == table.fingerprint()  # the same step and devices
    assert with_memory(narrowed, {"h100:0": 0.95 * gpu.memory_bytes}).device(
        "h100:0").memory_bytes == 0.95 * gpu.memory_bytes
    # A cap the whole step is just over once narrowed: the plan keeps under it.
    whole = plan(table, memory={"h100:0": 1e30}).predicted
    need = (whole.peak_memory_bytes or whole.memory_bytes)["h100:0"]
    tight = with_memory(table, {"h100:0": need / (1 - SPLIT_MARGIN / 2)})
    inside = plan(within_split_margin(tight, ["h100:0"])).predicted
    held = (inside.peak_memory_bytes or inside.memory_bytes)["h100:0"]
    assert held <= (1 - SPLIT_MARGIN) * tight.device("h100:0").memory_bytes * (1 + 1e-6)
    assert plan(tight).predicted.step_time_s <= inside.step_time_s


def test_the_replay_counts_the_stage_queued_behind_the_running_one():
    """A worker keeps two stages in flight (`Executor.prefetch`), and the
    queued one's outputs are allocated when it is dispatched: the replay
    counts them beside the running stage's. With one stage in flight it
    would not. The walk lists every stage replayed, once."""
    step, args, layers = _zoo_mlp()
    plan = {n: "cpu:0" if k < len(layers) // 2 else "cpu:1" for k, n in enumerate(layers)}
    ex = hetpar.auto(step, plan=plan, profile=None).lower(*args)._executor
    walk: list = []
    two = _memory_check.compiled_peaks(ex, walk)[0]
    assert sorted(w["stage"] for w in walk) == list(range(len(ex.stages.stages)))
    assert all(w["during"] >= w["after"] > 0 for w in walk)
    ex.prefetch = 1
    alone: list = []
    one = _memory_check.compiled_peaks(ex, alone)[0]
    assert all(two[d] >= one[d] for d in two)
    # A device running stages in a row: their successors' outputs (a layer's
    # activations, gradients or new state) are not nothing.
    several = [d for d, order in ex.stages.device_order.items() if len(order) > 1]
    assert several
    for d in several:
        pairs = [(w["during"], a["during"]) for w, a in zip(walk, alone) if w["device"] == d]
        assert all(x >= y for x, y in pairs) and any(x > y for x, y in pairs[:-1]), (d, pairs)


def test_a_cap_is_what_a_plan_may_use_the_margin_comes_off_the_device():
    """The margin is kept back from what a device holds, not from a `memory=`
    cap far under it: a plan replayed at 95% of its cap fits (a replan's own
    cap once took the margin off again, and the plan planned to it was
    replanned, run 23); over the cap, it does not."""
    import warnings

    step, args = _mlp_step()
    plan = _split_plan(step, args)

    def lowered(cap=None):
        memory = None if cap is None else {"cpu:1": cap}
        auto = hetpar.auto(step, devices=["cpu:0", "cpu:1"], plan=plan, profile=None,
                           memory=memory)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = auto.lower(*args)
        return compiled, [w for w in caught if w.category is MemoryCheckWarning]

    peak = lowered()[0].compiled_memory[0]["cpu:1"]
    assert peak > (1 - SPLIT_MARGIN) * (peak / 0.95)  # inside the margin of the cap
    assert not lowered(peak / 0.95)[1]
    assert lowered(peak / 1.05)[1]


def _two_gpu_step(predicted: dict, compiled: dict):
    """A split plan's step over two GPUs of one kind, a third of another kind
    and the host, as `misfits` and `replan_caps` read it (this machine has
    no GPU: the figures are run 32's, fit_h200x2)."""
    ns = types.SimpleNamespace
    kinds = {"gpu:0": ("h200", 45e9), "gpu:1": ("h200", 45e9), "gpu:2": ("h100", 80e9),
             "cpu:0": ("cpu", 100e9)}
    return ns(table=ns(devices=tuple(ns(name=d, kind=k, memory_bytes=m)
                                     for d, (k, m) in kinds.items())),
              devices={d: ns(platform="cpu" if d.startswith("cpu") else "gpu") for d in kinds},
              options=ns(memory=None), stages=ns(stages=[0, 1]),
              plan=ns(predicted=ns(peak_memory_bytes=predicted, memory_bytes={})),
              compiled_memory=(compiled, dict.fromkeys(compiled, "stage 7 (main)")))


def test_a_replan_gives_the_twin_of_a_gpu_over_the_same_cap():
    # Run 32 (two 45 GB H200s): the planner filled gpu:0 to 45 GB, which
    # replayed at 41.2, over the 39.6 the split margin leaves. Capped alone
    # at 43.4, the plan moved its excess onto gpu:1, which went over in turn.
    step = _two_gpu_step({"gpu:0": 45e9, "gpu:1": 44e9, "gpu:2": 70e9, "cpu:0": 50e9},
                         {"gpu:0": 41.2e9, "gpu:1": 39e9, "gpu:2": 60e9, "cpu:0": 50e9})
    found = _memory_check.misfits(step)
    assert [m.device for m in found] == ["gpu:0"]
    usable = (1 - SPLIT_MARGIN) * 45e9
    caps = _memory_check.replan_caps(step, found)
    # The planner overcounted there: never more than the replay may reach.
    assert caps == pytest.approx({"gpu:0": usable, "gpu:1": usable})  # gpu:2 is another kind
    # Where it undercounted, the cap is its figure less the excess; the twin
    # keeps what it was planned to hold (that fitted), no more.
    step = _two_gpu_step({"gpu:0": 30e9, "gpu:1": 36e9}, {"gpu:0": 41.2e9, "gpu:1": 38e9})
    caps = _memory_check.replan_caps(step, _memory_check.misfits(step))
    assert caps == pytest.approx({"gpu:0": 30e9 - (41.2e9 - usable), "gpu:1": 36e9})
    # The caps steer the planner; the compiled peaks still answer to the
    # devices (and the caller's caps, here none): gpu:1's 38 GB is over
    # its 36 GB cap but within the 39.6 GB it may reach, and is not over.
    step.options = types.SimpleNamespace(memory=caps)
    found = _memory_check.misfits(step, limits={})
    assert [m.device for m in found] == ["gpu:0"] and found[0].usable_bytes == usable
    # A second device over by more than the planner put there gets no
    # positive cap: the check gives up with one line (`_new_step`).
    step = _two_gpu_step({"gpu:0": 45e9, "gpu:2": 1e9}, {"gpu:0": 41.2e9, "gpu:2": 75e9})
    caps = _memory_check.replan_caps(step, _memory_check.misfits(step))
    assert caps["gpu:2"] <= 0 < caps["gpu:0"]


def test_the_compiled_host_figure_adds_the_parameters_staged_for_the_gpu():
    """No executable's memory analysis shows the pinned staging that takes a
    host-updated layer's parameters from the CPU device to the GPU each step
    (the pool the GPU's client keeps): the compiled check adds them to the
    CPU device's figure, as the planner counts them (`staging_bytes`), for
    a plan given as a dict too (from the step's layers and devices)."""
    from hetpar._memory_check import staged_bytes, with_host_staging
    from hetpar.core import Placement

    ns = types.SimpleNamespace
    step = ns(devices={"gpu:0": ns(platform="gpu"), "cpu:0": ns(platform="cpu")},
              graph={"a": ns(param_bytes=4e9), "b": ns(param_bytes=3e9),
                     "c": ns(param_bytes=2e9), "d": ns(param_bytes=None)},
              placements={"a": Placement("gpu:0", "cpu:0", "cpu:0", params="cpu:0"),
                          "b": Placement("gpu:0"),
                          "c": Placement("gpu:0", "gpu:0:pinned_host", "gpu:0"),
                          "d": Placement("cpu:0")})
    assert staged_bytes(step) == {"cpu:0": 4e9}  # only a's: c streams from a memory place
    peaks, where = with_host_staging(step, ({"gpu:0": 1e9, "cpu:0": 2e9},
                                            {"gpu:0": "stage 1", "cpu:0": "stage 2"}))
    assert peaks == {"gpu:0": 1e9, "cpu:0": 6e9}
    assert where["cpu:0"].startswith("stage 2 + ") and "staged" in where["cpu:0"]
    assert where["gpu:0"] == "stage 1"


def test_a_split_plans_compiled_check_takes_the_staged_parameters(monkeypatch):
    """The compiled check a split plan gets before it runs goes through
    `with_host_staging` (here two CPU devices, which stage nothing: the
    staging is set by hand), and the progress line names both figures."""
    step, args = _mlp_step()
    layers = hetpar.trace(step, *args).layers
    plan = {n: f"cpu:{k % 2}" for k, n in enumerate(layers)}
    plain = hetpar.auto(step, plan=plan).lower(*args).compiled_memory[0]["cpu:0"]
    monkeypatch.setattr(_memory_check, "staged_bytes", lambda step: {"cpu:0": 1e9})
    staged = hetpar.auto(step, plan=plan).lower(*args)
    assert staged.compiled_memory[0]["cpu:0"] == pytest.approx(plain + 1e9)
    assert "staged" in staged.compiled_memory[1]["cpu:0"]
    assert re.search(r"cpu:0 [\d.]+ [kMG]?B compiled", staged._peaks_line())


def test_the_progress_line_sets_planned_beside_compiled_peaks():
    from hetpar._compiled_step import CompiledStep

    ns = types.SimpleNamespace
    line = CompiledStep._peaks_line
    plan = ns(predicted=ns(peak_memory_bytes={"gpu:0": 39.6e9, "cpu:0": 113e9},
                           memory_bytes=None))
    assert line(ns(plan=plan, compiled_memory=({"gpu:0": 39.2e9, "cpu:0": 105e9}, {}))) == (
        " (peak memory: gpu:0 39.6 GB planned, 39.2 GB compiled; "
        "cpu:0 113 GB planned, 105 GB compiled)")
    groups = ns(predicted=ns(peak_memory_bytes={"cpu:0+cpu:1": 4e4}, memory_bytes=None))
    assert line(ns(plan=groups, compiled_memory=({"cpu:0": 3e4, "cpu:1": 3e4}, {}))) == (
        " (peak memory: cpu:0+cpu:1 40 kB planned; cpu:0 30 kB compiled; cpu:1 30 kB compiled)")
    assert line(ns(plan=None, compiled_memory=None)) == ""


def test_the_progress_line_says_what_the_pinned_pool_holds(monkeypatch):
    """The 6.74B plan's 77 GB in pinned memory took 94 GiB of the host's RAM
    (XLA's pool's regions: run 58's 112 GB of RSS); the line says so."""
    import jax

    from hetpar._compiled_step import CompiledStep

    ns = types.SimpleNamespace
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "93")
    plan = ns(predicted=ns(peak_memory_bytes={"gpu:0": 39.6e9, "gpu:0:pinned_host": 77.1e9},
                           memory_bytes=None))
    step = ns(plan=plan, compiled_memory=({"gpu:0": 35.6e9, "gpu:0:pinned_host": 79.5e9}, {}),
              devices={"gpu:0": ns(platform="gpu", process_index=jax.process_index())})
    assert CompiledStep._peaks_line(step).endswith(
        "; XLA's pinned pool holding 99.9 GB of the host's RAM for them)")


def test_a_replan_starts_from_what_the_last_plan_timed(monkeypatch):
    """A plan the compiled check sends back is planned again from the layers
    and whole steps its planning rounds had timed (`solve_placements`), not
    from nothing: on a 5.04B model at 45 GB of an H200 each replan timed
    the host's layers round by round again (fit_h200, run 49)."""
    from hetpar import _step_planning
    from hetpar._compiled_step import CompiledStep
    from hetpar._options import Options

    step, args = _mlp_step()
    seen = []
    real = _step_planning.cost_table_for

    def recording(compiled, devices, options, graph=None, timed=frozenset(),
                  steps=frozenset()):
        seen.append((timed, steps))
        return real(compiled, devices, options, graph, timed=timed, steps=steps)

    monkeypatch.setattr(_step_planning, "cost_table_for", recording)
    options = Options(devices=("cpu:0", "cpu:1"), profile="spec", data_parallel=False)
    before = types.SimpleNamespace(_timed=frozenset({("dense_0", "cpu:1")}),
                                   _timed_steps=frozenset({"cpu"}), _whole_steps={"x": 1.0})
    again = CompiledStep(step, args, options, before=before)
    assert seen[0] == (before._timed, before._timed_steps)
    assert again._whole_steps == {"x": 1.0} and again._timed == before._timed
    CompiledStep(step, args, options)
    assert seen[-1] == (frozenset(), frozenset())


def test_the_report_sums_the_hosts_devices_beside_the_process_resident_peak():
    """The CPU devices (and memory places) draw on one RAM, which the OS
    kills the process for overdrawing: the report sums their figures and
    sets the process's resident high-water mark beside them."""
    step, args = _mlp_step()
    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1"], plan=_split_plan(step, args),
                       profile=None)
    auto(*args)
    summary = auto.report().step
    memory, host = summary["memory"], summary["host_memory"]
    assert host["devices"] == ["cpu:0", "cpu:1"]
    assert host["predicted"] == pytest.approx(sum(memory[d]["predicted"] for d in memory))
    assert host["compiled"] == pytest.approx(sum(memory[d]["compiled"] for d in memory))
    assert host["measured"] > host["compiled"]  # the whole process: Python, XLA, the arrays
    assert host["capacity"] > host["measured"]
    assert "host RAM (cpu:0 + cpu:1)" in str(auto.report())


def test_a_memory_place_draws_its_pinned_pools_regions_on_the_host(monkeypatch):
    """XLA's pinned pool holds doubling regions of the host's RAM to serve a
    GPU's memory place: serving 77 GB under a 125 GiB limit it asked the OS
    for all 125 GiB, and the OS killed the process (fit_h200, run 56). The
    check counts the regions, a place alone too; under a 93 GiB limit the
    same place fits a 120 GB host."""
    from types import SimpleNamespace as ns

    from hetpar import _memory_check

    step = ns(devices={"gpu:0": ns(platform="gpu"), "cpu:0": ns(platform="cpu")})
    peaks = {"gpu:0": 39e9, "gpu:0:pinned_host": 77.1e9}
    monkeypatch.setattr(_memory_check, "host_ram", lambda: 120e9)
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "125")
    misfit = _memory_check.host_misfit(step, peaks, {})
    assert misfit is not None and misfit.host and misfit.device == "gpu:0:pinned_host"
    assert misfit.compiled_bytes == 125 * 2**30 and "pinned pool holding" in misfit.stage
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "93")
    assert _memory_check.host_misfit(step, peaks, {}) is None
    # Beside a CPU device's 20 GB, the 93 GiB pool does not fit either.
    misfit = _memory_check.host_misfit(step, {**peaks, "cpu:0": 20e9}, {})
    assert misfit is not None and misfit.compiled_bytes == 20e9 + 93 * 2**30
    # A CPU device's own place has no such pool: its bytes.
    assert _memory_check.host_draws(step, {"cpu:0:pinned_host": 77.1e9}) == (77.1e9, 0.0)


def test_a_sharded_step_far_below_capacity_reports_its_executables_memory_once_run():
    # Not compiled ahead (`worth_compiling`: predicted under half of each
    # device), its executable's own figure is read once the first call
    # compiled it, and set beside the planner's (fit_h200x2 run 72: planned
    # 42.1 GB a GPU, held 36.0).
    step, args = _mlp_step()
    auto = hetpar.auto(step, devices=["cpu:0", "cpu:1"], profile="spec", data_parallel="fsdp")
    plan = auto.lower(*args)
    assert plan.compiled_memory is None  # lower() compiled nothing
    assert auto.report().step["memory"]["cpu:0"]["compiled"] is None
    auto(*args)
    memory = auto.report().step["memory"]
    params = sum(x.nbytes for x in jax.tree_util.tree_leaves(args[0]))
    for d in ("cpu:0", "cpu:1"):
        assert memory[d]["compiled"] > params / 2  # at least its shard of the state
    assert memory["cpu:0"]["compiled"] == memory["cpu:1"]["compiled"]

"""The cost report and the command line, as a user meets them."""

import json
import logging as pylogging
import os
import re
import subprocess
import sys

import jax
import pytest

import hetpar
from hetpar import zoo


def hetpar_cli(*argv, check=True):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-m", "hetpar", *argv], capture_output=True,
                          text=True, env=env, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def hetpar_in_process(capsys, *argv, check=True):
    """`hetpar ARGV` in this process: the command's own code, without the
    interpreter and JAX start-up a subprocess pays (~10 s on 2 cores). The
    entry point itself (`python -m hetpar`, `app.run`) is run as a subprocess
    by test_cli_bad_input_is_one_clear_line's fast case and the slow tier."""
    from hetpar import cli

    capsys.readouterr()
    code = cli._main(cli._parser().parse_args([str(a) for a in argv]))
    out, err = capsys.readouterr()
    proc = subprocess.CompletedProcess(argv, code, out, err)
    if check:
        assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_report_json_keys():
    w = zoo.get("mlp", small=True)
    rep = hetpar.report(w.train_step, *jax.eval_shape(w.example_args)).to_json()
    assert {"model", "batch", "mode", "layers", "totals"} <= set(rep)
    layer_keys = {"name", "flops", "bytes_accessed", "transcendentals", "param_bytes",
                  "activation_bytes", "xla_flops", "xla_bytes_accessed"}
    assert all(layer_keys <= set(row) for row in rep["layers"])
    assert {"flops", "bytes_accessed", "transcendentals", "xla_flops",
            "xla_bytes_accessed"} <= set(rep["totals"])
    # Per-layer counts add up to the total (the shared group is tiny).
    assert sum(r["flops"] for r in rep["layers"]) == pytest.approx(rep["totals"]["flops"],
                                                                    rel=1e-3)
    assert rep["totals"]["xla_flops"] > 0


def test_report_by_op():
    w = zoo.get("conv6", small=True)
    rep = hetpar.report(w.train_step, *jax.eval_shape(w.example_args), by="op", xla=False)
    names = [r["name"] for r in rep.rows]
    assert "conv_general_dilated" in names and "dot_general" in names


@pytest.mark.slow  # two subprocesses that each trace and compile
def test_cli_report_json_and_csv():
    out = hetpar_cli("report", "mlp", "--small", "--format", "json").stdout
    data = json.loads(out)
    assert data["model"] == "mlp" and data["layers"]
    csv = hetpar_cli("report", "mlp", "--small", "--format", "csv", "--no-xla").stdout
    assert csv.splitlines()[0].startswith("name,flops")


def test_cli_trace_writes_the_layers_format(tmp_path, capsys):
    # Not graph.json: `hetpar plan --graph` takes what `hetpar costs --out` writes.
    path = tmp_path / "layers.json"
    hetpar_in_process(capsys, "trace", "conv6", "--small", "--out", str(path))
    data = json.loads(path.read_text())
    assert (data["format"], data["version"]) == ("hetpar.layers", 1)
    assert len(data["layers"]) >= 7 and "devices" not in data
    assert data["meta"]["model"] == "conv6"
    assert {"name", "flops", "param_bytes", "activation_bytes"} <= set(data["layers"][0])
    assert {"src", "dst", "bytes", "bytes_backward"} <= set(data["edges"][0])


def test_cli_plan_from_a_model_name(tmp_path, capsys):
    path = tmp_path / "plan.json"
    out = hetpar_in_process(capsys, "plan", "conv6", "--small", "--devices", "cpu:0,h100",
                            "--out", str(path)).stdout
    assert "baselines" in out
    plan = hetpar.Plan.load(path)
    assert set(plan.assignment.values()) <= {"cpu:0", "h100:0"}


@pytest.mark.slow  # calibrates (times the step): fast-tier time
def test_cli_plan_for_elsewhere_from_a_profile_and_a_calibrated_step(tmp_path):
    # Profile here, plan for there: a profile file's measured CPU lends its
    # calibration to the spec-sheet CPU kind; --calibrate times the step here.
    from hetpar.cost_models import load_profiles, save_profiles

    profiles = load_profiles(None)
    slow = profiles.devices["cpu"].replace(name="cpu:0", origin="measured",
                                           launch_overhead_s=0.5)
    path = tmp_path / "profiles.json"
    save_profiles(path, profiles.replace_devices({"cpu:0": slow}))
    plan = tmp_path / "plan.json"
    out = hetpar_cli("plan", "mlp", "--small", "--devices", "cpu:0", "--profiles", str(path),
                     "--out", str(plan)).stdout
    assert hetpar.Plan.load(plan).predicted.step_time_s > 0.5  # the profile's launch cost
    out = hetpar_cli("plan", "mlp", "--small", "--devices", "cpu:0", "--calibrate", "--out",
                     str(plan)).stdout
    assert "baselines" in out and hetpar.Plan.load(plan).predicted.step_time_s < 0.5
    bad = hetpar_cli("plan", "--graph", str(plan), "--calibrate", check=False)
    assert bad.returncode == 2 and "apply to a MODEL" in bad.stderr


def test_cli_plan_pipelined_replays_its_schedule(tmp_path, capsys):
    path = tmp_path / "plan.json"
    out = hetpar_in_process(capsys, "plan", "transformer", "--small", "--devices", "h100,h100",
                            "--mode", "pipelined", "--microbatches", "4", "--schedule", "1f1b",
                            "--out", str(path)).stdout
    assert "replays the 1f1b schedule" in out
    plan = hetpar.Plan.load(path)
    assert plan.mode == "pipelined" and plan.predicted.schedule == "1f1b"


def test_cli_hlo_of_one_layer(capsys):
    out = hetpar_in_process(capsys, "hlo", "mlp", "--small", "--layer", "fc1").stdout
    assert "HloModule" in out


@pytest.mark.slow  # the README main command, end to end (two compiles, interleaved timing)
def test_cli_run_main_job():
    out = hetpar_cli("run", "mlp", "--small", "--steps", "3").stdout
    assert "hetpar.auto" in out and "jax.jit" in out
    assert "interleaved step by step" in out
    # Both sides train from the same state on the same batch: the same losses.
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("step ")]
    assert len(rows) == 3
    assert all(row[5] == row[9] for row in rows), rows  # hetpar.auto's loss, jax.jit's
    measured = re.search(r"measured step interleaved \(median of steps 1-2\): hetpar.auto "
                         r"\S+ ms, jax.jit \S+ ms: ratio [\d.]+ \(hetpar.auto / jax.jit\)", out)
    assert measured, out
    # The planner's prediction beside the measured step, and their ratio (where the
    # prediction is the calibration's own timing, said so).
    assert re.search(r"predicted step \((planner|the calibration's own timing.*?)\): "
                     r"[\d.]+ [mu]?s\n   measured hetpar.auto alone \(median of 3 more steps\): "
                     r"[\d.]+ [mu]?s; measured / (predicted|calibration) [\d.e+]+", out), out
    if not [d for d in jax.devices() if d.platform != "cpu"]:
        assert "what-if" in out  # spec-sheet plans when no accelerator is here


def test_cli_run_says_why_a_calibrated_step_may_still_differ():
    from hetpar.cli._run import _measured_hint

    assert "more --steps" not in _measured_hint(10)
    assert "1 step timed after compiling: more --steps" in _measured_hint(1)
    assert "includes compilation" in _measured_hint(0)


@pytest.mark.slow  # 3-5 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_cli_run_calibrated_at_the_first_call(capsys, monkeypatch):
    # The prediction beside the measured step comes from layers and a step
    # timed here (--profile measure, the default), not spec sheets, and what
    # is timed is shown while it is timed.
    monkeypatch.delenv("HETPAR_PROFILES", raising=False)
    argv = ("run", "mlp", "--small", "--steps", "2", "--no-what-if", "--no-baseline")
    spec = hetpar_in_process(capsys, *argv, "--profile", "auto").stdout
    measured = hetpar_in_process(capsys, *argv).stdout

    def predicted(out):
        return re.search(r"predicted step \((?:planner|the calibration's own timing.*?"
                         r"measure\))\): ([\d.]+ [mu]?s)", out).group(1)

    assert predicted(spec) != predicted(measured), (spec, measured)
    assert "calibrate with --profile measure" in spec or "WARNING" not in spec
    assert "timing its layers" not in spec
    assert "timing its layers and its step here (--profile measure" in measured
    assert re.search(r"\[1/\d+\] fc1 on cpu:0: [\d.]+ [mu]?s", measured), measured
    assert "calibrated to the whole step measured here: cpu:0 " in measured, measured
    # Several CPU devices here: the step data parallel over two is timed and shown too.
    assert re.search(r"data parallel over cpu:0, cpu:1 [\d.]+ [mu]?s", measured), measured
    # The progress lines are hetpar's alone, on stdout, with absl's handler
    # on the root logger as `app.run` installs it; logging is as it was after.
    from absl import logging as absl_logging

    from hetpar.cli._run import _Progress

    absl_logging.use_absl_handler()
    root, absl_logger = pylogging.getLogger(), absl_logging.get_absl_logger()
    before = (root.level, absl_logger.level, absl_logger.propagate, len(absl_logger.handlers))
    again = hetpar_in_process(capsys, *argv)
    assert re.search(r"\[1/\d+\] fc1 on cpu:0", again.stdout), again.stdout
    for text in (measured, again.stdout, again.stderr):
        # No absl prefix naming hetpar.auto's modules (hetpar/_step_planning.py logs these lines).
        for source in ("_auto.py", "_auto_step.py", "_compiled_step.py", "_step_planning.py"):
            assert source not in text, text
        assert "xla_bridge" not in text, text
    assert (root.level, absl_logger.level, absl_logger.propagate,
            len(absl_logger.handlers)) == before
    assert not any(isinstance(h, _Progress) for h in absl_logger.handlers + root.handlers)
    # While it shows progress, other libraries' loggers stay as quiet as before.
    from hetpar.cli._run import _progress

    jax_level = pylogging.getLogger("jax").getEffectiveLevel()
    with _progress(True):
        assert root.level == before[0]
        assert pylogging.getLogger("jax").getEffectiveLevel() == jax_level
    # A profile file named by $HETPAR_PROFILES is the default when set.
    monkeypatch.setenv("HETPAR_PROFILES", "nope.json")
    proc = hetpar_in_process(capsys, *argv, check=False)
    assert proc.returncode == 2 and "nope.json" in proc.stderr, proc
    proc = hetpar_in_process(capsys, *argv, "--profile", "nope.json", check=False)
    assert proc.returncode == 2 and "profile='nope.json' is not a file" in proc.stderr


BAD_INPUT = [
    (("report", "resnet51"), "unknown"),
    (("report", "mlp", "--config", "widht=3"), "widht"),
    (("report", "mlp", "--config", "nonsense"), "KEY=VALUE"),
    (("hlo", "mlp", "--small", "--layer", "nope"), "no layer 'nope'"),
    (("costs", "mlp", "--small", "--devices", "cpu:0,quantum"), "quantum"),
    # Issue 14: config values and counts were used unchecked (tracebacks).
    (("report", "resnet18", "--small", "--config", "image_size=abc"),
     "config 'image_size' must be a positive int, got 'abc'"),
    (("trace", "resnet18", "--small", "--depth", "0"), "--depth must be a positive int, got 0"),
]


# As a subprocess (`python -m hetpar`, ~10 s each on 2 cores): the first case
# in the fast tier, every case in the slow one; the next test runs them all
# in process.
@pytest.mark.parametrize("argv,message", [
    BAD_INPUT[0], *(pytest.param(*case, marks=pytest.mark.slow) for case in BAD_INPUT[1:])])
def test_cli_bad_input_is_one_clear_line(argv, message):
    proc = hetpar_cli(*argv, check=False)
    assert proc.returncode == 2
    assert message.lower() in proc.stderr.lower()
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("argv,message", BAD_INPUT)
def test_cli_bad_input_is_one_clear_line_in_process(argv, message, capsys):
    proc = hetpar_in_process(capsys, *argv, check=False)
    assert proc.returncode == 2
    assert message.lower() in proc.stderr.lower()
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize(
    "argv,message",
    [
        *[((command, "mlp", "--small", *extra, f"--{flag}", value),
           f"--{flag} must be a positive int, got {value}")
          for command, extra, flags in [
              ("trace", (), ("batch", "depth")),
              ("report", (), ("batch", "depth")),
              ("hlo", (), ("batch", "depth")),
              ("costs", ("--devices", "cpu:0"), ("batch", "microbatches", "k")),
              ("plan", ("--devices", "cpu:0,h100"), ("batch", "microbatches")),
              ("run", (), ("batch", "steps", "microbatches")),
          ]
          for flag in flags for value in ("0", "-3")],
        (("report", "mlp", "--small", "--config", "hidden=32,zero"),
         "config 'hidden' must be a tuple of positive ints (e.g. 2,2,2,2), got '32,zero'"),
        (("report", "resnet18", "--small", "--config", "blocks=1,0,1,1"),
         "config 'blocks' must be a tuple of positive ints (e.g. 2,2,2,2), got '1,0,1,1'"),
        (("report", "transformer", "--small", "--config", "tie_embeddings=maybe"),
         "config 'tie_embeddings' must be a bool (true or false), got 'maybe'"),
        (("report", "mlp", "--small", "--config", "learning_rate=fast"),
         "config 'learning_rate' must be a number, got 'fast'"),
        (("costs", "mlp", "--small", "--devices", "cpu:0", "--config", "input_dim=2.5"),
         "config 'input_dim' must be a positive int, got '2.5'"),
        (("plan", "mlp", "--small", "--devices", "cpu:0,h100", "--config", "hidden="),
         "config 'hidden' must be a tuple of positive ints (e.g. 2,2,2,2), got ''"),
        (("run", "mlp", "--small", "--config", "batch_size=-1"),
         "config 'batch_size' must be positive, got -1"),
        (("plan", "--graph", "graph.json", "--config", "hidden=4"),
         "--config apply to a MODEL, not to --graph"),
    ],
)
def test_cli_bad_numbers_and_config_values_fail_before_any_work(argv, message, capsys):
    # In process (each case in milliseconds): the one line `hetpar` prints, exit status 2.
    from hetpar import cli

    assert cli._main(cli._parser().parse_args(list(argv))) == 2
    err = capsys.readouterr().err
    assert err == f"hetpar {argv[0]}: error: {err.split(': error: ', 1)[1]}"
    assert message in err and err.count("\n") == 1, err


def test_cli_config_values_are_parsed_by_the_models_types():
    from hetpar.cli._common import parse_config

    assert parse_config("resnet18", ["image_size=64", "blocks=(2, 1, 1, 1)",
                                     "learning_rate=1e-2"]) == {
        "image_size": 64, "blocks": (2, 1, 1, 1), "learning_rate": 0.01}
    assert parse_config("transformer", ["tie_embeddings=false", "num_heads=2"]) == {
        "tie_embeddings": False, "num_heads": 2}
    assert parse_config("mlp", ["hidden=16,8", "hidden=[4]"]) == {"hidden": (4,)}


def test_cli_costs_measures_the_fixed_part_per_microbatch(tmp_path, capsys, monkeypatch):
    # Layers whose costs at batch and batch/2 are known (test_cost_table's):
    # the file holds the fixed parts they imply, the clipped ones included.
    from .test_cost_table import KNOWN_COSTS, KNOWN_FIXED, known_layer_times

    known_layer_times(monkeypatch)
    out = tmp_path / "graph.json"
    hetpar_in_process(capsys, "costs", "mlp", "--small", "--devices", "cpu:0", "--measure",
                      "--k", "2", "--microbatches", "2", "--out", str(out))
    layers = {layer["name"]: layer for layer in json.loads(out.read_text())["layers"]}
    assert set(layers) == set(KNOWN_FIXED)
    for name, layer in layers.items():
        assert layer["time_s"]["cpu:0"] == pytest.approx(KNOWN_COSTS[name][4])
        assert layer["fixed_s"]["cpu:0"] == pytest.approx(KNOWN_FIXED[name], abs=1e-12)


def _plan_over_cpu0_cpu1(tmp_path, *, rename: dict | None = None):
    """plan.json for the small MLP over cpu:0 and cpu:1 (every layer on cpu:0),
    its device names edited by `rename` ({'cpu:1': 'cpu:7'}: planned elsewhere)."""
    w = zoo.get("mlp", small=True)
    graph = hetpar.trace(w.train_step, *jax.eval_shape(w.example_args))
    from hetpar.cost_models import cost_table

    table = cost_table(graph, ["cpu:0", "cpu:1"])
    p = hetpar.plan(table, baselines=False)
    data = p.to_json()
    data["assignment"] = dict.fromkeys(data["assignment"], "cpu:0")
    data["devices"] = [(rename or {}).get(d, d) for d in data["devices"]]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return w, path


# Issue 45, item 3: the command gives advice in flags, the API in arguments.
def test_cli_errors_advise_flags_and_the_api_arguments(tmp_path, capsys):
    from hetpar.core import ProfileError

    proc = hetpar_in_process(capsys, "costs", "mlp", "--small", "--devices", "cpu:0",
                             "--microbatches", "2", check=False)
    assert proc.returncode == 2 and "add --measure" in proc.stderr, proc.stderr
    with pytest.raises(ProfileError, match="pass measure=True"):
        zoo.cost_table("mlp", ["cpu:0"], small=True, microbatches=2)

    # A plan file naming a device that is not here.
    w, path = _plan_over_cpu0_cpu1(tmp_path, rename={"cpu:1": "cpu:7"})
    proc = hetpar_in_process(capsys, "run", "mlp", "--small", "--plan", path, "--steps", "1",
                             "--no-what-if", "--no-baseline", "--profile", "auto", check=False)
    assert proc.returncode == 2, proc
    assert "cpu:7 is not present here" in proc.stderr, proc.stderr
    assert "leave --plan out" in proc.stderr and "on_missing_device" not in proc.stderr
    with pytest.raises(hetpar.PlanError, match="on_missing_device='replan'") as e:
        hetpar.auto(w.train_step, plan=path).lower(*jax.eval_shape(w.example_args))
    assert "cpu:7 is not present here" in str(e.value) and "--plan" not in str(e.value)

    # A graph no plan fits: memory, in --memory and graph.json terms.
    from tests.random_tables import random_cost_table

    graph = tmp_path / "graph.json"
    random_cost_table(1, layers=4, devices=2).save(graph)
    proc = hetpar_in_process(capsys, "plan", "--graph", graph, "--memory", "cpu:0=1e-9",
                             "--memory", "gpu:1=1e-9", "--no-offload", check=False)
    assert proc.returncode == 2 and "--memory" in proc.stderr, proc.stderr
    assert "raise memory_bytes" not in proc.stderr
    proc = hetpar_in_process(capsys, "plan", "--graph", graph, "--max-cost", "1e-30",
                             check=False)
    assert proc.returncode == 2 and "raise --max-cost" in proc.stderr, proc.stderr


# Issue 45, item 7: one rule for device names; plans reaching past devices= refused.
def test_an_indexed_device_name_means_a_present_device(capsys):
    proc = hetpar_in_process(capsys, "costs", "mlp", "--small", "--devices", "cpu:0,cpu:7",
                             check=False)
    assert proc.returncode == 2, proc.stdout
    assert "device 'cpu:7' is not present" in proc.stderr, proc.stderr
    # The bare kind is the spec sheet, as before.
    out = hetpar_in_process(capsys, "costs", "mlp", "--small", "--devices", "cpu:0,h100").stdout
    assert "h100:0" in out


def test_a_hand_plan_outside_the_devices_given_is_refused(tmp_path):
    w = zoo.get("mlp", small=True)
    args = jax.eval_shape(w.example_args)
    layers = list(hetpar.trace(w.train_step, *args).layers)
    plan = dict.fromkeys(layers, "cpu:0") | {layers[-1]: "cpu:2"}
    with pytest.raises(hetpar.PlanError, match=r"\['cpu:2'\], which the devices given "
                                               r"\(cpu:0, cpu:1\) leave out"):
        hetpar.auto(w.train_step, devices=["cpu:0", "cpu:1"], plan=plan).lower(*args)
    # A plan file planned over a device not here names it, not "a different model".
    w, path = _plan_over_cpu0_cpu1(tmp_path, rename={"cpu:1": "cpu:7"})
    with pytest.raises(hetpar.PlanError) as e:
        hetpar.auto(w.train_step, plan=path).lower(*args)
    assert "cpu:7 is not present here" in str(e.value), e.value
    assert "different model" not in str(e.value)


# Issue 45, item 6 and issue 42's labels: what `hetpar run` says of its figures.
@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_cli_run_says_what_was_timed_now_and_what_is_its_own_calibration(
        tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HETPAR_PROFILES", raising=False)
    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path / "cache"))  # nothing timed before
    out = hetpar_in_process(capsys, "run", "mlp", "--small", "--devices", "cpu:0",
                            "--steps", "3", "--no-what-if").stdout
    timed = [ln for ln in out.splitlines() if re.search(r"\] fc\d on cpu:0: ", ln)]
    assert len(timed) == 3 and not any(ln.endswith(" cached") for ln in timed), out
    # One device, one microbatch: the prediction is the whole step timed while planning.
    assert "predicted step (the calibration's own timing of this step (cpu:0" in out, out
    assert "measured / calibration" in out and "measured / predicted" not in out, out
    # One figure per line: the interleaved median, then the steps alone.
    assert "measured step interleaved (median of steps 1-2): hetpar.auto" in out, out
    assert re.search(r"measured hetpar.auto alone \(median of 3 more steps\): [\d.]+ [mu]?s",
                     out), out
    # Only the compiling step timed: no ratio against the step alone.
    out = hetpar_in_process(capsys, "run", "mlp", "--small", "--devices", "cpu:0",
                            "--steps", "1", "--no-what-if", "--no-baseline").stdout
    assert "no measured / predicted: the one step timed includes compilation" in out, out
    assert not re.search(r"measured / (predicted|calibration) [\d.]", out), out


@pytest.mark.slow  # 3-5 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_report_labels_a_prediction_that_is_its_own_calibration(monkeypatch):
    from hetpar._step_clock import StepClock

    monkeypatch.setattr(StepClock, "TOLERANCE", -1.0)  # every gap warns: read the warning
    w = zoo.get("mlp", small=True, batch=8)
    report = {}
    for m in (1, 2):
        step = hetpar.auto(w.train_step, devices=["cpu:0"], profile="measure", microbatches=m)
        v, o, b = w.example_args()
        for _ in range(1 + StepClock.SETTLE + StepClock.STEPS):
            v, o, _ = step(v, o, b)
        report[m] = str(step.report())
    # One microbatch: the calibration's own timing, said so; its warning blames no stages.
    assert "batch=8" in report[1] and "?" not in report[1], report[1]
    assert "(the calibration's own timing of this step, cpu:0: not a test" in report[1]
    assert "measured / calibration" in report[1], report[1]
    assert "how repeatable" in report[1] and "stages overlap" not in report[1], report[1]
    # Two microbatches: a prediction (the layers per microbatch), on one device: no stages.
    assert "calibration's own" not in report[2] and "measured / predicted" in report[2]
    assert "as one stage" in report[2] and "stages overlap" not in report[2], report[2]


def test_cli_run_does_not_say_a_profile_file_comes_from_another_machine(
        tmp_path, capsys, monkeypatch):
    # Spec-sheet figures saved as a profile file: a CPU step they miss by far.
    from hetpar.cost_models import load_profiles, save_profiles

    monkeypatch.delenv("HETPAR_PROFILES", raising=False)
    path = tmp_path / "profiles.json"
    save_profiles(path, load_profiles())
    out = hetpar_in_process(capsys, "run", "mlp", "--small", "--devices", "cpu:0",
                            "--steps", "3", "--no-what-if", "--no-baseline",
                            "--profile", path).stdout
    assert "predicted step (planner)" in out and "measured / predicted" in out, out
    warning = [ln for ln in out.splitlines() if "WARNING" in ln]
    assert warning and "another machine" not in warning[0], out
    assert f"the figures come from {path}" in warning[0], warning

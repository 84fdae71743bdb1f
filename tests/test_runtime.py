"""Split execution against plain `jax.jit` on one device (virtual CPU devices).

The oracle, at every step: the same step under `jax.jit` on cpu:0, applied
to the very state hetpar's previous step returned. Comparing step by step
(rather than two independent 3-step trajectories) keeps the check at f32
rounding level: tiny BatchNorm batches make training chaotic, so two
trajectories that differ by one rounding at step 1 drift apart by step 3
whatever the implementation.

Tolerance: tests/oracle.py's, leaf by leaf (every parameter, optimizer
state, model state and the loss on its own scale).
"""

import dataclasses
import json
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hetpar
from hetpar import zoo
from hetpar._grad import microbatched
from hetpar.passes import SHARED

from . import oracle

CPU = jax.devices("cpu")


def check_steps(step_fn, auto_step, args, *, steps=3, microbatches=1, rtol=oracle.RTOL):
    """Runs `steps` steps under hetpar; each must equal jax.jit on the same
    inputs, leaf by leaf (tests/oracle.py)."""
    fn = microbatched(step_fn, microbatches, None)
    ref = jax.jit(fn)
    state = args[:-1]
    batch = args[-1]
    for _ in range(steps):
        out = auto_step(*state, batch)
        oracle.assert_equals_jit(out, fn, (*state, batch), rtol=rtol, jitted=ref)
        state = out[:-1]
    return out


def check_residency(auto_step, args, out):
    """Returned state sits on the device of its layer, so the next step moves none of it.

    Shared scalars (the step count) live where they are first read.
    """
    compiled = auto_step.lower(*args)
    graph = compiled.graph
    n_state = len(jax.tree_util.tree_leaves(args[:-1]))
    for k, leaf in enumerate(jax.tree_util.tree_leaves(out)[:n_state]):
        layer = graph.input_layers[k]
        if layer in (None, SHARED):
            want = compiled.stages.input_devices[k]
        else:
            want = compiled.assignment[layer]
        assert f"cpu:{next(iter(leaf.devices())).id}" == want, graph.program.in_paths[k]


def alternating(layers, n=2):
    return {name: f"cpu:{i % n}" for i, name in enumerate(layers)}


def small(name):
    # A small learning rate keeps the tiny configs' training well conditioned.
    return zoo.get(name, small=True, learning_rate=1e-4)


# Slow tier only (CI time): the fast tier's splits are
# test_each_family_split_and_pipelined_equals_jit's (a CNN, a transformer, an RNN).
# ResNet50, VGG16 and AlexNet are left out (CI time): their layers are ResNet18's
# and conv6's kinds (convolutions, pooling, BatchNorm, dense), split here.
# The rnn's scan is split by test_every_model_pipelined; the transformer by
# test_pipelined_plan_equals_jit, its tied embedding read across devices by
# test_a_parameter_read_on_another_device_moves_once_per_step.
ALTERNATING = [n for n in zoo.names()
               if n not in ("resnet50", "vgg16", "alexnet", "rnn", "transformer")]


@pytest.mark.slow
@pytest.mark.parametrize("name", ALTERNATING)
def test_alternating_plan_equals_jit(name):
    w = small(name)
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    step = hetpar.auto(w.train_step, plan=alternating(layers))
    out = check_steps(w.train_step, step, args)
    check_residency(step, args, out)
    assert step.lower(*args).stages is not None  # really split


# Pipelined plans on a subset (CI time), in the slow tier: an MLP, a
# transformer and a BatchNorm ResNet (the fast tier pipelines a CNN, a
# transformer and an RNN at M=2, 1F1B:
# test_each_family_split_and_pipelined_equals_jit). The schedules and the
# microbatch logic are model-independent, so each model covers M = 1, 2, 4 and
# both schedules between its cases rather than their full cross product (M=1
# once: one microbatch runs F0 B0 on each device under either schedule).
# GPipe (the default schedule) with M=2 runs fast in test_microbatching and
# test_equinox; M=1 is the step unchanged (test_microbatching).
PIPELINED = [
    *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("mlp", 2, "1f1b"), ("mlp", 1, "gpipe"), ("mlp", 2, "gpipe"), ("mlp", 4, "gpipe"),
        ("mlp", 4, "1f1b"),
        ("transformer", 2, "1f1b"), ("resnet18", 2, "1f1b"))),
]


@pytest.mark.parametrize("name, microbatches, schedule", PIPELINED)
def test_pipelined_plan_equals_jit(name, microbatches, schedule):
    w = zoo.get(name, small=True, learning_rate=1e-4, batch=4)
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    half = len(layers) // 2
    plan = {n: ("cpu:0" if i < half else "cpu:1") for i, n in enumerate(layers)}
    step = hetpar.auto(w.train_step, plan=plan, microbatches=microbatches, schedule=schedule)
    out = check_steps(w.train_step, step, args, microbatches=microbatches)
    check_residency(step, args, out)
    stages = step.lower(*args).stages
    assert stages.schedule == schedule
    if microbatches > 1:
        assert {s.microbatch for s in stages.stages} >= set(range(microbatches))


# The models whose layers pipelining treats apart from those
# test_pipelined_plan_equals_jit pipelines: a scan (rnn), an embedding's
# integer input (lm_embed). The convolutional nets' layers are split by
# test_alternating_plan_equals_jit and pipelined as ResNet18 (CI time: 15-40 s each).
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  for n in ("rnn", "lm_embed")])
def test_every_model_pipelined(name):
    """More of the zoo, pipelined once (M=2, 1F1B)."""
    w = zoo.get(name, small=True, learning_rate=1e-4, batch=4)
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    half = len(layers) // 2
    plan = {n: ("cpu:0" if i < half else "cpu:1") for i, n in enumerate(layers)}
    step = hetpar.auto(w.train_step, plan=plan, microbatches=2, schedule="1f1b")
    check_steps(w.train_step, step, args, steps=2, microbatches=2)


# The fast tier's check of the central claim on each family: a CNN, a
# transformer and an RNN, each split layer by layer over two devices and
# pipelined (M=2, 1F1B), two steps under the per-leaf oracle. Their configs
# are cut to the fewest layers that keep the family's kinds (convolutions,
# pooling and dense; embedding, attention block and tied head; embedding,
# LSTM scan and head): compiling each stage is what costs the time, so the
# zoo's small configs of these models are slow-tier (conftest.SLOW_MODELS).
# The cases are named by family, never by a model of conftest.SLOW_MODELS,
# which conftest would mark slow (the RNN's case, named "rnn", was: the fast
# tier ran no RNN).
FAMILIES = {
    "cnn": ("conv6", {"channels": (4, 8), "dense": (8,), "image_size": 8}),
    "transformer": ("transformer", {"num_layers": 1}),
    "lstm": ("rnn", {"num_layers": 1, "seq_len": 4}),
}


@pytest.mark.parametrize("mode", ["split", "pipelined"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_split_and_pipelined_equals_jit(family, mode):
    name, config = FAMILIES[family]
    w = zoo.get(name, small=True, learning_rate=1e-4, batch=4, **config)
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    # The first half of the layers on cpu:0, the rest on cpu:1 (alternating
    # every layer cost the transformer 5 minutes of stage compiles on 2 cores).
    half = len(layers) // 2
    plan = {n: ("cpu:0" if i < half else "cpu:1") for i, n in enumerate(layers)}
    microbatches = 1 if mode == "split" else 2
    step = hetpar.auto(w.train_step, plan=plan, microbatches=microbatches, schedule="1f1b")
    out = check_steps(w.train_step, step, args, steps=2, microbatches=microbatches)
    check_residency(step, args, out)
    stages = step.lower(*args).stages
    assert stages is not None and len({s.device for s in stages.stages}) == 2  # really split


@pytest.mark.slow  # 3-5 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_microbatched_gradient_equals_full_batch_without_batchnorm():
    w = zoo.get("mlp", small=True, learning_rate=1e-4, batch=4)
    args = w.example_args()
    full = jax.jit(w.train_step)(*args)
    step = hetpar.auto(w.train_step, plan=dict.fromkeys(hetpar.trace(w.train_step, *args).layers,
                                                        "cpu:0"), microbatches=4)
    # Four microbatches' gradients summed against one batch's: reassociated
    # sums, f32 rounding apart, each leaf on its own scale.
    assert not oracle.mismatches(step(*args), full)


@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_1f1b_interleaves_backward_before_last_forward():
    w = zoo.get("mlp", small=True, learning_rate=1e-4, batch=4)
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    plan = {n: ("cpu:0" if i < len(layers) // 2 else "cpu:1") for i, n in enumerate(layers)}
    step = hetpar.auto(w.train_step, plan=plan, microbatches=4, schedule="1f1b")
    stages = step.lower(*args).stages
    last = [stages.stages[i] for i in stages.device_order["cpu:1"]]
    phases = [(s.phase, s.microbatch) for s in last if s.microbatch is not None]
    # The last device of a 1F1B pipeline runs F0 B0 F1 B1 ...; GPipe would run F0..F3 first.
    assert phases[:2] == [("forward", 0), ("backward", 0)]


class Skip(nn.Module):
    @nn.compact
    def __call__(self, x):
        a = nn.Dense(16, name="a")(x)
        b = nn.Dense(16, name="b")(jnp.tanh(a))
        c = nn.Dense(16, name="c")(jnp.tanh(b))
        return nn.Dense(3, name="head")(jnp.tanh(c) + a)  # skip from a to head


@pytest.mark.slow
def test_skip_connection_across_devices():
    model, tx = Skip(), optax.adam(1e-3)
    x = jax.random.normal(jax.random.key(0), (8, 5))
    y = jax.random.normal(jax.random.key(1), (8, 3))
    params = model.init(jax.random.key(2), x)

    def step(params, opt_state, batch):
        loss, g = hetpar.value_and_grad(
            lambda p: jnp.mean((model.apply(p, batch["x"]) - batch["y"]) ** 2))(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss

    args = (params, tx.init(params), {"x": x, "y": y})
    plan = {"a": "cpu:0", "b": "cpu:1", "c": "cpu:2", "head": "cpu:3"}
    auto_step = hetpar.auto(step, plan=plan)
    graph = auto_step.lower(*args).graph
    assert graph.graph.has_edge("a", "head")  # the skip really crosses devices
    out = check_steps(step, auto_step, args)
    check_residency(auto_step, args, out)


def test_one_device_plan_is_one_jit_executable():
    w = small("mlp")
    args = w.example_args()
    step = hetpar.auto(w.train_step, devices=["cpu:1"])
    out = check_steps(w.train_step, step, args)
    assert step.lower(*args).stages is None
    assert {next(iter(x.devices())) for x in jax.tree_util.tree_leaves(out)} == {CPU[1]}


def test_planner_chooses_and_runs():
    w = small("mlp")
    args = w.example_args()
    step = hetpar.auto(w.train_step, devices=["cpu:0", "cpu:1"])
    check_steps(w.train_step, step, args, steps=1)
    assert step.plan is not None and set(step.assignment) == set(step.lower(*args).graph.layers)
    explained = step.explain()
    assert all(f"{layer} -> {dev}" in explained for layer, dev in step.assignment.items())


@pytest.mark.slow  # 3-5 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_plan_for_another_model_is_a_clear_error(tmp_path):
    w = small("mlp")
    args = w.example_args()
    step = hetpar.auto(w.train_step, devices=["cpu:0", "cpu:1"])
    step.lower(*args)
    path = tmp_path / "plan.json"
    step.plan.save(path)
    other = small("conv6")
    with pytest.raises(hetpar.PlanError):
        hetpar.auto(other.train_step, plan=str(path))(*other.example_args())


def test_saved_plan_that_leaves_a_device_idle_loads(tmp_path):
    # Planned over cpu:0 and cpu:1, everything on one: the plan's fingerprint
    # names both devices though it uses one.
    w = small("mlp")
    args = w.example_args()
    step = hetpar.auto(w.train_step, devices=["cpu:0", "cpu:1"])
    plan = step.lower(*args).plan
    idle = dataclasses.replace(plan, assignment=dict.fromkeys(plan.assignment, "cpu:1"))
    idle.save(tmp_path / "plan.json")
    again = hetpar.auto(w.train_step, devices=["cpu:0", "cpu:1"], plan=tmp_path / "plan.json")
    check_steps(w.train_step, again, args, steps=1)
    assert again.plan == idle and set(again.assignment.values()) == {"cpu:1"}
    # The plan records the devices it was planned over, so it loads without
    # them named again, among more devices present (the fingerprint of every
    # present device's table would not match).
    assert len(CPU) > 2 and idle.devices == ("cpu:0", "cpu:1")
    assert json.loads((tmp_path / "plan.json").read_text())["devices"] == ["cpu:0", "cpu:1"]
    bare = hetpar.auto(w.train_step, plan=tmp_path / "plan.json")
    check_steps(w.train_step, bare, args, steps=1)
    assert set(bare.assignment.values()) == {"cpu:1"}


def test_plan_dict_with_unknown_layers_is_a_clear_error():
    w = small("mlp")
    with pytest.raises(hetpar.PlanError, match="does not fit this step's layers"):
        hetpar.auto(w.train_step, plan={"nope": "cpu:0", "Dense_0": "cpu:1"})(*w.example_args())


def test_plan_naming_a_missing_device(tmp_path):
    w = small("mlp")
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    with pytest.raises(hetpar.PlanError, match="not present"):
        hetpar.auto(w.train_step, plan=dict.fromkeys(layers, "gpu:0"))(*args)


def test_missing_device_can_replan(caplog):
    w = small("mlp")
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    step = hetpar.auto(w.train_step, plan=dict.fromkeys(layers, "gpu:7"),
                       devices=["cpu:0", "cpu:1"], on_missing_device="replan")
    check_steps(w.train_step, step, args, steps=1)
    assert set(step.assignment.values()) <= {f"cpu:{i}" for i in range(len(CPU))}


def test_microbatches_must_divide_the_batch():
    w = zoo.get("mlp", small=True, batch=4)
    args = w.example_args()
    with pytest.raises(hetpar.HetparError, match="not divisible"):
        hetpar.auto(w.train_step, devices=["cpu:0"], microbatches=3)(*args)


def test_microbatches_need_the_gradient_mark():
    def step(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
        return w - 0.1 * g

    with pytest.raises(hetpar.HetparError, match="hetpar.value_and_grad"):
        hetpar.auto(step, devices=["cpu:0"], microbatches=2)(jnp.ones((3, 3)), jnp.ones((4, 3)))


class Boom(Exception):
    pass


def failing_step():
    """(switch, step): a two-layer step whose layer "second" raises once switch["now"] is set."""
    fail = {"now": False}

    def check(x):
        if fail["now"]:
            raise Boom("injected failure")

    def step(w, x):
        def loss(w):
            with hetpar.layer("first"):
                h = jnp.tanh(x @ w[0])
            with hetpar.layer("second"):
                jax.debug.callback(check, h)
                h = jnp.tanh(h @ w[1])
            return h.sum()

        val, g = jax.value_and_grad(loss)(w)
        return [a - 0.1 * b for a, b in zip(w, g)], val

    return fail, step


def test_failing_stage_names_layer_and_device_and_keeps_state():
    fail, step = failing_step()
    w = [jnp.ones((4, 4)), jnp.ones((4, 4)) * 0.5]
    before = [np.asarray(a).copy() for a in w]
    auto_step = hetpar.auto(step, plan={"first": "cpu:0", "second": "cpu:1"})
    auto_step(w, jnp.ones((2, 4)))
    fail["now"] = True
    with pytest.raises(hetpar.StageError, match=r"cpu:1.*second"):
        auto_step(w, jnp.ones((2, 4)))
    for a, b in zip(w, before):  # the caller's state is intact
        np.testing.assert_array_equal(np.asarray(a), b)


def test_one_device_plan_takes_a_batch_committed_elsewhere():
    # A host data loader hands over batches committed to cpu:0; the plan runs on cpu:1.
    w = small("mlp")
    variables, opt_state, batch = w.example_args()
    step = hetpar.auto(w.train_step, devices=["cpu:1"])
    out = step(variables, opt_state, jax.device_put(batch, CPU[0]))
    oracle.assert_equals_jit(out, w.train_step, (variables, opt_state, batch))
    state = out[:-1]
    assert {next(iter(x.devices())) for x in jax.tree_util.tree_leaves(state)} == {CPU[1]}
    # It is moved with device_put before jit sees it (jit's own copy is slow).
    on_cpu0 = jax.device_put(batch, CPU[0])
    moved = step.lower(variables, opt_state, on_cpu0)._batch_here((variables, opt_state, on_cpu0))
    assert {d for x in jax.tree_util.tree_leaves(moved[2]) for d in x.devices()} == {CPU[1]}
    assert moved[0] is variables


def test_move_many_batches_by_source_and_keeps_values():
    from hetpar.runtime import TransferEngine

    engine = TransferEngine()
    xs = [jax.device_put(np.arange(4.0) + i, CPU[i % 3]) for i in range(6)]
    xs += [jax.random.key(0), np.ones(2)]
    out = engine.move_many(xs, CPU[1])
    assert out[1] is xs[1] and out[4] is xs[4]  # already there: the same array
    for x, y in zip(xs[:6], out[:6]):
        assert y.devices() == {CPU[1]}
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert out[6].devices() == {CPU[1]} and out[7].devices() == {CPU[1]}
    assert engine.bytes_moved == 4 * xs[0].nbytes + xs[6].nbytes  # the numpy array is not counted


@pytest.mark.slow
def test_a_parameter_read_on_another_device_moves_once_per_step():
    # GPT-2's tied embedding: `wte` owns it, `lm_head` on another device reads
    # it in every microbatch's forward and backward stage.
    w = zoo.get("transformer", small=True, batch=4, learning_rate=1e-4)
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    plan = {n: "cpu:0" if n == "wte" else "cpu:1" for n in layers}
    step = hetpar.auto(w.train_step, plan=plan, microbatches=4)
    ex = step.lower(*args)._executor
    emb = args[0]["params"]["wte"]["embedding"]
    moved = []
    inner = ex.transfer.move_many

    def spy(xs, dst):
        moved.extend(x for x in xs if getattr(x, "shape", None) == emb.shape and dst == CPU[1]
                     and x.devices() != {dst})
        return inner(xs, dst)

    ex.transfer.move_many = spy
    *state, _ = step(*args)  # the first step places every input on its device
    moved.clear()
    check_steps(w.train_step, step, (*state, args[-1]), steps=2, microbatches=4)
    assert len(moved) == 2  # once per step, not once per microbatch stage (8 before)


def mlp_forward(w, x):
    with hetpar.layer("first"):
        h = jnp.tanh(x @ w[0])
    with hetpar.layer("second"):
        return h @ w[1]


MLP_W = [jnp.full((3, 4), 0.1), jnp.full((4, 2), 0.2)]
SPLIT = {"first": "cpu:0", "second": "cpu:1"}


@pytest.mark.slow
def test_retracing_on_new_shapes_keeps_the_thread_count_bounded():
    # Every signature compiles its own executor; they share one worker thread
    # per device. Before, each kept two threads of its own: 80 after 40 shapes.
    step = hetpar.auto(mlp_forward, plan=SPLIT)
    before = threading.active_count()
    most = before
    for n in range(1, 41):
        x = np.full((n, 3), 1.0 / n, np.float32)
        out = step(MLP_W, x)
        most = max(most, threading.active_count())
        if n % 10 == 0:
            np.testing.assert_allclose(out, jax.jit(mlp_forward)(MLP_W, x), rtol=1e-6)
    assert step.lower(MLP_W, x).stages is not None  # really split over cpu:0 and cpu:1
    assert most <= before + 2, f"{most - before} new threads after 40 shapes"


def test_two_threads_calling_two_signatures_at_once():
    # Both signatures' executors share the workers; a step queues its work on
    # every worker at once, so concurrent steps cannot wait on each other.
    step = hetpar.auto(mlp_forward, plan=SPLIT)
    xs = [np.full((n, 3), 0.5, np.float32) for n in (2, 3)]
    for x in xs:
        step.lower(MLP_W, x)
    errors = []

    def run(x):
        try:
            for _ in range(20):
                np.testing.assert_allclose(step(MLP_W, x), jax.jit(mlp_forward)(MLP_W, x),
                                           rtol=1e-6)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(x,)) for x in xs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors, errors


def test_run_compares_with_jit_on_the_fastest_single_device_baseline():
    from types import SimpleNamespace

    from hetpar.cli._run import _best_single_device
    from hetpar.planner import BaselineResult, Predicted

    def only(dev, t):
        return BaselineResult(f"only {dev}", predicted=Predicted(t, 0.0, 0.0, {dev: t}))

    baselines = {b.name: b for b in (only("cpu:0", 3.0), only("cpu:1", 1.0), only("gpu:5", 0.1),
                                     BaselineResult("only cpu:2", reason="out of memory"),
                                     BaselineResult("heft", predicted=Predicted(0.01, 0, 0, {})))}
    compiled = SimpleNamespace(plan=SimpleNamespace(baselines=baselines),
                               assignment={"a": "cpu:0", "b": "cpu:3"})
    # gpu:5 is predicted faster but not present; "heft" is not a single device.
    assert _best_single_device(compiled) == "cpu:1"
    compiled.plan = None
    assert _best_single_device(compiled) == "cpu:0"


def test_plan_devices_must_cover_its_placements(tmp_path):
    w = small("mlp")
    args = w.example_args()
    plan = hetpar.auto(w.train_step, devices=["cpu:0", "cpu:1"]).lower(*args).plan
    data = plan.to_json()
    data["devices"] = ["cpu:2"]
    with pytest.raises(hetpar.PlanError, match="leave out"):
        hetpar.Plan.from_json(data)
    data["devices"] = ["cpu:0", "cpu:0"]
    with pytest.raises(hetpar.PlanError, match="distinct"):
        hetpar.Plan.from_json(data)


@pytest.mark.slow  # 12-14 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_work_from_the_inputs_alone_runs_in_the_stage_that_reads_it():
    # GPT-2's cross-entropy gradient is a scatter of the loss's cotangent by
    # the labels: ready from the start, it used to run in the first stage of
    # the head's device (the tied embedding's) and cross to the head's stage
    # as a (batch, tokens - 1, vocab) f32 array, 408 MB at batch 16, where
    # the head's stage then ran 1.1-1.4x the head timed alone. One block (CI
    # time): the embedding, the head and the loss are what this is about. The
    # config of FAMILIES' transformer, so the compile cache serves both.
    w = zoo.get("transformer", batch=4, small=True, num_layers=1, learning_rate=1e-4)
    args = w.example_args()
    graph = hetpar.trace(w.train_step, *args)
    plan = {name: "cpu:0" if name in ("wte", "lm_head") else "cpu:1" for name in graph.layers}
    auto = hetpar.auto(w.train_step, plan=plan)
    stages = auto.lower(*args).stages
    vocab = args[0]["params"]["wte"]["embedding"].shape[0]
    tokens = args[-1]["x"].shape[1]
    scatter = (4, tokens - 1, vocab)  # the loss cotangent by label (next-token targets)
    assert scatter in {v.aval.shape for e in graph.program.jaxpr.jaxpr.eqns for v in e.outvars}
    assert not [st.index for st in stages.stages for v in st.inputs if v.aval.shape == scatter]
    head = next(st for st in stages.stages if "lm_head" in st.layers and st.device == "cpu:0"
                and "wte" not in st.layers)
    labels = next(v for v in head.inputs if jnp.issubdtype(v.aval.dtype, jnp.integer))
    assert labels in set(stages.graph.program.jaxpr.jaxpr.invars)  # the step's own input
    check_steps(w.train_step, auto, args, steps=2)


def test_a_worker_keeps_at_most_prefetch_stages_in_flight(monkeypatch):
    """A stage's outputs are allocated when it is dispatched, so a worker that
    ran ahead through a whole backward would hold every layer's gradient at
    once; the compiled memory check counts the running stage and one queued.
    Here every stage's result is a marker that records when the worker waits
    on it: before dispatching stage k on a device, it has waited for the
    stage `prefetch` places earlier on that device."""
    from hetpar.runtime import _run

    w = zoo.get("mlp", small=True)
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    step = hetpar.auto(w.train_step, plan=alternating(layers))
    ex = step.lower(*args)._executor
    assert ex.prefetch == 2
    log: list = []

    class Marker:
        def __init__(self, idx):
            self.idx = idx

        def block_until_ready(self):
            log.append(("waited", self.idx))
            return self

    real = _run._Run._stage

    def stage(self, idx, st, name, dev):
        outs = real(self, idx, st, name, dev)
        log.append(("dispatched", idx))
        return [Marker(idx), *outs]

    monkeypatch.setattr(_run._Run, "_stage", stage)
    monkeypatch.setattr(jax, "block_until_ready", lambda x: [
        m.block_until_ready() for m in (x if isinstance(x, list) else [x])
        if isinstance(m, Marker)] or x)
    step(*args)
    assert {i for what, i in log if what == "dispatched"} == set(range(len(ex.stages.stages)))
    for order in ex.stages.device_order.values():
        for k, idx in enumerate(order):
            if k >= ex.prefetch and ("dispatched", idx) in log:
                earlier = order[k - ex.prefetch]
                assert ("waited", earlier) in log[:log.index(("dispatched", idx))], (idx, log)


@pytest.mark.slow  # a diagnostic's plumbing, 6 s: over the fast tier's budget (CI runs it)
def test_record_memory_reads_each_stage_once_and_keeps_the_results():
    """`Executor.record_memory` serialises a step and reads each stage's device
    after it ran (None where the backend keeps no statistics, as on CPU),
    beside the compiled replay's walk; the step computes what it computes
    without it."""
    from hetpar._memory_check import compiled_peaks

    w = zoo.get("mlp", small=True)
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    step = hetpar.auto(w.train_step, plan=alternating(layers))
    expected = step(*args)
    ex = step._last._executor
    ex.record_memory = True
    got = step(*args)
    ex.record_memory = False
    assert sorted(i for i, _, _ in ex.last_memory) == list(range(len(ex.stages.stages)))
    for i, device, held in ex.last_memory:
        assert device == ex.stages.stages[i].device and held is None  # CPU: no statistics
    walk: list = []
    compiled_peaks(ex, walk)
    assert {w["stage"] for w in walk} == {i for i, _, _ in ex.last_memory}
    for a, b in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

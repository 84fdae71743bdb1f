"""State apart from compute, run (issue 15): offload plans equal `jax.jit`.

On virtual CPU devices: compute on `cpu:0`, parameters and optimizer state
kept on `cpu:1` between steps and updated there (ZeRO-Offload's split), or
kept on `cpu:1` and updated on `cpu:0` (state streamed in and out). Three
steps must match the same step under `jax.jit` on one device, leaf by leaf
(tests/oracle.py), the state must stay where the plan put it, and a failing
step must leave the caller's state intact.
"""

import csv
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetpar
from hetpar import zoo
from hetpar.core import Placement, PlanError
from hetpar.passes import split

from .test_runtime import check_steps, failing_step

OFFLOAD = {"compute": "cpu:0", "state": "cpu:1", "update": "cpu:1"}
STREAMED = {"compute": "cpu:0", "state": "cpu:1", "update": "cpu:0"}


# "partial" offloads every layer but the first: host_update's offloaded layers
# beside resident ones, fast tier time, so slow (CI time: 20 s a transformer case).
@pytest.mark.parametrize("model, how", [
    ("mlp", "host_update"), ("mlp", "streamed"),
    *(pytest.param(*case, marks=pytest.mark.slow)
      for case in (("mlp", "partial"), ("transformer", "streamed"), ("transformer", "partial")))])
def test_offload_plan_equals_jit(model, how):
    w = zoo.get(model, small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    if how == "host_update":
        plan = {layer: OFFLOAD for layer in graph.layers}
    elif how == "streamed":
        plan = {layer: STREAMED for layer in graph.layers}
    else:  # the first layer resident, the rest offloaded
        plan = {layer: OFFLOAD for layer in graph.layers}
        plan[graph.layers[0]] = "cpu:0"
    step = hetpar.auto(w.train_step, plan=plan)
    got = check_steps(w.train_step, step, args)  # each of 3 steps equals jax.jit's
    placements = step.placements
    assert all(isinstance(p, Placement) for p in placements.values())
    assert step.state_assignment[graph.layers[-1]] == "cpu:1"
    assert step.update_assignment[graph.layers[-1]] == ("cpu:0" if how == "streamed" else "cpu:1")
    # The offloaded layers' new state comes back where their state lives.
    cpu1 = jax.devices("cpu")[1]
    on_cpu1 = [x for x in jax.tree_util.tree_leaves(got[:-1])
               if isinstance(x, jax.Array) and cpu1 in x.devices()]
    assert on_cpu1, "offloaded state must stay on the state device"


def test_split_puts_each_part_on_its_device():
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    stages = split(graph, {layer: OFFLOAD for layer in graph.layers})
    update = [st for st in stages.stages if st.device == "cpu:1"]
    compute = [st for st in stages.stages if st.device == "cpu:0"]
    assert len(update) == 1, "the host update of all offloaded layers is one computation"
    assert compute and all(st.device == "cpu:0" for st in compute)
    # Each offloaded layer's forward is a stage of its own, so its weights'
    # copy can overlap the layers before it.
    fwd_layers = [st.layers for st in compute]
    assert len(fwd_layers) >= len(graph.layers)
    for layer, role, dev in zip(graph.input_layers, graph.input_roles, stages.input_devices):
        if layer not in graph.layers:
            continue  # shared scalars (Adam's count) live where first read
        assert dev == ("cpu:1" if role in ("param", "opt_state") else "cpu:0"), (layer, role)


def test_bad_placements_are_refused():
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    with pytest.raises(PlanError, match="unknown placement keys"):
        split(graph, {layer: {"compute": "cpu:0", "home": "cpu:1"} for layer in graph.layers})
    with pytest.raises(PlanError, match="needs 'compute'"):
        split(graph, {layer: {"state": "cpu:1"} for layer in graph.layers})
    with pytest.raises(PlanError, match="activations must be one of"):
        split(graph, {layer: {"compute": "cpu:0", "activations": "drop"}
                      for layer in graph.layers})


def test_caller_state_survives_a_failing_offload_step():
    fail, step = failing_step()
    cpu1 = jax.devices("cpu")[1]
    w = [jax.device_put(jnp.ones((4, 4)), cpu1), jax.device_put(jnp.ones((4, 4)) * 0.5, cpu1)]
    before = [np.asarray(a).copy() for a in w]
    auto_step = hetpar.auto(step, plan={"first": OFFLOAD, "second": OFFLOAD})
    new, _ = auto_step(w, jnp.ones((2, 4)))
    assert {d for a in new for d in a.devices()} == {cpu1}  # host-resident state stays there
    fail["now"] = True
    with pytest.raises(hetpar.StageError, match=r"cpu:0.*second"):
        auto_step(w, jnp.ones((2, 4)))
    for a, b in zip(w, before):  # the caller's host-resident state is intact
        np.testing.assert_array_equal(np.asarray(a), b)


# JAX's own host offload, per layer: optimizer state in a memory place (the
# CPU device's `pinned_host` memory here, a GPU's on the GPU machine),
# parameters resident, the update on the compute device.
PINNED = {"compute": "cpu:0", "params": "cpu:0", "state": "cpu:0:pinned_host",
          "update": "cpu:0"}


def _memory_kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(tree)
            if isinstance(x, jax.Array)}


@pytest.mark.parametrize("model", ["mlp", pytest.param("transformer", marks=pytest.mark.slow)])
def test_state_in_pinned_host_memory_equals_jit(model):
    w = zoo.get(model, small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    plan = {layer: PINNED for layer in graph.layers}
    step = hetpar.auto(w.train_step, plan=plan)
    new_params, new_opt, _ = check_steps(w.train_step, step, args)
    assert step.state_assignment[graph.layers[0]] == "cpu:0:pinned_host"
    assert step.params_assignment[graph.layers[0]] == "cpu:0"
    # The new optimizer moments go back to pinned host memory, the parameters stay.
    assert _memory_kinds(new_params) == {"device"}
    kinds = {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(new_opt)
             if isinstance(x, jax.Array) and x.ndim > 0}
    assert kinds == {"pinned_host"}, kinds
    # What the split sends home: the moments to the place, nothing to the device.
    homes = {d for d in step._last.stages.output_devices if d is not None}
    assert homes == {"cpu:0:pinned_host"}
    # Priced and reported: the CPU's pinned host memory is its own RAM (the
    # cost table lists accelerators' places only; this raised "unknown").
    assert step._last.predicted().step_time_s > 0
    assert "cpu:0" in str(step.report().to_json())


@pytest.mark.parametrize("sent", ["state", "activations"])
def test_the_compiled_check_counts_new_state_on_its_way_home(monkeypatch, sent):
    """A stage's new state sent to its memory place (or its activations
    offloaded there until the backward) keeps its device buffer until the
    copy ends, and the worker waits for it only when it dispatches the stage
    `prefetch` after (run 57: 3 GB over the compiled figure on an H200
    without it). The replay counts the stage before's beside each."""
    from hetpar import _memory_check

    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    how = PINNED if sent == "state" else {"compute": "cpu:0", "activations": "offload"}
    ex = hetpar.auto(w.train_step, plan={layer: how for layer in graph.layers}
                     ).lower(*args)._executor
    walk: list = []
    _memory_check.compiled_peaks(ex, walk)
    monkeypatch.setattr(_memory_check, "sent_home_bytes", lambda executor, st: 0.0)
    without: list = []
    _memory_check.compiled_peaks(ex, without)
    order = ex.stages.device_order["cpu:0"]
    away = {v for vs in ex._offload_vars for v in vs}
    sent = [sum(v.aval.size * v.aval.dtype.itemsize for v in ex.stages.stages[i].outputs
                if v in ex._send_home or v in away) for i in order]
    assert ex.prefetch == 2 and sum(sent[:-1]) > 0  # sent before the device's last stage
    during = {w["stage"]: w["during"] for w in walk}
    alone = {w["stage"]: w["during"] for w in without}
    for pos, i in enumerate(order):
        assert during[i] - alone[i] == pytest.approx(sent[pos - 1] if pos else 0.0)


def test_next_layers_state_comes_in_before_this_layers_goes_out():
    """Copies between a device and its memory places queue in issue order:
    each streaming stage's successor must have its state copy in issued
    before the stage's new state is sent out, or the two directions run one
    after the other (measured on an H100: 1.19 s against 0.95 s a step)."""
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    step = hetpar.auto(w.train_step, plan={layer: PINNED for layer in graph.layers})
    placed = step.place(*args)
    jax.block_until_ready(step(*placed))
    ex = step._last._executor
    moves, real = [], ex.transfer.move_many

    def logged(xs, dst):
        kinds = {getattr(getattr(x, "sharding", None), "memory_kind", None) for x in xs}
        if getattr(dst, "memory_kind", None) == "pinned_host":
            if "device" in kinds:  # (placing the inputs moves nothing)
                moves.append("out")
        elif "pinned_host" in kinds:
            moves.append("in")
        return real(xs, dst)

    ex.transfer.move_many = logged
    jax.block_until_ready(step(*placed))
    outs = [i for i, m in enumerate(moves) if m == "out"]
    assert len(outs) >= 2 and moves.count("in") >= 2, moves
    # When a layer's new state leaves, the next layer's has been asked for.
    for j, i in enumerate(outs[:moves.count("in") - 1]):
        assert moves[:i].count("in") >= j + 2, moves


@pytest.mark.parametrize("donated", [False, True])
def test_watched_timeline_shows_compute_and_copies_each_way(monkeypatch, donated):
    """Every stage's compute is in the watched timeline; with the streamed
    copies donated (as on an accelerator, emulated here) too: waiting on a
    donated copy raised, and the streaming stages' compute went missing."""
    if donated:
        from hetpar.runtime import _executor

        monkeypatch.setattr(_executor.Executor, "_copies_donated",
                            lambda self, st: _executor._reusable(st, set(self._streamed[st.index])))
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    step = hetpar.auto(w.train_step, plan={layer: PINNED for layer in graph.layers})
    placed = step.place(*args)
    expected = step(*placed)
    ex = step._last._executor
    ex.watch_events = True
    got = step(*placed)
    ex.watch_events = False
    events = ex.last_events
    kinds = {e.what for e in events}
    # (A copy in donated before its watcher saw it goes unrecorded: under
    # load, every one of them may.)
    assert {"compute", "copy out"} <= kinds <= {"copy in", "compute", "copy out"}, kinds
    assert all(0 <= e.start_s <= e.end_s for e in events)
    # Every stage computed once; every streamed layer's state came in and went out.
    assert sorted(e.stage for e in events if e.what == "compute") == list(
        range(len(ex.stages.stages)))
    streaming = {i for i, s in enumerate(ex._streams) if s}
    assert {e.stage for e in events if e.what == "copy out"} == streaming
    if donated:
        assert any(ex._donated_copies)
    else:
        assert streaming <= {e.stage for e in events if e.what == "copy in"}
    for a, b in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_params_apart_from_streamed_state():
    """Parameters on cpu:1, optimizer state in cpu:0's pinned memory, update on cpu:0."""
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    plan = {layer: {**PINNED, "params": "cpu:1"} for layer in graph.layers}
    step = hetpar.auto(w.train_step, plan=plan)
    new_params, new_opt, _ = check_steps(w.train_step, step, args)
    cpu1 = jax.devices("cpu")[1]
    assert all(cpu1 in x.devices() for x in jax.tree_util.tree_leaves(new_params))
    assert "pinned_host" in _memory_kinds(new_opt)


def test_memory_place_errors_are_clear():
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    with pytest.raises(PlanError, match="memory place"):
        split(graph, {layer: {"compute": "cpu:0:pinned_host"} for layer in graph.layers})
    bad = {layer: {**PINNED, "state": "cpu:0:unpinned_host"} for layer in graph.layers}
    cpu0 = jax.devices("cpu")[0]
    if "unpinned_host" not in {m.kind for m in cpu0.addressable_memories()}:
        with pytest.raises(PlanError, match="has no 'unpinned_host' memory"):
            hetpar.auto(w.train_step, plan=bad)(*args)


def test_place_moves_arguments_where_the_plan_keeps_them():
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    step = hetpar.auto(w.train_step, plan={layer: PINNED for layer in graph.layers})
    params, opt_state, batch = step.place(*args)
    assert _memory_kinds(params) == {"device"}
    assert "pinned_host" in _memory_kinds(opt_state)
    check_steps(w.train_step, step, (params, opt_state, batch))


def test_place_frees_the_old_copies():
    """After `place`, nothing of hetpar holds the caller's old arrays: a model
    that fills the GPU frees its optimizer state there once it is on the host."""
    import gc
    import weakref

    w = zoo.get("mlp", small=True)
    params, opt_state, batch = w.example_args()
    graph = hetpar.trace(w.train_step, params, opt_state, batch)
    old = weakref.ref(jax.tree_util.tree_leaves(opt_state)[1])
    step = hetpar.auto(w.train_step, plan={layer: PINNED for layer in graph.layers})
    del graph
    params, opt_state, batch = step.place(params, opt_state, batch)
    gc.collect()
    assert old() is None, "hetpar keeps a reference to the caller's old optimizer state"


def test_stages_recompute_cheap_residuals_instead_of_carrying_them(monkeypatch):
    """A block's forward stage hands its backward matmul outputs, not the
    dozens of elementwise intermediates one jit would fuse away."""
    from hetpar.passes import _split

    w = zoo.get("transformer", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    plan = {layer: PINNED for layer in graph.layers}
    block = graph.layers[2]

    def carried(stages):  # what the block's forward stage hands on
        forward = min((st for st in stages.stages if st.layers == (block,)),
                      key=lambda st: st.index)
        return sum(o.aval.size * o.aval.dtype.itemsize for o in forward.outputs)

    with_recompute = split(graph, plan)
    monkeypatch.setattr(_split, "RECOMPUTE_DEPTH", 0)
    without = split(graph, plan)
    assert carried(with_recompute) < 0.6 * carried(without)  # 0.53 when written
    # Streamed optimizer state is never re-read by a recomputed equation.
    homes = dict(zip(graph.program.jaxpr.jaxpr.invars, with_recompute.input_devices))
    for st in with_recompute.stages:
        for v in st.inputs:
            if homes.get(v) == "cpu:0:pinned_host":
                assert st.phase == "main" and any(
                    v in e.invars for e in st.jaxpr.jaxpr.eqns), "read by its update only"


def test_streamed_state_is_read_by_the_layers_backward_only():
    """Adam's `b1 * mu` needs no gradient: left free, it ran in each layer's
    forward stage, which pulled the layer's moments from pinned host memory
    and handed them, scaled, to the backward across the whole step (on a 5B
    model: 38 GB the GPU held at once). Every layer's optimizer state must be
    read by one stage: the one that computes the layer's gradient."""
    w = zoo.get("transformer", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    stages = split(graph, {layer: PINNED for layer in graph.layers})
    invars = graph.program.jaxpr.jaxpr.invars
    checked = 0
    for v, layer, role in zip(invars, graph.input_layers, graph.input_roles):
        if role != "opt_state" or not v.aval.shape:
            continue  # the step count is a scalar the shared group reads
        readers = [st for st in stages.stages if v in st.inputs]
        own = [st for st in stages.stages if layer in st.layers]
        assert [st.index for st in readers] == [own[-1].index], (layer, readers)
        checked += 1
    assert checked >= 2 * len(graph.layers) - 2  # mu and nu of (nearly) every layer


def _handed_on(stages, layer) -> int:
    """Bytes the layer's first stage (its forward) hands to later stages."""
    forward = min((st for st in stages.stages if st.layers == (layer,)), key=lambda st: st.index)
    return sum(o.aval.size * o.aval.dtype.itemsize for o in forward.outputs)


# Slow (35 s of compiles for remat on 2 cores). The fast tier checks the
# remat policy on an MLP in test_user_steps; the offload policy is checked
# in the slow tier only (here and test_user_steps' offload case).
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["remat", "offload"])
def test_activation_policies_equal_jit(policy):
    """activations="remat": a block's forward hands on only its output and
    the backward recomputes the rest; "offload": its residuals wait in pinned
    host memory between forward and backward. Both equal jax.jit."""
    w = zoo.get("transformer", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    blocks = [la for la in graph.layers if la.startswith("h")]
    plan = {la: ({"compute": "cpu:0", "activations": policy} if la in blocks else "cpu:0")
            for la in graph.layers}
    step = hetpar.auto(w.train_step, plan=plan)
    check_steps(w.train_step, step, args)
    ours = split(graph, plan)  # (one device: it runs as one executable, passes/_fuse.py)
    if policy == "remat":
        assert len(step._last.stages.stages) == 1
        # What the forward hands on: the block's output (read by the next
        # block too) and little else, against the residuals it hands on when
        # they are kept (offloaded: cut the same way, nothing recomputed).
        kept = split(graph, {la: ({"compute": "cpu:0", "activations": "offload"}
                                  if la in blocks else "cpu:0") for la in graph.layers})
        assert _handed_on(ours, blocks[0]) < 0.5 * _handed_on(kept, blocks[0])
    else:
        ex = step._last._executor
        assert any(ex._offload_out), "some forward stage sends residuals to pinned host"
        kinds = {getattr(ex.target(d), "memory_kind", None) for d in ex._offload_out if d}
        assert kinds == {"pinned_host"}


def test_new_state_goes_home_with_weight_decay_folded_into_the_gradient():
    """optax.chain(add_decayed_weights, adam): the moments read a gradient that
    read the parameters; they are still optimizer state, sent to its home."""
    import flax.linen as nn
    import optax

    model = nn.Sequential([nn.Dense(8, name="first"), nn.Dense(2, name="second")])

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, name="second")(jax.nn.relu(nn.Dense(8, name="first")(x)))

    del model
    net, opt = Net(), optax.chain(optax.add_decayed_weights(1e-2), optax.adam(1e-2))
    x = jnp.ones((4, 3))
    params = net.init(jax.random.PRNGKey(0), x)["params"]

    def train_step(params, opt_state, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(net.apply({"params": p}, x) ** 2))(params)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    args = (params, opt.init(params), x)
    graph = hetpar.trace(train_step, *args)
    plan = {layer: PINNED for layer in graph.layers}
    stages = split(graph, plan)
    homes = [d for d in stages.output_devices if d is not None]
    assert homes and set(homes) == {"cpu:0:pinned_host"}  # the moments, not the parameters
    step = hetpar.auto(train_step, plan=plan)
    new_params, new_opt, _ = check_steps(train_step, step, args)
    assert "pinned_host" in _memory_kinds(new_opt)
    assert _memory_kinds(new_params) == {"device"}


@pytest.mark.slow  # 3-5 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_microbatched_host_update_reads_the_summed_gradient_once():
    """Recomputation stays within a device and microbatch: the host update reads
    the accumulated gradient, not every microbatch's."""
    from hetpar.passes import _split

    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    step = hetpar.auto(w.train_step, plan={n: OFFLOAD for n in hetpar.trace(
        w.train_step, *args).layers}, microbatches=4)
    stages = step.lower(*args).stages

    def into_host(sg):  # elements the host's stages receive from the compute device
        made_on = {o: st.device for st in sg.stages for o in st.outputs}
        made_on.update(zip(sg.graph.program.jaxpr.jaxpr.invars, sg.input_devices))
        return sum(v.aval.size for st in sg.stages if st.device == "cpu:1"
                   for v in st.inputs if made_on.get(v) == "cpu:0")

    original = _split.RECOMPUTE_DEPTH
    try:
        _split.RECOMPUTE_DEPTH = 0
        plain = split(stages.graph, stages.placements)
    finally:
        _split.RECOMPUTE_DEPTH = original
    assert into_host(stages) == into_host(plain) > 0


def test_place_leaves_python_numbers_alone():
    w = zoo.get("mlp", small=True)
    params, opt_state, batch = w.example_args()

    def step_fn(params, opt_state, batch, lr):
        return w.train_step(params, opt_state, batch)

    graph = hetpar.trace(step_fn, params, opt_state, batch, 0.1)
    step = hetpar.auto(step_fn, plan={n: PINNED for n in graph.layers}, batch_argnums=2)
    placed = step.place(params, opt_state, batch, 0.1)
    assert placed[3] == 0.1 and isinstance(placed[3], float)


def test_what_users_see_says_where_offloaded_state_lives():
    """`step.assignment` is {layer: compute device} (the form `plan=` takes);
    `step.placements` and `step.report()` say where an offloaded layer's
    state lives, and `plan=step.placements` keeps it there (issue 45)."""
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    layers = hetpar.trace(w.train_step, *args).layers
    plan = {layer: OFFLOAD for layer in layers}
    plan[layers[0]] = "cpu:0"
    step = hetpar.auto(w.train_step, plan=plan)
    check_steps(w.train_step, step, args)
    assert step.assignment == {layer: "cpu:0" for layer in layers}
    assert step.placements[layers[-1]] == Placement(**OFFLOAD)

    report = step.report()
    rows = {r["name"]: r for r in report.to_json()["layers"]}
    assert rows[layers[0]]["placement"] == "cpu:0"
    assert rows[layers[-1]]["placement"] == {"compute": "cpu:0", **OFFLOAD}
    table = str(report).splitlines()
    assert "placement" in table[1]
    last = next(line for line in table if line.startswith(layers[-1] + " "))
    assert "cpu:0; params, state, update cpu:1" in last
    csv_rows = {r["name"]: r for r in csv.DictReader(io.StringIO(report.to_csv()))}
    assert csv_rows[layers[-1]]["placement"] == "cpu:0; params, state, update cpu:1"

    again = hetpar.auto(w.train_step, plan=step.placements)
    assert again.lower(*args).placements == step.placements


def test_report_names_every_replica_of_a_data_parallel_step():
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    step = hetpar.auto(w.train_step, devices=["cpu:0", "cpu:1"], data_parallel="always")
    check_steps(w.train_step, step, args, steps=1)
    rows = step.report().to_json()["layers"]
    assert {str(r["placement"]) for r in rows} == {"['cpu:0', 'cpu:1']"}
    assert "cpu:0, cpu:1 (data parallel)" in str(step.report())


@pytest.mark.slow  # 2 s; the fast tier keeps the replicated report above
def test_report_says_how_a_sharded_steps_state_lies():
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    fsdp = hetpar.auto(w.train_step, devices=["cpu:0", "cpu:1"], data_parallel="fsdp")
    check_steps(w.train_step, fsdp, args, steps=1)
    assert "cpu:0, cpu:1 (fsdp: parameters and optimizer state sharded)" in str(fsdp.report())
    assert {r["sharding"] for r in fsdp.report().to_json()["layers"]} == {"fsdp"}


def test_moments_scaled_in_the_update_not_handed_on_from_the_backward():
    """With a global-norm clip every update waits for the whole backward. Adam's
    `b1 * mu` and `b2 * nu` need no gradient, and ran in each layer's backward
    stage (its own stage when recomputed), which handed them to the update:
    two more copies of the moments on the GPU until the backward ended (a 2.9B
    Hugging Face Llama's plan replayed at 47.2 GB where the planner had 38 GB;
    experiments/results/fit_h200, run 20). Each moment is read by one stage:
    the layer's update."""
    from .test_one_program import _remat, _step

    train_step, args = _step()
    graph = hetpar.trace(train_step, *args)
    stages = split(graph, _remat(graph.layers))
    invars = graph.program.jaxpr.jaxpr.invars
    checked = 0
    for v, layer, role in zip(invars, graph.input_layers, graph.input_roles):
        if role != "opt_state" or not v.aval.shape or layer not in graph.layers:
            continue
        readers = [st.index for st in stages.stages if v in st.inputs]
        own = [st.index for st in stages.stages if layer in st.layers]
        assert readers == [own[-1]], (layer, readers, own)
        checked += 1
    assert checked >= 2 * 3  # mu and nu of each recomputed block at least


@pytest.mark.slow  # 9 s; the fast tier keeps one accelerator's pinned-host plan (mlp)
def test_two_accelerators_each_streaming_its_layers_state_equal_jit():
    # The plan kind the planner makes for a model too large for two GPUs
    # sharded (run 30's 6.74B table at 43 GB a GPU, fit_h200x2): the layers
    # split over two accelerators, each layer's optimizer state in its own
    # accelerator's pinned host memory, its activations recomputed, a few
    # layers updated on the host CPU. cpu:1 and cpu:2 stand in for the GPUs.
    w = zoo.get("transformer", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    half = len(graph.layers) // 2

    def where(i):
        dev = "cpu:1" if i < half else "cpu:2"
        if i == half - 1:  # one layer's state and update on the host
            return {"compute": dev, "params": dev, "state": "cpu:0", "update": "cpu:0",
                    "activations": "remat"}
        return {"compute": dev, "params": dev, "state": f"{dev}:pinned_host",
                "update": dev, "activations": "remat" if i % 2 else "keep"}

    plan = {layer: where(i) for i, layer in enumerate(graph.layers)}
    step = hetpar.auto(w.train_step, plan=plan)
    new_params, new_opt, _ = check_steps(w.train_step, step, step.place(*args))
    assert {step.state_assignment[la] for la in graph.layers} == {
        "cpu:1:pinned_host", "cpu:2:pinned_host", "cpu:0"}
    kinds = {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(new_opt)
             if isinstance(x, jax.Array) and x.ndim > 0}
    assert "pinned_host" in kinds


# Fetched: parameters and optimizer state both in the memory place, the
# update on the compute device (ZeRO-Infinity's parameter offload).
FETCHED = {**PINNED, "params": "cpu:0:pinned_host"}


def test_fetched_weights_move_for_each_read_and_are_never_kept():
    """Weights homed in a memory place come in for every stage that reads
    them (the forward, the backward with its update), prefetched as streamed state is, and
    are never cached on the device for the step: cached, a 6.74B model's
    27 GB of weights would sit beside its activations until the step ends.
    The step still equals jit's, and the new parameters go home."""
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    step = hetpar.auto(w.train_step, plan={layer: FETCHED for layer in graph.layers})
    new_params, new_opt, _ = check_steps(w.train_step, step, args)
    assert _memory_kinds(new_params) == {"pinned_host"}
    ex = step._last._executor
    roles = dict(zip(ex._invars, ex.stages.graph.input_roles))
    weights = {v for v, r in roles.items() if r == "param"}
    assert weights and not any(v in weights for v, _ in ex._cache_inputs)
    readers = {v: [st.index for st in ex.stages.stages if v in st.inputs] for v in weights}
    # The forward, and the backward with the update (one stage, one batch).
    assert {len(r) for r in readers.values()} == {2}, readers
    for v, stages in readers.items():
        for i in stages:  # streamed: the stage before it brings them ahead
            assert v in ex._streamed[i], (v, i)
    # In a step, each weight moves in once per reader.
    placed = step.place(*args)
    jax.block_until_ready(step(*placed))
    moved_in, real = [], ex.transfer.move_many

    def logged(xs, dst):
        if getattr(dst, "memory_kind", None) != "pinned_host":
            moved_in.extend(id(x) for x in xs)
        return real(xs, dst)

    ex.transfer.move_many = logged
    jax.block_until_ready(step(*placed))
    leaves = dict(zip(ex._invars, jax.tree_util.tree_leaves(placed)))
    counts = {v: moved_in.count(id(leaves[v])) for v in weights}
    assert counts == {v: len(r) for v, r in readers.items()}, counts


@pytest.mark.parametrize("how", ["streamed", "fetched"])
def test_streamed_copies_are_donated_into_the_new_state(monkeypatch, how):
    """On an accelerator, a stage's streamed inputs (state, and fetched
    weights, moved in for it alone) are the runtime's own copies: its
    executable takes them donated, so the new state is written into them
    and a streaming stage holds its state once (`streamed_in_flight`).
    Emulated on cpu:0 (excluded for real: a CPU copy may alias its source;
    one out of pinned host memory does not): the steps equal jit's, the
    state kept in the place survives each step, and so do the caller's
    arrays passed unplaced (moved to the place first, then copied in)."""
    from hetpar.runtime import _executor

    def as_on_an_accelerator(self, st):
        return _executor._reusable(st, set(self._streamed[st.index]))

    monkeypatch.setattr(_executor.Executor, "_copies_donated", as_on_an_accelerator)
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    placement = FETCHED if how == "fetched" else PINNED
    step = hetpar.auto(w.train_step, plan={layer: placement for layer in graph.layers})
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        placed = step.place(*args)
        check_steps(w.train_step, step, placed)  # each of 3 steps equals jit's
    # Only copies an output is written into are donated: a forward's fetched
    # weights are not (JAX warned "Some donated buffers were not usable").
    assert not [c for c in caught if "donated buffers" in str(c.message)], caught
    ex = step._last._executor
    donated = [d for d in ex._donated_copies if d]
    assert donated, "no stage took its streamed copies donated"
    for st, d in zip(ex.stages.stages, ex._donated_copies):
        outs = [(v.aval.shape, v.aval.dtype) for v in st.outputs]
        assert all((st.inputs[k].aval.shape, st.inputs[k].aval.dtype) in outs for k in d)
    # The homes survive: the placed state is still readable after the steps.
    for x in jax.tree_util.tree_leaves(placed[:2]):
        assert not x.is_deleted()
        np.asarray(x)
    # Unplaced (the caller's arrays on the device itself): never donated.
    out = step(*args)
    for x in jax.tree_util.tree_leaves(args[:2]):
        assert not x.is_deleted()
    oracle_out = jax.jit(w.train_step)(*args)
    np.testing.assert_allclose(np.asarray(out[-1]), np.asarray(oracle_out[-1]), rtol=1e-5)


def test_fetched_weights_with_microbatches_equal_jit():
    """Two microbatches: a fetched layer's weights come in for each
    microbatch's forward and backward and for the update, never kept; the
    accumulated step still equals jit's."""
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    step = hetpar.auto(w.train_step, plan={layer: FETCHED for layer in graph.layers},
                       microbatches=2)
    check_steps(w.train_step, step, args, microbatches=2)
    ex = step._last._executor
    roles = dict(zip(ex._invars, ex.stages.graph.input_roles))
    weights = {v for v, r in roles.items() if r == "param"}
    assert not any(v in weights for v, _ in ex._cache_inputs)
    reads = [sum(v in st.inputs for st in ex.stages.stages) for v in weights]
    assert max(reads) >= 4  # each microbatch's forward and backward read them


def test_placing_warns_where_the_pinned_pool_would_outgrow_the_hosts_free_ram(monkeypatch):
    # While place() copies host-built state into pinned memory, XLA's pool
    # grows by regions beside the host arrays not yet copied: the 6.74B model
    # at 45 GB of an H200 rose to 122.8 GB of the host's 134 (fit_h200, run
    # 58). Where that growth passes what the OS has available, the caller
    # hears it before anything moves; the state is placed all the same.
    import warnings

    from hetpar._host_memory import HostMemoryWarning
    from hetpar.core import placing_growth
    from hetpar.cost_models import _devices

    GiB = 1 << 30
    assert placing_growth(77.1e9, 77.1e9, 94 * GiB) == pytest.approx(32 * GiB)  # run 58
    assert placing_growth(77.1e9, 0.0, 94 * GiB) == 94 * GiB  # the host arrays stay
    assert placing_growth(1e9, 1e9, 94 * GiB, already=1e9) == 0.0  # the pool is there
    assert placing_growth(0.0, 0.0, 94 * GiB) == 0.0

    w = zoo.get("mlp", small=True)
    graph = hetpar.trace(w.train_step, *w.example_args())
    step = hetpar.auto(w.train_step, plan={layer: PINNED for layer in graph.layers},
                       donate_argnums=(0, 1))
    for available, warned in ((1.0, True), (1e15, False)):
        args = tuple(w.example_args())
        monkeypatch.setattr(_devices, "os_memory", lambda available=available: (available, 0.0))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            placed = step.place(*args)
        said = [str(c.message) for c in caught if issubclass(c.category, HostMemoryWarning)]
        assert bool(said) == warned, said
        if warned:
            assert "placing needs up to" in said[0] and "more of the host's RAM" in said[0]
        assert "pinned_host" in _memory_kinds(placed[1])

"""Several accelerators plus the CPU, on virtual CPU devices.

Four CPU devices stand in for a host with two GPUs: cpu:2 and cpu:3 get H100
profiles (and an NVLink-class link between them), cpu:0 stays a CPU. Asked
for layer placements only, the planner must pipeline across the two "GPUs";
left free, it runs the step data parallel over them. Either way the step must
equal `jax.jit` on one device.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetpar
from hetpar import zoo
from hetpar.cost_models import LinkProfile, ProfileSet, cost_table, spec

from . import oracle
from .test_runtime import check_steps

GPUS = ("cpu:2", "cpu:3")


def two_gpu_profiles() -> ProfileSet:
    devices = {name: spec("h100").replace(name=name, origin="measured") for name in GPUS}
    devices["cpu:0"] = spec("cpu").replace(name="cpu:0", origin="measured")
    links = []
    for a, b in itertools.permutations(["cpu:0", *GPUS], 2):
        peer = a in GPUS and b in GPUS
        # The small test model's layers take microseconds: links must be cheaper
        # still for a pipeline to pay off (the planner is right to refuse otherwise).
        links.append(LinkProfile(a, b, "device_put", 1e-8, 300e9 if peer else 25e9,
                                 "test: NVLink-class peer link, PCIe host link"))
    return ProfileSet(devices, tuple(links))


@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_cost_table_sees_two_gpus():
    w = zoo.get("transformer", small=True, batch=8)
    graph = hetpar.trace(w.train_step, *w.example_args())
    table = cost_table(graph, ["cpu:0", *GPUS], profiles=two_gpu_profiles())
    kinds = {d.name: d.kind for d in table.devices}
    assert kinds["cpu:2"] == kinds["cpu:3"] == "h100"
    layer = table.layers[2]
    assert layer.time_s["cpu:2"] == pytest.approx(layer.time_s["cpu:3"])
    assert layer.time_s["cpu:2"] < layer.time_s["cpu:0"]


@pytest.mark.slow  # 30-40 s on 2 cores; test_runtime's family pipelines are the fast check
@pytest.mark.parametrize("schedule", ["1f1b"])  # GPipe: test_runtime
def test_pipeline_over_two_gpus_equals_jit(schedule):
    w = zoo.get("transformer", small=True, batch=8, learning_rate=1e-4)
    args = w.example_args()
    step = hetpar.auto(w.train_step, devices=["cpu:0", *GPUS], profile=two_gpu_profiles(),
                       microbatches=4, schedule=schedule, data_parallel=False)
    compiled = step.lower(*args)
    used = set(compiled.assignment.values())
    assert used >= set(GPUS), compiled.plan.summary(compiled.table)  # both "GPUs" busy
    assert compiled.plan.mode == "pipelined"
    assert compiled.plan.predicted.schedule == schedule  # the prediction replays it
    check_steps(w.train_step, step, args, microbatches=4)


# (ResNet18 left out for CI time: its replayed orders are a chain's, as the MLP's.)
@pytest.mark.parametrize("name", [pytest.param("transformer", marks=pytest.mark.slow), "mlp"])
def test_replay_runs_each_device_in_the_runtimes_order(name):
    """The planner's replay and the split pass give every device the same order of work.

    Both a contiguous plan (1F1B holds) and one that visits a device twice
    (1F1B would deadlock and falls back to GPipe, in both).
    """
    from hetpar._grad import microbatched
    from hetpar.passes import split
    from hetpar.planner import simulate

    w = zoo.get(name, small=True, batch=4)
    args = w.example_args()
    for m, schedule in itertools.product((1, 4), ("gpipe", "1f1b")):
        graph = hetpar.trace(microbatched(w.train_step, m, None), *args)
        table = cost_table(graph, list(GPUS), profiles=two_gpu_profiles())
        n = len(graph.layers)
        plans = {
            "contiguous": {la: GPUS[i >= n // 2] for i, la in enumerate(graph.layers)},
            "revisits": {la: GPUS[n // 3 <= i < 2 * n // 3]
                         for i, la in enumerate(graph.layers)},
        }
        for kind, assignment in plans.items():
            stages = split(graph, assignment, schedule=schedule)
            replay = simulate(table, assignment, m, schedule)
            assert replay.schedule == stages.schedule, (kind, m)
            for dev in GPUS:
                ran = [(s.microbatch, s.phase) for s in stages.stages_on(dev)
                       if s.phase in ("forward", "backward", "main")]
                replayed = [(s.microbatch, s.phase) for s in replay.stages
                            if s.device == dev and s.phase != "post"]
                assert ran == replayed, (kind, m, schedule, dev)
                # With microbatches the update runs once, after the last backward:
                # a "post" stage in the replay wherever the runtime has one (the
                # runtime may cut it in two around shared values, the replay does not).
                ran_post = any(s.phase == "post" for s in stages.stages_on(dev))
                replayed_post = [s for s in replay.stages if s.device == dev
                                 and s.phase == "post"]
                assert ran_post == bool(replayed_post), (kind, m, schedule, dev)
                if replayed_post:
                    last_backward = max(s.end_s for s in replay.stages
                                        if s.device == dev and s.phase == "backward")
                    assert replayed_post[0].start_s >= last_backward


@pytest.mark.slow  # the planner's data-parallel choice is tested fast in test_planner
def test_data_parallel_over_two_gpus_equals_jit():
    w = zoo.get("transformer", small=True, batch=8, learning_rate=1e-4)
    args = w.example_args()
    step = hetpar.auto(w.train_step, devices=["cpu:0", *GPUS], profile=two_gpu_profiles())
    compiled = step.lower(*args)
    # Equal "GPUs", a fast peer link: replicas beat any layer placement. Their
    # state sharded is predicted faster still: each updates half of it.
    assert compiled.plan.replicas == GPUS, compiled.plan.summary()
    assert compiled.plan.sharding in ("zero1", "fsdp")
    assert compiled.plan.solver["chosen"] == f"{compiled.plan.sharding} cpu:2+cpu:3"
    assert compiled.plan.baselines["data parallel cpu:2+cpu:3"].feasible
    layer_plan = compiled.plan.solver["layer_plan_predicted"]["step_time_s"]
    assert compiled.plan.predicted.step_time_s < layer_plan
    out = check_steps(w.train_step, step, args)
    # State stays on both replicas (sharded or replicated): the next step moves none of it.
    for leaf in jax.tree_util.tree_leaves(out[:-1]):
        assert {f"cpu:{d.id}" for d in leaf.devices()} == set(GPUS)


def test_data_parallel_refuses_a_batch_that_does_not_split():
    w = zoo.get("transformer", small=True, batch=3)
    step = hetpar.auto(w.train_step, devices=list(GPUS), profile=two_gpu_profiles())
    with pytest.raises(hetpar.HetparError, match=r"does not split over 2 replicas.*multiple of 2"):
        step(*w.example_args())


@pytest.mark.slow
def test_data_parallel_plan_round_trips_and_runs_from_file(tmp_path):
    w = zoo.get("transformer", small=True, batch=4, learning_rate=1e-4)
    args = w.example_args()
    first = hetpar.auto(w.train_step, devices=list(GPUS), profile=two_gpu_profiles())
    plan = first.lower(*args).plan
    plan.save(tmp_path / "plan.json")
    loaded = hetpar.Plan.load(tmp_path / "plan.json")
    assert loaded.replicas == GPUS and loaded == plan
    again = hetpar.auto(w.train_step, plan=tmp_path / "plan.json", profile=two_gpu_profiles())
    check_steps(w.train_step, again, args, steps=2)


@pytest.mark.slow  # 3-5 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_data_parallel_always_skips_the_ilp_and_equals_jit(monkeypatch):
    # Later calls go straight to the replicated jit after comparing every
    # leaf's shape and dtype (the full path's checks of GPT-2's 446 leaves
    # cost more than a batch-16 step on two H200s); anything new (another
    # batch, state of another dtype) takes the full path, which plans it.
    from hetpar import _auto, _auto_step

    signatures = []
    full = _auto.signature
    monkeypatch.setattr(_auto_step, "signature", lambda args: signatures.append(1) or full(args))
    w = zoo.get("mlp", small=True, batch=8)
    args = w.example_args()
    step = hetpar.auto(w.train_step, devices=list(GPUS), data_parallel="always")
    out = check_steps(w.train_step, step, args)
    assert len(signatures) == 1  # the first call only
    compiled = step.lower(*args)
    assert compiled.plan.replicas == GPUS
    assert compiled.plan.solver["name"] == "none"  # no ILP ran
    state, batch = out[:-1], args[-1]
    # A batch committed to one device goes straight to jit too, split first.
    on_one = jax.device_put(batch, jax.devices("cpu")[0])
    calls = len(signatures)
    oracle.assert_equals_jit(step(*state, on_one), w.train_step, (*state, batch))
    assert len(signatures) == calls
    rep = compiled._replicated
    assert all(x.sharding == rep.split
               for x in jax.tree.leaves(rep._placed((*state, on_one), rep._nums)[0][-1]))
    # An uncommitted batch (jnp on the default device) goes to jit as it is,
    # which lays it out faster than a device_put first; the step still equals jit.
    loose = jax.tree.map(jnp.asarray, jax.tree.map(np.asarray, batch))
    assert not any(x.committed for x in jax.tree.leaves(loose))
    assert rep._placed((*state, loose), rep._nums)[0][-1] is loose
    oracle.assert_equals_jit(step(*state, loose), w.train_step, (*state, batch))
    # Another batch size, or state of another dtype: not run on the fast path.
    small = zoo.get("mlp", small=True, batch=4).example_args()[-1]
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16)
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    assert compiled.call_known((*state, small)) is _auto.UNKNOWN
    assert compiled.call_known((*half, batch)) is _auto.UNKNOWN


def test_data_parallel_user_step_with_an_uncommitted_batch_equals_jit():
    # Written as plain-JAX users write it: the optimizer a closure (an optax
    # chain), remat around a block, a scan over layers, the batch made with
    # jnp (uncommitted: jit lays it out over the replicas itself).
    import optax

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))

    def loss(params, x, y):
        @jax.checkpoint
        def block(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(block, x, params["ws"])
        return jnp.mean((h @ params["out"] - y) ** 2)

    def train_step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"ws": jax.random.normal(k1, (3, 8, 8)) * 0.3, "out": jax.random.normal(k2, (8, 2))}
    batch = (jax.random.normal(k3, (8, 8)), jnp.ones((8, 2)))
    assert not any(x.committed for x in jax.tree.leaves(batch))
    step = hetpar.auto(train_step, devices=list(GPUS), data_parallel="always")
    *got, _ = oracle.check_steps_equal_jit(step, train_step, (params, tx.init(params), batch))
    assert step.lower(*got, batch).plan.replicas == GPUS


def test_data_parallel_compiles_once_when_the_first_state_is_uncommitted():
    # A loop's first state is made with jnp (uncommitted) or numpy; every later
    # state is the last step's result, committed over the replicas. jit keys its
    # compiled step on both, so the step compiled twice (7.4 s at step 1 for
    # GPT-2 b64 on 2x H200) until hetpar put the first state where later ones
    # live. Constants passed afresh every call (a Python learning rate, a jnp
    # scalar) must not compile it again either (a review found they did).
    traces = []

    def loss_step(w, b, hp, batch):
        x, y = batch
        loss, (gw, gb) = jax.value_and_grad(
            lambda w, b: jnp.mean((jnp.tanh(x @ w) - y) ** 2) + b ** 2, argnums=(0, 1))(w, b)
        return w - hp["lr"] * gw, b - hp["decay"] * gb, loss

    def train_step(w, b, hp, batch):
        traces.append(1)  # runs once per trace
        return loss_step(w, b, hp, batch)

    w, b = jnp.full((4, 4), 0.1, jnp.float32), np.float32(0.5)  # uncommitted; numpy
    hp = {"lr": 0.1, "decay": jnp.float32(0.2)}  # passed as is every call
    batch = (jnp.ones((8, 4)), jnp.zeros((8, 4)))
    step = hetpar.auto(train_step, devices=list(GPUS), data_parallel="always")
    got = step(w, b, hp, batch)
    traced = len(traces)
    reference = jax.jit(loss_step)
    oracle.assert_equals_jit(got, loss_step, (w, b, hp, batch), jitted=reference)
    for _ in range(3):
        inputs = (*got[:2], hp, batch)
        got = step(*inputs)
        oracle.assert_equals_jit(got, loss_step, inputs, jitted=reference)
    assert len(traces) == traced  # steps 1-3 ran what step 0 compiled

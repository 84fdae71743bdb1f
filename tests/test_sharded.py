"""Sharded state (ZeRO-1, FSDP) on virtual CPU devices: the runtime equals
`jax.jit` on one device, leaf by leaf, its state stays sharded from step to
step, and the planner prices the stages beside replicated data parallel."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetpar
from hetpar import zoo
from hetpar.core import CostTable, GraphFormatError, Layer, PlanError
from hetpar.planner import Plan, evaluate_data_parallel, evaluate_sharded, plan
from hetpar.planner._sharded import FSDP_HIDDEN
from hetpar.runtime import shard_axis

from . import oracle
from .test_multi_accelerator import two_gpu_profiles
from .test_planner import EXACT, _two_gpus

TWO, FOUR = ["cpu:0", "cpu:1"], ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def _bytes_here(tree) -> int:
    """Bytes of `tree`'s leaves that one device (the first's) holds."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def _whole_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


# -- runtime ----------------------------------------------------------------------


@pytest.mark.parametrize("shape,n,axis", [
    ((64, 32), 2, 0), ((32, 64), 4, 1), ((10, 32), 4, 1), ((6, 6), 4, None), ((), 2, None),
    ((8, 8), 2, 0),  # equal axes: the first
])
def test_a_leaf_is_sharded_on_its_largest_axis_the_group_divides(shape, n, axis):
    assert shard_axis(shape, n) == axis


@pytest.mark.parametrize("devices", [TWO, FOUR], ids=["2", "4"])
def test_fsdp_equals_jit_and_keeps_its_state_sharded(devices):
    w = zoo.get("mlp", small=True, batch=8)
    args = w.example_args()
    step = hetpar.auto(w.train_step, devices=devices, data_parallel="fsdp")
    out = oracle.check_steps_equal_jit(step, w.train_step, args)
    compiled = step.lower(*args)
    assert compiled.plan.sharding == "fsdp" and compiled.plan.replicas == tuple(devices)
    n = len(devices)
    params, opt_state = out[0], out[1]
    for x in jax.tree.leaves((params, opt_state)):
        axis = shard_axis(x.shape, n)
        want = () if axis is None else (*[None] * axis, "replica")
        assert tuple(x.sharding.spec) == want, (x.shape, x.sharding.spec)
    assert _bytes_here(params) < _whole_bytes(params) / n * 1.2  # fc3's bias stays whole at 4
    assert _bytes_here(opt_state) < _whole_bytes(opt_state) / n * 1.2
    # The state came back laid out as it went in: the next step reshards nothing.
    rep = compiled._replicated
    assert rep._placed((*out[:-1], args[-1]), frozenset({0, 1}))[1] == []


def test_place_lays_sharded_state_out_giving_up_the_donated_host_arrays(monkeypatch):
    # place() lays each state leaf out as the step wants it (not the first
    # call), a chunk at a time, deleting the donated arrays it copied: the
    # host then holds one copy of a model built there.
    from hetpar import _place

    monkeypatch.setattr(_place, "CHUNK_BYTES", 1)  # every array its own chunk
    w = zoo.get("mlp", small=True, batch=8)
    host = jax.devices("cpu")[3]  # built apart from the replicas
    args = tuple(jax.device_put(w.example_args(), host))
    before = jax.tree.map(np.array, args)
    step = hetpar.auto(w.train_step, devices=TWO, data_parallel="fsdp", donate_argnums=(0, 1))
    step.lower(*args)
    puts, real = [], jax.device_put

    def counting(x, *a, **k):
        puts.append(len(x) if isinstance(x, list) else 1)
        return real(x, *a, **k)

    monkeypatch.setattr(jax, "device_put", counting)
    placed = step.place(*args)
    monkeypatch.setattr(jax, "device_put", real)
    # The batch (committed to the host: jit would refuse it) in one put, then
    # one put per chunk: here each donated array alone.
    assert puts == [len(jax.tree.leaves(args[2]))] + [1] * len(jax.tree.leaves(args[:2]))
    rep = step.lower(*placed)._replicated
    assert rep._placed(placed)[1] == []  # the first call puts nothing more
    for x in jax.tree.leaves(placed[:2]):
        axis = shard_axis(x.shape, 2)
        assert tuple(x.sharding.spec) == (() if axis is None else (*[None] * axis, "replica"))
    assert all(x.is_deleted() for x in jax.tree.leaves(args[:2]))
    assert not any(x.is_deleted() for x in jax.tree.leaves(args[2]))  # the batch stays
    for a, b in zip(jax.tree.leaves(placed[:2]), jax.tree.leaves(before[:2])):
        np.testing.assert_array_equal(np.asarray(a), b)
    oracle.assert_equals_jit(step(*placed), w.train_step, before)
    # Given up by that step, the placed state is refused before the jit over
    # both devices, which crashed the process on it, on either path in.
    for call in (rep, lambda *a: rep.call_placed_batch(a)):
        with pytest.raises(RuntimeError, match="deleted"):
            call(*placed)


def test_host_built_state_is_laid_out_from_its_numpy_view_not_cut_on_the_default_device(
        caplog):
    # A single-device array put to shardings over other devices is cut by a
    # jitted slice, on the default device where the array is uncommitted (a
    # model built under jax.default_device(cpu)): on two H200s the first GPU
    # kept 6.8 GB after laying out the 5.04B model's state (fit_h200x2, run
    # 67). Host arrays go as their NumPy view: nothing is compiled, the
    # values are the same.
    import logging

    from hetpar.runtime._replicated import host_view

    host = jax.devices("cpu")[3]
    with jax.default_device(host):
        w = jnp.arange(64.0 * 32).reshape(64, 32)
        key = jax.random.key(0)
    assert not w.committed
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("replica",))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("replica"))
    assert isinstance(host_view(w, split), np.ndarray)
    assert host_view(key, split) is key  # a PRNG key has no NumPy view
    on_target = jax.device_put(w, jax.devices("cpu")[0])
    assert host_view(on_target, split) is on_target  # already on a target device
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        y = jax.device_put(host_view(w, split), split)
    assert not [r for r in caplog.records if "_multi_slice" in r.getMessage()]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(w))
    assert y.sharding == split


def test_zero1_shards_the_optimizer_state_and_replicates_the_parameters():
    w = zoo.get("mlp", small=True, batch=8)
    args = w.example_args()
    step = hetpar.auto(w.train_step, devices=TWO, data_parallel="zero1")
    params, opt_state, _ = oracle.check_steps_equal_jit(step, w.train_step, args)
    assert all(x.sharding.spec == jax.sharding.PartitionSpec() for x in jax.tree.leaves(params))
    assert _bytes_here(params) == _whole_bytes(params)
    sharded = [x for x in jax.tree.leaves(opt_state) if x.ndim]
    assert sharded and all("replica" in tuple(x.sharding.spec) for x in sharded)
    assert _bytes_here(opt_state) < 0.6 * _whole_bytes(opt_state)


@pytest.mark.slow  # a transformer compiled over 4 devices: 20-40 s on 2 cores
def test_fsdp_transformer_over_four_devices_equals_jit():
    w = zoo.get("transformer", small=True, batch=8, learning_rate=1e-4)
    step = hetpar.auto(w.train_step, devices=FOUR, data_parallel="fsdp")
    params, *_ = oracle.check_steps_equal_jit(step, w.train_step, w.example_args())
    assert _bytes_here(params) < 0.4 * _whole_bytes(params)


def _flax_step():
    """A user-written Flax step: value_and_grad, optax.chain(clip, adamw)."""
    import flax.linen as nn
    import optax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.gelu(nn.Dense(32)(x))
            x = nn.LayerNorm()(x)
            return nn.Dense(4)(x)

    model = Net()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))

    def train_step(params, opt_state, batch):
        x, y = batch

        def loss(p):
            return jnp.mean((model.apply(p, x) - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    kx, ky, kp = jax.random.split(jax.random.key(1), 3)
    x, y = jax.random.normal(kx, (8, 12)), jax.random.normal(ky, (8, 4))
    params = model.init(kp, x)
    return train_step, (params, tx.init(params), (x, y))


@pytest.mark.parametrize("stage", [  # slow tier: the fast tier's fsdp and zero1 tests are above
    pytest.param("fsdp", marks=pytest.mark.slow),  # 26 s on 2 loaded cores
    pytest.param("zero1", marks=pytest.mark.slow)])  # 5-6 s
def test_user_flax_step_sharded_equals_jit(stage):
    train_step, args = _flax_step()
    step = hetpar.auto(train_step, devices=TWO, data_parallel=stage)
    params, opt_state, _ = oracle.check_steps_equal_jit(step, train_step, args)
    assert _bytes_here(opt_state) < 0.6 * _whole_bytes(opt_state)
    shrunk = _bytes_here(params) < 0.6 * _whole_bytes(params)
    assert shrunk == (stage == "fsdp")


def test_a_group_of_mixed_kinds_is_refused_naming_them():
    w = zoo.get("mlp", small=True, batch=8)
    step = hetpar.auto(w.train_step, devices=["cpu:0", "cpu:2"], profile=two_gpu_profiles(),
                       data_parallel="fsdp")
    with pytest.raises(PlanError, match=r"one kind.*cpu:0 \(cpu\), cpu:2 \(h100\)"):
        step(*w.example_args())


def test_data_parallel_option_names_its_values():
    with pytest.raises(hetpar.HetparError, match="zero1.*fsdp.*got 'zero3'"):
        hetpar.auto(lambda p, b: p, data_parallel="zero3")


# -- planner ----------------------------------------------------------------------


def _sharded_table(cap=1e12, leaves=None, **kw):
    """`_two_gpus` with each layer's state as leaves: parameters 4e8 / 3 and
    optimizer state (memory_bytes less 2 x parameters and activations)."""
    table = _two_gpus(cap=cap, **kw)
    layers = []
    for la in table.layers:
        opt = 3e9 - 2 * la.param_bytes - la.activation_bytes
        state = leaves or (("param", (1024, 8), la.param_bytes), ("opt_state", (1024, 8), opt))
        layers.append(dataclasses.replace(la, state_leaves=state))
    return dataclasses.replace(table, layers=tuple(layers))


def test_fsdp_and_zero1_predictions_by_hand():
    table = _sharded_table(fixed=0.1, update=0.3)
    pair = ["gpu:0", "gpu:1"]
    dp = evaluate_data_parallel(table, pair)
    z1, fsdp = (evaluate_sharded(table, pair, s) for s in ("zero1", "fsdp"))
    # Each updates half its state: the update's share halves.
    assert z1.busy_s["gpu:0"] == pytest.approx(0.1 + 0.3 / 2 + 0.6 / 2)
    assert fsdp.busy_s == z1.busy_s
    ring = 1e-5 + 4e8 / 2 / 100e9  # one ring step over the whole gradient
    assert dp.transfer_s == pytest.approx(2 * ring)
    assert z1.transfer_s == pytest.approx(2 * ring)  # reduce-scatter + all-gather
    per_layer = 1e-5 + 4e8 / 3 / 2 / 100e9
    # 3 per layer, of which XLA hides a measured share behind compute
    assert fsdp.transfer_s == pytest.approx((1 - FSDP_HIDDEN) * 3 * 3 * per_layer)
    # Memory (nothing donated: old and new state): zero1 keeps half the
    # optimizer state, old and new, and half of each gradient, whose other
    # half the backward frees the activations for anyway (each layer's half
    # of the activations, 5e8, outweighs its gradient); plus the largest
    # layer's whole gradient while it is made.
    opt = 3 * (3e9 - 2 * 4e8 / 3 - 1e9)
    layer = 4e8 / 3
    assert dp.memory_bytes["gpu:0"] - z1.memory_bytes["gpu:0"] == pytest.approx(
        opt - layer / 2)
    # fsdp keeps half the parameters too (old and new), and the running
    # layer's gathered parameters and unreduced gradient.
    assert dp.memory_bytes["gpu:0"] - fsdp.memory_bytes["gpu:0"] == pytest.approx(
        opt + 4e8 - layer)


def test_collectives_measured_over_a_group_price_its_sharded_state():
    # The calibration times an all-gather and a reduce-scatter over the
    # group's real devices (two virtual CPU devices here, named as GPUs of
    # the table) and the planner prices sharded state on that ring, not on
    # the copy links between the members.
    from cost_models._calibrate_table import _with_collectives
    from hetpar.runtime import ring_figures

    table = _sharded_table(fixed=0.1, update=0.3)
    present = dict(zip(["gpu:0", "gpu:1"], jax.devices("cpu")[:2]))
    timed = _with_collectives(table, present,
                              lambda names, devs: ring_figures(devs, sizes=(1 << 20, 32 << 20)))
    ring = timed.meta["collectives"]["gpu:0+gpu:1"]
    assert ring["bandwidth_bytes_per_s"] > 0 and ring["latency_s"] >= 5e-6
    # A ring ten times the links' bandwidth (100 GB/s): fsdp's 3 collectives
    # a layer move a member's half of its parameters at 1 TB/s.
    fast = dataclasses.replace(table, meta={**table.meta, "collectives": {
        "gpu:0+gpu:1": {"bandwidth_bytes_per_s": 1e12, "latency_s": 2e-5}}})
    slow, quick = (evaluate_sharded(t, ["gpu:0", "gpu:1"], "fsdp") for t in (table, fast))
    exposed = (1 - FSDP_HIDDEN) * 3 * 3
    assert quick.transfer_s == pytest.approx(exposed * (2e-5 + 4e8 / 3 / 2 / 1e12))
    assert slow.transfer_s == pytest.approx(exposed * (1e-5 + 4e8 / 3 / 2 / 1e11))
    assert quick.busy_s == slow.busy_s


def test_planner_chooses_fsdp_when_replicas_do_not_fit():
    # 12.7 GB per replica, 8 GB per device: zero1 holds 7.57 GB, fsdp 7.23 GB.
    p = plan(_sharded_table(cap=8e9), gap=EXACT)
    base = p.baselines
    assert re.search(r"gpu:0 memory: a replica holds .*12.7 GB",
                     base["data parallel gpu:0+gpu:1"].reason)
    assert base["zero1 gpu:0+gpu:1"].feasible and base["fsdp gpu:0+gpu:1"].feasible
    chosen = min(("zero1", "fsdp"), key=lambda s: base[f"{s} gpu:0+gpu:1"].predicted.step_time_s)
    assert p.sharding == chosen and p.replicas == ("gpu:0", "gpu:1")
    assert p.predicted.memory_bytes["gpu:0"] <= 8e9
    # Tighter: only fsdp fits.
    table = _sharded_table(cap=7.5e9)
    p = plan(table, gap=EXACT)
    assert p.sharding == "fsdp", p.summary()
    assert p.predicted.memory_bytes["gpu:0"] == pytest.approx(7.233e9, rel=1e-3)
    assert re.search(r"zero1 gpu:0\+gpu:1 +infeasible: gpu:0 memory", p.summary())
    assert p.explain(table).startswith("fsdp over gpu:0, gpu:1 (parameters and optimizer")


def test_planner_keeps_replicated_data_parallel_where_it_fits_and_is_faster():
    # Slow to start (2 ms a collective): fsdp's three collectives a layer
    # cost more than the replicas' one all-reduce.
    p = plan(_sharded_table(latency=2e-3), gap=EXACT)
    assert p.replicas == ("gpu:0", "gpu:1") and p.sharding is None
    base = p.baselines
    assert base["fsdp gpu:0+gpu:1"].predicted.step_time_s > p.predicted.step_time_s
    # zero1 costs what data parallel does where no update is timed: the first wins.
    assert base["zero1 gpu:0+gpu:1"].predicted.step_time_s == pytest.approx(
        p.predicted.step_time_s)
    assert plan(_sharded_table(cap=7.5e9), sharded=False, gap=EXACT).replicas == ()


def test_a_layer_no_group_size_divides_stays_replicated_and_is_explained():
    odd = (("param", (3, 5), 4e8 / 3), ("opt_state", (3, 5), 3e9 - 8e8 / 3 - 1e9))
    table = _sharded_table(leaves=odd)
    pair = ["gpu:0", "gpu:1"]
    # Nothing splits: fsdp holds what data parallel holds, and all-reduces the same.
    dp, fsdp = evaluate_data_parallel(table, pair), evaluate_sharded(table, pair, "fsdp")
    assert fsdp.memory_bytes == pytest.approx(dp.memory_bytes)
    assert fsdp.transfer_s == pytest.approx(dp.transfer_s)
    p = dataclasses.replace(plan(table), replicas=tuple(pair), sharding="fsdp")
    assert "l1: 2 state leaves stay replicated: no axis of theirs is a multiple of 2" in (
        p.explain(table))


def test_sharded_plan_round_trips_and_bad_sharding_is_named(tmp_path):
    p = plan(_sharded_table(cap=7.5e9), gap=EXACT)
    p.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == p and loaded.sharding == "fsdp"
    data = p.to_json()
    for bad in ("zero3", 3):
        with pytest.raises(PlanError, match=f"sharding must be one of.*got {bad!r}"):
            Plan.from_json({**data, "sharding": bad})
    with pytest.raises(PlanError, match="sharding.*without replicas"):
        Plan.from_json({k: v for k, v in data.items() if k != "replicas"})
    old = {k: v for k, v in data.items() if k != "sharding"}  # a plan from before
    assert Plan.from_json(old).sharding is None


def test_state_leaves_round_trip_in_graph_json_and_bad_ones_are_named():
    table = _sharded_table()
    again = CostTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again.layers[0].state_leaves == table.layers[0].state_leaves
    bad = table.to_json()
    bad["layers"][0]["state_leaves"][0]["shape"] = [3, -1]
    with pytest.raises(GraphFormatError, match=r"layers\[0\]\.state_leaves\[0\]\.shape"):
        CostTable.from_json(bad)
    bad["layers"][0]["state_leaves"][0] = {"role": "grad", "shape": [3], "bytes": 1}
    with pytest.raises(GraphFormatError, match=r"state_leaves\[0\]\.role"):
        CostTable.from_json(bad)


def test_traced_tables_carry_each_layers_state_leaves():
    from hetpar.cost_models import cost_table

    w = zoo.get("mlp", small=True, batch=8)
    table = cost_table(hetpar.trace(w.train_step, *w.example_args()), ["cpu:0"])
    layer: Layer = table.layers[0]
    roles = {r for r, _, _ in layer.state_leaves}
    assert roles == {"param", "opt_state"}
    assert sum(b for r, _, b in layer.state_leaves if r == "param") == layer.param_bytes
    assert np.prod((64, 32)) * 4 in [b for _, _, b in layer.state_leaves]


def test_the_two_h200_table_plans_fsdp_as_it_measured():
    # Run 30's calibrated table (2x H200, the 6.74B Llama-style step at 84 GB
    # a GPU, experiments/results/fit_h200x2): the planner chooses fsdp, and
    # what it predicts is what ran there: 274.5 ms a step (hand-written FSDP:
    # 269.2 ms), a peak of 58.1 GB on gpu:0. zero1 (70.3 GB measured in run
    # 28) no longer fits the 74 GB a split plan may use.
    import pathlib

    from hetpar._step_planning import within_split_margin

    path = (pathlib.Path(__file__).parent.parent / "experiments/results/fit_h200x2"
            / "run30_table_llama7b_0.56.json")
    table = within_split_margin(CostTable.load(path), ["gpu:0", "gpu:1"])
    p = plan(table, donate=True)
    assert p.sharding == "fsdp" and p.replicas == ("gpu:0", "gpu:1")
    assert p.predicted.step_time_s == pytest.approx(0.2745, rel=0.15)
    assert p.predicted.memory_bytes["gpu:0"] == pytest.approx(58.1e9, rel=0.10)
    assert re.search(r"zero1 gpu:0\+gpu:1 +infeasible: gpu:0 memory", p.summary())

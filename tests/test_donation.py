"""Donation in split plans (issue 41, item 4), on virtual CPU devices.

`hetpar.auto(..., donate_argnums=...)` on a plan split over devices, or with
state kept apart from compute (cpu:1 as the state home), must compute what
`jax.jit` computes, leave the donated caller arrays deleted as `jax.jit`
with the same `donate_argnums` leaves them, and the others intact. The
reference runs on copies made before each step (the originals are given
up). The planner side: with donation, state needs one copy where it lives.
"""

import jax
import numpy as np
import pytest

import hetpar
from hetpar import zoo
from hetpar.core import HetparError, InfeasibleError

from . import oracle

OFFLOAD = {"compute": "cpu:0", "state": "cpu:1", "update": "cpu:1"}
STREAMED = {"compute": "cpu:0", "state": "cpu:1", "update": "cpu:0"}
DONATE = (0, 1)  # the parameters and the optimizer state


def _plan(how: str, layers: list) -> dict:
    if how == "split":  # the first half on cpu:0, the rest on cpu:1
        half = len(layers) // 2
        return {n: "cpu:0" if k < half else "cpu:1" for k, n in enumerate(layers)}
    if how == "remat":  # one device, recomputed: one executable (passes/_fuse.py; the
        # fast tier's check of it against jax.jit)
        return {n: {"compute": "cpu:0", "activations": "remat"} for n in layers}
    return {n: OFFLOAD if how == "host_update" else STREAMED for n in layers}


def _copies(tree):
    """Fresh copies on cpu:0, for the reference (the originals are donated)."""
    return oracle.on_cpu0(jax.tree_util.tree_map(lambda x: np.array(x), tree))


def _deleted(tree) -> list[bool]:
    return [isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("how", ["split", "host_update", "streamed", "remat"])
def test_donating_split_and_offload_plans_equal_jit_and_give_up_the_state(how):
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    step = hetpar.auto(w.train_step, plan=_plan(how, graph.layers), donate_argnums=DONATE)
    state, batch = step.place(*args)[:-1], args[-1]
    stages = step.lower(*state, batch).stages
    assert stages is not None  # a split plan, not one jit
    assert (len(stages.stages) == 1) == (how == "remat")  # fused: one executable
    jitted = jax.jit(w.train_step)
    donating_jit = jax.jit(w.train_step, donate_argnums=DONATE)
    for _ in range(3):
        before, mine = _copies(state), _copies(state)
        out = step(*state, batch)
        oracle.assert_equals_jit(out, w.train_step, (*before, batch), jitted=jitted)
        # Deleted leaf by leaf as jax.jit with the same donate_argnums leaves them.
        donating_jit(*mine, batch)
        assert _deleted(state) == _deleted(mine)
        assert any(_deleted(state))
        assert not any(_deleted(batch)) and not any(_deleted(out))
        state = out[:-1]


def test_a_donated_argument_used_again_gets_the_deleted_buffer_error_explained():
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    step = hetpar.auto(w.train_step, plan=_plan("split", graph.layers), donate_argnums=DONATE)
    placed = step.place(*args)
    step(*placed)
    with pytest.raises(HetparError, match="donate_argnums.*earlier step.*deleted"):
        step(*placed)


def test_a_stage_out_of_memory_after_donation_is_told_as_out_of_memory(monkeypatch):
    """A stage that runs out of memory mid-step, after earlier stages gave up
    donated inputs, can name deleted buffers in its error (an H200 at 7.5 GB,
    experiments/results/fit_h200 run 20): the caller is told the step ran out
    of memory and that donated arrays may be gone, not that they passed a
    deleted argument."""
    from hetpar._recovery import OutOfMemoryError
    from hetpar.runtime import _executor

    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    original = _executor.Executor._compile_all

    def compile_all(executor, stages):
        compiled = original(executor, stages)

        def out_of_memory(*a):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                               "1024 bytes (an input buffer was deleted or donated)")

        return [*compiled[:-1], out_of_memory]

    monkeypatch.setattr(_executor.Executor, "_compile_all", compile_all)
    step = hetpar.auto(w.train_step, plan=_plan("split", graph.layers), donate_argnums=DONATE)
    with pytest.raises(OutOfMemoryError, match="ran out of memory.*donate_argnums may be deleted"):
        step(*step.place(*args))


def test_without_donate_argnums_the_caller_state_stays():
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    step = hetpar.auto(w.train_step, plan=_plan("host_update", graph.layers))
    placed = step.place(*args)
    step(*placed)
    assert not any(_deleted(placed))
    step(*placed)  # the same state again: still there


@pytest.mark.parametrize("how", ["split", "host_update", "streamed"])
def test_a_buffer_read_by_several_stages_is_given_up_by_the_last_only(how):
    """Statically: each donated input is taken donated by at most one stage,
    which every other reader of it is dispatched before; the rest are
    deleted after their last reader (counted), never by an earlier one."""
    from hetpar.runtime._executor import _dispatched_before

    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    step = hetpar.auto(w.train_step, plan=_plan(how, graph.layers), donate_argnums=DONATE)
    ex = step.lower(*args)._executor
    stages = ex.stages.stages
    before = _dispatched_before(ex.stages)
    n_state = len(jax.tree_util.tree_leaves(args[:-1]))
    assert ex.donated == tuple(range(n_state))
    several = 0
    for i in ex.donated:
        v = ex._invars[i]
        readers = [st.index for st in stages if v in st.inputs]
        takers = [s for s in range(len(stages)) for k in ex._donate[s] if stages[s].inputs[k] is v]
        assert len(takers) <= 1
        several += len(readers) > 1
        if takers:
            (last,) = takers
            assert all(before[last] >> r & 1 for r in readers if r != last), \
                f"input {i} donated by stage {last} before its readers {readers} ran"
        elif readers:
            assert ex._free_at[v] == len(readers)
    assert several, "the plan must read some donated input in several stages"
    if how == "split":  # state on its compute device: its update takes it donated
        assert any(ex._donate)


def test_dispatch_order_counts_producers_and_device_order():
    from hetpar.runtime._executor import _dispatched_before

    class St:
        def __init__(self, index, inputs, outputs):
            self.index, self.inputs, self.outputs = index, inputs, outputs

    class G:
        stages = (St(0, ("x",), ("a",)), St(1, ("x",), ("b",)), St(2, ("a", "b"), ("c",)),
                  St(3, ("x",), ()))
        device_order = {"cpu:0": (0, 2), "cpu:1": (1,), "cpu:2": (3,)}

    before = _dispatched_before(G)
    assert before[2] == 0b011 and before[0] == 0 and before[3] == 0


# -- the planner: one copy of donated state where it lives ------------------

def _table(**kw):
    from .test_offload_planner import table

    return table(**kw)


def test_donation_prices_host_and_device_state_once():
    from hetpar.planner import evaluate
    from hetpar.planner._solve import with_donation

    from .test_offload_planner import GB, OPT, PARAM

    t = _table(blocks=6)
    state = 6 * (PARAM + OPT)
    offloaded = {f"b{i}": OFFLOAD | {"compute": "gpu:0", "state": "cpu:0", "update": "cpu:0"}
                 for i in range(6)}
    for placements, where in ((offloaded, "cpu:0"), (dict.fromkeys(offloaded, "gpu:0"), "gpu:0")):
        kept = evaluate(t, placements).peak_memory_bytes[where]
        donated = evaluate(with_donation(t), placements).peak_memory_bytes[where]
        assert kept - donated == pytest.approx(state, abs=1e-3 * GB), where


def test_a_plan_that_fits_only_with_donation_is_found_with_it_and_refused_without():
    from hetpar.planner import plan

    t = _table(blocks=6, gpu_gb=30, host_gb=1, cpu_compute=False)  # 6 x 4.5 GB, 7.5 undonated
    p = plan(t, donate=True)
    assert set(p.assignment.values()) == {"gpu:0"} and not p.offloaded
    assert p.predicted.peak_memory_bytes["gpu:0"] <= 30e9
    with pytest.raises(InfeasibleError, match="no plan fits memory"):
        plan(t)


def test_hetpar_plan_donate_flag(tmp_path, capsys):
    from .test_cli import hetpar_in_process

    graph = tmp_path / "graph.json"
    _table(blocks=6, gpu_gb=30, host_gb=1, cpu_compute=False).save(graph)
    out = hetpar_in_process(capsys, "plan", "--graph", str(graph), "--donate").stdout
    assert "gpu:0" in out
    err = hetpar_in_process(capsys, "plan", "--graph", str(graph), check=False).stderr
    assert "no plan fits memory" in err


@pytest.mark.parametrize("how", ["one device", "data parallel"])
def test_a_donated_argument_used_again_is_explained_on_one_jit_too(how):
    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    devices, dp = ("cpu:0", True) if how == "one device" else (["cpu:0", "cpu:1"], "always")
    step = hetpar.auto(w.train_step, devices=devices, data_parallel=dp, profile=None,
                       donate_argnums=DONATE)
    placed = step.place(*args)
    step(*placed)
    with pytest.raises(HetparError, match="argument was deleted: donate_argnums.*earlier step"
                       ) as info:
        step(*placed)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("how", ["one_device", "host_update"])
def test_place_gives_up_donated_arrays_as_it_copies_them(how, monkeypatch):
    """With donate_argnums, place() deletes each donated array once its copy
    is made, a chunk at a time (the host then holds one copy of a model
    built there); the batch and arrays already in place stay."""
    from hetpar import _place

    monkeypatch.setattr(_place, "CHUNK_BYTES", 1)  # every array its own chunk
    w = zoo.get("mlp", small=True)
    args = oracle.on_cpu0(tuple(w.example_args()))
    before = _copies(args[:2])
    graph = hetpar.trace(w.train_step, *args)
    plan = ({n: "cpu:1" for n in graph.layers} if how == "one_device"
            else _plan(how, graph.layers))
    step = hetpar.auto(w.train_step, plan=plan, donate_argnums=DONATE)
    placed = step.place(*args)
    moved = [a is not b for a, b in zip(jax.tree_util.tree_leaves(args[:2]),
                                        jax.tree_util.tree_leaves(placed[:2]))]
    assert any(moved)
    assert _deleted(args[:2]) == moved  # given up exactly where copied
    assert not any(_deleted(args[2:])) and not any(_deleted(placed))
    for a, b in zip(jax.tree_util.tree_leaves(placed[:2]), jax.tree_util.tree_leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    oracle.assert_equals_jit(step(*placed), w.train_step, (*before, args[-1]))


def test_a_failed_copy_in_place_loses_nothing(monkeypatch):
    """A copy that fails half-way (out of host memory): the arrays moved so
    far and those not yet moved come back in the error, whole."""
    from hetpar import _place
    from hetpar._place import PlaceError

    monkeypatch.setattr(_place, "CHUNK_BYTES", 1)
    w = zoo.get("mlp", small=True)
    args = oracle.on_cpu0(tuple(w.example_args()))
    before = _copies(args[:2])
    graph = hetpar.trace(w.train_step, *args)
    step = hetpar.auto(w.train_step, plan={n: "cpu:1" for n in graph.layers},
                       donate_argnums=DONATE)
    step.lower(*args)
    calls = []
    real = jax.device_put

    def failing(x, *a, **k):
        calls.append(1)
        if len(calls) == 3:  # the batch, the first donated chunk, then this one
            raise RuntimeError("RESOURCE_EXHAUSTED: out of host memory")
        return real(x, *a, **k)

    monkeypatch.setattr(jax, "device_put", failing)
    with pytest.raises(PlaceError, match="Nothing is lost") as info:
        step.place(*args)
    monkeypatch.setattr(jax, "device_put", real)
    kept = info.value.placed
    assert any(_deleted(args[:2])) and not any(_deleted(kept))
    for a, b in zip(jax.tree_util.tree_leaves(kept[:2]), jax.tree_util.tree_leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_place_never_gives_up_an_array_whose_copy_shares_its_buffer():
    """A put may hand back the caller's own buffer in a new array: an array
    replicated over cpu:0 and cpu:1 placed for a plan on cpu:1, arguments
    placed twice, an array at two donated positions (tied). None of those
    originals may be deleted: the placed state would go with them."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    w = zoo.get("mlp", small=True)
    args = tuple(w.example_args())
    graph = hetpar.trace(w.train_step, *args)
    step = hetpar.auto(w.train_step, plan=dict.fromkeys(graph.layers, "cpu:1"),
                       donate_argnums=DONATE)
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("d",))
    both = jax.device_put(args[:2], NamedSharding(mesh, PartitionSpec()))
    before = _copies(both)
    placed = step.place(*both, args[2])
    assert not any(_deleted(placed))
    again = step.place(*placed)  # already in place: nothing moves, nothing goes
    assert not any(_deleted(again)) and not any(_deleted(placed))
    oracle.assert_equals_jit(step(*again), w.train_step, (*before, args[2]))
    # The same arrays at two donated positions: copied once, both placed.
    def tied_step(p, q, batch):  # q: the same arrays as p
        new_p, _, loss = w.train_step(p, args[1], batch)
        return new_p, q, loss

    tied = hetpar.auto(tied_step, devices="cpu:1", donate_argnums=(0, 1))
    p = oracle.on_cpu0(args[0])
    out = tied.place(p, p, args[2])
    assert not any(_deleted(out))
    for a, b in zip(jax.tree_util.tree_leaves(out[0]), jax.tree_util.tree_leaves(out[1])):
        assert a is b

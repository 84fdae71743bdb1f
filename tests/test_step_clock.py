"""The step clock's waits: one result a device where a step is one executable.

Waiting for every result of a step timed by the clock cost the zoo's 5.04B
fsdp step over two H200s 10-15 ms a step (experiments/results/fit_h200x2,
run 71): an executable's results on a device are ready together, so the
clock waits for one there; a plan of several stages waits for them all.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetpar
from hetpar import _step_clock
from hetpar._step_clock import StepClock, one_per_device

from .test_auto_options import step  # two layers: "first", "second"


def train_step(w, x):
    loss, g = jax.value_and_grad(step)(w, x)
    return [a - 0.1 * b for a, b in zip(w, g)], loss


# (Spec sheets price a step of microseconds: the clock's gap warning is not the point.)
pytestmark = pytest.mark.filterwarnings("ignore::hetpar.PredictionWarning")

W = [jnp.ones((3, 4)) * 0.1, jnp.ones((4, 2)) * 0.1]
X = np.ones((4, 3), np.float32)


@pytest.fixture
def waits(monkeypatch):
    """The arrays each of the clock's waits was given."""
    seen = []
    real = _step_clock.wait

    def watched(arrays):
        seen.append(list(arrays))
        real(arrays)

    monkeypatch.setattr(_step_clock, "wait", watched)
    return seen


def _run(auto, calls: int):
    out = None
    w = [x.copy() for x in W]
    for _ in range(calls):
        w, loss = auto(w, X)
        out = (w, loss)
    return out


def test_one_device_step_waits_for_one_result(waits):
    auto = hetpar.auto(train_step, devices=["cpu:0"], profile="spec")
    _run(auto, 1 + StepClock.SETTLE + StepClock.STEPS)
    assert len(waits) == 1 + StepClock.SETTLE + StepClock.STEPS
    assert auto._last.executable_devices == frozenset(jax.devices("cpu")[:1])
    assert all(len(arrays) == 1 for arrays in waits)
    assert auto.measured_step_s > 0


def test_step_over_two_devices_waits_for_one_result_on_each(waits):
    auto = hetpar.auto(train_step, devices=["cpu:0", "cpu:1"], data_parallel="fsdp",
                       profile="spec")
    _run(auto, 1 + StepClock.SETTLE + StepClock.STEPS)
    assert auto._last.one_executable
    assert auto._last.executable_devices == frozenset(jax.devices("cpu")[:2])
    devices = {d for arrays in waits for x in arrays for d in x.sharding.device_set}
    assert {d.id for d in devices} == {0, 1}
    assert all(len(arrays) == 1 for arrays in waits)  # the replicated loss covers both
    assert auto.measured_step_s > 0


def test_the_clock_tells_one_per_device_the_executables_devices(monkeypatch):
    given = []
    real = _step_clock.one_per_device

    def watched(arrays, devices=None):
        given.append(devices)
        return real(arrays, devices)

    monkeypatch.setattr(_step_clock, "one_per_device", watched)
    auto = hetpar.auto(train_step, devices=["cpu:0", "cpu:1"], data_parallel="fsdp",
                       profile="spec")
    _run(auto, 1 + StepClock.SETTLE)
    assert given == [frozenset(jax.devices("cpu")[:2])] * (1 + StepClock.SETTLE)


def test_step_of_several_stages_waits_for_every_result(waits):
    plan = hetpar.auto(train_step, devices=["cpu:0", "cpu:1"], profile="spec").lower(W, X).plan
    split = dataclasses.replace(plan, assignment={"first": "cpu:0", "second": "cpu:1"},
                                replicas=(), sharding=None)
    auto = hetpar.auto(train_step, plan=split)
    _run(auto, 1 + StepClock.SETTLE)
    assert not auto._last.one_executable
    assert auto._last.executable_devices is None
    assert all(len(arrays) == 3 for arrays in waits)  # two weights and the loss


def test_one_per_device_covers_every_device_widest_first():
    cpus = jax.devices("cpu")[:2]
    mesh = jax.sharding.Mesh(np.array(cpus), ("d",))
    P = jax.sharding.PartitionSpec
    whole = jax.device_put(jnp.zeros(()), jax.sharding.NamedSharding(mesh, P()))
    split = jax.device_put(jnp.zeros((4,)), jax.sharding.NamedSharding(mesh, P("d")))
    on0 = jax.device_put(jnp.zeros(()), cpus[0])
    on1 = jax.device_put(jnp.zeros(()), cpus[1])
    assert one_per_device([on0, split, whole]) in ([split], [whole])
    assert one_per_device([on0, on1, on0]) == [on0, on1]
    assert one_per_device([]) == []


def test_nnx_step_returning_nothing_waits_for_its_new_state(waits):
    # An NNX step that updates its objects in place and returns nothing: the
    # clock times it to its new state, not to the call's return (dispatch).
    optax = pytest.importorskip("optax")
    nnx = pytest.importorskip("flax.nnx")

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def update(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)

    auto = hetpar.auto(update, devices=["cpu:0"], profile="spec")
    for _ in range(1 + StepClock.SETTLE + StepClock.STEPS):
        assert auto(model, optimizer, X) is None
    assert waits and all(len(arrays) == 1 for arrays in waits)
    assert auto.measured_step_s > 0


def test_one_per_device_with_the_device_count_stops_once_covered():
    cpus = jax.devices("cpu")[:2]
    mesh = jax.sharding.Mesh(np.array(cpus), ("d",))
    P = jax.sharding.PartitionSpec
    split = jax.device_put(jnp.zeros((4,)), jax.sharding.NamedSharding(mesh, P("d")))
    on0 = jax.device_put(jnp.zeros(()), cpus[0])
    on1 = jax.device_put(jnp.zeros(()), cpus[1])
    both, first = frozenset(cpus), frozenset(cpus[:1])

    def ids(arrays):
        return [id(x) for x in arrays]

    assert ids(one_per_device([split, on0, on1], both)) == ids([split])
    assert ids(one_per_device([on0, on0, split, on1], both)) == ids([on0, split])
    assert ids(one_per_device([on0, on1, split], first)) == ids([on0])
    # Results on devices outside the set are still covered, never left out.
    assert ids(one_per_device([on1, on0], first)) == ids([on1, on0])

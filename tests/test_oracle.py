"""The oracle (tests/oracle.py) can fail: one wrong leaf is caught.

On every zoo model (small config at batch 8, the equality tests' learning
rate 1e-4), one step under `jax.jit`, then copies of its result each wrong in a single
leaf: the leaf moved by 1e-4 of its own norm, or left at its input value
(stale, never updated; only where the step moved it by more than the
oracle's RTOL of its norm, since no per-leaf check at 1e-5 can see a
smaller move). The oracle, with its computed rounding floor, must reject
every such copy on every model (issue 42's goal: 100%).

The step starts from a state in mid-training, not at initialisation. At
initialisation some leaves hold no value the step fixes: biases initialised
to zero whose gradient is zero in exact arithmetic (CycleGAN's conv biases
feed instance norm; GPT-2's key bias, which softmax ignores) get Adam steps
of rounding noise's sign, so jit and any other order of rounding disagree by
their whole value, and their Adam moments with them. No check can tell a
wrong copy of such a leaf from a right one (the oracle missed 2 of the
transformer's 169 and 54 of CycleGAN's 121 there). In training every leaf
has a value of its own, and so has the state here: each float leaf of the
initial state plus a random positive tenth of its own RMS (of 1e-2 where it
is zero), positive so that second moments and variances stay positive.

Batch 8, not the small configs' 2: BatchNorm over two examples (one pixel
each in ResNet's last stage) normalises them to about +-1 whatever its input,
so every gradient through it is rounding-dominated (the oracle missed 53 of
ResNet-18's 201 leaves and 74 of ResNet-50's 281 at batch 2, all caught at 8).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetpar import zoo

from . import oracle
from .conftest import codegen_unoptimised, rerun_optimised

FAST = ("mlp",)


def mid_training(state, seed=1):
    """`state` with every float leaf moved off its initial value (module docstring)."""
    leaves, tree = jax.tree_util.tree_flatten(state)
    rng = np.random.default_rng(seed)
    out = []
    for x in leaves:
        a = np.asarray(x)
        if jnp.issubdtype(a.dtype, jnp.floating) and a.size:
            rms = float(np.sqrt(np.mean(np.asarray(a, np.float64) ** 2))) or 1e-2
            a = a + (0.1 * rms * np.abs(rng.standard_normal(a.shape))).astype(a.dtype)
        out.append(jnp.asarray(a))
    return tree.unflatten(out)


def wrong_copies(args, step, jitted):
    """(wrong copies, unseen) of one step from `args`: single-leaf
    perturbations and stale leaves, each (description, tree, want, floor);
    `unseen`: stale leaves the step moved by less than RTOL of their norm,
    which no per-leaf check at that tolerance can tell from updated."""
    want = jitted(*args)
    floor = oracle.unfused(step, *args)
    moved = oracle.relative_errors(args[:-1], want[:-1])
    copies, unseen = [], []
    for what, wrong in oracle.perturbations(args[:-1], want, relative=1e-4):
        if what.startswith("stale") and moved[what.split(" ", 1)[1]] <= oracle.RTOL:
            unseen.append(what)
        else:
            copies.append((what, wrong, want, floor))
    return copies, unseen


def wrong_leaves_missed(name):
    """(missed, caught, total, unseen) of the wrong copies of one step from a
    mid-training state, and of the stale leaves it moves by less than RTOL
    from the initial state, where the step moves them more (Adam's first
    step is +-lr on every weight: lm_embed's embedding and kernels)."""
    w = zoo.get(name, small=True, learning_rate=1e-4, batch=8)
    *state, batch = w.example_args()
    jitted = jax.jit(w.train_step)
    copies, unseen = wrong_copies(oracle.on_cpu0((*mid_training(tuple(state)), batch)),
                                  w.train_step, jitted)
    at_init, unseen_at_init = wrong_copies(oracle.on_cpu0((*state, batch)), w.train_step, jitted)
    copies += [c for c in at_init if c[0] in unseen]
    unseen = [u for u in unseen if u in unseen_at_init]
    missed = [what for what, wrong, want, floor in copies
              if not oracle.mismatches(wrong, want, floor)]
    return missed, len(copies) - len(missed), len(copies), unseen


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in zoo.names()])
def test_one_stale_or_perturbed_leaf_is_caught(name):
    missed, caught, total, unseen = wrong_leaves_missed(name)
    # Unseen: VGG's kernels under SGD at lr 1e-4 (the equality tests' rate).
    print(f"{name}: caught {caught}/{total}; stale leaves moved under RTOL: {len(unseen)}")
    assert total > 0 and not missed, f"{name}: caught {caught}/{total}; missed {missed}"


def test_rounding_passes_and_wrong_integer_leaves_do_not():
    # The oracle itself on a hand-made tree: a float leaf at f32 rounding
    # passes, an integer leaf off by one and a key that differs do not, and
    # the floor lets a noise leaf differ by up to FLOOR_FACTOR x the other
    # rounding's gap.
    want = {"w": jnp.linspace(1.0, 2.0, 8), "n": jnp.array(3), "k": jax.random.key(0),
            "noise": jnp.array([1e-4, -1e-4])}
    rounded = {**want, "w": want["w"] * (1 + 1e-7)}
    assert not oracle.mismatches(rounded, want)
    assert oracle.mismatches({**want, "n": jnp.array(4)}, want) == [
        "['n']: |got - jit| inf, |jit| 0 (relative inf)"]
    assert oracle.mismatches({**want, "k": jax.random.key(1)}, want)
    flipped = {**want, "noise": jnp.array([1e-4, 1e-4])}
    other = {**want, "noise": jnp.array([-1e-4, -1e-4])}
    assert oracle.mismatches(flipped, want)  # no floor given
    assert not oracle.mismatches(flipped, want, other)  # within the other rounding's gap
    assert oracle.mismatches(flipped, want, lambda: want)  # the other rounding agrees: no floor


ADAM = optax.adam(1e-4)


def attention_step(params, opt_state, x):
    """One attention head trained with Adam; its key bias shifts every score
    of a query by the same amount, which softmax ignores: the bias's gradient
    is zero in exact arithmetic, its value after the step rounding noise."""
    def loss(p):
        q, k, v = x @ p["q"], x @ p["k"] + p["key_bias"], x @ p["v"]
        a = jax.nn.softmax(q @ k.swapaxes(-1, -2) / 4.0, axis=-1)
        return jnp.mean((a @ v) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = ADAM.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


@pytest.mark.slow  # op by op is ~100 primitive compiles
def test_the_unfused_floor_is_op_by_ops_gap(request):
    # The floor the tests use (one compile, nothing fused) stands for the
    # op-by-op gap issue 42 names: on leaves where rounding decides the
    # value, the two gaps are the same size, each within FLOOR_FACTOR of the
    # other (tests/oracle.py's docstring has the zoo's figures). A claim
    # about the code users compile: at -O0 (the suite on CPU, conftest) the
    # key bias is bitwise equal op by op and 7e-6 apart unfused, so it runs
    # optimised, in a process of its own.
    if codegen_unoptimised():
        return rerun_optimised(request)
    keys = jax.random.split(jax.random.key(0), 4)
    params = {n: jax.random.normal(k, (16, 16)) / 4 for n, k in zip("qkv", keys)}
    params["key_bias"] = jnp.zeros(16)
    args = oracle.on_cpu0((params, ADAM.init(params), jax.random.normal(keys[3], (4, 32, 16))))
    want = jax.jit(attention_step)(*args)
    by_op = oracle.leaf_errors(oracle.eagerly(attention_step, *args), want)
    by_unfused = oracle.leaf_errors(oracle.unfused(attention_step, *args), want)
    noisy = 0
    for (name, op_gap, scale), (_, unfused_gap, _) in zip(by_op, by_unfused):
        if max(op_gap, unfused_gap) <= oracle.RTOL * scale:
            continue  # rounding does not decide this leaf: no floor needed
        noisy += 1
        assert op_gap <= oracle.FLOOR_FACTOR * unfused_gap, (name, op_gap, unfused_gap)
        assert unfused_gap <= oracle.FLOOR_FACTOR * op_gap, (name, op_gap, unfused_gap)
    assert noisy >= 3  # the key bias and its two Adam moments

"""The oracle (tests/oracle.py) can fail: one wrong leaf is caught.

On every zoo model (small config, the equality tests' learning rate 1e-4),
one step under `jax.jit`, then copies of its result each wrong in a single
leaf: the leaf moved by 1e-4 of its own norm, or left at its input value
(stale, never updated; only where the step moved it by more than the
oracle's RTOL of its norm: VGG's 16 kernels under SGD move less, and no
per-leaf check at 1e-5 can see them stale). The oracle must
reject every such copy, but where the step itself does not fix the leaf to
that precision: a leaf whose op-by-op result differs from jit's by more than
the wrong copy does (FLOOR_FACTOR x the gap) is rounding noise in f32, and
any implementation may return any of its values. Those leaves are named
below per model and must stay few and of the kinds that are noise:

* CycleGAN's conv biases feed instance norm, which removes them: their
  gradient is zero in exact arithmetic, Adam turns its rounding noise into
  +-lr steps, and jit and op by op disagree by the whole value (stale is in
  fact the exact answer there). Their Adam moments follow.
* ResNet's and the transformer's biases ahead of a normalisation or a
  softmax over what they shift (BatchNorm biases before a conv and
  BatchNorm, attention's key bias) are the same in part: op by op and jit
  differ by 5e-5..1e-3 of the leaf, so a 1e-4 move stays within that.
"""

import re

import jax
import pytest

from hetpar import zoo

from . import oracle

# Leaves whose f32 value the step does not fix to 1e-4 (see the docstring),
# as a pattern over the leaf's path; models absent: every leaf is caught.
# Measured at the small configs (issue 42's report lists the counts).
NOISE = {
    "cyclegan_generator": r"\['(conv_in|down\d|block\d|up\d)'\](\['conv\d'\])?\['bias'\]",
    # Batch-2 BatchNorm: its biases (+-lr from zero) and every gradient
    # through it (SGD's momentum trace holds the step's gradient).
    "resnet18": r"(bn\d?|downsample_bn|fc)'\]\['(bias|scale)'\]|\.trace\[",
    "resnet50": r"(bn\d?|downsample_bn|fc)'\]\['(bias|scale)'\]|\.trace\[",
    "mobilenet_v1": r"bn\d?'\]\['scale'\]|\['depthwise'\]\['kernel'\]",
    "transformer": r"\['c_attn'\]\['bias'\]",
}
FAST = ("mlp", "lm_embed")


def wrong_leaves_missed(name):
    """(missed, caught, total, unseen) of the single-leaf perturbations of one
    step; `unseen`: stale leaves the step moved by less than RTOL of their
    norm, which no per-leaf check at that tolerance can tell from updated
    (VGG's kernels under SGD at lr 1e-4: the equality tests' rate)."""
    w = zoo.get(name, small=True, learning_rate=1e-4)
    args = oracle.on_cpu0(tuple(w.example_args()))
    want = jax.jit(w.train_step)(*args)
    eager = oracle.eagerly(w.train_step, *args)
    moved = oracle.relative_errors(args[:-1], want[:-1])
    missed, unseen, total = [], [], 0
    for what, wrong in oracle.perturbations(args[:-1], want, relative=1e-4):
        kind, leaf = what.split(" ", 1)
        if kind == "stale" and moved[leaf] <= oracle.RTOL:
            unseen.append(what)
            continue
        total += 1
        if not oracle.mismatches(wrong, want, eager):
            missed.append(what)
    return missed, total - len(missed), total, unseen


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in zoo.names()])
def test_one_stale_or_perturbed_leaf_is_caught(name):
    missed, caught, total, unseen = wrong_leaves_missed(name)
    print(f"{name}: caught {caught}/{total}; stale leaves moved under RTOL: {len(unseen)}")
    noise = NOISE.get(name)
    unexplained = [m for m in missed if noise is None or not re.search(noise, m)]
    assert not unexplained, f"{name}: caught {caught}/{total}; missed {unexplained}"
    # Noise stays a small part of the state (CycleGAN: 9 biases of 30 leaves, x3 with Adam).
    assert len(missed) <= 0.5 * total, (caught, total, missed)


def test_rounding_passes_and_wrong_integer_leaves_do_not():
    # The oracle itself on a hand-made tree: a float leaf at f32 rounding
    # passes, an integer leaf off by one and a key that differs do not, and
    # the floor lets a noise leaf differ by up to FLOOR_FACTOR x op by op's gap.
    import jax.numpy as jnp

    want = {"w": jnp.linspace(1.0, 2.0, 8), "n": jnp.array(3), "k": jax.random.key(0),
            "noise": jnp.array([1e-4, -1e-4])}
    rounded = {**want, "w": want["w"] * (1 + 1e-7)}
    assert not oracle.mismatches(rounded, want)
    assert oracle.mismatches({**want, "n": jnp.array(4)}, want) == [
        "['n']: |got - jit| inf, |jit| 0 (relative inf)"]
    assert oracle.mismatches({**want, "k": jax.random.key(1)}, want)
    flipped = {**want, "noise": jnp.array([1e-4, 1e-4])}
    eager = {**want, "noise": jnp.array([-1e-4, -1e-4])}
    assert oracle.mismatches(flipped, want)  # no floor given
    assert not oracle.mismatches(flipped, want, eager)  # within op by op's own gap
    assert oracle.mismatches(flipped, want, lambda: want)  # op by op agrees: no floor

"""A Flax NNX training step under `hetpar.auto` against the same step under `nnx.jit`.

Issue 44 item 6: `hetpar.auto` ran 1.27-1.39x `nnx.jit` on a small NNX GPT
and 1.5-1.6x on NNX MLPs, splitting and merging the NNX objects on every
call. Both steps run on one CPU device (`hetpar.auto(devices="cpu:0")`, a
one-device plan), on the same model, interleaved step by step so that load
from other processes falls on both alike; the figure is the median of each
and their ratio. `--full_path` times what every call cost before
`NnxFastCall` (hetpar/_nnx_args.py): every call split, signed and updated
through `NnxArgs`.

  python experiments/nnx_overhead.py                # writes results/nnx_overhead_cpu.{md,json}
  python experiments/nnx_overhead.py --full_path    # ... nnx_overhead_cpu_full_path.*
"""

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

import hetpar
from experiments._timing import host_cpu, write_results

_STEPS = flags.DEFINE_integer("steps", 200, "timed steps of each, interleaved")
_FULL_PATH = flags.DEFINE_bool("full_path", False, "time every call through NnxArgs "
                               "(split, signature, update), as before NnxFastCall")
_OUT = flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results"),
                           "folder for the results")


class MLP(nnx.Module):
    def __init__(self, depth: int, width: int, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, vocab: int, seq: int, d: int, depth: int, heads: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq, d)) * 0.02)
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(depth)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def next_token(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def make_step(loss_fn):
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    return train_step


def cases():
    """(name, make_objects, loss, x, y) for each model timed."""
    rng = np.random.default_rng(0)
    for depth in (4, 32):
        x = rng.normal(size=(16, 64)).astype(np.float32)
        yield (f"mlp{depth} (64 wide, batch 16)",
               lambda depth=depth: MLP(depth, 64, nnx.Rngs(0)), mse, x, x)
    tokens = rng.integers(0, 128, size=(8, 33)).astype(np.int32)
    yield ("gpt 2 blocks (d 64, 4 heads, seq 32, batch 8)",
           lambda: GPT(128, 32, 64, 2, 4, nnx.Rngs(0)), next_token, tokens[:, :-1],
           tokens[:, 1:])


def interleaved(steps, a, b, objects_a, objects_b, x, y) -> tuple[float, float]:
    """Median seconds per step of `a` and `b`, one step of each in turn."""
    ta, tb = [], []
    for _ in range(steps):
        for step, objects, times in ((a, objects_a, ta), (b, objects_b, tb)):
            t0 = time.perf_counter()
            jax.block_until_ready(step(*objects, x, y))
            times.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def main(argv):
    del argv
    if _FULL_PATH.value:
        from hetpar._nnx_args import NnxFastCall

        NnxFastCall.build = classmethod(lambda cls, *a: None)
    rows = []
    for name, make, loss_fn, x, y in cases():
        def objects(make=make):
            model = make()
            return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

        ref_objects, our_objects = objects(), objects()
        ref = nnx.jit(make_step(loss_fn))
        ours = hetpar.auto(make_step(loss_fn), devices="cpu:0")
        interleaved(5, ref, ours, ref_objects, our_objects, x, y)  # compile, settle
        ref_s, our_s = interleaved(_STEPS.value, ref, ours, ref_objects, our_objects, x, y)
        rows.append({"model": name, "nnx_jit_ms": ref_s * 1e3, "hetpar_ms": our_s * 1e3,
                     "ratio": our_s / ref_s, "extra_ms": (our_s - ref_s) * 1e3})
    cpu = host_cpu()
    path = "every call through NnxArgs (before NnxFastCall)" if _FULL_PATH.value else (
        "NnxFastCall after the first call")
    lines = [f"# Flax NNX step: hetpar.auto against nnx.jit ({path})", "",
             f"CPU: {cpu}, {os.cpu_count()} cores (shared with other work); jax "
             f"{jax.__version__}, flax {__import__('flax').__version__}; one CPU device; "
             f"median of {_STEPS.value} interleaved steps each; adam.", "",
             "| model | nnx.jit ms | hetpar.auto ms | ratio | extra ms |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['nnx_jit_ms']:.2f} | {r['hetpar_ms']:.2f} | "
              f"{r['ratio']:.2f} | {r['extra_ms']:+.2f} |" for r in rows]
    name = "nnx_overhead_cpu" + ("_full_path" if _FULL_PATH.value else "")
    write_results(os.path.join(_OUT.value, name), "\n".join(lines) + "\n",
                  {"cpu": cpu, "cores": os.cpu_count(), "jax": jax.__version__,
                   "flax": __import__("flax").__version__, "steps": _STEPS.value,
                   "path": path, "rows": rows})


if __name__ == "__main__":
    app.run(main)

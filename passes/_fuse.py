"""A split step that runs on one device, as one executable: `one_program`.

A plan that recomputes some layers' activations (`activations="remat"`) on
one device is cut into stages, because a recomputed layer's backward must
run apart from its forward (`_split`). Run as stages, such a step paid a
dispatch and a lost fusion at every layer edge: a 6.74B Llama-style step
planned with recomputed layers on one H200 ran at 2.0x `jax.jit`'s step
(experiments/results/fit_h200, run 11).

`one_program` puts the stages back into one jaxpr, compiled as one
executable, the way `jax.checkpoint` does it inside one jit: the inputs of
every stage that recomputes another's equations pass through one
`optimization_barrier` together. XLA cannot then merge the recomputed
equations with the originals (their inputs are no longer provably equal),
nor run them before the stage's last input, the gradient from the layer
above, is there: the recomputation happens where the plan put it, and the
forward's residuals die after the forward, as the plan priced them.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.extend import core as jcore

from hetpar.core import memory_place
from hetpar.passes._split import Stage, StageGraph


def fusable(stages: StageGraph) -> bool:
    """Whether every stage computes on one device that also holds every
    input and result: no memory place, no offloaded activations, no
    microbatches (whose stages interleave for a pipeline)."""
    devices = {st.device for st in stages.stages}
    if len(devices) != 1 or len(stages.stages) < 2:
        return False
    (device,) = devices
    places = {*stages.input_devices, *(d for d in stages.output_devices if d is not None)}
    return (places <= {device} and memory_place(device)[1] is None
            and all(st.microbatch is None for st in stages.stages)
            and all(not p.offloaded and p.activations in ("keep", "remat")
                    for p in stages.placements.values()))


def one_program(stages: StageGraph) -> StageGraph:
    """`stages` as one stage, where `fusable`; else `stages` unchanged."""
    if not fusable(stages):
        return stages
    jaxpr = stages.graph.program.jaxpr.jaxpr
    order = [stages.stages[i] for i in stages.device_order[stages.stages[0].device]]
    # A stage that holds equations of other stages recomputes them.
    recomputes = {st.index for st in order if len(st.jaxpr.jaxpr.eqns) > len(st.eqns)}
    read = {v for st in order for v in st.inputs}
    inputs = [v for v in jaxpr.invars if v in read]
    defined = {v for st in order for v in st.outputs}
    outputs = list(dict.fromkeys(v for v in jaxpr.outvars
                                 if isinstance(v, jcore.Var) and v in defined))

    def program(*args):
        env = dict(zip(inputs, args))
        for st in order:
            vals = [env[v] for v in st.inputs]
            if st.index in recomputes:
                vals = jax.lax.optimization_barrier(vals)
            env.update(zip(st.outputs, jcore.jaxpr_as_fun(st.jaxpr)(*vals)))
        return [env[v] for v in outputs]

    closed = jax.make_jaxpr(program)(*(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                                       for v in inputs))
    one = Stage(0, order[0].device, tuple(sorted(i for st in order for i in st.eqns)), None,
                "main", tuple(dict.fromkeys(la for st in order for la in st.layers)),
                tuple(inputs), tuple(outputs), closed)
    return dataclasses.replace(stages, stages=(one,), device_order={one.device: (0,)})

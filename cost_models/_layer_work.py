"""The roofline's view of one traced layer: its work by op class, dtype and call buffers.

A layer of a `LayerGraph` (`hetpar.passes.trace`) carries hetpar's count of
its work per jaxpr op class (`LayerInfo.work`). `layer_work` turns that into
a `LayerWork` over the roofline's op classes (`ROOFLINE_CLASS` maps one to
the other); `graph_layer_work` adds what only the layer's jaxpr tells: the
dtype its matmuls read, the arrays its call takes and returns
(`layer_io`), and, compiled for a backend, XLA's after-fusion bytes
(`layer_fused_bytes`) and the kernels XLA launches for it
(`layer_kernels`). `update_work` is the part of a layer's work that is its
optimizer update, which the offload planner may run on another device.
"""

from __future__ import annotations

import math
import types

import numpy as np
from absl import logging

from hetpar.core import ProfileError
from hetpar.cost_models._profile import OP_CLASSES, ROOFLINE_CLASS
from hetpar.cost_models._roofline import LayerWork


def layer_dtype(graph, layer: str) -> str:
    """`bf16` when the layer's matmuls read 16-bit floats, else `f32`."""
    closed, _, _ = graph.layer_jaxpr(layer)
    for e in closed.jaxpr.eqns:
        if e.primitive.name in ("dot_general", "conv_general_dilated"):
            if any(str(getattr(a.aval, "dtype", "")) in ("bfloat16", "float16")
                   for a in e.invars):
                return "bf16"
    return "f32"


def layer_io(graph, layer: str) -> tuple[int, float]:
    """(arrays, bytes) of the layer callable's inputs and outputs, from its jaxpr.

    Each array is a buffer the runtime hands over per call (one per
    parameter and optimizer-state leaf, activation and gradient); together
    they are read or written at least once.
    """
    from jax.extend import core as jcore

    closed, _, _ = graph.layer_jaxpr(layer)
    n, nbytes = 0, 0.0
    for v in list(closed.jaxpr.invars) + list(closed.jaxpr.outvars):
        aval = getattr(v, "aval", None)
        if isinstance(v, jcore.Literal) or aval is None or not hasattr(aval, "shape"):
            continue  # literals are not buffers
        n += 1
        try:
            nbytes += float(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
        except TypeError:  # extended dtypes (PRNG keys): a key is a few words
            nbytes += float(math.prod(aval.shape)) * 8.0
    return n, nbytes


# XLA's cost analysis counts a loop body once: after-fusion bytes of a layer
# holding one would understate its traffic by the trip count.
_LOOPS = frozenset({"scan", "while"})


def _has_loop(jaxpr) -> bool:
    from jax.extend import core as jcore

    for e in jaxpr.eqns:
        if e.primitive.name in _LOOPS:
            return True
        for v in e.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
                if isinstance(inner, jcore.Jaxpr) and _has_loop(inner):
                    return True
    return False


def layer_xla_cost(graph, layer: str, backend: str):
    """XLA's after-fusion cost of the layer compiled alone for `backend` (an `XlaCost`).

    Returns None when XLA's figures cannot stand for the layer: it holds a
    loop (XLA counts the body once) or the compile or analysis failed.
    """
    from hetpar.passes import compiled_cost  # hetpar.passes loads JAX: only when compiling

    closed, inputs, _ = graph.layer_jaxpr(layer)
    if _has_loop(closed.jaxpr):
        return None
    try:
        return compiled_cost(closed, [v.aval for v in inputs], backend)
    except Exception as e:  # noqa: BLE001 - the unfused count still stands
        logging.warning("XLA cost of %s on %s failed: %s", layer, backend, e)
        return None


def layer_fused_bytes(graph, layer: str, backend: str) -> float | None:
    """Bytes the layer moves after XLA's fusion on `backend`, or None when unknown.

    Remembered on disk beside the layer timings (keyed by the layer's jaxpr,
    the backend and the jax version): compiling every GPT-2 layer for the GPU
    again took a minute at each `profile="measure"` plan.
    """
    import jax

    from hetpar.cost_models._layer_timing import layer_key
    from hetpar.cost_models._measure import cached_json

    def compiled() -> dict:
        cost = layer_xla_cost(graph, layer, backend)
        return {"bytes": None if cost is None else float(cost.bytes_accessed)}

    key = f"{layer_key(graph, layer)}-{backend}-{jax.__version__}".replace("/", "_")
    return cached_json("fused_bytes", key, compiled, required=("bytes",))["bytes"]


#: Entry-computation instructions that launch no kernel: they name, pack or
#: alias buffers (or order asynchronous copies).
_NOT_KERNELS = frozenset({
    "parameter", "tuple", "get-tuple-element", "constant", "bitcast", "after-all",
    "copy-start", "copy-done", "opt-barrier",
})


def count_kernels(hlo: str) -> int | None:
    """Kernels an optimised HLO module launches: instructions of its ENTRY computation.

    After XLA's fusion passes each instruction left in the entry computation
    (a fusion, a convolution or dot, a custom call such as a cuDNN
    convolution or cuBLAS GEMM, a copy, a while loop) runs as one kernel or
    one library call, and each costs a fixed time on top of its work (launch
    and tail on a GPU, dispatch and thread wake-up on a CPU's thunk
    executor). Instructions that only name or alias buffers (`_NOT_KERNELS`)
    are not counted; a while loop counts once, as its body's kernels are in
    other computations. Returns None when the text has no ENTRY computation.
    """
    lines = hlo.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("ENTRY ")), None)
    if start is None:
        return None
    n = 0
    for line in lines[start + 1:]:
        if line.strip() == "}":
            break
        _, eq, rhs = line.partition("=")
        if not eq:
            continue
        rhs = rhs.strip()
        if rhs.startswith("("):  # a tuple type: skip to its closing parenthesis
            depth = 0
            for j, ch in enumerate(rhs):
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0:
                    rhs = rhs[j + 1:].strip()
                    break
        else:
            rhs = rhs.partition(" ")[2].strip()
        opcode = rhs.partition("(")[0].strip()
        if opcode and opcode not in _NOT_KERNELS:
            n += 1
    return n


def layer_kernels(graph, layer: str, backend: str) -> int | None:
    """Kernels the layer launches compiled alone for `backend` (`count_kernels`), or None.

    None when the compile fails. Compiles the layer (seconds for a large one).
    """
    from hetpar.passes import hlo_text  # hetpar.passes loads JAX: only when compiling

    try:
        return count_kernels(hlo_text(graph, layer, optimized=True, backend=backend))
    except Exception as e:  # noqa: BLE001 - the count is optional
        logging.warning("kernel count of %s on %s failed: %s", layer, backend, e)
        return None


def layer_work(info, *, dtype: str = "f32", launches: int = 1, buffers: int = 0,
               io_bytes: float = 0.0, fused_bytes: float | None = None) -> LayerWork:
    """The roofline's view of a LayerInfo's counted work.

    Args:
      info: a `LayerInfo` (its `work.by_class` is `{jaxpr op class: [flops, trans,
        bytes]}`).
      dtype: whose peak applies (`f32`, `bf16`).
      launches: dispatches; a layer's stage is one executable, so 1.
      buffers, io_bytes: the call's input and output arrays and their bytes
        (`layer_io`); 0 when unknown.
      fused_bytes: after-fusion bytes on the device (`layer_fused_bytes`),
        None when unknown.

    Returns:
      A LayerWork over the roofline's op classes; its `conv_flops` are the
      convolutions' FLOPs (`info.work.by_primitive`), part of the matmul class.
    """
    flops = dict.fromkeys(OP_CLASSES, 0.0)
    nbytes = dict.fromkeys(OP_CLASSES, 0.0)
    trans = 0.0
    for cls, (f, t, b) in info.work.by_class.items():
        c = ROOFLINE_CLASS.get(cls)
        if c is None:
            raise ProfileError(
                f"layer work: jaxpr op class {cls!r} has no roofline class; map it in "
                "ROOFLINE_CLASS (hetpar.cost_models, `_profile.py`)")
        flops[c] += float(f)
        nbytes[c] += float(b)
        trans += float(t)
    by_primitive = getattr(info.work, "by_primitive", None) or {}
    conv = float(by_primitive.get("conv_general_dilated", (0.0,))[0])
    return LayerWork(flops, nbytes, launches=launches, transcendentals=trans, dtype=dtype,
                     buffers=int(buffers), io_bytes=float(io_bytes),
                     fused_bytes=None if fused_bytes is None else float(fused_bytes),
                     conv_flops=min(conv, flops["matmul"]))


def graph_layer_work(graph, layer: str, backend: str | None = None) -> LayerWork:
    """`layer_work` of one layer of a LayerGraph, with its dtype, buffers and io bytes.

    With `backend` (a present platform: `cpu`, `gpu`), the layer is compiled
    for it and XLA's after-fusion bytes fill `fused_bytes`.
    """
    n, io = layer_io(graph, layer)
    fused = None if backend is None else layer_fused_bytes(graph, layer, backend)
    return layer_work(graph[layer], dtype=layer_dtype(graph, layer), buffers=n, io_bytes=io,
                      fused_bytes=fused)


def update_work(graph, layer: str) -> LayerWork | None:
    """The roofline's view of the layer's optimizer update alone, or None if it has none.

    The update is the layer's equations that are neither forward nor
    backward (`hetpar.passes.is_forward` / `is_backward` on the name
    stack): Optax's update, gradient accumulation. Elementwise, so the
    roofline prices it by its bytes. One launch: the runtime runs it as
    (part of) one executable.
    """
    from hetpar.passes import Work, eqn_work, is_backward, is_forward  # JAX: only with a graph

    eqns = graph.program.eqns
    work, n = Work(), 0
    for i in graph[layer].eqns:
        stack = str(eqns[i].source_info.name_stack)
        if not (is_forward(stack) or is_backward(stack)):
            work.add(eqn_work(eqns[i]))
            n += 1
    if n == 0:
        return None
    return layer_work(types.SimpleNamespace(work=work))

"""Compiler passes over jaxprs: tracing into layers, cost counting, XLA's view, splitting.

Imported as `hetpar.passes`. Modules: `_program` (the traced step),
`_tiny` (values too small to decide placement), `_layer_names` (layers
named by the key paths of the parameters they read, at a balanced depth),
`_layers` (which layer each equation belongs to), `_layer_graph` (the
LayerGraph), `_costs` (FLOPs and bytes counted on the jaxpr), `_xla` (XLA's
cost analysis and HLO), `_split` (per-device stages of a plan), `_fuse` (a one-device split
as one executable).
"""

from hetpar.passes._costs import (
    OP_CLASSES,
    Work,
    conv_flops,
    dot_general_flops,
    eqn_work,
    inner_jaxprs,
    jaxpr_work,
    leaf_equations,
    op_class,
)
from hetpar.passes._fuse import fusable, one_program
from hetpar.passes._layer_graph import (
    LAYERS_FORMAT,
    LAYERS_VERSION,
    PARAM,
    LayerGraph,
    LayerInfo,
    batch_argnums_of,
    trace,
)
from hetpar.passes._layer_names import balanced_names
from hetpar.passes._layers import (
    MICROBATCH_SCOPE,
    SHARED,
    eqn_path,
    is_backward,
    is_forward,
    layer,
    microbatch_of,
    module_path,
)
from hetpar.passes._program import (
    Program,
    StaticKey,
    StaticLeaves,
    is_traced,
    static_where,
    subjaxpr,
    trace_program,
)
from hetpar.passes._split import Stage, StageGraph, check_covers, split
from hetpar.passes._xla import XlaCost, compiled_cost, hlo_text, layer_costs, step_cost

__all__ = [
    "LAYERS_FORMAT",
    "LAYERS_VERSION",
    "MICROBATCH_SCOPE",
    "OP_CLASSES",
    "PARAM",
    "SHARED",
    "LayerGraph",
    "LayerInfo",
    "Program",
    "Stage",
    "StaticKey",
    "StaticLeaves",
    "StageGraph",
    "Work",
    "balanced_names",
    "batch_argnums_of",
    "XlaCost",
    "check_covers",
    "fusable",
    "compiled_cost",
    "conv_flops",
    "dot_general_flops",
    "eqn_path",
    "eqn_work",
    "inner_jaxprs",
    "leaf_equations",
    "hlo_text",
    "is_backward",
    "is_forward",
    "is_traced",
    "jaxpr_work",
    "layer",
    "layer_costs",
    "microbatch_of",
    "module_path",
    "op_class",
    "one_program",
    "split",
    "static_where",
    "step_cost",
    "subjaxpr",
    "trace",
    "trace_program",
]

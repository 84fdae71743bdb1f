"""Compiler passes over jaxprs: tracing into layers, cost counting, splitting.

Imported as `hetpar.passes`.
"""

from hetpar.passes._costs import OP_CLASSES, Work, conv_flops, dot_general_flops, eqn_work, op_class
from hetpar.passes._layer_graph import LayerGraph, LayerInfo, trace
from hetpar.passes._layers import SHARED, layer, module_path
from hetpar.passes._program import Program, subjaxpr, trace_program

__all__ = [
    "OP_CLASSES",
    "SHARED",
    "LayerGraph",
    "LayerInfo",
    "Program",
    "Work",
    "conv_flops",
    "dot_general_flops",
    "eqn_work",
    "layer",
    "module_path",
    "op_class",
    "subjaxpr",
    "trace",
    "trace_program",
]

"""hetpar: heterogeneous layer scheduling for JAX training steps.

The public API is this flat list; the work lives in private modules.
"""

from hetpar._errors import (
    GraphFormatError,
    HetparError,
    InfeasibleError,
    PlanError,
    ProfileError,
    TraceError,
    UnknownModelError,
)
from hetpar._report import CostReport, report
from hetpar.passes import LayerGraph, layer, trace

__version__ = "0.1.0"

__all__ = [
    "CostReport",
    "LayerGraph",
    "layer",
    "report",
    "trace",
    "GraphFormatError",
    "HetparError",
    "InfeasibleError",
    "PlanError",
    "ProfileError",
    "TraceError",
    "UnknownModelError",
]

"""hetpar: heterogeneous layer scheduling for JAX training steps.

The public API is this flat list; the work lives in private modules.
"""

from hetpar._auto import AutoStep, auto
from hetpar._errors import (
    GraphFormatError,
    HetparError,
    InfeasibleError,
    PlanError,
    ProfileError,
    TraceError,
    UnknownModelError,
)
from hetpar._grad import grad, value_and_grad
from hetpar._report import CostReport, report
from hetpar.passes import LayerGraph, layer, trace
from hetpar.planner import CostTable, Plan, plan
from hetpar.runtime import StageError

__version__ = "0.1.0"

__all__ = [
    "AutoStep",
    "auto",
    "grad",
    "value_and_grad",
    "CostReport",
    "CostTable",
    "Plan",
    "StageError",
    "plan",
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

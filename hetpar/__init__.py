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

__version__ = "0.1.0"

__all__ = [
    "GraphFormatError",
    "HetparError",
    "InfeasibleError",
    "PlanError",
    "ProfileError",
    "TraceError",
    "UnknownModelError",
]

"""hetpar: heterogeneous layer scheduling for JAX training steps.

The public API is this flat list; the work lives in private modules. Names
load on first use (PEP 562), so `import hetpar` costs nothing until a name is
used, and the JAX-free parts (`hetpar.core`, `hetpar.planner`) never load JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from hetpar.core import (
    CostTable,
    GraphFormatError,
    HetparError,
    InfeasibleError,
    PlanError,
    ProfileError,
    TraceError,
    UnknownModelError,
)

__version__ = "0.1.0"

# Before JAX starts its GPU client, let XLA's pinned host pool (where offload
# plans keep state) grow to three quarters of the host's RAM, unless the user
# set its size.
from hetpar._host_memory import widen_pinned_pool as _widen_pinned_pool  # noqa: E402

_widen_pinned_pool()

# name -> module that defines it; loaded on first attribute access.
_LAZY = {
    "AutoStep": "hetpar._auto",
    "auto": "hetpar._auto",
    "grad": "hetpar._grad",
    "value_and_grad": "hetpar._grad",
    "CostReport": "hetpar._report",
    "report": "hetpar._report",
    "LayerGraph": "hetpar.passes",
    "layer": "hetpar.passes",
    "trace": "hetpar._nnx_args",  # hetpar.passes.trace, NNX objects as hetpar.auto takes them
    "Plan": "hetpar.planner",
    "plan": "hetpar.planner",
    "StageError": "hetpar.runtime",
    "PredictionWarning": "hetpar._step_clock",
    "HostMemoryWarning": "hetpar._host_memory",
    "OutOfMemoryWarning": "hetpar._recovery",
    "OutOfMemoryError": "hetpar._recovery",
    "PlaceError": "hetpar._place",
    "gather": "hetpar.runtime",
}

if TYPE_CHECKING:  # for type checkers and IDEs; never executed
    from hetpar._auto import AutoStep, auto
    from hetpar._grad import grad, value_and_grad
    from hetpar._host_memory import HostMemoryWarning
    from hetpar._nnx_args import trace
    from hetpar._place import PlaceError
    from hetpar._recovery import OutOfMemoryError, OutOfMemoryWarning
    from hetpar._report import CostReport, report
    from hetpar._step_clock import PredictionWarning
    from hetpar.passes import LayerGraph, layer
    from hetpar.planner import Plan, plan
    from hetpar.runtime import StageError, gather


# Sub-packages reachable as attributes (`hetpar.zoo.get(...)` after `import hetpar`).
_SUBPACKAGES = ("core", "cost_models", "distributed", "passes", "planner", "runtime", "zoo")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"hetpar.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hetpar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBPACKAGES))


__all__ = [
    "AutoStep",
    "PredictionWarning",
    "HostMemoryWarning",
    "OutOfMemoryWarning",
    "OutOfMemoryError",
    "PlaceError",
    "auto",
    "grad",
    "value_and_grad",
    "CostReport",
    "CostTable",
    "Plan",
    "StageError",
    "gather",
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

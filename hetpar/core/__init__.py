"""The JAX-free core every other part of hetpar builds on.

It holds the planner's input (the cost table, graph.json), the pipeline
schedule shared by the split pass and the planner's replay, the errors hetpar
raises at its boundaries, and the small helpers for files and units. It
imports numpy and networkx at most, never JAX, so offline planning starts in
milliseconds (the import-linter contract in pyproject.toml keeps it so).
"""

from hetpar.core._collectives import (
    hierarchical_allreduce_s,
    ring_allgather_s,
    ring_allreduce_s,
)
from hetpar.core._errors import (
    GraphFormatError,
    HetparError,
    InfeasibleError,
    PlanError,
    ProfileError,
    TraceError,
    UnknownModelError,
)
from hetpar.core._files import load_json, save_json
from hetpar.core._fingerprint import fingerprint
from hetpar.core._graph import FORMAT as GRAPH_FORMAT
from hetpar.core._graph import VERSION as GRAPH_VERSION
from hetpar.core._graph import CostTable, Device, Edge, Layer, Link
from hetpar.core._placement import (
    ACTIVATIONS,
    ACTIVATIONS_RUN,
    MEMORY_KINDS,
    Placement,
    is_memory_place,
    local_name,
    memory_place,
    parse_placements,
    pinned_pool_reserved,
    placing_growth,
    process_of,
)
from hetpar.core._schedule import (
    PHASE_RANK,
    SCHEDULES,
    completes,
    device_aware_order,
    device_orders,
    runs,
    stage_deps,
)
from hetpar.core._units import human, nbytes, seconds, signed_seconds

__all__ = [
    "ACTIVATIONS",
    "ACTIVATIONS_RUN",
    "GRAPH_FORMAT",
    "GRAPH_VERSION",
    "PHASE_RANK",
    "SCHEDULES",
    "CostTable",
    "Device",
    "Edge",
    "GraphFormatError",
    "HetparError",
    "InfeasibleError",
    "Layer",
    "Link",
    "PlanError",
    "MEMORY_KINDS",
    "Placement",
    "ProfileError",
    "TraceError",
    "UnknownModelError",
    "completes",
    "device_aware_order",
    "device_orders",
    "fingerprint",
    "hierarchical_allreduce_s",
    "human",
    "load_json",
    "save_json",
    "nbytes",
    "is_memory_place",
    "memory_place",
    "pinned_pool_reserved",
    "placing_growth",
    "local_name",
    "process_of",
    "parse_placements",
    "ring_allgather_s",
    "ring_allreduce_s",
    "seconds",
    "signed_seconds",
    "runs",
    "stage_deps",
]

"""hetpar.planner: place layers on devices with an ILP (graph.json -> plan.json).

The public surface is this flat list; the work lives in private modules,
each importing only those before it: `_arrays` (the data model: `Arrays`,
`Placed`, `Predicted`, `held_bytes`), `_closed_form` (a step's cost in
closed form), `_simulate` (replays a pipelined schedule, or a step with state
apart from compute), `_evaluate` (the cost model: `evaluate` picks the closed
form or the replay; `violations`, data parallel), `_ilp` (the pulp model),
`_feasibility` (infeasibility diagnosis), `_baselines`, `_offload` (where
each layer's state lives and its update runs), `_sharded` (the whole step
over a group with its state sharded: ZeRO-1, FSDP), `_plan` (Plan),
`_solve` (plan). The input, CostTable (graph.json), is `hetpar.core`'s, re-exported
here.
"""

from hetpar.core import CostTable, Device, Edge, Layer, Link
from hetpar.planner._arrays import Arrays, Predicted, held_bytes
from hetpar.planner._baselines import (
    BaselineResult,
    all_baselines,
    exhaustive,
    greedy_fastest,
    heft,
    memory_fill,
    single_device,
)
from hetpar.planner._evaluate import (
    data_parallel_obstacle,
    evaluate,
    evaluate_data_parallel,
    violations,
)
from hetpar.planner._groups import GROUP_STATES, Group, group_obstacle, group_table, groups_of
from hetpar.planner._ilp import highs_available
from hetpar.planner._plan import Plan
from hetpar.planner._sharded import SHARDINGS, evaluate_sharded, sharded_obstacle
from hetpar.planner._simulate import Replay, StageRun, evaluate_replayed, simulate
from hetpar.planner._solve import plan, plan_over_groups, replica_groups

__all__ = [
    "GROUP_STATES",
    "Group",
    "group_obstacle",
    "group_table",
    "groups_of",
    "plan_over_groups",
    "SHARDINGS",
    "Arrays",
    "BaselineResult",
    "CostTable",
    "Device",
    "Edge",
    "Layer",
    "Link",
    "Plan",
    "Predicted",
    "Replay",
    "StageRun",
    "all_baselines",
    "data_parallel_obstacle",
    "evaluate",
    "evaluate_data_parallel",
    "evaluate_replayed",
    "evaluate_sharded",
    "exhaustive",
    "greedy_fastest",
    "heft",
    "held_bytes",
    "highs_available",
    "memory_fill",
    "plan",
    "replica_groups",
    "sharded_obstacle",
    "simulate",
    "single_device",
    "violations",
]

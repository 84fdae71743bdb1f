"""hetpar's model zoo: reference training workloads on synthetic data.

Each model comes as a `Workload` (Flax model, Optax optimizer, example batch,
pure `train_step`), at its published size or, with `small=True`, at a size
fit for tests. `trace_model` and `cost_table` take a model by name to its
traced step (LayerGraph) and to the planner's CostTable (graph.json).
"""

from hetpar.zoo._costs import cost_table, trace_model
from hetpar.zoo._registry import describe, get, names, parse_config
from hetpar.zoo._sweep import grid as sweep_grid
from hetpar.zoo._sweep import small_grid, sweep_step, trace_sweep
from hetpar.zoo._workload import Workload

__all__ = ["Workload", "cost_table", "describe", "get", "names", "parse_config", "small_grid",
           "sweep_grid", "sweep_step", "trace_model", "trace_sweep"]

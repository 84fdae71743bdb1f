"""hetpar's model zoo: reference training workloads on synthetic data.

Each model comes as a `Workload` (Flax model, Optax optimizer, example batch,
pure `train_step`), at its published size or, with `small=True`, at a size
fit for tests.
"""

from hetpar.zoo._registry import describe, get, names
from hetpar.zoo._workload import Workload

__all__ = ["Workload", "describe", "get", "names"]

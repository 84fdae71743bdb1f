"""Running plans: the transfer engine, the per-device executor and its worker threads,
data-parallel replicas."""

from hetpar._host_memory import HostMemoryWarning
from hetpar.runtime._executor import Executor, StageError, StageEvent
from hetpar.runtime._network import gather
from hetpar.runtime._overhead import crossing_s, link_bandwidth, link_curve, stage_overhead_s
from hetpar.runtime._replicated import Replicated
from hetpar.runtime._transfer import TransferEngine
from hetpar.runtime._workers import Workers

__all__ = ["Executor", "HostMemoryWarning", "Replicated", "StageError", "StageEvent",
           "TransferEngine", "Workers",
           "crossing_s",
           "gather", "link_bandwidth", "link_curve", "stage_overhead_s"]

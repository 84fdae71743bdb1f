"""Running plans: the transfer engine, the per-device executor and its worker threads,
data-parallel replicas, sharded state (ZeRO-1, FSDP), pipelines of device groups."""

from hetpar._host_memory import HostMemoryWarning
from hetpar.runtime._collective_bench import ring_figures
from hetpar.runtime._executor import Executor, StageError, StageEvent
from hetpar.runtime._groups import GroupRunner, output_roles
from hetpar.runtime._memory import executable_peak
from hetpar.runtime._network import gather
from hetpar.runtime._overhead import crossing_s, link_bandwidth, link_curve, stage_overhead_s
from hetpar.runtime._place_links import place_line, place_link_figures
from hetpar.runtime._replicated import Replicated
from hetpar.runtime._sharded import STAGES, Sharded, shard_axis
from hetpar.runtime._transfer import TransferEngine, copied_apart
from hetpar.runtime._workers import Workers

__all__ = ["STAGES", "Executor", "GroupRunner", "HostMemoryWarning", "Replicated", "Sharded",
           "StageError", "StageEvent", "TransferEngine", "Workers", "copied_apart", "crossing_s",
           "executable_peak", "gather", "link_bandwidth", "link_curve", "output_roles",
           "place_line", "place_link_figures", "ring_figures", "shard_axis",
           "stage_overhead_s"]

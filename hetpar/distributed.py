"""What a script run on several processes calls (see docs/distributed.md).

    import hetpar.distributed
    hetpar.distributed.initialize()   # before any other JAX call; a no-op in one process

Every process runs the same script; `python -m hetpar.launch -n 2 script.py`
starts them on one machine, and `initialize(from_cluster=True)` takes the
process layout from SLURM or Open MPI. Devices of several processes are
named `p{process}/{kind}:{index}` (`device_name`); `hetpar.gather` reads a
result held by one process on all of them.
"""

from hetpar._distributed import (
    abort,
    check_same_on_all_processes,
    device_name,
    device_names,
    initialize,
    parse_device_name,
)
from hetpar.runtime import gather

__all__ = [
    "abort",
    "check_same_on_all_processes",
    "device_name",
    "device_names",
    "gather",
    "initialize",
    "parse_device_name",
]

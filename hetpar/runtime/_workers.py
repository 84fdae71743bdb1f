"""The worker threads that run a step's stages: one per device.

JAX dispatch from one Python thread did not overlap CPU and GPU work on the
GPU machine; one thread per device did (docs/measurements.md). The threads
belong to a `Workers` object that several executors may share: `hetpar.auto`
gives one to all the signatures a step compiles, so retracing on new shapes
adds executables, never threads. What each thread runs is the executor's
(`_executor`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor


class Workers:
    """One worker thread per device, shared by every Executor given this object.

    Threads start on first use. A step's calls to its devices' workers are
    queued together under a lock: every worker then runs concurrent steps
    (two signatures of one `hetpar.auto` step called from two threads) in the
    same order, so no step waits on a worker that waits on it. The threads
    end on `close()` or when this object is garbage collected.
    """

    def __init__(self):
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def run(self, calls: Mapping[str, Callable[[], None]]) -> None:
        """Runs `calls[device]()` on each device's worker and waits for them all."""
        with self._lock:
            futures = [self._pool(name).submit(fn) for name, fn in calls.items()]
        for f in futures:
            f.result()

    def _pool(self, name: str) -> ThreadPoolExecutor:
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = ThreadPoolExecutor(1, thread_name_prefix=f"hetpar-{name}")
        return pool

    def close(self) -> None:
        """Ends the threads (after the work queued on them); later runs start new ones."""
        with self._lock:
            pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.shutdown(wait=False)

"""Multi-controller JAX: starting `jax.distributed`, and naming devices across processes.

Used by `hetpar.auto` under `jax.distributed` (docs/distributed.md): device
names across processes (`present_devices`), and the check that every process
ends with the same plan (data parallel, placements and pipelines across
processes, or hierarchical; the collectives that run them live in
`hetpar.runtime._network`).

- `initialize()` joins the job that `python -m hetpar.launch` (or a cluster
  manager) started; it does nothing in a plain single-process run.
- `abort(code)` leaves a multi-process job at once, without JAX's exit barrier.
- `device_name(d)` / `parse_device_name(name)`: device names that stay unique
  and stable across processes (`p1/cpu:0`), and are today's names (`cpu:0`,
  see `hetpar.cost_models.device_name`) when there is one process.
"""

from __future__ import annotations

import os
import re
import sys
import time

# Set by hetpar.launch; kept in sync with the names there (not imported, so that
# this module and the launcher stay independent of each other's imports).
ENV_COORDINATOR = "HETPAR_COORDINATOR"
ENV_NUM_PROCESSES = "HETPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "HETPAR_PROCESS_ID"

_NAME = re.compile(r"(?:p(?P<process>\d+)/)?(?P<platform>[A-Za-z][A-Za-z0-9_]*):(?P<index>\d+)")


def initialize(*, from_cluster: bool = False, fail_fast: bool = True, **kwargs) -> bool:
    """Join the multi-process JAX job this process belongs to, if any; True if one runs.

    Call it first thing, before any JAX computation or `jax.devices()` (JAX
    refuses to initialize later). Calling it again is harmless (idempotent).

    - Under `python -m hetpar.launch`: reads HETPAR_COORDINATOR,
      HETPAR_NUM_PROCESSES and HETPAR_PROCESS_ID and calls
      `jax.distributed.initialize(coordinator_address=..., num_processes=...,
      process_id=...)`.
    - Else, with `from_cluster=True`: plain `jax.distributed.initialize()`,
      which detects SLURM, Open MPI, Cloud TPU or Kubernetes by itself.
    - Else: nothing; one process, as before (returns False).

    Args:
      from_cluster: let JAX detect a cluster manager when the HETPAR_* variables
        are absent. Off by default: JAX's detection raises outside a cluster.
      fail_fast: when a multi-process job starts, make an uncaught exception
        end this process at once (see `abort`) instead of at JAX's exit
        barrier, so that the launcher sees the failure and stops the others.
      **kwargs: passed on to `jax.distributed.initialize` (e.g.
        `initialization_timeout`, `heartbeat_timeout_seconds`).
    """
    import jax

    if jax.distributed.is_initialized():
        return True  # a second call, or the caller initialized JAX itself
    env = os.environ
    if ENV_COORDINATOR in env:
        # CPU collectives across processes need an implementation: JAX 0.10
        # defaults to gloo, older releases had none (no cross-process CPU
        # collectives at all). Keep a choice already made (e.g. "mpi").
        if jax.config.jax_cpu_collectives_implementation in (None, "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=env[ENV_COORDINATOR],
                                   num_processes=int(env[ENV_NUM_PROCESSES]),
                                   process_id=int(env[ENV_PROCESS_ID]), **kwargs)
    elif from_cluster:
        jax.distributed.initialize(**kwargs)
    else:
        return False
    if fail_fast and jax.process_count() > 1:
        _install_fail_fast()
    return True


def abort(code: int = 1) -> None:
    """End this process now with exit status `code`, skipping JAX's exit barrier.

    Why: at exit JAX calls `jax.distributed.shutdown()`, a barrier that waits
    for every process (up to `shutdown_timeout_seconds`, 300 s by default). A
    process that fails alone -- `sys.exit(3)` or an uncaught exception -- so
    stays alive there, while the others block in their next collective; a
    launcher sees nobody exit and cannot tell who failed. `abort` flushes the
    standard streams and calls `os._exit`: no barrier, no atexit handlers.
    Use it instead of `sys.exit(nonzero)` in multi-process scripts.
    """
    if code != 0:
        _note_failure()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not stop the exit
            pass
    os._exit(code)


# Kept in sync with hetpar.launch.ENV_FAILURE_DIR (not imported: see above).
ENV_FAILURE_DIR = "HETPAR_FAILURE_DIR"


def _note_failure() -> None:
    """Tell the launcher when this process failed, the first time it does.

    Its peers fail moments later of this failure (a collective's "Connection
    closed by peer") and may exit within the launcher's look; the time
    written here, before the traceback is printed, says who came first.
    """
    folder = os.environ.get(ENV_FAILURE_DIR)
    if not folder:
        return
    path = os.path.join(folder, os.environ.get(ENV_PROCESS_ID, "0"))
    try:
        # "x": the first failure's time stays when a later one (abort after the
        # hook) comes; the temporary name and rename keep a reader from a half-file.
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "x") as f:
            f.write(repr(time.time()))
        if not os.path.exists(path):
            os.replace(tmp, path)
        else:
            os.remove(tmp)
    except OSError:  # best effort: the launcher still times the exit
        pass


def _install_fail_fast() -> None:
    """Make an uncaught exception print its traceback as usual, then `abort(1)`.

    Only the main thread's uncaught exceptions (sys.excepthook); `sys.exit(n)`
    raises SystemExit, which never reaches the hook: hence `abort`.
    """
    previous = sys.excepthook
    if getattr(previous, "_hetpar_fail_fast", False):
        return

    def hook(exc_type, exc, tb):
        _note_failure()  # before the traceback: printing it takes time a peer may use
        try:
            previous(exc_type, exc, tb)
        finally:
            abort(1)

    hook._hetpar_fail_fast = True
    sys.excepthook = hook


def check_same_on_all_processes(value: str, what: str, *, hint: str = "") -> None:
    """Raise HetparError on every process unless `value` is the same string on all.

    A collective (`multihost_utils.process_allgather` of 64 bits: those of a
    fingerprint `sha256:<16 hex digits>` itself, else of `value`'s SHA-256):
    every process must call it, in the same order as its other collectives.
    Does nothing with one process.

    Raises:
      HetparError: the processes hold different values; the message lists
        each process's (fingerprint) and says which one this process has.
    """
    import hashlib

    import jax
    import numpy as np

    if jax.process_count() <= 1:
        return
    from jax.experimental import multihost_utils

    own = _FINGERPRINT.fullmatch(value)
    digest = bytes.fromhex(own.group(1)) if own else hashlib.sha256(value.encode()).digest()[:8]
    mine = np.frombuffer(digest, np.uint8).astype(np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 8)
    if (every == every[0]).all():
        return
    from hetpar.core import HetparError

    prefix = "sha256:" if own else "hash "
    listed = ", ".join(f"process {i}: {prefix}{bytes(row.astype(np.uint8).tolist()).hex()}"
                       for i, row in enumerate(every))
    raise HetparError(
        f"{what} differs between processes ({listed}); this is process "
        f"{jax.process_index()}" + (f". {hint[0].upper()}{hint[1:]}" if hint else ""))


_FINGERPRINT = re.compile(r"sha256:([0-9a-f]{16})")


def device_name(d) -> str:
    """A device's name: `p{process}/{platform}:{local index}` across processes, else `cpu:0`.

    With one process this is exactly `hetpar.cost_models.device_name`
    (`{platform}:{id}`), so plans, cost tables and profiles keep their names.
    With several, ids are global numbers that depend on how JAX numbers each
    platform's devices (CPU ids jump by process), so the name says which process
    owns the device and its place among that process's devices of the platform:
    the same on every process, and the same as `jax.local_devices()` order there.
    """
    return device_names([d])[0]


def device_names(devices) -> list[str]:
    """`device_name` of each of `devices`, in one pass (not one scan of
    `jax.devices()` per device)."""
    import jax

    if jax.process_count() <= 1:
        return [f"{d.platform}:{d.id}" for d in devices]
    index: dict[tuple[str, int], dict[int, int]] = {}
    out = []
    for d in devices:
        key = (d.platform, d.process_index)
        if key not in index:
            same = sorted(e.id for e in jax.devices(d.platform)
                          if e.process_index == d.process_index)
            index[key] = {i: k for k, i in enumerate(same)}
        out.append(f"p{d.process_index}/{d.platform}:{index[key][d.id]}")
    return out


def parse_device_name(name: str) -> tuple[int | None, str, int]:
    """(process index or None, platform, index) of a name from `device_name`.

    `p1/cpu:0` -> (1, "cpu", 0); `gpu:3` -> (None, "gpu", 3). For a name without
    a process the number is the device id (single-process naming).

    Raises:
      ValueError: `name` is not such a name.
    """
    m = _NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"not a device name: {name!r} (expected 'cpu:0' or 'p1/cpu:0')")
    process = m.group("process")
    return (None if process is None else int(process)), m.group("platform"), int(m.group("index"))

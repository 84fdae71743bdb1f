"""What `hetpar.auto` does when a step runs out of device memory.

A plan is checked against the devices' capacities before it runs, but a
memory model can still undercount (XLA's workspace, fragmentation, a
collective's buffers). Since no stage donates its inputs, the caller's
state is intact after a failed step: `hetpar.auto` caps the device that
ran out below what the failed plan predicted for it, plans again and
retries the step with the same arguments, warning once
(`OutOfMemoryWarning`). After `MAX_REPLANS` tries it stops with one line
naming the device, the bytes XLA could not allocate and what to try.
"""

from __future__ import annotations

import re

from hetpar.core import HetparError, InfeasibleError, nbytes

#: Plans tried after the first one ran out of memory.
MAX_REPLANS = 3
#: A split step's first calls wait for their results before returning: a GPU
#: executable runs asynchronously, and one that runs out of memory says so
#: only when its results are read (an H200 at 15 GB: in the caller's
#: `float(loss)`, beyond hetpar's reach). By the third call a step holds
#: what it holds in a training loop: its state, the last step's, and what
#: is in flight.
CHECKED_STEPS = 3
#: Each retry keeps the device this far under what the last plan predicted
#: it would hold: the model undercounted by at least capacity / predicted.
SHRINK = 0.85

_ALLOCATE = re.compile(r"allocat\w* (\d+(?:\.\d+)?)\s*(bytes|[KMG]i?B)", re.IGNORECASE)
_GPU_ALLOCATOR = re.compile(r"allocator GPU_(\d+)_bfc")
_UNITS = {"bytes": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class OutOfMemoryWarning(UserWarning):
    """A step ran out of device memory and `hetpar.auto` planned it again."""


class OutOfMemoryError(HetparError):
    """A step ran out of device memory and no smaller plan fits (or the plan was given)."""


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` (or what caused it) is XLA's out-of-memory error."""
    while e is not None:
        text = str(e)
        if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text:
            return True
        e = e.__cause__
    return False


def ready(outputs) -> None:
    """Waits for a split step's results; an error that shows only then (out of
    memory on an accelerator) is raised as a `StageError` naming the device of
    the first result that failed."""
    import jax

    from hetpar.cost_models import global_device_name
    from hetpar.runtime import StageError

    for x in outputs:
        if not isinstance(x, jax.Array):
            continue
        try:
            x.block_until_ready()
        except Exception as e:  # noqa: BLE001 - re-raised with its device
            devices = list(x.sharding.device_set)
            name = global_device_name(devices[0]) if len(devices) == 1 else None
            raise StageError(f"the step failed on {name or 'its devices'} while running: "
                             f"{type(e).__name__}: {str(e).splitlines()[0][:300]}. The inputs "
                             "you passed are unchanged.", device=name) from e


def failed_device(e: BaseException, used: list[str]) -> str | None:
    """The device a failed step ran out of memory on: the GPU whose allocator
    XLA's message names (`GPU_0_bfc`: an error read off a later stage's result
    on another device still names the GPU that ran out), else the device a
    `StageError` names, else the only device the step used; None where it
    cannot tell."""
    cause = e
    while cause is not None:
        m = _GPU_ALLOCATOR.search(str(cause))
        if m and f"gpu:{m.group(1)}" in used:
            return f"gpu:{m.group(1)}"
        cause = cause.__cause__
    device = getattr(e, "device", None)
    if device is not None:
        return device
    return used[0] if len(used) == 1 else None


def bytes_wanted(e: BaseException) -> float | None:
    """The allocation XLA's message says failed, in bytes (None if it does not say)."""
    while e is not None:
        m = _ALLOCATE.search(str(e))
        if m:
            return float(m.group(1)) * _UNITS[m.group(2).lower()]
        e = e.__cause__
    return None


def smaller_cap(capacity: float, predicted: float | None, tries: int = 0,
                wanted: float | None = None) -> float:
    """The cap the next plan gets on a device that ran out of memory: under the
    capacity and under what the failed plan predicted it would hold there, by
    `SHRINK` more each try, less the allocation that failed (it was wanted on
    top of all the plan had counted)."""
    base = capacity if not predicted else min(capacity, predicted)
    cap = SHRINK ** (tries + 1) * base - (wanted or 0.0)
    return max(cap, 0.25 * SHRINK ** (tries + 1) * base)


def give_up(device: str, e: BaseException, *, tries: int = 0, cap: float | None = None,
            why: InfeasibleError | None = None, given: bool = False,
            donated: bool = False) -> OutOfMemoryError:
    """The one-line error after the last try, or where hetpar may not plan again:
    `given` a plan, `donated` arguments (no longer the caller's to retry with),
    or no other device to take state (none of these)."""
    wanted = bytes_wanted(e)
    need = f" (XLA could not allocate {nbytes(wanted)} more)" if wanted else ""
    if why is not None:
        tried = (f"; planned again with {device} capped at {nbytes(cap)}, no plan fits "
                 f"({str(why).splitlines()[0]})")
    elif tries:
        tried = f"; {tries} smaller plans ran out of memory too"
    elif given:
        tried = "; the plan was given, so hetpar did not plan again"
    elif donated:
        tried = "; its arguments were donated (donate_argnums), so hetpar cannot run it again"
    else:
        tried = "; no other device can take its state"
    state = ("Arrays passed in donate_argnums may be deleted" if donated
             else "Your arguments are unchanged")
    advice = (f"Give a plan that keeps less on {device}, or drop plan= and let hetpar plan "
              "for the memory there" if given else
              "Try a smaller batch, microbatches=M with hetpar.value_and_grad, more devices, "
              "or a CPU among the devices to hold state in host memory")
    return OutOfMemoryError(f"{device} ran out of memory running the step{need}{tried}. "
                            f"{state}. {advice}")

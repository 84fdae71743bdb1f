"""Huge pages for the host CPU's layers (glibc's `glibc.malloc.hugetlb` tunable).

XLA's CPU runtime allocates a computation's temporaries with malloc on every
call: GPT-2's tied LM head at batch 16 takes ~1.2 GB of them. glibc maps
allocations that large afresh from 4 KiB pages, so every call first touches
~300,000 pages, and unmaps them after. On an H200 host (16 cores,
experiments/results/cpu_stall) that unmapping kept a native thread busy
45-78 ms after each head, and a Python thread calling into JAX then (the GPU's
worker copying the head's result) held every other Python thread up for as
long: the plan's GPU backward started that late on every step. With
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (malloc asks for transparent huge
pages) the stall went from 70 ms to 2 ms, the head itself ran 15-25% faster,
and the memory-capped GPT-2 plan's step went from 1.131 s to 0.911 s
(predicted 0.900 s).

glibc reads the tunable when a process starts: the `hetpar` CLI re-executes
itself with it (`ensure_huge_pages`); `hetpar.auto` warns once when a plan
computes on a CPU beside an accelerator without it. Where glibc or the kernel
has no such tunable (not Linux, musl, transparent huge pages off) it is ignored.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence

TUNABLE = "glibc.malloc.hugetlb=1"
# The sub-commands that compute layers on a host CPU (timing them, or running a plan).
COMPUTING_COMMANDS = frozenset({"run", "profile", "costs"})
OPT_OUT = "HETPAR_NO_HUGE_PAGES"  # set (to anything) to keep the process as it starts


class HostMemoryWarning(UserWarning):
    """A plan computes on a host CPU in a process without huge pages for malloc."""


def has_huge_pages(env: Mapping[str, str] = os.environ) -> bool:
    """Whether `env` asks glibc's malloc for huge pages (hugetlb 1 or 2)."""
    for item in env.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = item.partition("=")
        if name.strip() == "glibc.malloc.hugetlb":
            return value.strip() not in ("", "0")
    return False


def with_huge_pages(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the tunable added to any GLIBC_TUNABLES it has."""
    out = dict(env)
    if not has_huge_pages(out):
        have = [t for t in out.get("GLIBC_TUNABLES", "").split(":")
                if t and not t.startswith("glibc.malloc.hugetlb=")]
        out["GLIBC_TUNABLES"] = ":".join([*have, TUNABLE])
    return out


def ensure_huge_pages(argv: Sequence[str], env: Mapping[str, str] = os.environ,
                      execve: Callable = os.execve, platform: str = sys.platform) -> None:
    """Re-executes `python -m hetpar ARGV` with the tunable set, for a sub-command
    that computes on the host CPU, on Linux, unless it is set already or
    HETPAR_NO_HUGE_PAGES is. Returns only where it does not."""
    # The sub-command: the first word that names one (a flag's value may come first).
    computes = any(a in COMPUTING_COMMANDS for a in argv if not a.startswith("-"))
    if platform != "linux" or not computes or has_huge_pages(env) or OPT_OUT in env:
        return
    execve(sys.executable, [sys.executable, "-m", "hetpar", *argv], with_huge_pages(env))


_warned = False


def warn_without_huge_pages(platforms: Iterable[str],
                            env: Mapping[str, str] = os.environ,
                            platform: str = sys.platform) -> bool:
    """Warns once per process (returns True) when a plan computes on a CPU beside
    an accelerator (`platforms`, its devices' JAX platforms) in a Linux process
    started without huge pages for malloc."""
    global _warned
    kinds = set(platforms)
    if (_warned or platform != "linux" or "cpu" not in kinds or kinds == {"cpu"}
            or has_huge_pages(env) or OPT_OUT in env):
        return False
    _warned = True
    warnings.warn(
        "hetpar: this plan computes on the host CPU beside an accelerator, and this "
        "process's malloc maps the CPU's temporaries in 4 KiB pages: on an H200 host "
        "that made a GPT-2 plan's step 1.24x slower (the CPU's layers slower, and "
        "45-78 ms stalls of every Python thread after a large CPU layer). Start "
        f"Python with GLIBC_TUNABLES={TUNABLE} (the `hetpar` command does so itself); "
        f"set {OPT_OUT}=1 to silence this.", HostMemoryWarning, stacklevel=4)
    return True

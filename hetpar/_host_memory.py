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

glibc (2.35 on) reads the tunable when a process starts: the `hetpar` CLI
re-executes itself with it (`ensure_huge_pages`); `hetpar.auto` warns once when
a plan computes on a CPU beside an accelerator without it. Neither happens where
it cannot help (not Linux, not glibc 2.35 or later) or where the user named the
tunable already (`glibc.malloc.hugetlb=0` included) or set HETPAR_NO_HUGE_PAGES.
Standard library only: the CLI asks before anything imports JAX.

Huge pages make fresh pages cheaper, not rarer: glibc still maps each
allocation over 32 MB afresh and unmaps it when freed (a thread's own arena
cannot keep one over 64 MB), so a host update stage faults in its
temporaries on every call, and inside a step, beside the GPU's transfers,
that costs more than alone. With `HETPAR_KEEP_FREED_MEMORY` set, the `hetpar`
command and `hetpar launch` also start Python with one arena that keeps what
it frees (`KEEP_TUNABLES`): the 0.54B Llama plan updating its state on the
CPU ran 732 ms a step against 1017 ms, and steadier, but its first call's
compile took 68 s against 11 s, XLA's compiler threads contending for the one
arena's lock (experiments/results/fit_h200, run 44). Hence opt-in: for long
runs whose plan computes on the CPU. `mallopt` cannot do it once the process
runs: its threads keep the arenas they have.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence

TUNABLE = "glibc.malloc.hugetlb=1"
# The sub-commands that compute layers on a host CPU (timing them, or running a plan).
COMPUTING_COMMANDS = frozenset({"run", "profile", "costs"})
OPT_OUT = "HETPAR_NO_HUGE_PAGES"  # set (to anything, even empty) to keep the process as it starts


# Set (to anything): the `hetpar` command and `hetpar launch` start Python with
# malloc keeping one arena and what it frees (module docstring: the trade).
KEEP_OPT_IN = "HETPAR_KEEP_FREED_MEMORY"
KEEP_TUNABLES = ("glibc.malloc.arena_max=1", "glibc.malloc.mmap_max=0",
                 "glibc.malloc.trim_threshold=68719476736")


class HostMemoryWarning(UserWarning):
    """A plan computes on a host CPU in a process without huge pages for malloc."""


def hugetlb_setting(env: Mapping[str, str] = os.environ) -> str | None:
    """The value `env`'s GLIBC_TUNABLES gives glibc.malloc.hugetlb (None: not named)."""
    for item in env.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = item.partition("=")
        if name.strip() == "glibc.malloc.hugetlb":
            return value.strip()
    return None


def _tunable_named(env: Mapping[str, str], names: Sequence[str]) -> bool:
    """Whether `env`'s GLIBC_TUNABLES names any of `names` (any value)."""
    named = {t.partition("=")[0].strip() for t in env.get("GLIBC_TUNABLES", "").split(":")}
    return any(n in named for n in names)


def has_huge_pages(env: Mapping[str, str] = os.environ) -> bool:
    """Whether `env` asks glibc's malloc for huge pages (hugetlb 1 or 2)."""
    return hugetlb_setting(env) not in (None, "", "0")


def with_huge_pages(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the tunable added to any GLIBC_TUNABLES it has (a hugetlb value it
    names already is kept)."""
    out = dict(env)
    if hugetlb_setting(out) is None:
        have = [t for t in out.get("GLIBC_TUNABLES", "").split(":") if t]
        out["GLIBC_TUNABLES"] = ":".join([*have, TUNABLE])
    return out


def glibc_takes_it(libc: str | None = None) -> bool:
    """Whether this process's C library is glibc 2.35 or later (the tunable's first)."""
    if libc is None:
        try:
            libc = os.confstr("CS_GNU_LIBC_VERSION")
        except (AttributeError, ValueError, OSError):
            return False
    name, _, version = (libc or "").partition(" ")
    try:
        return name == "glibc" and tuple(int(v) for v in version.split(".")[:2]) >= (2, 35)
    except ValueError:
        return False


def wants_huge_pages(env: Mapping[str, str], platform: str | None = None,
                     libc: str | None = None) -> bool:
    """Whether a process with `env` should get the tunable: on Linux with a glibc
    that takes it, the user naming neither it nor the opt-out."""
    return ((platform or sys.platform) == "linux" and hugetlb_setting(env) is None
            and OPT_OUT not in env and glibc_takes_it(libc))


def malloc_env(env: Mapping[str, str], platform: str | None = None,
               libc: str | None = None) -> dict[str, str]:
    """`env` with the tunables hetpar starts a computing process with: huge
    pages (`wants_huge_pages`), and where `KEEP_OPT_IN` is set, one arena that
    keeps what it frees (`KEEP_TUNABLES`, each unless the user names it),
    on Linux with a glibc that takes them."""
    out = with_huge_pages(env) if wants_huge_pages(env, platform, libc) else dict(env)
    if (KEEP_OPT_IN in env and (platform or sys.platform) == "linux"
            and glibc_takes_it(libc)):
        have = [t for t in out.get("GLIBC_TUNABLES", "").split(":") if t]
        add = [t for t in KEEP_TUNABLES if not _tunable_named(out, [t.partition("=")[0]])]
        if add:
            out["GLIBC_TUNABLES"] = ":".join([*have, *add])
    return out


def ensure_huge_pages(argv: Sequence[str], env: Mapping[str, str] | None = None, *,
                      execve=None, platform: str | None = None, libc: str | None = None,
                      orig_argv: Sequence[str] | None = None) -> None:
    """Re-executes this process as it was started (`sys.orig_argv`: interpreter
    options, `-m hetpar` or the console script) with the tunables of
    `malloc_env` set, where its sub-command (`argv`) computes on the host CPU
    and they add anything. Returns only where they do not."""
    env = os.environ if env is None else env
    # Any word naming such a sub-command (a flag's value may come first); a word
    # that only looks like one costs a re-exec, nothing else.
    computes = any(a in COMPUTING_COMMANDS for a in argv if not a.startswith("-"))
    started = list(sys.orig_argv if orig_argv is None else orig_argv)
    if (not computes or not sys.executable or getattr(sys, "frozen", False)
            or len(started) < 2):
        return
    wanted = malloc_env(env, platform, libc)
    if wanted.get("GLIBC_TUNABLES") == env.get("GLIBC_TUNABLES"):
        return
    (execve or os.execve)(sys.executable, [sys.executable, *started[1:]], wanted)


_warned = False


def _user_stacklevel() -> int:
    """The stack level of the first frame outside hetpar (counted from the caller
    of `warnings.warn` in `warn_without_huge_pages`)."""
    root = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        frame, level = frame.f_back, level + 1
    return level


def warn_without_huge_pages(platforms: Iterable[str], env: Mapping[str, str] | None = None, *,
                            platform: str | None = None, libc: str | None = None) -> bool:
    """Warns once per process (returns True) when a plan computes on a CPU beside
    an accelerator (`platforms`: the JAX platforms of the devices that run its
    stages in this process) and `wants_huge_pages` says the tunable would help."""
    global _warned
    kinds = set(platforms)
    env = os.environ if env is None else env
    if (_warned or "cpu" not in kinds or kinds == {"cpu"}
            or not wants_huge_pages(env, platform, libc)):
        return False
    _warned = True
    warnings.warn(
        "hetpar: this plan computes on the host CPU beside an accelerator, and this "
        "process's malloc maps the CPU's temporaries in 4 KiB pages: on H200 hosts "
        "that made a GPT-2 plan's step 1.24x slower and a 0.54B Llama plan updating "
        "its state on the CPU about 2x slower (the CPU's layers slower, and 45-78 ms "
        "stalls of every Python thread after a large CPU layer). Start "
        f"Python with GLIBC_TUNABLES={TUNABLE} (the `hetpar` command does so itself); "
        f"set {OPT_OUT}=1 to silence this.", HostMemoryWarning, stacklevel=_user_stacklevel())
    return True


#: XLA's GPU client keeps pinned host memory (JAX's `pinned_host` memory
#: kind, where offload plans keep state) in a pool of its own (the
#: `xla_gpu_host_bfc` allocator, one per client: a process's GPUs share it)
#: of PINNED_POOL_GIB unless this variable says otherwise, read when the
#: client starts. A plan keeping a 6.74B model's 77.7 GB of state there
#: failed placing it, "Out of host memory ... with allocator
#: xla_gpu_host_bfc" (fit_h200, run 53); within 64 GiB the model at 45 GB of
#: an H200 must update layers on the host CPU instead (21.5 s a step
#: planned, against 3.4 s fetching its weights from a wider pool).
PINNED_POOL_VAR = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
PINNED_POOL_GIB = 64
#: The share of the host's RAM `import hetpar` widens the pool to: the rest
#: is for the process itself (~9 GB on an H200 host beside its arrays,
#: run 51), arrays on CPU devices, and the caller's arrays still on the
#: host while they move into the pool.
PINNED_POOL_RAM_SHARE = 0.75


def pinned_pool_bytes(env: Mapping[str, str] = os.environ) -> float:
    """What XLA's pinned host pool may hold in this process (the planner caps
    a GPU's memory place at its share: `cost_models._resolve.memory_places`)."""
    try:
        gib = float(env.get(PINNED_POOL_VAR, PINNED_POOL_GIB))
    except ValueError:
        gib = PINNED_POOL_GIB
    return gib * (1 << 30)


def physical_ram() -> float | None:
    """The host's RAM from sysconf, None where the OS does not say."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def widen_pinned_pool(env: dict | None = None, ram: float | None = None) -> bool:
    """Lets XLA's pinned host pool grow to PINNED_POOL_RAM_SHARE of the
    host's RAM (`ram` bytes; the OS's figure by default): sets
    PINNED_POOL_VAR where the user has not set it and no JAX backend has
    started yet (`import hetpar` before JAX's first use); the planner caps
    each memory place at what the pool then allows (`pinned_pool_bytes`),
    and counts the pool's regions on the host (`pinned_pool_reserved`).
    Returns whether it set it."""
    env = os.environ if env is None else env
    if PINNED_POOL_VAR in env or _backends_started():
        return False
    ram = physical_ram() if ram is None else ram
    if ram is None:
        return False
    gib = int(ram * PINNED_POOL_RAM_SHARE // (1 << 30))
    if gib <= PINNED_POOL_GIB:  # no wider than the default
        return False
    env[PINNED_POOL_VAR] = str(gib)
    return True


def _backends_started() -> bool:
    """Whether this process's JAX has created its backends (clients) already."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is None:
        return False
    return bool(getattr(bridge, "_backends", None))


"""Start N local copies of a script as one multi-process JAX job.

    python -m hetpar.launch -n 2 --devices_per_process 2 script.py [args...]

A tool for trying multi-controller JAX on one machine and for tests, not a
cluster launcher: under SLURM or Open MPI use `srun`/`mpirun`, which JAX's
own `jax.distributed.initialize()` detects. Each copy gets the environment
`hetpar._distributed.initialize()` reads (see docs/distributed.md):

  HETPAR_COORDINATOR    host:port of process 0's coordination service
  HETPAR_NUM_PROCESSES  N
  HETPAR_PROCESS_ID     0 .. N-1
  JAX_CPU_COLLECTIVES_IMPLEMENTATION  gloo (unless already set), so CPU
                        collectives cross processes
  XLA_FLAGS             with --xla_force_host_platform_device_count=K when
                        --devices_per_process K is given
  CUDA_VISIBLE_DEVICES  GPUs [i*G, (i+1)*G) of those visible, for copy i,
                        when --gpus_per_process G is given (each process
                        then drives its own GPUs, as on separate hosts)
  GLIBC_TUNABLES        with glibc.malloc.hugetlb=1, where glibc takes it and
                        neither it nor HETPAR_NO_HUGE_PAGES is set (huge pages
                        for the host CPU's layers: hetpar/_host_memory.py)

Every output line of copy i is printed as `[p{i}] line`. When a copy exits
non-zero, the others get `--grace` seconds to finish (they usually hang in a
collective waiting for the dead one), are then killed, and the launcher exits
non-zero, naming the copy that failed first. A peer often fails moments
after the first, of the first's failure (gloo: "Connection closed by peer"),
so both may have exited by the time the launcher looks: each copy's exit is
timed by a thread waiting on it, and a copy started by
`hetpar._distributed.initialize()` also writes when its uncaught exception
(or `abort`) happened into the folder HETPAR_FAILURE_DIR names; the earliest
failure is the one named.

This module never imports JAX: it only starts processes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from hetpar import _host_memory

# Our own variable names: JAX auto-detects only cluster managers (SLURM, Open
# MPI, TPU, Kubernetes) and JAX_COORDINATOR_ADDRESS, never the process count or
# id of a plain local launch.
ENV_COORDINATOR = "HETPAR_COORDINATOR"
ENV_NUM_PROCESSES = "HETPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "HETPAR_PROCESS_ID"
#: A folder where a failing copy writes `<process id>` holding the time.time()
#: of its failure (hetpar._distributed's fail-fast hook and abort).
ENV_FAILURE_DIR = "HETPAR_FAILURE_DIR"

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def free_port() -> int:
    """A TCP port free on localhost now (another program may take it before we use it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(base: dict, *, process_id: int, num_processes: int, coordinator: str,
              devices_per_process: int | None, gpus_per_process: int | None = None,
              failure_dir: str | None = None) -> dict:
    """The environment of copy `process_id`: `base` plus the variables in the module doc."""
    env = dict(base)
    env[ENV_COORDINATOR] = coordinator
    if failure_dir is not None:
        env[ENV_FAILURE_DIR] = failure_dir
    env[ENV_NUM_PROCESSES] = str(num_processes)
    env[ENV_PROCESS_ID] = str(process_id)
    # gloo is JAX 0.10's default already; set it anyway so that an older or newer
    # default of "none" cannot silently give per-process collectives. A value the
    # caller set is kept (e.g. "mpi").
    env.setdefault("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo")
    if devices_per_process is not None:
        # Replace, not append: the caller's XLA_FLAGS may carry its own count
        # (tests/conftest.py forces 4 in the pytest process), and XLA would
        # take the last one anyway; one clear flag is easier to read in logs.
        flags = _DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
        flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
        env["XLA_FLAGS"] = " ".join(flags)
    if gpus_per_process is not None:
        # Without it every process would take every GPU of the host.
        visible = base.get("CUDA_VISIBLE_DEVICES")
        ids = (visible.split(",") if visible else
               [str(i) for i in range(num_processes * gpus_per_process)])
        mine = ids[process_id * gpus_per_process:(process_id + 1) * gpus_per_process]
        if len(mine) < gpus_per_process:
            raise ValueError(f"--gpus_per_process {gpus_per_process} x {num_processes} "
                             f"processes needs {num_processes * gpus_per_process} GPUs; "
                             f"CUDA_VISIBLE_DEVICES lists {len(ids)}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    env = _host_memory.malloc_env(env)
    # Lines should arrive as they are printed, not when a buffer fills.
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _pump(i: int, stream, out, lock: threading.Lock) -> None:
    """Copy `stream` to `out` line by line, each prefixed `[p{i}] `."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        with lock:
            out.write(f"[p{i}] {line}\n")
            out.flush()
    stream.close()


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the launcher dies (Linux only).

    The copies lead their own sessions (so that we can signal each one's whole
    group), hence a SIGKILL of the launcher -- e.g. by a test's subprocess
    timeout -- would otherwise leave them hanging in a collective for minutes.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # best effort: without it the launcher's own cleanup still applies


def _kill(proc: subprocess.Popen, sig: int) -> None:
    """Signal the process group we started for `proc` (it may have children of its own)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)  # the child leads its own group: start_new_session
    except ProcessLookupError:
        pass


def _exit_status(returncode: int) -> int:
    """A shell-style exit status for a child's return code (128+N for signal N)."""
    if returncode < 0:
        return 128 - returncode
    return returncode if 0 < returncode < 256 else 1


def launch(argv: list[str], num_processes: int, *, devices_per_process: int | None = None,
           gpus_per_process: int | None = None, port: int | None = None, grace: float = 30.0,
           python: str | None = None, out=None) -> int:
    """Run `python argv...` as `num_processes` copies; return the launcher's exit status.

    0 when every copy exits 0. Otherwise the status of the copy that failed first
    (killed copies do not count as failing first), after the others have had
    `grace` seconds to finish and been killed.
    """
    out = out or sys.stdout
    python = python or sys.executable
    coordinator = f"localhost:{port or free_port()}"
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    # exited[i]: time.time() when copy i's waiter saw it exit. One thread per
    # copy blocks in its wait(), so exits are timed as they happen, not at
    # the next poll, where a peer failing of the first's failure would look
    # as early as the first (and the lower process number won).
    exited: list[float | None] = [None] * num_processes
    failure_dir = tempfile.mkdtemp(prefix="hetpar-launch-")

    def note(msg: str) -> None:
        with lock:
            print(f"[launch] {msg}", file=sys.stderr, flush=True)

    def wait(i: int, p: subprocess.Popen) -> None:
        p.wait()
        exited[i] = time.time()

    try:
        for i in range(num_processes):
            env = child_env(os.environ, process_id=i, num_processes=num_processes,
                            coordinator=coordinator, devices_per_process=devices_per_process,
                            gpus_per_process=gpus_per_process, failure_dir=failure_dir)
            procs.append(subprocess.Popen(
                [python, *argv], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent))
        # Threads only now: preexec_fn is unsafe while other threads run.
        for i, p in enumerate(procs):
            threads.append(threading.Thread(target=_pump, args=(i, p.stdout, out, lock),
                                            daemon=True))
            threads.append(threading.Thread(target=wait, args=(i, p), daemon=True))
        for t in threads:
            t.start()

        first_failed: int | None = None
        deadline: float | None = None
        while True:
            if all(t is not None for t in exited):
                break
            if first_failed is None:
                first_failed = _first_failure(procs, exited, failure_dir)
                if first_failed is not None:
                    deadline = time.monotonic() + grace
                    note(f"process {first_failed} failed first (exit code "
                         f"{_exit_code(procs[first_failed])}); stopping the others in at "
                         f"most {grace:g} s")
            if deadline is not None and time.monotonic() >= deadline:
                _stop(procs, note)
                break
            time.sleep(0.05)
        for p in procs:
            p.wait()
        if first_failed is None:  # every copy finished before we looked
            first_failed = _first_failure(procs, exited, failure_dir)
            if first_failed is not None:
                note(f"process {first_failed} failed first "
                     f"(exit code {procs[first_failed].returncode})")
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM via main()
        note("interrupted; stopping all processes")
        _stop(procs, note)
        for p in procs:
            p.wait()
        return 130
    except BaseException:  # e.g. a copy failed to start: leave no orphans behind
        _stop(procs, note)
        raise
    finally:
        for t in threads:
            t.join(timeout=5)
        shutil.rmtree(failure_dir, ignore_errors=True)

    if first_failed is None:
        return 0
    return _exit_status(procs[first_failed].returncode)


def _first_failure(procs: list[subprocess.Popen], exited: list[float | None],
                   failure_dir: str) -> int | None:
    """The copy whose failure came first, or None while none has failed.

    A copy fails when it exits non-zero; it is timed by when it said it
    failed (a file in `failure_dir`, written by hetpar's fail-fast hook
    before the traceback is printed) or else when it exited. A copy that
    wrote a file but has not exited yet is failing too: it counts, so that
    a peer's consequent exit is not named first while the first still prints.
    """
    when: dict[int, float] = {}
    for i, p in enumerate(procs):
        said = _failure_time(failure_dir, i)
        if said is not None:
            when[i] = said
        elif exited[i] is not None and p.returncode != 0:
            when[i] = exited[i]
    if not any(exited[i] is not None and procs[i].returncode != 0 for i in range(len(procs))):
        return None  # nobody has exited non-zero yet: a file alone may be a handled abort
    return min(when, key=lambda i: (when[i], i)) if when else None


def _exit_code(p: subprocess.Popen) -> int | str:
    """`p`'s return code; a copy that said it failed may still be printing its traceback."""
    try:
        return p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return "not exited yet"


def _failure_time(failure_dir: str, i: int) -> float | None:
    try:
        with open(os.path.join(failure_dir, str(i))) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def _stop(procs: list[subprocess.Popen], note, term_wait: float = 2.0) -> None:
    """SIGTERM every live copy, then SIGKILL what is still alive after `term_wait` s.

    SIGTERM first so that a script's own handlers may run; SIGKILL because a
    JAX process ignores SIGTERM once `jax.distributed` runs (its preemption
    notifier takes the signal and only logs "SIGTERM caught"), and a copy
    blocked inside a C++ collective would not act on it anyway.
    """
    live = [(i, p) for i, p in enumerate(procs) if p.poll() is None]
    if live:
        note("killing process(es) " + ", ".join(str(i) for i, _ in live))
    for _, p in live:
        _kill(p, signal.SIGTERM)
    end = time.monotonic() + term_wait
    while time.monotonic() < end and any(p.poll() is None for _, p in live):
        time.sleep(0.05)
    for _, p in live:
        _kill(p, signal.SIGKILL)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(args: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hetpar.launch",
        description="Start N local copies of a script as one multi-process JAX job.")
    ap.add_argument("-n", "--num_processes", type=int, required=True,
                    help="how many copies to start")
    ap.add_argument("--devices_per_process", type=int, default=None,
                    help="virtual CPU devices per copy (sets XLA_FLAGS "
                         "--xla_force_host_platform_device_count)")
    ap.add_argument("--gpus_per_process", type=int, default=None,
                    help="GPUs per copy: copy i sees GPUs [i*G, (i+1)*G) of those visible "
                         "(sets CUDA_VISIBLE_DEVICES)")
    ap.add_argument("--port", type=int, default=None,
                    help="coordinator port on localhost (default: a free one)")
    ap.add_argument("--grace", type=float, default=30.0,
                    help="seconds the other copies get to finish after one fails, "
                         "before they are killed (default 30)")
    ap.add_argument("script", help="the Python script each copy runs")
    ap.add_argument("script_args", nargs=argparse.REMAINDER,
                    help="arguments passed to the script")
    ns = ap.parse_args(args)
    if ns.num_processes < 1:
        ap.error("-n must be at least 1")
    if ns.devices_per_process is not None and ns.devices_per_process < 1:
        ap.error("--devices_per_process must be at least 1")
    if ns.gpus_per_process is not None and ns.gpus_per_process < 1:
        ap.error("--gpus_per_process must be at least 1")
    # SIGTERM (e.g. from a batch system) stops the copies like Ctrl-C does.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    return launch([ns.script, *ns.script_args], ns.num_processes,
                  devices_per_process=ns.devices_per_process,
                  gpus_per_process=ns.gpus_per_process, port=ns.port, grace=ns.grace)


if __name__ == "__main__":
    sys.exit(main())

"""Does a big CPU computation stall the process as it ends? (issue 17)

In the memory-capped GPT-2 plans (results/plan_memory) the GPU's first
backward stage after the host CPU's head (0.75-0.9 s, the tied LM head's
forward and backward at batch 16) started 46-112 ms late in every watched
step, on H100 and H200 hosts, and a thread sampling the Python threads found
none running for 48 ms right where the head ended. This runs that head's
work (logits over a 50257-word vocabulary, softmax cross-entropy and its
gradients, ~1.2 GB of temporaries) on the CPU device while a ticker thread
sleeps 1 ms at a time and records how late it wakes, and reports, per run,
the head's seconds and the ticker's longest lateness during the run and in
the 150 ms after it.

    python experiments/probe_cpu_stall.py --out FILE [--runs 6] [--batch 16]
        [--put gpu:0 [--early put|asarray|wait|none] [--put_ready]]

--put DEVICE: as the plan does, the head's input gradient (6 MB) is put on
DEVICE by another thread as soon as the head is dispatched (before it is
ready; `jax.device_put`, as the transfer engine puts); --early asarray or
wait: that thread only reads the array as numpy, or waits for it;
--put_ready: then the same put of the ready array, the ticker watching.

Run it under different allocators (env: MALLOC_* settings, LD_PRELOAD) to
see whether the stall is the computation's memory going back to the system.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from hetpar.core import ProfileError
from hetpar.cost_models import resolve_device

_THREADS = r"""
import os, sys, time
pid, stop = int(sys.argv[1]), sys.argv[2]
rows = []
while not os.path.exists(stop):
    now = time.monotonic()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        rows.append((now, int(tid), name, fields[0], int(fields[11]) + int(fields[12])))
    time.sleep(0.001)
print(repr(rows))
"""


class _Threads:
    """Another process reading this one's threads from /proc every ~1 ms (their
    state and CPU ticks): it needs no interpreter lock here, so it sees what
    runs while this process's Python threads do not."""

    def __enter__(self):
        import subprocess
        import sys
        import tempfile

        self._stop = pathlib.Path(tempfile.mkdtemp()) / "stop"
        self._proc = subprocess.Popen([sys.executable, "-c", _THREADS, str(os.getpid()),
                                       str(self._stop)], stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        return self

    def __exit__(self, *exc):
        import ast

        self._stop.touch()
        self.rows = ast.literal_eval(self._proc.communicate()[0])

    def busy(self, lo: float, hi: float, known: dict | None = None) -> dict:
        """{thread: (CPU ticks in [lo, hi], how many samples it was running)}, a
        thread named by `known` ({native id: name}, Python's threads) or its own name
        and id."""
        first, last, running = {}, {}, {}
        for now, tid, name, state, ticks in self.rows:
            if lo <= now <= hi:
                first.setdefault((tid, name), ticks)
                last[tid, name] = ticks
                running[tid, name] = running.get((tid, name), 0) + (state == "R")
        out: dict = {}
        for (tid, name), t in last.items():
            label = (known or {}).get(tid, f"{name} {tid}")
            out[label] = (t - first[tid, name], running[tid, name])
        return {k: v for k, v in sorted(out.items(), key=lambda kv: -kv[1][0]) if v[0] or v[1]}


class _Ticker:
    """Sleeps `every_s` at a time; records (woke, late) for every wake-up."""

    def __init__(self, every_s: float = 0.001):
        self.every_s = every_s
        self.wakes: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(self.every_s)
            now = time.perf_counter()
            self.wakes.append((now, now - t - self.every_s))

    def __enter__(self):
        self._thread.start()
        time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def worst(self, lo: float, hi: float) -> float:
        """The longest lateness of a sleep that ended in [lo, hi]."""
        return max((late for woke, late in self.wakes if lo <= woke <= hi), default=0.0)

    def worst_window(self, lo: float, hi: float) -> tuple[float, float]:
        """(start, end) of the longest late sleep that ended in [lo, hi]."""
        woke, late = max(((w, la) for w, la in self.wakes if lo <= w <= hi),
                         key=lambda wl: wl[1], default=(lo, 0.0))
        return woke - late - self.every_s, woke


def _polled(x, every_s: float = 0.0005):
    """`x` once ready, by polling `is_ready` (registering no waiter on it)."""
    while not x.is_ready():
        time.sleep(every_s)
    return x


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--put", default=None, help="a device to put the head's result on (gpu:0)")
    ap.add_argument("--early", default=None,
                    choices=("put", "asarray", "wait", "wait_only", "put_only",
                             "poll_put_only", "none"),
                    help="what a second thread does with the head's result as soon as the "
                         "head is dispatched (the puts: on --put; default: put with --put, "
                         "else none)")
    ap.add_argument("--threads", action="store_true",
                    help="another process samples this one's threads (/proc) through "
                         "the runs: which ran in each stall")
    ap.add_argument("--put_ready", action="store_true",
                    help="then put the ready result on --put, the ticker watching")
    args = ap.parse_args(argv)
    args.early = args.early or ("put" if args.put else "none")
    if (args.early.startswith(("put", "poll_put")) or args.put_ready) and not args.put:
        what = "--put_ready" if args.put_ready else f"--early {args.early}"
        ap.error(f"{what} puts the head's result on a device: name it with --put (gpu:0)")
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    n = args.batch * args.seq
    x = jax.device_put(rng.standard_normal((n, 768), np.float32), cpu)
    w = jax.device_put(rng.standard_normal((args.vocab, 768), np.float32) * 0.02, cpu)
    labels = jax.device_put(rng.integers(0, args.vocab, n).astype(np.int32), cpu)

    def loss(x, w):
        logits = x @ w.T
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))

    head = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    jax.block_until_ready(head(x, w))
    target = None
    if args.put:
        try:  # a bad name: one line naming the present devices
            target = resolve_device(args.put)
        except ProfileError as e:
            ap.error(str(e))
        jax.block_until_ready(jax.device_put(head(x, w)[1][0], target))
    early = {  # what another thread does with the head's input gradient once dispatched
        "put": lambda gx: jax.device_put(gx, target).block_until_ready(),
        "asarray": np.asarray,  # what jax.device_put does first with a CPU array
        "wait": jax.block_until_ready,
        "wait_only": jax.block_until_ready,  # and this thread alone waits for the head
        "put_only": lambda gx: jax.device_put(gx, target).block_until_ready(),  # alone
        "poll_put_only": lambda gx: jax.device_put(_polled(gx), target).block_until_ready(),
        "none": None}[args.early]
    rows = []
    known = {threading.get_native_id(): "python: main"}
    threads = _Threads() if args.threads else contextlib.nullcontext()
    with threads, _Ticker() as ticker:
        known[ticker._thread.native_id] = "python: the ticker"
        time.sleep(0.2)
        for _ in range(args.runs):
            t0 = time.perf_counter()
            out = head(x, w)
            done = {}
            if early is not None:
                def run(gx=out[1][0], done=done):
                    known[threading.get_native_id()] = "python: the early thread"
                    early(gx)
                    done["t"] = time.perf_counter()
                thread = threading.Thread(target=run)
                thread.start()
            if args.early.endswith("_only"):
                thread.join()
            else:
                jax.block_until_ready(out)
            t1 = time.perf_counter()
            row = {"head_s": t1 - t0, "late_during_s": ticker.worst(t0, t1), "t1": t1}
            if early is not None:
                thread.join()
                row["early_done_after_ready_s"] = done["t"] - t1
            time.sleep(0.15)
            row["late_after_s"] = ticker.worst(t1, t1 + 0.15)
            row["late_window"] = ticker.worst_window(t1, t1 + 0.15)
            if target is not None and args.put_ready:
                t2 = time.perf_counter()
                jax.device_put(out[1][0], target).block_until_ready()
                t3 = time.perf_counter()
                time.sleep(0.15)
                row["put_of_ready_s"] = t3 - t2
                row["late_after_put_of_ready_s"] = ticker.worst(t2, t3 + 0.15)
            del out
            time.sleep(0.05)
            rows.append(row)
    if args.threads:  # which threads ran through each run's longest stall
        for row in rows:
            row["threads_in_stall"] = threads.busy(*row["late_window"], known)
            row["threads_after"] = threads.busy(row["t1"], row["t1"] + 0.15, known)
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("MALLOC", "LD_PRELOAD", "GLIBC_TUNABLES"))}
    head_ms = statistics.median(r["head_s"] for r in rows) * 1e3
    during = statistics.median(r["late_during_s"] for r in rows) * 1e3
    after = statistics.median(r["late_after_s"] for r in rows) * 1e3
    extra = "".join(
        f", {k} {statistics.median(r[k] for r in rows) * 1e3:.1f} ms"
        for k in ("early_done_after_ready_s", "put_of_ready_s", "late_after_put_of_ready_s")
        if k in rows[0])
    if args.threads:
        print("threads running through the stall (name: CPU ticks, samples running):",
              rows[-1]["threads_in_stall"], flush=True)
    print(f"{env or 'default allocator'}, early {args.early}: head {head_ms:.0f} ms, the "
          f"ticker's worst lateness during {during:.1f} ms, after {after:.1f} ms{extra} "
          f"(medians of {args.runs})", flush=True)
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": env, "cpu_count": os.cpu_count(), "rows": rows},
                               indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

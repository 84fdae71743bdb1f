"""Why a host update stage runs slower in the step than alone (issue 41).

The 0.54B Llama-style offload plan's host update stage (nine layers' clipped
AdamW on the CPU) ran 556-705 ms inside the step and 209-289 ms timed alone
after it (experiments/results/fit_h200 run 24, fit_h200x2 run 35). Ruled out
so far: the gradients read from pinned pages (~10%), the host state's page
backing (run 36), subnormal values (XLA's CPU runtime flushes them:
`probe_host_denormals.py`).

This plans the model from a saved cost table (no calibration), runs the plan
given, and wraps each host stage's executable so that, inside the step, at
the moment the stage would run, it runs three times:

- `copies_plain_s`: on fresh host copies of its inputs (not the step's buffers);
- `copies_pinned_s`: the same, what another device makes brought as the step
  brings it (staged in the GPU's pinned host memory, then aliased);
- `copies_pinned_copied_s`: the same, then copied into the CPU's own memory;
- `real_s`: on the step's own inputs (what the step then uses).

Each with the CPU time every thread of the process spent meanwhile, by
thread name and for the busiest one by one (`/proc/self/task`), each
thread's state, wait channel and system call sampled (and a native
thread's kernel stack, as root), and the whole machine's busy time
(`/proc/stat`); the first run on the step's own inputs also with every
thread's native stack once, where `eu-stack` or `py-spy` is on the PATH
(runs 38-41 found an unnamed native thread at work while the stage ran
slow; this names what it runs). Slow in all three: what runs beside the stage (threads,
the machine). Slow only on the step's buffers: the buffers. Then the same
three alone, after the steps, and whole steps with what comes from the GPU
aliased or copied (`TransferEngine.ALIAS_PINNED`).

    python experiments/probe_host_stage.py --table T.json --out R.json
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \
        python experiments/probe_host_stage.py --tiny --out /tmp/r.json   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

TICK = os.sysconf("SC_CLK_TCK")


def tasks():
    """(tid, name, stat fields from the state on) of every thread of this
    process; a Python thread is named by its Python name."""
    import threading

    py = {t.native_id: t.name for t in threading.enumerate()}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue
        yield tid, py.get(int(tid)) or s[s.index("(") + 1:s.rindex(")")], \
            s[s.rindex(")") + 2:].split(), int(tid) in py


def thread_times() -> dict:
    """{(tid, name): (user s, system s, minor page faults)} for every thread."""
    return {(tid, name): (int(f[11]) / TICK, int(f[12]) / TICK, int(f[7]))
            for tid, name, f, _ in tasks()}


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return (sum(v) - idle) / TICK, sum(v) / TICK


class StackSampler:
    """Samples every other Python thread's innermost frames every `every_s`:
    what the process's Python threads do while a stage runs."""

    def __init__(self, every_s: float = 0.01):
        import threading

        self.every_s, self.counts, self._stop = every_s, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, name="probe-sampler", daemon=True)

    def _run(self):
        import threading
        import traceback

        me = threading.get_ident()
        names = {}
        while not self._stop.wait(self.every_s):
            self._kernel_states()
            for t in threading.enumerate():
                names[t.ident] = t.name
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                top = traceback.extract_stack(frame)[-3:]
                key = f"{names.get(ident, ident)}: " + " < ".join(
                    f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in reversed(top))
                self.counts[key] = self.counts.get(key, 0) + 1

    def _kernel_states(self):
        """Each native thread's state, kernel wait channel and system call
        (where the kernel lets this process read them): what a thread that
        is not running waits on (a lock such as the address space's
        `mmap_lock` shows as an rwsem wait)."""
        for tid, name, fields, is_python in tasks():
            state = fields[0]
            wchan = syscall = "?"
            try:
                with open(f"/proc/self/task/{tid}/wchan") as f:
                    wchan = f.read().strip() or "0"
                with open(f"/proc/self/task/{tid}/syscall") as f:
                    syscall = f.read().split()[0]
            except (OSError, IndexError):
                pass
            if name in ("probe-sampler", "probe-native"):
                continue
            key = f"{name} {state} wchan={wchan} syscall={syscall}"
            if not is_python and (state != "S" or syscall not in ("202", "7")):
                # A native thread at work: its kernel stack, where readable
                # (root), names what it waits on or does in the kernel.
                try:
                    with open(f"/proc/self/task/{tid}/stack") as f:
                        frames = [ln.split()[-1].split("+")[0] for ln in f.read().splitlines()]
                    key += " stack=" + "<".join(frames[:4])
                except (OSError, IndexError):
                    pass
            self.kernel[key] = self.kernel.get(key, 0) + 1

    def __enter__(self):
        self.kernel = {}
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def top(self, n: int = 8) -> list:
        return sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]

    def kernel_top(self, n: int = 24) -> list:
        return sorted(self.kernel.items(), key=lambda kv: -kv[1])[:n]


#: Readers of every thread's native stack that leave the process running
#: after (gdb attached from a thread of the process itself hung with it
#: stopped, on the 2-core machine).
NATIVE_TOOLS = (("eu-stack", ["eu-stack", "-p", "{pid}"]),
                ("py-spy", ["py-spy", "dump", "--native", "--pid", "{pid}"]))


class NativeStacks:
    """Every thread's native stack once, `after_s` into a run, by the first of
    `NATIVE_TOOLS` on the PATH (it stops the process while it reads them):
    what a thread no Python frame names is doing."""

    def __init__(self, after_s: float = 0.25):
        import shutil
        import threading

        self.tool = next(((n, cmd) for n, cmd in NATIVE_TOOLS if shutil.which(n)), None)
        self.text, self.after_s = "", after_s
        self._thread = threading.Thread(target=self._run, name="probe-native", daemon=True)

    def _run(self):
        import subprocess

        time.sleep(self.after_s)
        name, cmd = self.tool
        try:
            r = subprocess.run([c.format(pid=os.getpid()) for c in cmd], capture_output=True,
                               text=True, timeout=90)
            self.text = r.stdout + r.stderr[-2000:]
        except (OSError, subprocess.SubprocessError) as e:
            self.text = f"{name} failed: {e}"
        finally:
            import signal

            os.kill(os.getpid(), signal.SIGCONT)  # never left stopped by a reader killed

    def __enter__(self):
        if self.tool is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.tool is not None:
            self._thread.join()

    def of_threads(self, tids: set) -> dict:
        """{tid: its stack} for `tids`, cut from the tool's output."""
        import re

        out, tid = {}, None
        for line in self.text.splitlines():
            m = re.search(r"(?:^TID |LWP |Thread )(\d+)", line)
            if m and (line.startswith("TID ") or "LWP" in line or line.startswith("Thread ")):
                tid = m.group(1)
            if tid in tids:
                out.setdefault(tid, []).append(line.strip()[:200])
        return {t: lines[:16] for t, lines in out.items()}


def timed(fn, *args, sample: bool = False, native: bool = False):
    """(result, seconds, what ran meanwhile) for `fn(*args)` made ready;
    `native`: with every thread's native stack once, a quarter second in."""
    import contextlib

    import jax

    sampler = StackSampler() if sample else contextlib.nullcontext()
    stacks = NativeStacks() if native else contextlib.nullcontext()
    th0, m0, t = thread_times(), machine_busy(), time.perf_counter()
    with sampler, stacks:
        out = jax.block_until_ready(fn(*args))
    s = time.perf_counter() - t
    th1, m1 = thread_times(), machine_busy()
    by_name: dict = {}
    busy_threads = 0
    for key, (u, sy, flt) in th1.items():
        u0, s0, f0 = th0.get(key, (0.0, 0.0, 0))
        du, ds, df = u - u0, sy - s0, flt - f0
        if du + ds > 0 or df > 0:
            name = key[1] if not key[1].startswith("tf_") else key[1]
            a = by_name.setdefault(name, [0.0, 0.0, 0])
            a[0] += du
            a[1] += ds
            a[2] += df
            busy_threads += du + ds > 0.5 * s
    rows = sorted(by_name.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:10]
    meanwhile = {"process_cpu_s": round(sum(a[0] + a[1] for a in by_name.values()), 3),
                 "threads_busy_half_the_time": busy_threads,
                 "by_thread_name_user_sys_s_minflt": {
                     k: [round(a[0], 3), round(a[1], 3), a[2]] for k, a in rows},
                 "machine_busy_cores": round((m1[0] - m0[0]) / s, 2)}
    # The busiest threads one by one (a thread pool's names are alike).
    each = sorted(((sum(v[:2]) - sum(th0.get(k, (0.0, 0.0, 0))[:2]),
                    v[2] - th0.get(k, (0.0, 0.0, 0))[2], k) for k, v in th1.items()),
                  reverse=True)[:6]
    meanwhile["busiest_threads"] = [{"tid": k[0], "name": k[1], "cpu_s": round(c, 3),
                                     "minflt": f} for c, f, k in each]
    if sample:
        meanwhile["python_stacks"] = sampler.top()
        meanwhile["thread_states"] = sampler.kernel_top()
    if native:
        meanwhile["native_tool"] = stacks.tool[0] if stacks.tool else None
        meanwhile["native_stacks"] = stacks.of_threads({k[0] for _, _, k in each})
    return out, s, meanwhile


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table", help="a saved cost table to plan from (no calibration)")
    p.add_argument("--tiny", action="store_true",
                   help="a smoke run: the tiny model, every layer's update on the CPU")
    p.add_argument("--model", default="llama")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import bench_fit
    import jax
    import numpy as np

    import hetpar
    from hetpar._step_planning import within_split_margin
    from hetpar.core import CostTable
    from hetpar.planner import plan

    try:
        gpu, name = jax.devices("gpu")[0], "gpu:0"
    except RuntimeError:  # a smoke run on two CPU devices, the second as the GPU
        gpu, name = jax.devices("cpu")[1], "cpu:1"
    cpu = jax.devices("cpu")[0]
    train_step, init, _ = bench_fit._workload(args.model, None, tiny=args.tiny)
    with jax.default_device(cpu):
        state = init(jax.random.key(0))
    if args.tiny:
        placements = {layer: {"compute": name, "state": "cpu:0", "update": "cpu:0"}
                      for layer in hetpar.trace(train_step, *state).layers}
    else:
        table = CostTable.load(args.table)
        accs = [d.name for d in table.devices if d.kind not in ("cpu", "pinned_host")]
        chosen = plan(within_split_margin(table, accs), donate=True)
        placements = {layer: {f: getattr(pl, f).replace("gpu:0", name) for f in
                              ("compute", "params", "state", "update", "activations")}
                      for layer, pl in chosen.placements.items()}
    step = hetpar.auto(train_step, devices=[name, "cpu:0"], plan=placements,
                       donate_argnums=(0, 1))
    params, opt_state, batch = step.place(*state)
    del state
    result = {"card": getattr(gpu, "device_kind", str(gpu)), "jax": jax.__version__,
              "cpu_count": os.cpu_count(), "table": args.table and os.path.basename(args.table),
              "steps_s": []}
    for _ in range(args.steps):
        t = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        float(loss)
        jax.block_until_ready((params, opt_state))
        result["steps_s"].append(time.perf_counter() - t)
    ex = step._last._executor
    host = [st for st in ex.stages.stages
            if ex.devices[st.device].platform == "cpu" and ex.compiled[st.index] is not None]
    result["host_stages"] = [{"stage": st.index, "layers": list(st.layers)} for st in host]

    def copies(st, xs, how: str) -> list:
        """Host copies of `xs` apart from the step's buffers; "pinned": what
        another device makes brought as the step brings it (aliasing the
        GPU's pinned staging buffer); "pinned_copied": then copied into
        memory the CPU device owns (`TransferEngine.ALIAS_PINNED = False`)."""
        out = []
        for v, x in zip(st.inputs, xs):
            fresh = np.array(x)
            prod = ex._producer.get(v)
            src = None if prod is None else ex.devices[ex.stages.stages[prod].device]
            if how != "plain" and src is not None and src.platform != "cpu":
                y = ex.transfer.move(jax.device_put(fresh, src), cpu)
                if how == "pinned_copied":
                    y = jax.device_put(y, cpu, may_alias=False)
                out.append(y)
            else:
                out.append(jax.device_put(fresh, cpu))
        return jax.block_until_ready(out)

    def trio(st, fn, xs, where: str) -> dict:
        row = {"stage": st.index, "where": where}
        for how in ("plain", "pinned", "pinned_copied"):
            ys = copies(st, xs, how)
            out, s, meanwhile = timed(fn, *ys, sample=True)
            row[f"copies_{how}_s"], row[f"copies_{how}_meanwhile"] = s, meanwhile
            del out, ys
        return row

    rows: list = []
    originals = {st.index: ex.compiled[st.index] for st in host}
    for st in host:
        def wrapped(*xs, st=st, fn=originals[st.index]):
            jax.block_until_ready(xs)
            row = trio(st, fn, xs, "in the step")
            out, s, meanwhile = timed(fn, *xs, sample=True, native=not rows)
            row["real_s"], row["real_meanwhile"] = s, meanwhile
            rows.append(row)
            return out
        ex.compiled[st.index] = wrapped
    try:
        for _ in range(2):
            t = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, batch)
            float(loss)
            jax.block_until_ready((params, opt_state))
            rows.append({"probed_step_s": time.perf_counter() - t})
    finally:
        ex.compiled[:] = [originals.get(i, f) for i, f in enumerate(ex.compiled)]
    # Whole steps with what comes from the GPU copied into the CPU's own
    # memory, then aliased again, alternating.
    for alias in (False, True, False, True):
        ex.transfer.ALIAS_PINNED = alias
        times = []
        for _ in range(3):
            t = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, batch)
            float(loss)
            jax.block_until_ready((params, opt_state))
            times.append(time.perf_counter() - t)
        rows.append({"alias_pinned": alias, "steps_s": times})
    ex.transfer.ALIAS_PINNED = True
    # Alone, after the steps: the step's last inputs cannot be had (donated),
    # so copies of ones shaped as them, as bench_fit's host_stages does.
    for st in host:
        xs = [np.ones(v.aval.shape, v.aval.dtype) for v in st.inputs]
        rows.append(trio(st, originals[st.index], xs, "alone"))
    result["probes"] = rows
    result["steps_median_s"] = statistics.median(result["steps_s"][1:] or result["steps_s"])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    for r in rows:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
               if not k.endswith("meanwhile")})
        for k, v in r.items():
            if k.endswith("meanwhile"):
                print("   ", k, v)


if __name__ == "__main__":
    main()

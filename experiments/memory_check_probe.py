"""The compiled memory check on a GPU (issue 41, item 2): for the Llama-style
model (experiments/llama_style.py) under a small GPU limit, the plan's
predicted, compiled (hetpar/_memory_check.py) and measured per-device peak.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 python experiments/memory_check_probe.py
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import hetpar  # noqa: E402
import llama_style  # noqa: E402


def main():
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    step_fn, init = llama_style.make(llama_style.Config(), batch=8, seq=512)
    with jax.default_device(cpu):
        params, opt_state, batch = init(jax.random.key(0))
    out = {"limit_gb": gpu.memory_stats()["bytes_limit"] / 1e9}
    step = hetpar.auto(step_fn, devices=["gpu:0", "cpu:0"], profile="auto")
    t = time.perf_counter()
    compiled = step.lower(params, opt_state, batch)
    out["lower_s"] = time.perf_counter() - t
    out["in_use_after_lower_gb"] = gpu.memory_stats()["bytes_in_use"] / 1e9
    out["memory_caps"] = dict(step.options.memory or {})
    out["compiled_gb"] = {d: v / 1e9 for d, v in (compiled.compiled_memory or ({}, {}))[0].items()}
    out["compiled_where"] = (compiled.compiled_memory or ({}, {}))[1]
    pred = compiled.plan.predicted if compiled.plan is not None else None
    if pred is not None:
        out["predicted_gb"] = {d: v / 1e9 for d, v in
                               (pred.peak_memory_bytes or pred.memory_bytes).items()}
    out["states"] = {str(k): n for k, n in
                     _count(p.state for p in compiled.placements.values()).items()}
    print("PROBE " + json.dumps(out), flush=True)
    try:
        params, opt_state, batch = step.place(params, opt_state, batch)
        out["in_use_after_place_gb"] = gpu.memory_stats()["bytes_in_use"] / 1e9
        p, o, loss = step(params, opt_state, batch)
        float(loss)
        out["ran"] = True
    except Exception as e:  # noqa: BLE001 - the probe reports what failed
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    out["peak_gb"] = gpu.memory_stats()["peak_bytes_in_use"] / 1e9
    out["report_memory_gb"] = {d: {k: (None if v is None else v / 1e9) for k, v in m.items()}
                               for d, m in step.report().step["memory"].items()}
    out["first_call"] = step.report().step["first_call"]
    print("PROBE " + json.dumps(out), flush=True)


def _count(values):
    out = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


if __name__ == "__main__":
    main()

"""Reproduces Figure 2 of the CS 243 report: GB accessed and GFLOPs of JAX
training steps before / after XLA's optimisation passes.

For each workload it prints, beside the report's figures:
  - hetpar's own count on the jaxpr (hetpar's "before" column),
  - XLA's cost analysis of the lowered HLO (before passes; the report's "before"),
  - XLA's cost analysis of the compiled HLO (after passes; the report's "after").

Usage:
  python experiments/figure2_hlo_profiles.py --backend cpu --out experiments/results/figure2_cpu
"""

from __future__ import annotations

import json
import platform

import jax
import jax.numpy as jnp
from absl import app, flags

from hetpar import zoo
from hetpar.passes import step_cost, trace

FLAGS = flags.FLAGS
flags.DEFINE_string("backend", "cpu", "XLA backend whose compiler gives the XLA columns")
flags.DEFINE_string("out", "experiments/results/figure2_cpu", "output path prefix (.md, .json)")

# The report's Figure 2: (GB accessed before, after), (GFLOPs before, after).
PUBLISHED = {
    "log(tanh(x).sum()), x of length 65536": ((0.012, 0.002), (0.001, 0.001)),
    "MobileNetV1 (256x256)": ((1.6, 1.3), (4.5, 15.0)),
    "ResNet50 (256x256)": ((4.0, 2.7), (31.0, 31.5)),
    "ResNet50 (16x256x256)": ((57.3, 33.8), (496.9, 504.4)),
}


def _tanh_step():
    def step(x):
        return jax.grad(lambda x: jnp.log(jnp.tanh(x).sum()))(x)

    return step, (jax.ShapeDtypeStruct((65536,), jnp.float32),)


def _zoo_step(name: str, batch: int):
    w = zoo.get(name, batch=batch, image_size=256)
    return w.train_step, tuple(jax.eval_shape(w.example_args))


def workloads():
    return {
        "log(tanh(x).sum()), x of length 65536": _tanh_step,
        "MobileNetV1 (256x256)": lambda: _zoo_step("mobilenet_v1", 1),
        "ResNet50 (256x256)": lambda: _zoo_step("resnet50", 1),
        "ResNet50 (16x256x256)": lambda: _zoo_step("resnet50", 16),
    }


def measure(backend: str) -> list[dict]:
    rows = []
    for label, make in workloads().items():
        fn, args = make()
        graph = trace(fn, *args)
        ours = graph.total_work()
        before = step_cost(graph, backend, optimized=False)
        after = step_cost(graph, backend, optimized=True)
        (pub_gb, pub_gf) = PUBLISHED[label]
        gb = lambda x: None if x is None else x / 1e9
        rows.append({
            "workload": label,
            "published_gb": pub_gb, "published_gflops": pub_gf,
            "hetpar_gb": gb(ours.bytes_accessed), "hetpar_gflops": gb(ours.flops),
            "xla_before_gb": gb(before.bytes_accessed), "xla_before_gflops": gb(before.flops),
            "xla_after_gb": gb(after.bytes_accessed), "xla_after_gflops": gb(after.flops),
        })
    return rows


def to_markdown(rows: list[dict], backend: str) -> str:
    f = lambda x: "?" if x is None else f"{x:.3g}"
    lines = [
        f"# Figure 2 of the CS 243 report, reproduced (backend: {backend}, jax {jax.__version__},"
        f" {platform.processor() or platform.machine()})",
        "",
        "GB accessed and GFLOPs of one training step with backprop, before / after XLA's "
        "optimisation passes. `hetpar` is hetpar's count on the jaxpr (unfused: every "
        "equation reads its operands and writes its results); `XLA` columns are "
        "`cost_analysis()` of the lowered (before) and compiled (after) HLO.",
        "",
        "| workload | GB published (before / after) | GB hetpar | GB XLA before / after "
        "| GFLOPs published (before / after) | GFLOPs hetpar | GFLOPs XLA before / after |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['published_gb'][0]} / {r['published_gb'][1]} "
            f"| {f(r['hetpar_gb'])} | {f(r['xla_before_gb'])} / {f(r['xla_after_gb'])} "
            f"| {r['published_gflops'][0]} / {r['published_gflops'][1]} "
            f"| {f(r['hetpar_gflops'])} | {f(r['xla_before_gflops'])} / "
            f"{f(r['xla_after_gflops'])} |")
    lines += ["", "## Where and why the numbers differ", "",
              "- XLA's own before/after columns track the report's closely: both are "
              "`cost_analysis()` of the same kind of program (a JAX train step with "
              "backprop), so the differences are JAX/XLA versions and model details "
              "(the report's exact MobileNetV1/ResNet50 code and optimizer are not given; "
              "ours use SGD-momentum / RMSprop updates and BatchNorm in training mode, "
              "all inside the step).",
              "- hetpar's FLOPs, counted on the jaxpr, equal XLA's 'before' FLOPs to "
              "three digits on the CPU (jax 0.10): convolutions count only the taps on "
              "real input, as XLA does. (With jax 0.11 on the GPU machine the log(tanh) "
              "gradient traces to fewer equations: 0.000197 GFLOPs.)",
              "- hetpar's bytes are lower than XLA's 'before' bytes: hetpar charges each "
              "jaxpr equation for its operands and results once, while the lowered HLO "
              "holds more, smaller ops (broadcasts, converts, copies) that each read and "
              "write. Both are unfused counts; XLA's 'after' column is the fused traffic.",
              "- XLA's 'after' FLOPs can exceed 'before' (MobileNetV1 4.6 -> 15, as in the "
              "report): most likely XLA's convolution-group rewriting, which turns grouped "
              "(depthwise) convolutions and their gradients into dense ones with masked "
              "kernels (not verified pass by pass). On a GPU "
              "(figure2_gpu_h200.md) 'after' leaves out cuDNN convolutions entirely (they "
              "are custom calls), and the lowered analysis returns nothing: why hetpar "
              "counts FLOPs itself rather than relying on XLA."]
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    rows = measure(FLAGS.backend)
    md = to_markdown(rows, FLAGS.backend)
    print(md)
    with open(FLAGS.out + ".md", "w") as fh:
        fh.write(md)
    with open(FLAGS.out + ".json", "w") as fh:
        json.dump({"backend": FLAGS.backend, "jax": jax.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    app.run(main)

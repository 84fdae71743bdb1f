"""The CS 243 report's per-layer figures, measured with hetpar's cost models.

Figures 3 and 5: per-layer time per sample on the CPU and the GPU (log scale)
for `cnn_preprocess` and `lm_embed`; Figure 6: per-layer cost per sample for
both. Figures 7 and 8: time per sample against batch size (1..1024) for the
text-vectorization layer of `lm_embed` and the first LSTM layer of `rnn`,
median and interquartile range, CPU against GPU.

    python experiments/layer_figures.py --out_dir experiments/results
    python experiments/layer_figures.py --data experiments/results/figures_h200.json

Measuring writes `figures_<card>.json`; plotting needs matplotlib and can run
later from that file (`--data`), on a machine without the GPU.
"""

from __future__ import annotations

import json
import pathlib
import time

from absl import app, flags, logging

_OUT = flags.DEFINE_string("out_dir", "experiments/results", "where to write")
_DATA = flags.DEFINE_string("data", None, "plot from this figures_*.json instead of measuring")
_K = flags.DEFINE_integer("k", 10, "timed runs per point")
_BATCHES = flags.DEFINE_list("batches", ["1", "4", "16", "64", "128", "256", "512", "1024"],
                             "batch sizes of Figures 7 and 8")

_PER_LAYER = ("cnn_preprocess", "lm_embed")
# Layer names depend on the zoo's module names: pick by substring, largest FLOPs first.
_SWEEPS = {"fig7": ("lm_embed", ("vector",)), "fig8": ("rnn", ("lstm", "scan"))}


def _pick_layer(graph, needles) -> str:
    hits = [n for n in graph.layers if any(k in n.lower() for k in needles)]
    return max(hits or graph.layers, key=lambda n: graph[n].flops)


def _measure(devices):
    from hetpar.core import seconds
    from hetpar.cost_models import (
        device_name,
        measure,
        measure_layer,
        random_inputs,
        spec,
        spec_kind_of,
    )
    from hetpar.zoo import trace_model

    data = {"per_layer": {}, "sweeps": {}, "devices": {}}
    for d in devices:
        kind = spec_kind_of(d)
        prof = spec(kind) if kind in ("cpu", "t4", "a100", "h100", "h200") else spec("cpu")
        # Dollars: each device rented on its own (a CPU-only instance for the CPU),
        # the comparison the report's Figure 6 makes.
        data["devices"][device_name(d)] = {"card": d.device_kind, "kind": kind,
                                           "price_per_hour": prof.price_per_hour,
                                           "price_source": prof.sources.get("price_per_hour")}
    for model in _PER_LAYER:
        w, graph = trace_model(model)
        batch = w.config["batch_size"]
        rows = {}
        for name in graph.layers:
            rows[name] = {}
            for d in devices:
                t = measure_layer(graph, name, d, k=_K.value)
                rows[name][device_name(d)] = {"median_s": t.median_s, "iqr_s": t.iqr_s}
                logging.info("%s/%s on %s: %s", model, name, device_name(d),
                             seconds(t.median_s))
        data["per_layer"][model] = {"batch": batch, "layers": rows}
    for fig, (model, needles) in _SWEEPS.items():
        points = {device_name(d): [] for d in devices}
        for b in (int(x) for x in _BATCHES.value):
            _, graph = trace_model(model, batch=b)
            layer = _pick_layer(graph, needles)
            fn, args = random_inputs(graph, layer)
            for d in devices:
                t = measure(fn, args, d, k=_K.value, warmup=2)
                points[device_name(d)].append(
                    {"batch": b, "median_s": t.median_s,
                     "q1_s": sorted(t.samples)[len(t.samples) // 4],
                     "q3_s": sorted(t.samples)[(3 * len(t.samples)) // 4]})
                logging.info("%s batch %d on %s: %s", layer, b, device_name(d),
                             seconds(t.median_s))
        data["sweeps"][fig] = {"model": model, "layer": layer, "points": points}
    return data


def _plot(data, out: pathlib.Path, tag: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    devs = data["devices"]
    label = {d: f"{d} ({v['card']})" for d, v in devs.items()}
    written = []

    def bars(ax, model, height, legend, error_bars=False):
        """A bar per device for every layer of `model`: `height(pl, d, median_s)`."""
        pl = data["per_layer"][model]
        names = list(pl["layers"])
        x, width = np.arange(len(names)), 0.8 / len(devs)
        for i, d in enumerate(devs):
            med = np.array([pl["layers"][n][d]["median_s"] for n in names])
            err = (np.array([pl["layers"][n][d]["iqr_s"] for n in names]) / pl["batch"] / 2
                   if error_bars else None)
            ax.bar(x + i * width, height(pl, d, med), width, yerr=err, label=legend(d))
        ax.set_yscale("log")
        ax.set_xticks(x + width * (len(devs) - 1) / 2, names, rotation=30, ha="right")
        return pl

    def save(f, name):
        f.tight_layout()
        f.savefig(out / name, dpi=120)
        plt.close(f)
        written.append(str(out / name))

    for fig, model in (("fig3", "cnn_preprocess"), ("fig5", "lm_embed")):
        f, ax = plt.subplots(figsize=(8, 4.5))
        pl = bars(ax, model, lambda pl, d, med: med / pl["batch"], label.get, error_bars=True)
        ax.set_ylabel("seconds per sample (fwd+bwd+update)")
        ax.set_title(f"{model}: per-layer time per sample, batch {pl['batch']}\n"
                     f"measured on {data['host']}, jax {data['jax']}", fontsize=9)
        ax.legend(fontsize=8)
        save(f, f"{fig}_time_{model}_{tag}.png")
    f, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, model in zip(axes, _PER_LAYER, strict=True):
        pl = bars(ax, model,
                  lambda pl, d, med: med * devs[d]["price_per_hour"] / 3600 / pl["batch"],
                  lambda d: f"{label[d]}, ${devs[d]['price_per_hour']}/h")
        ax.set_ylabel("dollars per sample")
        ax.set_title(f"{model} (batch {pl['batch']})", fontsize=9)
        ax.legend(fontsize=7)
    f.suptitle(f"Per-layer cost per sample on {data['host']}; on-demand prices of each device "
               "rented alone (CPU: 16-core CPU-only instance)", fontsize=9)
    save(f, f"fig6_cost_{tag}.png")
    for fig, sw in data["sweeps"].items():
        f, ax = plt.subplots(figsize=(6.5, 4.5))
        for d, pts in sw["points"].items():
            b = np.array([p["batch"] for p in pts])
            med = np.array([p["median_s"] for p in pts]) / b
            ax.plot(b, med, marker="o", label=label[d])
            ax.fill_between(b, np.array([p["q1_s"] for p in pts]) / b,
                            np.array([p["q3_s"] for p in pts]) / b, alpha=0.3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("seconds per sample (median, IQR band)")
        ax.set_title(f"{sw['model']}/{sw['layer']}: time per sample vs batch\n"
                     f"{data['host']}, jax {data['jax']}", fontsize=9)
        ax.legend(fontsize=8)
        save(f, f"{fig}_batch_{sw['layer']}_{tag}.png")
    return written


def main(argv):
    del argv
    import os

    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    if _DATA.value:
        data = json.loads(pathlib.Path(_DATA.value).read_text())
    else:
        import jax

        from hetpar.cost_models import present_devices, spec_kind_of

        devices = list(present_devices().values())
        accel = [d for d in devices if d.platform != "cpu"]
        data = _measure(devices)
        data["host"] = (accel[0].device_kind if accel else "CPU") + f" + {os.cpu_count()}-core CPU"
        data["jax"] = jax.__version__
        data["date"] = time.strftime("%Y-%m-%d")
        data["tag"] = spec_kind_of(accel[0]) if accel else "cpu"
        (out / f"figures_{data['tag']}.json").write_text(json.dumps(data, indent=1) + "\n")
    try:
        written = _plot(data, out, data["tag"])
    except ImportError:
        logging.warning("matplotlib is missing: plot later with --data")
        return
    logging.info("wrote %s", ", ".join(written))


if __name__ == "__main__":
    app.run(main)
